"""A custom FORWARD cannot honour step(loss_kwargs=..., return_outputs=...).

One process (gloo, CPU), two stages on the rank, ScheduleInterleaved1F1B,
two microbatches, a loss function with a keyword argument.  The same step runs
with the built-in FORWARD and with a custom FORWARD registered through
register_custom_function that does what the built-in one does with everything
its _PipelineContext offers (reading return_outputs / loss_kwargs from it when
present).  Losses and kept output chunks are compared.

Run with a stock torch:  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import functools
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _ComputationType


N = 2


def loss_fn(out: torch.Tensor, target: torch.Tensor, weight: float = 1.0):
    return weight * nn.functional.mse_loss(out, target)


def custom_forward(stages: dict, action, ctx) -> None:
    schedule = ctx.schedule_ref
    stage, mb = stages[action.stage_index], action.microbatch_index
    output = stage.forward_one_chunk(
        mb,
        ctx.arg_mbs[mb],
        ctx.kwarg_mbs[mb],
        save_forward_output=getattr(ctx, "return_outputs", True),
    )
    loss_kwargs = getattr(ctx, "loss_kwargs", None)
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb, loss_kwargs)
    if action.stage_index + 1 in stages:  # the local hand-off to the next stage
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)


def run(custom: bool, x: torch.Tensor, y: torch.Tensor) -> tuple[list, int]:
    torch.manual_seed(0)
    stages = [PipelineStage(nn.Linear(4, 4), i, 2, torch.device("cpu")) for i in (0, 1)]
    schedule = ScheduleInterleaved1F1B(stages, N, loss_fn=loss_fn)
    if custom:
        by_index = {s.stage_index: s for s in stages}
        schedule.register_custom_function(
            _ComputationType.FORWARD, functools.partial(custom_forward, by_index)
        )
    losses: list[torch.Tensor] = []
    schedule.step(
        x, target=y, losses=losses, return_outputs=False, loss_kwargs={"weight": 0.5}
    )
    kept = len(stages[1].output_chunks)
    name = "custom FORWARD" if custom else "built-in FORWARD"
    print(f"{name}: losses {[round(t.item(), 6) for t in losses]}, kept outputs {kept}")
    return losses, kept


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(
        f"torch {torch.__version__}; step(return_outputs=False, loss_kwargs={{'weight': 0.5}})"
    )
    x, y = torch.randn(2 * N, 4), torch.randn(2 * N, 4)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        builtin_losses, builtin_kept = run(False, x, y)
        custom_losses, custom_kept = run(True, x, y)
        dist.destroy_process_group()
    problems = []
    if not all(torch.equal(a, b) for a, b in zip(builtin_losses, custom_losses)):
        problems.append("the custom FORWARD's losses ignore loss_kwargs")
    if custom_kept != builtin_kept:
        problems.append("the custom FORWARD keeps outputs return_outputs=False drops")
    if problems:
        print(
            "defect present: _PipelineContext carries neither loss_kwargs nor "
            "return_outputs, so " + " and ".join(problems)
        )
        return 1
    print("defect absent: the custom FORWARD reproduces the built-in one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
