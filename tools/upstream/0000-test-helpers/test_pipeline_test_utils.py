# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_pipeline_test_utils.py
"""The shared schedule-test helpers (``pipeline_test_utils``) on stock schedules.

A loop and a V schedule over stages cut from one reference model match the
single-process reference step (losses, outputs, every gradient), and a check
that fails on one rank fails on every rank.
"""

import pipeline_test_utils as ptu

import torch
from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleaved1F1B
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


class PipelineTestUtilsTest(ptu.PipelineTestCase):
    @parametrize("ScheduleClass", [ScheduleInterleaved1F1B, ScheduleDualPipeV])
    def test_schedule_matches_reference(self, ScheduleClass):
        indices = ptu.stage_indices(ScheduleClass, self.rank, self.world_size)
        ref, modules, stages = ptu.build_pipeline(indices, 4, self.device)
        schedule = ScheduleClass(stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn)
        x, y = ptu.random_batch(self.device)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        ref_out, ref_losses = ptu.reference_step(ref, x, y)

        def check():
            if any(s.is_last for s in stages):
                torch.testing.assert_close(out, ref_out)
                torch.testing.assert_close(losses, ref_losses)
            ptu.assert_grads_match(modules, indices, ref)

        self.assert_on_all_ranks(check)

    def test_a_failed_check_fails_every_rank(self):
        def check():
            self.assertEqual(self.rank, 0)

        with self.assertRaises(AssertionError):
            self.assert_on_all_ranks(check)


instantiate_parametrized_tests(PipelineTestUtilsTest)
PipelineTestUtilsTestNCCL = ptu.nccl_variant(PipelineTestUtilsTest)


if __name__ == "__main__":
    run_tests()
