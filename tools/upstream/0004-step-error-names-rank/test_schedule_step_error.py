# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_step_error.py
"""A failed ``_PipelineScheduleRuntime`` step names the rank that failed.

One two-stage pipeline per rank; a stage's forward fails on global rank 1
only.  The exception that reaches the caller carries a note naming the
pipeline rank, the global rank, the time step and the action.
"""

import pipeline_test_utils as ptu

import torch.distributed as dist
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.testing._internal.common_utils import run_tests


class ScheduleStepErrorTest(ptu.PipelineTestCase):
    def test_step_error_names_rank(self):
        group, _ = dist.new_subgroups(group_size=1)
        _, modules, stages = ptu.build_pipeline([0, 1], 2, self.device, group)
        schedule = ScheduleInterleaved1F1B(
            stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn
        )
        x, y = ptu.random_batch(self.device)
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


ScheduleStepErrorTestNCCL = ptu.nccl_variant(ScheduleStepErrorTest)


if __name__ == "__main__":
    run_tests()
