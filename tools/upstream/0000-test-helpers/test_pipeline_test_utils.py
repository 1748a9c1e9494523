# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_pipeline_test_utils.py
"""The shared schedule-test helpers (``pipeline_test_utils``) on stock schedules.

A loop and a V schedule over stages cut from one reference model match the
single-process reference step (losses, outputs, every gradient), and a check
that fails on one rank fails on every rank.
"""

from pipeline_test_utils import (
    assert_grads_match,
    build_pipeline,
    loss_fn,
    N_MICROBATCHES,
    nccl_variant,
    PipelineTestCase,
    random_batch,
    reference_step,
    stage_indices,
)

import torch
from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleInterleaved1F1B
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


class PipelineTestUtilsTest(PipelineTestCase):
    @parametrize("ScheduleClass", [ScheduleInterleaved1F1B, ScheduleDualPipeV])
    def test_schedule_matches_reference(self, ScheduleClass):
        indices = stage_indices(ScheduleClass, self.rank, self.world_size)
        ref, modules, stages = build_pipeline(indices, 4, self.device)
        schedule = ScheduleClass(stages, N_MICROBATCHES, loss_fn=loss_fn)
        x, y = random_batch(self.device)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        ref_out, ref_losses = reference_step(ref, x, y)

        def check():
            if any(s.is_last for s in stages):
                torch.testing.assert_close(out, ref_out)
                torch.testing.assert_close(losses, ref_losses)
            assert_grads_match(modules, indices, ref)

        self.assert_on_all_ranks(check)

    def test_a_failed_check_fails_every_rank(self):
        def check():
            self.assertEqual(self.rank, 0)

        with self.assertRaises(AssertionError):
            self.assert_on_all_ranks(check)


instantiate_parametrized_tests(PipelineTestUtilsTest)
PipelineTestUtilsTestNCCL = nccl_variant(PipelineTestUtilsTest)


if __name__ == "__main__":
    run_tests()
