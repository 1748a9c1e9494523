#!/usr/bin/env bash
# mypy over the package as pyproject.toml's [tool.mypy] configures it (torch's own
# settings: every function typed, untyped bodies checked), in the test environment
# of tools/_env.sh; exits non-zero on a type error. Extra arguments go to mypy
# (e.g. a single file, or --no-incremental).
#
#   bash tools/typecheck.sh
#   bash tools/typecheck.sh torch_pipelining_ext/sim
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_env.sh
# one cache per environment: what mypy infers from torch depends on its release
"$VENV_PY" -m mypy --cache-dir "$VENV_DIR/.mypy_cache" "$@"
