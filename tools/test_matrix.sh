#!/usr/bin/env bash
# The README's test command on every supported torch minor, one after the other,
# each in its own environment (the heavy matrix; CI runs a covering subset, see
# .ci/run). Every release but 2.13.0 is a CUDA build from the package index
# (about 3 GB, runs on CPU); pip configurations that cap torch are ignored for
# them. Each such environment is removed after its tests unless KEEP_VENVS=1.
#
#   bash tools/test_matrix.sh                      # 2.9.1 ... 2.15.0, the whole suite
#   bash tools/test_matrix.sh 2.11.0 2.14.1        # these releases only
#   bash tools/test_matrix.sh 2.11.0 -- -k overlap # extra pytest arguments
#
# Last line: `test_matrix <release>=pass|fail ... failed=N`; exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

releases=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    releases+=("$1")
    shift
done
[[ "${1:-}" != "--" ]] || shift
[[ ${#releases[@]} -gt 0 ]] || releases=(2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0)

summary=()
failed=0
for v in "${releases[@]}"; do
    echo "=== torch $v: bash tools/run_tests.sh --torch $v $* ==="
    if [[ "$v" == 2.13.0 ]]; then
        bash tools/run_tests.sh --torch "$v" -- "$@"
    else
        PIP_CONFIG_FILE=/dev/null bash tools/run_tests.sh --torch "$v" -- "$@"
    fi
    if [[ $? -eq 0 ]]; then
        summary+=("$v=pass")
    else
        summary+=("$v=fail")
        failed=$((failed + 1))
    fi
    if [[ "$v" != 2.13.0 && "${KEEP_VENVS:-0}" != "1" ]]; then
        rm -rf ".venv/torch-$v"
    fi
done
echo "test_matrix ${summary[*]} failed=$failed"
[[ $failed -eq 0 ]]
