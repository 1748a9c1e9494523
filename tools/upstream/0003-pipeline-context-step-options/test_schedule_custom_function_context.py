# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_custom_function_context.py
"""What ``_PipelineScheduleRuntime`` tells custom functions.

A custom FORWARD registered with ``register_custom_function`` reads the step's
``return_outputs`` and ``loss_kwargs`` from ``_PipelineContext`` and gives the
same losses, outputs and gradients as a single-process reference.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _Action, _PipelineContext, FORWARD
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    run_tests,
    skip_but_pass_in_sandcastle_if,
)


N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("injected failure")
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0):
    return scale * nn.functional.mse_loss(output, target)


class CustomForward:
    """FORWARD written against the stage API, as a user would write it."""

    def __init__(self) -> None:
        self.return_outputs: list[bool] = []

    def __call__(self, action: _Action, ctx: _PipelineContext) -> None:
        # Read the step options first: a failure here happens on every rank.
        return_outputs, loss_kwargs = ctx.return_outputs, ctx.loss_kwargs
        self.return_outputs.append(return_outputs)
        schedule = ctx.schedule_ref
        stages = {s.stage_index: s for s in schedule._stages}
        stage, mb = stages[action.stage_index], action.microbatch_index
        if not stage.is_first and action.stage_index - 1 not in stages:
            for work in schedule.fwd_recv_ops.pop((action.stage_index, mb)):
                work.wait()
        output = stage.forward_one_chunk(
            mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=return_outputs
        )
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb, loss_kwargs)
        if action.stage_index + 1 in stages:
            stages[action.stage_index + 1].set_local_fwd_input(output, mb)


class ScheduleCustomFunctionContextTest(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cuda":
            torch.cuda.set_device(self.rank)
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def _pipeline(self, group: dist.ProcessGroup, stage_indices, n_stages):
        torch.manual_seed(0)
        ref = nn.Sequential(*(MLP(DIM) for _ in range(n_stages))).to(self.device)
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        stages = [
            PipelineStage(m, i, n_stages, self.device, group=group)
            for m, i in zip(modules, stage_indices)
        ]
        return ref, modules, stages

    def _batch(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        shape = (N_MICROBATCHES * MB_SIZE, DIM)
        x, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        return x.to(self.device), y.to(self.device)

    def test_custom_forward_sees_step_options(self):
        torch.set_num_threads(1)
        n_stages = 2 * self.world_size
        stage_indices = [self.rank, self.rank + self.world_size]
        ref, modules, stages = self._pipeline(dist.group.WORLD, stage_indices, n_stages)
        schedule = ScheduleInterleaved1F1B(stages, N_MICROBATCHES, loss_fn=loss_fn)
        forward = CustomForward()
        schedule.register_custom_function(FORWARD, forward)
        last_stage = next((s for s in stages if s.is_last), None)

        for step, (return_outputs, loss_kwargs) in enumerate(
            [(False, {"scale": 3.0}), (True, None)]
        ):
            x, y = self._batch(step)
            losses: list[torch.Tensor] = []
            out = schedule.step(
                x,
                target=y,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
            )
            self.assertEqual(
                forward.return_outputs, [return_outputs] * 2 * N_MICROBATCHES
            )
            forward.return_outputs.clear()

            ref_outputs, ref_losses = [], []
            for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
                ref_out = ref(x_mb)
                loss = loss_fn(ref_out, y_mb, **(loss_kwargs or {}))
                (loss / N_MICROBATCHES).backward()
                ref_outputs.append(ref_out.detach())
                ref_losses.append(loss.detach())
            if last_stage is not None:
                torch.testing.assert_close(losses, ref_losses)
                if return_outputs:
                    torch.testing.assert_close(out, torch.cat(ref_outputs))
                else:
                    self.assertEqual(len(last_stage.output_chunks), 0)
            for module, i in zip(modules, stage_indices):
                for (name, p), ref_p in zip(
                    module.named_parameters(), ref[i].parameters()
                ):
                    torch.testing.assert_close(
                        p.grad, ref_p.grad, msg=f"stage {i} {name}"
                    )
                module.zero_grad()
            ref.zero_grad()


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < 2, "NCCL test requires 2+ GPUs"
)
class ScheduleCustomFunctionContextTestNCCL(ScheduleCustomFunctionContextTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
