# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_compute_comms_reduce_grad.py
"""``compute_comms`` schedules and REDUCE_GRAD.

PP=2 x DP=2.  ScheduleInterleaved1F1B's own lowered schedule, loaded into
``_PipelineScheduleRuntime`` as a ``compute_comms`` CSV, trains right (plain
and ``fully_shard`` stages: every gradient equals a single-process
reference).  The same schedule without its REDUCE_GRAD / WAIT_REDUCE_GRAD
(written by hand, or before REDUCE_GRAD existed), or with them for some
stages only, is rejected when loaded: its gradients would be neither reduced
nor scaled.
"""

import os
import re
import tempfile

import pipeline_test_utils as ptu

from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    REDUCE_GRAD,
    WAIT_REDUCE_GRAD,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


PP = 2
DP = 2


class ScheduleComputeCommsReduceGradTest(ptu.PipelineTestCase):
    world_size = PP * DP

    def _stages(self, use_fsdp: bool):
        mesh = self.mesh((PP, DP), ("pp", "dp"))
        pp_rank = mesh["pp"].get_local_rank()
        indices = [pp_rank, pp_rank + PP]
        wrap = (lambda m: fully_shard(m, mesh=mesh["dp"])) if use_fsdp else None
        ref, modules, stages = ptu.build_pipeline(
            indices, 2 * PP, self.device, mesh["pp"].get_group(), wrap=wrap
        )
        return ref, modules, indices, stages

    def _load_lowered(self, stages, keep_reduce_grad=lambda stage_index: True):
        """Load the lowered 1F1B schedule as compute_comms, keeping some REDUCE_GRADs."""
        lowered = ScheduleInterleaved1F1B(
            stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn
        ).pipeline_order_with_comms
        rows = [
            [
                a
                for a in lowered[rank]
                if a.computation_type not in (REDUCE_GRAD, WAIT_REDUCE_GRAD)
                or keep_reduce_grad(a.stage_index)
            ]
            for rank in sorted(lowered)
        ]
        schedule = _PipelineScheduleRuntime(
            stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "schedule.csv")
            with open(path, "w") as f:
                f.writelines(",".join(str(a) for a in row) + "\n" for row in rows)
            schedule._load_csv(path, format="compute_comms")
        return schedule

    @parametrize("use_fsdp", [False, True])
    def test_complete_schedule_trains(self, use_fsdp):
        ref, modules, indices, stages = self._stages(use_fsdp)
        schedule = self._load_lowered(stages)
        for step in range(2):
            x, y = ptu.random_batch(self.device, seed=step)
            schedule.step(x, target=y)
            ptu.reference_step(ref, x, y)
            self.assert_grads_match_reference(modules, indices, ref)
            for module in (*modules, ref):
                module.zero_grad()

    @parametrize("kept", ["none", "first_stage"])
    def test_compute_comms_without_reduce_grad_raises(self, kept):
        _, _, _, stages = self._stages(use_fsdp=False)
        # No REDUCE_GRAD at all, or each rank keeps the one of its first stage only.
        keep = (lambda i: i < PP) if kept == "first_stage" else (lambda i: False)
        # every rank validates the whole schedule and stops at rank 0 (stages 0, PP)
        missing = [PP] if kept == "first_stage" else [0, PP]
        with self.assertRaisesRegex(
            ValueError,
            re.escape(f"Rank 0 runs backward for stages {missing} but has no"),
        ):
            self._load_lowered(stages, keep)


instantiate_parametrized_tests(ScheduleComputeCommsReduceGradTest)
ScheduleComputeCommsReduceGradTestNCCL = ptu.nccl_variant(
    ScheduleComputeCommsReduceGradTest
)


if __name__ == "__main__":
    run_tests()
