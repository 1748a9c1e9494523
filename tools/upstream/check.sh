#!/usr/bin/env bash
# Apply the upstream patch series to a copy of torch 2.15.0's pipelining package
# and run each patch's test on stock torch and with the patches applied.
#
#   bash tools/upstream/check.sh            # every patch
#   bash tools/upstream/check.sh 0001 0003  # only the named patches (still applied in order)
#
# Environment:
#   UPSTREAM_TORCH_PYTHON  a python with torch 2.15.0 installed (reused read-only);
#                          default: a scratch venv under $UPSTREAM_CHECK_DIR, created
#                          and filled on first use (downloads ~3 GB)
#   UPSTREAM_CHECK_DIR     scratch directory (default: ~/.cache/torch-upstream-check)
#   UPSTREAM_TEST_TIMEOUT  seconds per test run (default: 900)
#
# Exit status: 0 when every patch applies without fuzz, every test fails on
# stock 2.15.0, passes with the series applied up to its patch, and passes
# again on the complete series; 1 otherwise.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TORCH_VERSION="2.15.0"
CHECK_DIR="${UPSTREAM_CHECK_DIR:-${HOME}/.cache/torch-upstream-check}"
TEST_TIMEOUT="${UPSTREAM_TEST_TIMEOUT:-900}"
LOG_DIR="${CHECK_DIR}/logs"

die() { echo "check.sh: $*" >&2; exit 1; }

command -v patch >/dev/null || die "needs the patch tool (e.g. apt-get install patch)"

# --- 1. a python with torch 2.15.0 ----------------------------------------------
mkdir -p "${CHECK_DIR}" "${LOG_DIR}" || die "cannot create ${CHECK_DIR}"
if [[ -n "${UPSTREAM_TORCH_PYTHON:-}" ]]; then
    PY="${UPSTREAM_TORCH_PYTHON}"
else
    VENV="${CHECK_DIR}/venv-torch-${TORCH_VERSION}"
    PY="${VENV}/bin/python"
    if ! "${PY}" -c "import torch, expecttest, numpy" >/dev/null 2>&1; then
        echo "Installing torch ${TORCH_VERSION} into ${VENV} (about 3 GB) ..."
        python3 -m venv "${VENV}" || die "python3 -m venv failed"
        # PIP_CONFIG_FILE=/dev/null: ignore site-wide pip settings (version caps) for this install.
        PIP_CONFIG_FILE=/dev/null "${PY}" -m pip install --quiet \
            "torch==${TORCH_VERSION}" expecttest numpy || die "pip install torch==${TORCH_VERSION} failed"
    fi
fi
SITE="$("${PY}" - "${TORCH_VERSION}" <<'PYEOF'
import os, sys
import torch
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"{sys.executable} has torch {torch.__version__}, need {sys.argv[1]}")
print(os.path.dirname(os.path.dirname(torch.__file__)))
PYEOF
)" || die "no torch ${TORCH_VERSION} in ${PY}"
"${PY}" -c "import expecttest, numpy" 2>/dev/null || die "${PY} lacks expecttest/numpy (needed by torch.testing._internal)"

# The committed patches must be what the package generates now.
"${PY}" "${HERE}/make_series.py" --check --torch-dir "${SITE}" \
    || die "the series is stale: run python tools/upstream/make_series.py"

