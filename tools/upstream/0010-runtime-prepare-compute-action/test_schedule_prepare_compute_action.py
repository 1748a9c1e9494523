# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_prepare_compute_action.py
"""A custom OVERLAP_F_B built from ``_PipelineScheduleRuntime.prepare_compute_action``.

``prepare_compute_action`` splits a compute action into its in-order
bookkeeping (done at once) and its compute (returned).  An OVERLAP_F_B that
prepares both sub-actions in schedule order and runs the computes the other
way round gives the same outputs, losses and gradients as the built-in path
(bitwise) and as a single-process reference.
"""

import copy

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _PipelineContext,
    OVERLAP_F_B,
)
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    run_tests,
    skip_but_pass_in_sandcastle_if,
)


N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8
V_SCHEDULES = (ScheduleDualPipeV,)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def overlap_backward_first(action: _Action, ctx: _PipelineContext) -> None:
    """OVERLAP_F_B: bookkeeping in schedule order, then the two computes in
    reverse order (as an implementation that overlaps them may finish them)."""
    schedule = ctx.schedule_ref
    computes = [schedule.prepare_compute_action(a, ctx) for a in action.sub_actions]
    for compute in reversed(computes):
        compute()


class SchedulePrepareComputeActionTest(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cuda":
            torch.cuda.set_device(self.rank)
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def _run(self, ScheduleClass, register):
        """One step; returns (output, losses, grads by stage) of this rank."""
        n_stages = 2 * self.world_size
        if ScheduleClass in V_SCHEDULES:
            stage_indices = [self.rank, n_stages - 1 - self.rank]
        else:
            stage_indices = [self.rank, self.rank + self.world_size]
        torch.manual_seed(0)
        ref = nn.Sequential(*(MLP(DIM) for _ in range(n_stages))).to(self.device)
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        stages = [
            PipelineStage(m, i, n_stages, self.device)
            for m, i in zip(modules, stage_indices)
        ]
        schedule = ScheduleClass(stages, N_MICROBATCHES, loss_fn=loss_fn)
        register(schedule)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
        y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        grads = {
            i: [p.grad.clone() for p in m.parameters()]
            for m, i in zip(modules, stage_indices)
        }
        # single-process reference
        for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
            (loss_fn(ref(x_mb), y_mb) / N_MICROBATCHES).backward()
        for i, stage_grads in grads.items():
            for g, ref_p in zip(stage_grads, ref[i].parameters()):
                torch.testing.assert_close(g, ref_p.grad, msg=f"stage {i}")
        return out, losses, grads

    def _assert_same_as_builtin(self, ScheduleClass, register) -> None:
        expected = self._run(ScheduleClass, lambda schedule: None)
        actual = self._run(ScheduleClass, register)
        # Same operations on the same data: identical results.
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    def test_custom_overlap_f_b_from_prepare_compute_action(self):
        torch.set_num_threads(1)

        def register(schedule):
            schedule.register_custom_function(OVERLAP_F_B, overlap_backward_first)

        self._assert_same_as_builtin(ScheduleDualPipeV, register)


instantiate_parametrized_tests(SchedulePrepareComputeActionTest)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < 2, "NCCL test requires 2+ GPUs"
)
class SchedulePrepareComputeActionTestNCCL(SchedulePrepareComputeActionTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
