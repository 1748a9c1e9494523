# Sourced by tools/run_tests.sh and tools/run_demo.sh: create (or reuse) a virtual
# environment with a pinned torch and this package installed in editable mode.
#
#   TORCH_VERSION   torch release to install (default 2.13.0)
#   PYTHON          interpreter used to create the environment (default python3)
#   VENV_DIR        where the environment lives (default .venv/torch-$TORCH_VERSION)
#   FRESH=1         delete and recreate the environment first
#
# After sourcing, $VENV_PY is the environment's python.

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV_DIR="${VENV_DIR:-$REPO_ROOT/.venv/torch-$TORCH_VERSION}"
EXTRAS="${EXTRAS:-test,hf}"

if [[ "${FRESH:-0}" == "1" ]]; then
    rm -rf "$VENV_DIR"
fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: $PYTHON is $("$PYTHON" --version 2>&1); torch_pipelining_ext needs Python 3.10+" >&2
    exit 2
fi

VENV_PY="$VENV_DIR/bin/python"
stamp="$VENV_DIR/.installed-$TORCH_VERSION-$EXTRAS"
if [[ ! -x "$VENV_PY" || ! -f "$stamp" || "$REPO_ROOT/setup.py" -nt "$stamp" ]]; then
    echo ">>> creating $VENV_DIR (torch==$TORCH_VERSION)" >&2
    "$PYTHON" -m venv "$VENV_DIR"
    "$VENV_PY" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
    "$VENV_PY" -m pip install --quiet --disable-pip-version-check -e "$REPO_ROOT[$EXTRAS]" "torch==$TORCH_VERSION" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
    "$VENV_PY" -c "import torch, torch_pipelining_ext" >/dev/null
    touch "$stamp"
fi
installed="$("$VENV_PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ "$installed" != "$TORCH_VERSION" ]]; then
    echo "error: $VENV_DIR has torch $installed, expected $TORCH_VERSION (rerun with FRESH=1)" >&2
    exit 2
fi
export VENV_PY
