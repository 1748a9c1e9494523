# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_grad_accumulation.py
"""Gradient accumulation across ``step()`` calls with ``scale_grads=True``.

Steps without ``zero_grad()`` must give the sum of the steps' gradients:
a step's ``scale_grads`` may only divide what the step added, also when FSDP
reductions are deferred with ``step(finalize_gradients=False)`` and when
``eval()`` runs between steps.  PP=2 x DP=2; the data-parallel replicas see
the same batch, plain or ``fully_shard``-ed stages, so every gradient must
equal a single-process reference.
"""

import pipeline_test_utils as ptu

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)


PP = 2
DP = 2


class ScheduleGradAccumulationTest(ptu.PipelineTestCase):
    world_size = PP * DP

    @parametrize(
        "ScheduleClass",
        [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS],
    )
    @parametrize("use_fsdp", [False, True])
    def test_accumulate_without_zero_grad(self, ScheduleClass, use_fsdp):
        self._accumulate(ScheduleClass, use_fsdp, finalize=[True, True, True])

    @parametrize("ScheduleClass", [Schedule1F1B, ScheduleInterleaved1F1B])
    def test_accumulate_with_deferred_fsdp_reduction(self, ScheduleClass):
        # A finalized step, then one whose reduction is deferred, then the
        # step that finalizes it: the first step's gradients are carried.
        self._accumulate(ScheduleClass, True, finalize=[True, False, True])

    @parametrize("ScheduleClass", [ScheduleGPipe, Schedule1F1B])
    def test_accumulate_with_eval_between_steps(self, ScheduleClass):
        # eval() runs step() without backward: it scales nothing.
        self._accumulate(ScheduleClass, False, [True, True, True], evaluate=True)

    @parametrize("ScheduleClass", [ScheduleGPipe, ScheduleInterleaved1F1B])
    def test_step_from_zero_gradients_is_unchanged(self, ScheduleClass):
        # A step that starts without gradients divides the sum of the
        # microbatches' gradients once, as before: bitwise that division.
        _, modules, _, schedule = self._pipeline(ScheduleClass, False)
        _, plain_modules, _, plain = self._pipeline(ScheduleClass, False, False)
        x, y = ptu.random_batch(self.device)
        schedule.step(x, target=y)
        plain.step(x, target=y)

        def check():
            for module, plain_module in zip(modules, plain_modules):
                named = zip(module.named_parameters(), plain_module.parameters())
                for (name, p), plain_p in named:
                    expected = plain_p.grad / ptu.N_MICROBATCHES
                    self.assertTrue(torch.equal(p.grad, expected), name)

        self.assert_on_all_ranks(check)

    def _pipeline(self, ScheduleClass, use_fsdp, scale_grads=True):
        """The reference model, this rank's stage modules and indices, the schedule."""
        mesh = self.mesh((PP, DP), ("pp", "dp"))
        pp_rank = mesh["pp"].get_local_rank()
        single_stage = issubclass(ScheduleClass, PipelineScheduleSingle)
        indices = ptu.stage_indices(
            ScheduleClass, pp_rank, PP, stages_per_rank=1 if single_stage else 2
        )
        ref, modules, stages = ptu.build_pipeline(
            indices,
            PP if single_stage else 2 * PP,
            self.device,
            group=mesh["pp"].get_group(),
            wrap=(lambda m: fully_shard(m, mesh=mesh["dp"])) if use_fsdp else None,
        )
        schedule = ScheduleClass(
            stages[0] if single_stage else stages,
            ptu.N_MICROBATCHES,
            loss_fn=ptu.loss_fn,
            scale_grads=scale_grads,
        )
        return ref, modules, indices, schedule

    def _accumulate(self, ScheduleClass, use_fsdp, finalize, evaluate=False):
        ref, modules, indices, schedule = self._pipeline(ScheduleClass, use_fsdp)
        for step, finalize_gradients in enumerate(finalize):  # no zero_grad()
            x, y = ptu.random_batch(self.device, seed=step)
            schedule.step(x, target=y, finalize_gradients=finalize_gradients)
            if evaluate:
                schedule.eval(x, target=y)
            ptu.reference_step(ref, x, y)
            if finalize_gradients:  # .grad is valid once the reduction is finalized
                self.assert_grads_match_reference(modules, indices, ref)


instantiate_parametrized_tests(ScheduleGradAccumulationTest)
ScheduleGradAccumulationTestNCCL = ptu.nccl_variant(ScheduleGradAccumulationTest)


if __name__ == "__main__":
    run_tests()
