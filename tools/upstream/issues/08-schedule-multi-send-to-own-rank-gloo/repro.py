"""PipelineScheduleMulti sends to its own rank: adjacent local stages fail on gloo.

One process (gloo, CPU), two adjacent stages on the rank, two microbatches.
A custom schedule subclasses PipelineScheduleMulti (the public base class of
multi-stage schedules) and sets pipeline_order in its __init__, as its
subclasses do; the base class's step() runs it.  The order is the compute-only
one ScheduleLoopedBFS computes for the same stages (its public pipeline_order),
so no action is built by hand.  The step is compared with a single-process
reference.

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
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS
from torch.distributed.pipelining.schedules import PipelineScheduleMulti


N = 2


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class CustomSchedule(PipelineScheduleMulti):
    """A custom schedule: sets pipeline_order; PipelineScheduleMulti.step runs it."""

    def __init__(self, stages: list, n_microbatches: int, loss_fn) -> None:
        super().__init__(stages, n_microbatches, loss_fn=loss_fn)
        self.pipeline_order = ScheduleLoopedBFS(
            stages, n_microbatches, loss_fn=loss_fn
        ).pipeline_order


def run_step() -> str | None:
    """None if the step runs and every gradient matches the reference."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = copy.deepcopy(ref)
    stages = [PipelineStage(model[i], i, 2, torch.device("cpu")) for i in (0, 1)]
    schedule = CustomSchedule(stages, N, loss_fn=loss_fn)
    order = ",".join(str(a) for a in schedule.pipeline_order[0] if a is not None)
    print(f"torch {torch.__version__}; schedule (rank 0): {order}")
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    try:
        schedule.step(x, target=y)
    except RuntimeError as e:
        return f"RuntimeError: {str(e).splitlines()[0]}"
    for x_mb, y_mb in zip(x.chunk(N), y.chunk(N)):
        (loss_fn(ref(x_mb), y_mb) / N).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        if p.grad is None or not torch.allclose(p.grad, r.grad):
            return "wrong gradients"
    return None


def main() -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        error = run_step()
        dist.destroy_process_group()
    print(f"PipelineScheduleMulti.step(): {error or 'ok, gradients match'}")
    if error:
        print(
            "defect present: PipelineScheduleMulti's step passes activations "
            f"between two stages of one rank by P2P to the own rank: {error}"
        )
        return 1
    print("defect absent: adjacent stages on one rank run on gloo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
