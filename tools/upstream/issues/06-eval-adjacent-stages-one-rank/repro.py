"""eval() fails when one rank holds two adjacent stages.

One process (gloo, CPU), two stages on the rank (the local hand-off between
adjacent stages that V-schedules use on every multi-rank run), four
microbatches: step() then eval() for each multi-stage schedule; eval()'s
output is compared with the model's own forward.

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
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


N = 4
SCHEDULES = (
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    ScheduleDualPipeV,
)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def try_eval(schedule_class: type, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """None if step() then eval() work and eval() returns the model's output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage_models = copy.deepcopy(model)
    stages = [PipelineStage(stage_models[i], i, 2, torch.device("cpu")) for i in (0, 1)]
    schedule = schedule_class(stages, N, loss_fn=loss_fn)
    schedule.step(x, target=y)
    try:
        out = schedule.eval(x, target=y)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    with torch.no_grad():
        if not torch.allclose(out, stage_models(x)):
            return "eval() returned a wrong output"
    return None


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"torch {torch.__version__}")
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    failures = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        for schedule_class in SCHEDULES:
            error = try_eval(schedule_class, x, y)
            print(f"{schedule_class.__name__}: step() ok, eval() {error or 'ok'}")
            if error:
                failures[schedule_class.__name__] = error
        dist.destroy_process_group()
    if failures:
        names = ", ".join(failures)
        print(
            f"defect present: eval() fails with two adjacent stages on one rank ({names}): {next(iter(failures.values()))}"
        )
        return 1
    print("defect absent: eval() works with two adjacent stages on one rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
