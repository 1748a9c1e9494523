# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Concurrent OVERLAP_F_B over FSDP2 stages.

PP=2 x DP=2, ScheduleDualPipeV over stages whose blocks and roots are
``fully_shard``-ed (``reshard_after_forward=True``, the default): no
all-gather runs inside the two concurrent computes of an overlapped action
(both stages are unsharded before they start, so a rank's data-parallel
collectives do not depend on thread timing), and the results are bitwise
those of the built-in OVERLAP_F_B and equal a single-process reference.
"""

from unittest import mock

from overlap_test_utils import MarkedBlock, run_dual_pipe_v
from pipeline_test_utils import nccl_variant, PipelineTestCase

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.pipelining import _ep_marks
from torch.testing._internal.common_utils import run_tests


PP = 2
DP = 2


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MarkedBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ScheduleOverlapFSDPTest(PipelineTestCase):
    world_size = PP * DP

    def _run(self, overlap: bool, all_gathers: list):
        mesh = self.mesh((PP, DP), ("pp", "dp"))

        def shard(module):
            for block in module.blocks:
                fully_shard(block, mesh=mesh["dp"])
            return fully_shard(module, mesh=mesh["dp"])

        original = _fsdp_param_group.foreach_all_gather

        def recorded(*args, **kwargs):
            all_gathers.append(_ep_marks._current_binding() is not None)
            return original(*args, **kwargs)

        with mock.patch.object(_fsdp_param_group, "foreach_all_gather", recorded):
            return run_dual_pipe_v(
                self,
                overlap,
                make_stage=Blocks,
                wrap=shard,
                group=mesh["pp"].get_group(),
                pp_rank=mesh["pp"].get_local_rank(),
                pp_size=PP,
            )

    def test_no_all_gather_inside_the_concurrent_computes(self):
        sequential = self._run(False, [])
        all_gathers: list[bool] = []
        overlapped = self._run(True, all_gathers)
        self.assertGreater(len(all_gathers), 0)
        inside = sum(all_gathers)
        self.assertEqual(inside, 0, f"{inside} all-gathers inside overlapped computes")
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)


ScheduleOverlapFSDPTestNCCL = nccl_variant(ScheduleOverlapFSDPTest)


if __name__ == "__main__":
    run_tests()
