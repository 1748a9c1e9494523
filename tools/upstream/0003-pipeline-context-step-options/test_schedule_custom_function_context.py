# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_custom_function_context.py
"""What ``_PipelineScheduleRuntime`` tells custom functions.

A custom FORWARD registered with ``register_custom_function``, written
against the stage API as a user writes it (``ptu.stage_api_forward``), honours
the step's ``return_outputs`` and ``loss_kwargs`` as far as its
``_PipelineContext`` carries them (a context without them gets the
defaults): losses, outputs and gradients must equal a single-process
reference's for the options given.
"""

import pipeline_test_utils as ptu

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import FORWARD
from torch.testing._internal.common_utils import run_tests


class ScheduleCustomFunctionContextTest(ptu.PipelineTestCase):
    def test_custom_forward_sees_step_options(self):
        indices = ptu.stage_indices(ScheduleInterleaved1F1B, self.rank, self.world_size)
        ref, modules, stages = ptu.build_pipeline(
            indices, 4, self.device, dist.group.WORLD
        )
        schedule = ScheduleInterleaved1F1B(
            stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn
        )
        schedule.register_custom_function(FORWARD, ptu.stage_api_forward)
        last_stage = next((s for s in stages if s.is_last), None)
        for step, (return_outputs, loss_kwargs) in enumerate(
            [(False, {"scale": 3.0}), (True, None)]
        ):
            x, y = ptu.random_batch(self.device, seed=step)
            losses: list[torch.Tensor] = []
            out = schedule.step(
                x,
                target=y,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
            )
            ref_out, ref_losses = ptu.reference_step(ref, x, y, loss_kwargs=loss_kwargs)

            def check():
                if last_stage is not None:
                    torch.testing.assert_close(losses, ref_losses)
                    if return_outputs:
                        torch.testing.assert_close(out, ref_out)
                    else:
                        self.assertEqual(len(last_stage.output_chunks), 0)
                ptu.assert_grads_match(modules, indices, ref)

            self.assert_on_all_ranks(check)
            for module in (*modules, ref):
                module.zero_grad()


ScheduleCustomFunctionContextTestNCCL = ptu.nccl_variant(
    ScheduleCustomFunctionContextTest
)


if __name__ == "__main__":
    run_tests()
