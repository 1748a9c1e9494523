#!/usr/bin/env bash
# torchtitan's DeepSeek-V3 debug model under the package's concurrent OVERLAP_F_B
# (tools/torchtitan_spmd_check.py: PP=2 x EP=2 on 4 gloo ranks, DualPipeV, the
# debug config's selective checkpointing; the overlapped run bitwise the
# sequential one and equal to the unsplit model), then its negative control
# (--no-thread-state: without the package's torchtitan pair the overlapped run
# must fail), after test_torchtitan_compat.py's tests against the real
# torchtitan.  CI runs it in the torch 2.15.0 environment.
#
#   bash tools/torchtitan_check.sh PYTHON   # PYTHON: torch 2.14 or newer, with this package
#
# torchtitan and what the check imports of its dependencies
# (tools/torchtitan-requirements.txt, pinned) go into a folder of their own,
# $TORCHTITAN_DIR (default: .venv/torchtitan-<PYTHON's torch>), put on
# PYTHONPATH for the check only; PYTHON's environment is left as it is.
# The last line is the check's: `torchtitan_spmd_check=pass|fail ...`;
# exits 1 if either run did not give its expected verdict.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${1:?usage: bash tools/torchtitan_check.sh PYTHON}"
torch_version=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
dir="${TORCHTITAN_DIR:-$PWD/.venv/torchtitan-$torch_version}"
stamp="$dir/.installed-$(sha256sum tools/torchtitan-requirements.txt | cut -c1-16)"
if [[ ! -e "$stamp" ]]; then
    rm -rf "$dir"
    if ! "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" \
        -r tools/torchtitan-requirements.txt; then
        rm -rf "$dir"
        echo "error: could not install tools/torchtitan-requirements.txt into $dir" >&2
        exit 1
    fi
    touch "$stamp"
fi

export OMP_NUM_THREADS=1 PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
status=0
# the package's torchtitan pair against the real torchtitan (skipped without it)
if "$PY" -m pytest -q -p no:cacheprovider -rs \
    test/distributed/pipelining/test_torchtitan_compat.py -k RealTorchtitanTest \
    > "$dir/pytest.log" 2>&1 && grep -q " passed" "$dir/pytest.log" \
    && ! grep -q " skipped" "$dir/pytest.log"; then
    echo "RealTorchtitanTest: $(tail -n 1 "$dir/pytest.log")"
else
    tail -n 40 "$dir/pytest.log"
    echo "error: test_torchtitan_compat.py's RealTorchtitanTest did not pass (or skipped)" >&2
    status=1
fi
# the negative control's verdict is "pass" when its overlapped run failed as it must
if "$PY" tools/torchtitan_spmd_check.py --no-thread-state > "$dir/negative.log" 2>&1; then
    echo "negative control: $(tail -n 1 "$dir/negative.log")"
else
    tail -n 40 "$dir/negative.log"
    echo "error: the negative control (--no-thread-state) did not give its verdict" >&2
    status=1
fi
"$PY" tools/torchtitan_spmd_check.py || status=1
exit $status
