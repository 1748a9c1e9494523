# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_step_error.py
"""Where a ``_PipelineScheduleRuntime`` step failed.

An exception raised by an action carries a note naming the pipeline rank, the
global rank, the time step and the action.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    run_tests,
    skip_but_pass_in_sandcastle_if,
)


N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("injected failure")
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0):
    return scale * nn.functional.mse_loss(output, target)


class ScheduleStepErrorTest(MultiProcContinuousTest):
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

    def _pipeline(self, group: dist.ProcessGroup, stage_indices, n_stages):
        torch.manual_seed(0)
        ref = nn.Sequential(*(MLP(DIM) for _ in range(n_stages))).to(self.device)
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        stages = [
            PipelineStage(m, i, n_stages, self.device, group=group)
            for m, i in zip(modules, stage_indices)
        ]
        return ref, modules, stages

    def _batch(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        shape = (N_MICROBATCHES * MB_SIZE, DIM)
        x, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        return x.to(self.device), y.to(self.device)

    def test_step_error_names_rank(self):
        torch.set_num_threads(1)
        # One two-stage pipeline per rank: the failure stays on its rank.
        group, _ = dist.new_subgroups(group_size=1)
        _, modules, stages = self._pipeline(group, [0, 1], 2)
        schedule = ScheduleInterleaved1F1B(stages, N_MICROBATCHES, loss_fn=loss_fn)
        x, y = self._batch(0)
        schedule.step(x, target=y)  # a good step first

        modules[1].fail = self.rank == 1
        if self.rank != 1:
            schedule.step(x, target=y)
            return
        with self.assertRaises(RuntimeError) as cm:  # forward_one_chunk wraps it
            schedule.step(x, target=y)
        self.assertIsInstance(cm.exception.__cause__, ValueError)
        notes = "\n".join(getattr(cm.exception, "__notes__", []))
        self.assertIn("pipeline rank 0 (global rank 1)", notes)
        self.assertIn("running action 1F0", notes)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < 2, "NCCL test requires 2+ GPUs"
)
class ScheduleStepErrorTestNCCL(ScheduleStepErrorTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
