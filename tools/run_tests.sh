#!/usr/bin/env bash
# Run the test suite in a virtual environment with a pinned torch.
#
#   bash tools/run_tests.sh                       # torch 2.13.0 (default)
#   bash tools/run_tests.sh --torch 2.9.1         # any release 2.9 ... 2.15
#   bash tools/run_tests.sh --torch 2.11.0 --fresh -- -k overlap   # fresh venv, extra pytest args
#   bash tools/run_tests.sh --transformers 4.57.6 -- test/distributed/pipelining/test_hf_stages.py
#
# The tests run on TEST_WORKERS pytest-xdist workers (default 2: most of the
# suite's time is processes that start, import torch and wait on each other,
# so two workers take 0.85 of one's wall time on two cores; TEST_WORKERS=0
# runs them in this process).  xdist's default distribution: giving each
# worker whole classes (--dist loadscope) starts a multi-process class's
# ranks once instead of in both workers, but the workers then finish apart
# (the README's command took as long, the slow tests 599 s instead of 551 s).
#
# Exits non-zero when a test fails (or when no test ran).
set -euo pipefail
cd "$(dirname "$0")/.."

while [[ $# -gt 0 ]]; do
    case "$1" in
        --torch) export TORCH_VERSION="$2"; shift 2 ;;
        --transformers) export TRANSFORMERS_VERSION="$2"; shift 2 ;;
        --fresh) export FRESH=1; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) break ;;
    esac
done

source tools/_env.sh
"$VENV_PY" -m torch_pipelining_ext
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
# test paths among the arguments replace the default (the whole suite)
paths=(test/)
for arg in "$@"; do
    [[ "$arg" == test/* ]] && paths=()
done
"$VENV_PY" -m pytest "${paths[@]}" -q -p no:cacheprovider --durations=15 \
    -n "${TEST_WORKERS:-2}" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "error: no test was collected" >&2
fi
exit $rc
