#!/usr/bin/env bash
# The main job: train a small MoE with PP x EP overlap end to end (see README.md).
#
#   bash tools/run_demo.sh                 # 4 gloo ranks on this machine, torch 2.13.0
#   bash tools/run_demo.sh --steps 8       # any flag of `python -m torch_pipelining_ext.demo`
#   TORCH_VERSION=2.9.1 bash tools/run_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_env.sh
exec "$VENV_PY" -m torch_pipelining_ext.demo "$@"
