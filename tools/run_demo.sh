#!/usr/bin/env bash
# The main job: train a tiny Hugging Face MoE with PP x EP and the concurrent
# OVERLAP_F_B, compared with the sequential one and the unsplit model (README.md):
# the trainer's comparison mode, `python -m torch_pipelining_ext.train
# --compare-sequential`, with the demo's flags (torch_pipelining_ext.demo.train.DEMO_FLAGS).
#
#   bash tools/run_demo.sh                 # 2 gloo ranks (EP=2), torch 2.13.0, newest transformers 5.x
#   bash tools/run_demo.sh --pp 2          # PP=2 x EP=2 on 4 ranks; any flag of the trainer overrides the demo's
#   bash tools/run_demo.sh --trace DIR     # Chrome traces of the last step, timeline.png, expert_load.png
#   TORCH_VERSION=2.9.1 bash tools/run_demo.sh
#
# The environment (tools/_env.sh) is created on first use.  Exit status: 0 ok,
# 1 results differ, 2 bad arguments or environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV_PY" -m torch_pipelining_ext.demo "$@"
