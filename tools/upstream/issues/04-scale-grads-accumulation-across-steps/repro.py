"""Accumulating gradients over two step() calls gives (1 + 1/n) x one step's, not 2 x.

One process (gloo, CPU), four microbatches, scale_grads=True (the default);
ScheduleGPipe and Schedule1F1B (one stage), ScheduleInterleaved1F1B (two
stages on the rank).  Two step() calls on the same batch without zero_grad()
in between: the gradients must be twice those of one step (the reference
accumulates the same two steps by hand).

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
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle


N = 4
STEPS = 2


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def accumulated_ratio(schedule_class: type, x: torch.Tensor, y: torch.Tensor) -> float:
    """Smallest and largest |grad after STEPS steps| / |reference grad|."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for _ in range(STEPS):
        for x_mb, y_mb in zip(x.chunk(N), y.chunk(N)):
            (loss_fn(ref(x_mb), y_mb) / N).backward()
    model = copy.deepcopy(ref)
    if issubclass(schedule_class, PipelineScheduleSingle):
        stages = PipelineStage(model, 0, 1, torch.device("cpu"))
    else:  # two stages on this rank
        stages = [PipelineStage(model[i], i, 2, torch.device("cpu")) for i in (0, 1)]
    schedule = schedule_class(stages, N, loss_fn=loss_fn)
    for _ in range(STEPS):
        schedule.step(x, target=y)  # no zero_grad(): gradient accumulation
    ratios = [
        (p.grad.norm() / r.grad.norm()).item()
        for p, r in zip(model.parameters(), ref.parameters())
    ]
    same = all(
        torch.allclose(p.grad, r.grad)
        for p, r in zip(model.parameters(), ref.parameters())
    )
    print(
        f"{schedule_class.__name__}: after {STEPS} steps every gradient matches the "
        f"reference: {same} (|grad| / |reference| = {min(ratios):.4f} .. "
        f"{max(ratios):.4f})"
    )
    return max(ratios, key=lambda r: abs(r - 1))


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"torch {torch.__version__}, {N} microbatches, expected ratio 1")
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        classes = (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)
        ratios = {}
        for cls in classes:
            try:
                ratios[cls.__name__] = accumulated_ratio(cls, x, y)
            except Exception as e:  # e.g. gloo on torch 2.9: no send to the own rank
                print(
                    f"{cls.__name__}: not run on this torch: {str(e).splitlines()[0]}"
                )
        dist.destroy_process_group()
    wrong = {name: r for name, r in ratios.items() if abs(r - 1) > 1e-4}
    if wrong:
        print(
            f"defect present: {STEPS} accumulated steps give "
            + ", ".join(f"{r:.4f} ({name})" for name, r in wrong.items())
            + f" x the right gradients, i.e. (1 + 1/{N}) / 2 = {(1 + 1 / N) / 2:.4f}"
        )
        return 1
    print(f"defect absent: {STEPS} accumulated steps give the right gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
