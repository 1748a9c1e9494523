# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_grad_accumulation.py
"""Gradient accumulation across ``step()`` calls with ``scale_grads=True``.

Steps without ``zero_grad()`` must give the sum of the steps' gradients:
``scale_grads`` may only divide what the current step added, also when FSDP
reductions are deferred with ``step(finalize_gradients=False)``.
PP=2 x DP=2; the data-parallel replicas see the same batch, plain or
``fully_shard``-ed stages, so every gradient must equal a single-process
reference.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skip_but_pass_in_sandcastle_if,
)


PP = 2
DP = 2
N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8
N_STEPS = 3
SINGLE_STAGE_SCHEDULES = (ScheduleGPipe, Schedule1F1B)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class ScheduleGradAccumulationTest(MultiProcContinuousTest):
    world_size = PP * DP

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

    def _mesh(self):
        cls = type(self)
        if getattr(cls, "_cached_mesh", None) is None:
            cls._cached_mesh = init_device_mesh(
                self.device_type(), (PP, DP), mesh_dim_names=("pp", "dp")
            )
        return cls._cached_mesh

    def _assert_on_all_ranks(self, check) -> None:
        # Every rank fails together, so that no rank is left in a collective.
        error = None
        try:
            check()
        except AssertionError as e:
            error = e
        failed = torch.tensor([int(error is not None)], device=self.device)
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise AssertionError(
                f"the check failed on {int(failed.item())} other rank(s)"
            )

    @parametrize(
        "ScheduleClass",
        [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS],
    )
    @parametrize("use_fsdp", [False, True])
    def test_accumulate_without_zero_grad(self, ScheduleClass, use_fsdp):
        self._accumulate(ScheduleClass, use_fsdp, finalize=[True] * N_STEPS)

    @parametrize("ScheduleClass", [Schedule1F1B, ScheduleInterleaved1F1B])
    def test_accumulate_with_deferred_fsdp_reduction(self, ScheduleClass):
        # A finalized step, then one whose reduction is deferred, then the
        # step that finalizes it: the first step's gradients are carried.
        self._accumulate(ScheduleClass, True, finalize=[True, False, True])

    @parametrize("ScheduleClass", [Schedule1F1B, ScheduleInterleaved1F1B])
    def test_accumulate_with_eval_between_steps(self, ScheduleClass):
        # eval() runs step() without backward: it scales nothing.
        self._accumulate(ScheduleClass, False, [True] * N_STEPS, evaluate=True)

    @parametrize("ScheduleClass", [ScheduleGPipe, ScheduleInterleaved1F1B])
    def test_step_from_zero_gradients_is_unchanged(self, ScheduleClass):
        # A step that starts without gradients divides the sum of the
        # microbatches' gradients once, as before: bitwise that division.
        torch.set_num_threads(1)
        _, modules, _, schedule = self._pipeline(ScheduleClass, False)
        _, plain_modules, _, plain = self._pipeline(ScheduleClass, False, False)
        x, y = self._batch(torch.Generator().manual_seed(1))
        schedule.step(x, target=y)
        plain.step(x, target=y)

        def check():
            for module, plain_module in zip(modules, plain_modules):
                named = zip(module.named_parameters(), plain_module.parameters())
                for (name, p), plain_p in named:
                    expected = plain_p.grad / N_MICROBATCHES
                    self.assertTrue(torch.equal(p.grad, expected), name)

        self._assert_on_all_ranks(check)

    def _pipeline(self, ScheduleClass, use_fsdp, scale_grads=True):
        """The reference model, this rank's stage modules and indices, the schedule."""
        mesh = self._mesh()
        pp_rank = mesh["pp"].get_local_rank()
        single_stage = ScheduleClass in SINGLE_STAGE_SCHEDULES
        n_stages = PP if single_stage else 2 * PP
        torch.manual_seed(0)
        ref = nn.Sequential(*(MLP(DIM) for _ in range(n_stages))).to(self.device)
        stage_indices = [pp_rank] if single_stage else [pp_rank, pp_rank + PP]
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        if use_fsdp:
            modules = [fully_shard(m, mesh=mesh["dp"]) for m in modules]
        stages = [
            PipelineStage(m, i, n_stages, self.device, group=mesh["pp"].get_group())
            for m, i in zip(modules, stage_indices)
        ]
        schedule = ScheduleClass(
            stages[0] if single_stage else stages,
            N_MICROBATCHES,
            loss_fn=loss_fn,
            scale_grads=scale_grads,
        )
        return ref, modules, stage_indices, schedule

    def _batch(self, gen):
        x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
        y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
        return x.to(self.device), y.to(self.device)

    def _accumulate(self, ScheduleClass, use_fsdp, finalize, evaluate=False):
        torch.set_num_threads(1)
        ref, modules, stage_indices, schedule = self._pipeline(ScheduleClass, use_fsdp)
        gen = torch.Generator().manual_seed(1)
        for step, finalize_gradients in enumerate(finalize):  # no zero_grad()
            x, y = self._batch(gen)
            schedule.step(x, target=y, finalize_gradients=finalize_gradients)
            if evaluate:
                schedule.eval(x, target=y)
            for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
                (loss_fn(ref(x_mb), y_mb) / N_MICROBATCHES).backward()
            if not finalize_gradients:
                continue  # .grad is only valid once the reduction is finalized

            # Gather first (the same collectives on every rank), then compare.
            grads = [
                [
                    p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    for p in module.parameters()
                ]
                for module in modules
            ]

            def check():
                for module, i, module_grads in zip(modules, stage_indices, grads):
                    named = zip(
                        module.named_parameters(), ref[i].parameters(), module_grads
                    )
                    for (name, _), ref_p, grad in named:
                        msg = f"step {step} stage {i} {name}"
                        self.assertIsNotNone(grad, f"{msg}: no gradient")
                        torch.testing.assert_close(
                            grad, ref_p.grad, msg=lambda m, msg=msg: f"{msg}: {m}"
                        )

            self._assert_on_all_ranks(check)


instantiate_parametrized_tests(ScheduleGradAccumulationTest)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < PP * DP, f"NCCL test requires {PP * DP}+ GPUs"
)
class ScheduleGradAccumulationTestNCCL(ScheduleGradAccumulationTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
