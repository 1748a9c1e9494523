#!/usr/bin/env bash
# ruff as pyproject.toml configures it (the rules and the 88-column format of
# torch's own pyproject.toml), in the test environment of tools/_env.sh.
#
#   bash tools/lint.sh          # check: lint and format; exits non-zero on a finding
#   bash tools/lint.sh --fix    # fix what ruff can and format the files
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/_env.sh
if [[ "${1:-}" == "--fix" ]]; then
    "$VENV_PY" -m ruff check --fix .
    "$VENV_PY" -m ruff format .
else
    "$VENV_PY" -m ruff check .
    "$VENV_PY" -m ruff format --check .
fi
