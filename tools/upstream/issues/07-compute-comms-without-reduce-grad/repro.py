"""A compute_comms schedule without REDUCE_GRAD trains with unscaled gradients.

One process (gloo, CPU), two stages on the rank, four microbatches,
_PipelineScheduleRuntime loading the same actions three ways:
  * compute_only CSV (the loader adds REDUCE_GRAD while lowering): reference;
  * compute_comms CSV with REDUCE_GRAD / WAIT_REDUCE_GRAD per stage;
  * compute_comms CSV without them (as schedules written for torch 2.9 are).
Every parameter gradient is compared with a single-process reference.

Run with a stock torch:  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime


N = 4
COMPUTE = [f"0F{i},1F{i},1B{i},0B{i}" for i in range(N)]
REDUCE = "1REDUCE_GRAD,1WAIT_REDUCE_GRAD,0REDUCE_GRAD,0WAIT_REDUCE_GRAD"
CSVS = {
    "compute_only": ",".join(COMPUTE),
    "compute_comms with REDUCE_GRAD": ",".join([*COMPUTE, REDUCE]),
    "compute_comms without REDUCE_GRAD": ",".join(COMPUTE),
}


class Refused(Exception):
    """The schedule did not load."""


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def gradient_ratio(label: str, path: str, x: torch.Tensor, y: torch.Tensor) -> float:
    """Worst |grad| / |reference grad| over the parameters (raises if the load fails)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = copy.deepcopy(ref)
    stages = [PipelineStage(model[i], i, 2, torch.device("cpu")) for i in (0, 1)]
    schedule = _PipelineScheduleRuntime(stages, N, loss_fn=loss_fn)
    with open(path, "w") as f:
        f.write(CSVS[label] + "\n")
    try:
        schedule._load_csv(path, format=label.split()[0])
    except (ValueError, RuntimeError, AssertionError) as e:
        raise Refused(f"{type(e).__name__}: {e}") from e
    schedule.step(x, target=y)
    for x_mb, y_mb in zip(x.chunk(N), y.chunk(N)):
        (loss_fn(ref(x_mb), y_mb) / N).backward()
    ratios = [
        (p.grad.norm() / r.grad.norm()).item()
        for p, r in zip(model.parameters(), ref.parameters())
    ]
    return max(ratios, key=lambda r: abs(r - 1))


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"torch {torch.__version__}, {N} microbatches")
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        for label in CSVS:
            try:
                ratio = gradient_ratio(label, os.path.join(tmp, "schedule.csv"), x, y)
                results[label] = ratio
                print(f"{label}: loaded; |grad| / |reference| = {ratio:.4f}")
            except Refused as e:
                print(f"{label}: refused when loaded: {str(e).splitlines()[0]}")
        dist.destroy_process_group()
    ratio = results.get("compute_comms without REDUCE_GRAD")
    if ratio is not None and abs(ratio - 1) > 1e-4:
        print(
            "defect present: a compute_comms schedule without REDUCE_GRAD loads "
            f"without an error and its gradients are {ratio:.4f} x the right ones "
            f"(never divided by the {N} microbatches)"
        )
        return 1
    print(
        "defect absent: a compute_comms schedule without REDUCE_GRAD is refused "
        "or gives the right gradients"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
