# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Custom functions of a ``_PipelineScheduleRuntime`` step share one context.

A custom FORWARD that keeps a count on its ``_PipelineContext`` finds it
again in later actions of the step, and a new step brings a new context;
the results equal the built-in path's and a single-process reference's.
"""

import pipeline_test_utils as ptu

import torch
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import FORWARD
from torch.testing._internal.common_utils import run_tests


class CountingForward:
    """A FORWARD that counts the step's forwards on the context it is given."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.contexts: list[int] = []

    def __call__(self, action, ctx) -> None:
        ctx.forwards = getattr(ctx, "forwards", 0) + 1
        self.counts.append(ctx.forwards)
        self.contexts.append(id(ctx))
        ptu.stage_api_forward(action, ctx)


class ScheduleContextPerStepTest(ptu.PipelineTestCase):
    def test_custom_functions_share_the_step_context(self):
        builtin = ptu.run_step(self, ScheduleInterleaved1F1B)[1]
        forward = CountingForward()

        def register(schedule):
            schedule.register_custom_function(FORWARD, forward)

        schedule, custom = ptu.run_step(self, ScheduleInterleaved1F1B, register)
        n_forwards = 2 * ptu.N_MICROBATCHES  # two stages per rank
        self.assertEqual(forward.counts, list(range(1, n_forwards + 1)))
        self.assertEqual(len(set(forward.contexts)), 1)
        torch.testing.assert_close(custom, builtin, rtol=0, atol=0)
        # the next step has a context of its own
        forward.counts.clear()
        x, y = ptu.random_batch(self.device, seed=2)
        schedule.step(x, target=y)
        self.assertEqual(forward.counts, list(range(1, n_forwards + 1)))


ScheduleContextPerStepTestNCCL = ptu.nccl_variant(ScheduleContextPerStepTest)


if __name__ == "__main__":
    run_tests()
