# Sourced by tools/run_tests.sh and tools/run_demo.sh: create (or reuse) a virtual
# environment with a pinned torch and this package installed in editable mode.
#
#   TORCH_VERSION   torch release to install (default 2.13.0)
#   PYTHON          interpreter used to create the environment (default python3)
#   VENV_DIR        where the environment lives (default .venv/torch-$TORCH_VERSION)
#   TRANSFORMERS_VERSION  pin transformers (e.g. 4.57.6; default: the newest 5.x);
#                   the default VENV_DIR then ends in -transformers-$TRANSFORMERS_VERSION
#   FRESH=1         delete and recreate the environment first
#
# After sourcing, $VENV_PY is the environment's python.

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-}"
_venv_name="torch-$TORCH_VERSION${TRANSFORMERS_VERSION:+-transformers-$TRANSFORMERS_VERSION}"
VENV_DIR="${VENV_DIR:-$REPO_ROOT/.venv/$_venv_name}"
EXTRAS="${EXTRAS:-test,hf}"

if [[ "${FRESH:-0}" == "1" ]]; then
    rm -rf "$VENV_DIR"
fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: $PYTHON is $("$PYTHON" --version 2>&1); torch_pipelining_ext needs Python 3.10+" >&2
    exit 2
fi

VENV_PY="$VENV_DIR/bin/python"
stamp="$VENV_DIR/.installed-$_venv_name-$EXTRAS"

# A failed install must not leave an environment that looks usable: the one
# created here is removed (an existing one is kept, and retried next time).
_env_failed() {
    echo "error: $1" >&2
    if [[ "$_env_created" == "1" ]]; then
        rm -rf "$VENV_DIR"
        echo "error: removed the half-built $VENV_DIR" >&2
    fi
    exit 2
}

_env_pip_install() {
    local log rc=0
    log="$(mktemp)"
    "$VENV_PY" -m pip install --quiet --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
    # (pip warns about find-links folders that do not exist on this machine)
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    if [[ $rc -ne 0 ]]; then
        _env_failed "pip install $* failed (exit status $rc, output above). If the resolver found no torch==$TORCH_VERSION, a pip configuration may cap torch: 'pip config list' shows it, PIP_CONFIG_FILE=/dev/null ignores it"
    fi
}

if [[ ! -x "$VENV_PY" || ! -f "$stamp" || "$REPO_ROOT/setup.py" -nt "$stamp" ]]; then
    echo ">>> creating $VENV_DIR (torch==$TORCH_VERSION)" >&2
    _env_created=0
    [[ -e "$VENV_DIR" ]] || _env_created=1
    "$PYTHON" -m venv "$VENV_DIR" || _env_failed "$PYTHON -m venv $VENV_DIR failed"
    _env_pip_install "torch==$TORCH_VERSION"
    # unpinned: the newest 5.x, what a user installing the hf extra gets today
    _tf_req="transformers>=5,<6"
    [[ -z "$TRANSFORMERS_VERSION" ]] || _tf_req="transformers==$TRANSFORMERS_VERSION"
    # The editable install writes the package's egg-info into the checkout:
    # environments built at the same time (.ci/run builds the next one in the
    # background) take turns here.
    mkdir -p "$REPO_ROOT/.venv"
    exec {_env_lock}>"$REPO_ROOT/.venv/.editable-install.lock"
    if command -v flock >/dev/null; then flock "$_env_lock"; fi
    _env_pip_install -e "$REPO_ROOT[$EXTRAS]" "torch==$TORCH_VERSION" "$_tf_req"
    exec {_env_lock}>&-
    "$VENV_PY" -c "import torch, torch_pipelining_ext" >/dev/null \
        || _env_failed "torch or torch_pipelining_ext does not import in $VENV_DIR"
    touch "$stamp"
fi
installed="$("$VENV_PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ "$installed" != "$TORCH_VERSION" ]]; then
    echo "error: $VENV_DIR has torch $installed, expected $TORCH_VERSION (rerun with FRESH=1)" >&2
    exit 2
fi
export VENV_PY
