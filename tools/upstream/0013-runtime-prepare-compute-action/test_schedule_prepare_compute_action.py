# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""``_PipelineScheduleRuntime.prepare_compute_action``: bookkeeping apart from compute.

Every compute action the runtime runs goes through ``prepare_compute_action``
(a subclass that overrides it sees them all, in schedule order).  A custom
OVERLAP_F_B that prepares both sub-actions in schedule order and then runs
their computes backward-first gives bitwise the built-in results, and the
gradients of a single-process reference.
"""

from pipeline_test_utils import nccl_variant, PipelineTestCase, run_step

import torch
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
)
from torch.testing._internal.common_utils import run_tests


COMPUTE = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


class Preparing(ScheduleDualPipeV):
    """``prepare_compute_action`` records each action it prepares."""

    prepared: list = []

    def prepare_compute_action(self, action, ctx, **kwargs):
        self.prepared.append(action)
        return super().prepare_compute_action(action, ctx, **kwargs)


def backward_first(action, ctx) -> None:
    """OVERLAP_F_B: both sub-actions prepared in order, their computes reversed."""
    schedule = ctx.schedule_ref
    computes = [schedule.prepare_compute_action(a, ctx) for a in action.sub_actions]
    for compute in reversed(computes):
        compute()


class SchedulePrepareComputeActionTest(PipelineTestCase):
    def test_prepare_compute_action(self):
        schedule, builtin = run_step(self, ScheduleDualPipeV, schedule_type=Preparing)
        expected = [
            sub
            for action in schedule.pipeline_order_with_comms[self.rank]
            for sub in (action.sub_actions or (action,))
            if sub.computation_type in COMPUTE
        ]
        self.assertEqual(Preparing.prepared, expected)

        def register(schedule):
            schedule.register_custom_function(OVERLAP_F_B, backward_first)

        custom = run_step(self, ScheduleDualPipeV, register)[1]
        torch.testing.assert_close(custom, builtin, rtol=0, atol=0)


SchedulePrepareComputeActionTestNCCL = nccl_variant(SchedulePrepareComputeActionTest)


if __name__ == "__main__":
    run_tests()
