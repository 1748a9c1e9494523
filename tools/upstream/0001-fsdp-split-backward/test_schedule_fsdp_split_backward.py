# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_fsdp_split_backward.py
"""Split-backward schedules (I/W) with nested ``fully_shard`` stages.

PP=2 x DP=2: every stage is an FSDP root whose layers are ``fully_shard``-ed
too (the usual FSDP2 recipe), both data-parallel replicas see the same batch,
so every gradient must equal the one of a single-process reference.
"""

import pipeline_test_utils as ptu

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


PP = 2
DP = 2


class SquaredWeightLinear(nn.Module):
    """``x @ (w * w).T + b``: the weight gradient reads the weight itself."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim, dim) - 0.5)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.weight, self.bias)


class StageModule(nn.Module):
    """Two Linear+ReLU layers, a squared-weight layer and a gain owned by the root."""

    def __init__(self, dim: int = ptu.DIM) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.squared = SquaredWeightLinear(dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.squared(x) * self.gain


class ScheduleFSDPSplitBackwardTest(ptu.PipelineTestCase):
    world_size = PP * DP

    @parametrize(
        "ScheduleClass",
        [ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, ScheduleDualPipeV],
    )
    def test_nested_fully_shard_gradients(self, ScheduleClass):
        mesh = self.mesh((PP, DP), ("pp", "dp"))

        def shard(module: nn.Module) -> nn.Module:
            for layer in (*module.layers, module.squared):
                fully_shard(layer, mesh=mesh["dp"])
            return fully_shard(module, mesh=mesh["dp"])

        indices = ptu.stage_indices(ScheduleClass, mesh["pp"].get_local_rank(), PP)
        ref, modules, stages = ptu.build_pipeline(
            indices, 2 * PP, self.device, mesh["pp"].get_group(), StageModule, shard
        )
        schedule = ScheduleClass(stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn)
        x, y = ptu.random_batch(self.device)
        schedule.step(x, target=y)
        ptu.reference_step(ref, x, y)
        self.assert_grads_match_reference(modules, indices, ref)


instantiate_parametrized_tests(ScheduleFSDPSplitBackwardTest)
ScheduleFSDPSplitBackwardTestNCCL = ptu.nccl_variant(ScheduleFSDPSplitBackwardTest)


if __name__ == "__main__":
    run_tests()
