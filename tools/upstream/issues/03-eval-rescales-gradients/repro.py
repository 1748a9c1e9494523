"""eval() on a single-stage schedule divides the last step's gradients by n again.

One process (gloo, CPU), one stage, ScheduleGPipe and Schedule1F1B with four
microbatches: step(), then eval() on the same batch, then the gradients are
compared with a single-process reference.

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


N = 4


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def check(schedule_class: type, x: torch.Tensor, y: torch.Tensor) -> float:
    """Ratio |grad after step+eval| / |reference grad| of the weight."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    model = copy.deepcopy(ref)
    for x_mb, y_mb in zip(x.chunk(N), y.chunk(N)):
        (loss_fn(ref(x_mb), y_mb) / N).backward()
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    schedule = schedule_class(stage, N, loss_fn=loss_fn)
    schedule.step(x, target=y)
    after_step = model.weight.grad.clone()
    schedule.eval(x, target=y)
    after_eval = model.weight.grad
    ratio = (after_eval.norm() / ref.weight.grad.norm()).item()
    print(
        f"{schedule_class.__name__}: after step() the gradient matches the "
        f"reference: {torch.allclose(after_step, ref.weight.grad)}; after eval(): "
        f"{torch.allclose(after_eval, ref.weight.grad)} (|grad| / |reference| = "
        f"{ratio:.4f})"
    )
    return ratio


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"torch {torch.__version__}, {N} microbatches")
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        ratios = {
            cls.__name__: check(cls, x, y) for cls in (ScheduleGPipe, Schedule1F1B)
        }
        dist.destroy_process_group()
    wrong = {name: r for name, r in ratios.items() if abs(r - 1) > 1e-4}
    if wrong:
        print(
            "defect present: eval() changed the gradients of the preceding step: "
            + ", ".join(
                f"{name} left {r:.4f} x the reference" for name, r in wrong.items()
            )
        )
        return 1
    print("defect absent: eval() left the gradients of the preceding step as they were")
    return 0


if __name__ == "__main__":
    sys.exit(main())
