#!/usr/bin/env bash
# The trainer, `python -m torch_pipelining_ext.train`, in the test environment
# (tools/_env.sh: created on first use), and the text to try it on.
#
#   bash tools/run_train.sh prepare-text DIR      # DIR/docs.jsonl + DIR/tokenizer/ from Python's docstrings (tools/prepare_text.py)
#   bash tools/run_train.sh --model-type qwen3_moe --ep 2 --tokenizer DIR/tokenizer --data DIR/docs.jsonl --run-dir RUN
#   bash tools/run_train.sh --help                # every flag of the trainer
#
# Exit status: the trainer's (0 done, 1 a rank failed, 2 bad input).
# Paths are taken from the directory it is run in.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
source "$repo/tools/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ "${1:-}" == "prepare-text" ]]; then
    shift
    exec "$VENV_PY" "$repo/tools/prepare_text.py" "$@"
fi
exec "$VENV_PY" -m torch_pipelining_ext.train "$@"
