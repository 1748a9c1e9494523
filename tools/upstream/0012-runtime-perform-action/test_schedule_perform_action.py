# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""``_PipelineScheduleRuntime.perform_action``: every built-in action, one entry point.

The step loop runs every action that has no custom function, and every
sub-action of OVERLAP_F_B, through ``perform_action``: a subclass that
overrides it sees them all.  Custom FORWARD and backward functions that count
their actions and call ``perform_action`` give bitwise the results of the
built-in path, and the gradients of a single-process reference.
"""

from pipeline_test_utils import (
    N_MICROBATCHES,
    nccl_variant,
    PipelineTestCase,
    run_step,
)

import torch
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


COMPUTE = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


def recording(schedule_class: type) -> type:
    """``schedule_class`` whose ``perform_action`` records each action first."""

    class Recording(schedule_class):
        def perform_action(self, action, ctx):
            self.performed.append(action)
            super().perform_action(action, ctx)

    Recording.performed = []
    return Recording


class CountingAction:
    """Any action type: count it, then run it the built-in way."""

    def __init__(self) -> None:
        self.calls: dict[object, int] = {}

    def __call__(self, action, ctx) -> None:
        ctype = action.computation_type
        self.calls[ctype] = self.calls.get(ctype, 0) + 1
        ctx.schedule_ref.perform_action(action, ctx)


class SchedulePerformActionTest(PipelineTestCase):
    @parametrize("ScheduleClass", [ScheduleDualPipeV, ScheduleInterleavedZeroBubble])
    def test_perform_action(self, ScheduleClass):
        schedule_type = recording(ScheduleClass)
        schedule, builtin = run_step(self, ScheduleClass, schedule_type=schedule_type)
        expected = [
            sub
            for action in schedule.pipeline_order_with_comms[self.rank]
            for sub in (
                action.sub_actions
                if action.computation_type == OVERLAP_F_B
                else (action,)
            )
        ]
        self.assertEqual(schedule_type.performed, expected)

        counting = CountingAction()

        def register(schedule):
            for ctype in COMPUTE:
                schedule.register_custom_function(ctype, counting)

        custom = run_step(self, ScheduleClass, register)[1]
        torch.testing.assert_close(custom, builtin, rtol=0, atol=0)
        # custom functions get the top-level actions; DualPipeV runs some of
        # its forwards and backwards inside OVERLAP_F_B (built-in here)
        self.assertGreater(counting.calls.get(FORWARD, 0), 0)
        if ScheduleClass is ScheduleInterleavedZeroBubble:
            self.assertEqual(counting.calls[FORWARD], 2 * N_MICROBATCHES)
            self.assertEqual(counting.calls[BACKWARD_WEIGHT], 2 * N_MICROBATCHES)


instantiate_parametrized_tests(SchedulePerformActionTest)
SchedulePerformActionTestNCCL = nccl_variant(SchedulePerformActionTest)


if __name__ == "__main__":
    run_tests()
