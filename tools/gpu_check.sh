#!/usr/bin/env bash
# One-GPU check (CONTRIBUTING.md, "GPU check"): the single-GPU test variants and
# device-level OVERLAP_F_B overlap; a summary, then one machine-readable line.
#
#   bash tools/gpu_check.sh                          # venv .venv/torch-$TORCH_VERSION (tools/_env.sh)
#   TORCH_VERSION=2.14.1 bash tools/gpu_check.sh     # a CUDA build of torch (PyPI), its own venv
#   bash tools/gpu_check.sh --skip-tests -- -k dualpipev   # flags of tools/gpu_check.py; pytest args after --
#
# No network once the venv exists; at most 6 minutes ($GPU_CHECK_TIMEOUT_S).
# Exit status: 0 pass, 1 a check failed, 3 no CUDA GPU or no CUDA build of
# torch (within seconds), 124 out of time.  $GPU_CHECK_PYTHON runs another
# interpreter instead of the venv's.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,12p' "$0"
    exit 0
fi

no_cuda() {
    echo "gpu_check: $1" >&2
    echo "gpu_check=no_cuda"
    exit 3
}

# Before creating or even reading the venv: is there an NVIDIA GPU at all?
if [[ "${GPU_CHECK_SKIP_DEVICE_PROBE:-0}" != "1" ]]; then
    if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } && [[ ! -e /dev/nvidiactl ]]; then
        no_cuda "no NVIDIA GPU on this machine (nvidia-smi -L fails or is missing, no /dev/nvidiactl); run it on a machine with a CUDA GPU"
    fi
fi

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    PY="$GPU_CHECK_PYTHON"
else
    source tools/_env.sh
    PY="$VENV_PY"
fi

# cuBLAS is deterministic across streams only with a fixed workspace: the
# overlapped run is compared bitwise with the sequential one.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
limit="${GPU_CHECK_TIMEOUT_S:-360}"
set +e
timeout --kill-after=10 "$limit" "$PY" tools/gpu_check.py "$@"
rc=$?
set -e
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "gpu_check: did not finish within $limit s" >&2
    echo "gpu_check=timeout seconds=$limit"
    exit 124
fi
exit $rc