# --- 2. trees: stock and patched copies of the installed torch package ------------
# Each tree is a directory put first on PYTHONPATH.  It holds a link to every
# entry of the installed site-packages, except torch/, which is a tree of links
# whose torch/distributed/pipelining/ is a real copy (the only part patched).
# Relative library paths (torch/lib -> ../../nvidia/...) resolve as installed.
make_tree() {
    local tree="$1"
    rm -rf "${tree}"
    mkdir -p "${tree}/site"
    local entry
    for entry in "${SITE}"/*; do
        [[ "$(basename "${entry}")" == "torch" ]] && continue
        ln -s "${entry}" "${tree}/site/$(basename "${entry}")"
    done
    cp -rs "${SITE}/torch" "${tree}/site/torch"
    rm -rf "${tree}/site/torch/distributed/pipelining"
    cp -r "${SITE}/torch/distributed/pipelining" "${tree}/site/torch/distributed/pipelining"
    find "${tree}/site/torch/distributed/pipelining" -name __pycache__ -prune -exec rm -rf {} +
    # The tests exercise torch alone: shadow torch_pipelining_ext, should the
    # python used have it installed, with a module that refuses to import.
    mkdir -p "${tree}/site/torch_pipelining_ext" "${tree}/test/distributed/pipelining"
    echo 'raise ImportError("the upstream tests must not import torch_pipelining_ext")' \
        >"${tree}/site/torch_pipelining_ext/__init__.py"
}

STOCK="${CHECK_DIR}/stock"
PATCHED="${CHECK_DIR}/patched"
echo "torch ${TORCH_VERSION} from ${SITE}"
make_tree "${STOCK}"
make_tree "${PATCHED}"

# Runs one test file of a tree; prints PASS or FAIL, keeps the log.
run_test() {
    local tree="$1" test_file="$2" log="$3"
    local target="${tree}/test/distributed/pipelining/$(basename "${test_file}")"
    cp "${test_file}" "${target}"
    (
        cd "${tree}" || exit 1
        # The tests exercise torch only: this package must not be importable.
        env -u PYTHONSTARTUP PYTHONPATH="${tree}/site" PYTHONDONTWRITEBYTECODE=1 \
            TORCH_PIPELINING_EXT_DISABLE=1 OMP_NUM_THREADS=1 \
            timeout "${TEST_TIMEOUT}" "${PY}" - "${tree}" "${target}" <<'PYEOF'
import os, runpy, sys
tree, target = sys.argv[1], sys.argv[2]
import torch.distributed.pipelining as pipelining
if not os.path.realpath(pipelining.__file__).startswith(os.path.realpath(tree)):
    sys.exit(f"torch.distributed.pipelining comes from {pipelining.__file__}, not {tree}")
sys.argv = [target]
sys.path.insert(0, os.path.dirname(target))
runpy.run_path(target, run_name="__main__")
PYEOF
    ) >"${log}" 2>&1
    if [[ $? -eq 0 ]]; then echo PASS; else echo FAIL; fi
}

# --- 3. the series --------------------------------------------------------------
mapfile -t ALL_PATCHES < <(cd "${HERE}" && ls -d [0-9][0-9][0-9][0-9]-*/ | sed 's:/$::' | sort)
[[ ${#ALL_PATCHES[@]} -gt 0 ]] || die "no patches under ${HERE}"
SELECTED=("$@")
selected() {
    [[ ${#SELECTED[@]} -eq 0 ]] && return 0
    local s
    for s in "${SELECTED[@]}"; do [[ "$1" == "${s}"* ]] && return 0; done
    return 1
}

declare -a ROWS TESTS
status=0
for name in "${ALL_PATCHES[@]}"; do
    dir="${HERE}/${name}"
    diff="${dir}/patch.diff"
    test_file="$(ls "${dir}"/test_*.py 2>/dev/null | head -n 1)"
    [[ -f "${diff}" && -n "${test_file}" ]] || { echo "${name}: missing patch.diff or test_*.py"; status=1; continue; }
    added=$(grep -v '^+++ ' "${diff}" | grep -c '^+')
    removed=$(grep -v '^--- ' "${diff}" | grep -c '^-')
    if ! patch -p1 --fuzz=0 --no-backup-if-mismatch --batch -d "${PATCHED}/site" <"${diff}" >"${LOG_DIR}/${name}.apply.log" 2>&1; then
        ROWS+=("${name}|+${added} -${removed}|does not apply|-|-")
        status=1
        echo "${name}: patch does not apply (see ${LOG_DIR}/${name}.apply.log)"
        break
    fi
    selected "${name}" || continue
    echo "${name}: running $(basename "${test_file}") on stock and patched torch ..."
    stock=$(run_test "${STOCK}" "${test_file}" "${LOG_DIR}/${name}.stock.log")
    patched=$(run_test "${PATCHED}" "${test_file}" "${LOG_DIR}/${name}.patched.log")
    ROWS+=("${name}|+${added} -${removed}|${stock}|${patched}")
    TESTS+=("${name}|${test_file}")
    [[ "${stock}" == FAIL && "${patched}" == PASS ]] || status=1
done

# Every selected test again on the complete series: later patches keep earlier fixes.
declare -A SERIES
for entry in "${TESTS[@]}"; do
    name="${entry%%|*}"
    test_file="${entry#*|}"
    echo "${name}: running $(basename "${test_file}") on the complete series ..."
    SERIES["${name}"]=$(run_test "${PATCHED}" "${test_file}" "${LOG_DIR}/${name}.series.log")
    [[ "${SERIES[${name}]}" == PASS ]] || status=1
done

echo
printf '%-34s %-13s %-22s %-8s\n' "patch (torch ${TORCH_VERSION})" "lines" "test: stock -> patched" "series"
printf '%-34s %-13s %-22s %-8s\n' "----------------------------------" "-------------" "----------------------" "--------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r name lines stock patched <<<"${row}"
    printf '%-34s %-13s %-22s %-8s\n' "${name}" "${lines}" "${stock} -> ${patched}" "${SERIES[${name}]:--}"
done
echo
echo "logs: ${LOG_DIR}"
if [[ ${status} -ne 0 ]]; then
    echo "MISMATCH: every test must FAIL on stock and PASS with its patch and with the whole series."
fi
exit ${status}
