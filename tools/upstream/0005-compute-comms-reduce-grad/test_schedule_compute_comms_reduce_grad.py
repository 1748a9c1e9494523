# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_compute_comms_reduce_grad.py
"""``compute_comms`` schedules written without REDUCE_GRAD.

The lowered schedule of a built-in schedule, with its REDUCE_GRAD and
WAIT_REDUCE_GRAD actions removed (as a schedule written by hand or before
REDUCE_GRAD existed), loaded into ``_PipelineScheduleRuntime`` as a
``compute_comms`` CSV, is rejected: its gradients would be neither reduced
(FSDP) nor scaled.  So is a rank that has REDUCE_GRAD for some of its stages
only.  Passed through ``_add_missing_reduce_grad`` first, the schedule trains
right: PP=2 x DP=2, the data-parallel replicas see the same batch, so every
gradient must equal a single-process reference.
"""

import copy
import os
import re
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    REDUCE_GRAD,
    WAIT_REDUCE_GRAD,
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
N_STAGES = 2 * PP
N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8


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


class ScheduleComputeCommsReduceGradTest(MultiProcContinuousTest):
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

    def _stages(self, use_fsdp: bool):
        mesh = self._mesh()
        pp_rank = mesh["pp"].get_local_rank()
        torch.manual_seed(0)
        ref = nn.Sequential(*(MLP(DIM) for _ in range(N_STAGES))).to(self.device)
        stage_indices = [pp_rank, pp_rank + PP]
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        if use_fsdp:
            modules = [fully_shard(m, mesh=mesh["dp"]) for m in modules]
        stages = [
            PipelineStage(m, i, N_STAGES, self.device, group=mesh["pp"].get_group())
            for m, i in zip(modules, stage_indices)
        ]
        return ref, modules, stage_indices, stages

    def _load_compute_comms(self, schedule, rows) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "schedule.csv")
            with open(path, "w") as f:
                f.writelines(",".join(str(a) for a in row) + "\n" for row in rows)
            schedule._load_csv(path, format="compute_comms")

    def _lowered_rows(self, stages, keep_reduce_grad_stages=()):
        lowered = ScheduleInterleaved1F1B(
            stages, N_MICROBATCHES, loss_fn=loss_fn
        ).pipeline_order_with_comms
        return [
            [
                a
                for a in lowered[rank]
                if a.computation_type not in (REDUCE_GRAD, WAIT_REDUCE_GRAD)
                or a.stage_index in keep_reduce_grad_stages
            ]
            for rank in sorted(lowered)
        ]

    @parametrize("use_fsdp", [False, True])
    def test_add_missing_reduce_grad(self, use_fsdp):
        torch.set_num_threads(1)
        ref, modules, stage_indices, stages = self._stages(use_fsdp)
        schedule = _PipelineScheduleRuntime(stages, N_MICROBATCHES, loss_fn=loss_fn)
        # imported here: the other test must fail on stock torch for its own reason
        from torch.distributed.pipelining.schedules import _add_missing_reduce_grad

        rows = [
            _add_missing_reduce_grad(row, N_MICROBATCHES)
            for row in self._lowered_rows(stages)
        ]
        self._load_compute_comms(schedule, rows)

        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(
                self.device
            )
            y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(
                self.device
            )
            schedule.step(x, target=y)
            for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
                (loss_fn(ref(x_mb), y_mb) / N_MICROBATCHES).backward()
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
            for module in modules:
                module.zero_grad()
            ref.zero_grad()

    @parametrize("kept", ["none", "first_stage"])
    def test_compute_comms_without_reduce_grad_raises(self, kept):
        torch.set_num_threads(1)
        _, _, _, stages = self._stages(use_fsdp=False)
        schedule = _PipelineScheduleRuntime(stages, N_MICROBATCHES, loss_fn=loss_fn)
        # No REDUCE_GRAD at all, or each rank keeps the one of its first stage only.
        keep = range(PP) if kept == "first_stage" else ()
        rows = self._lowered_rows(stages, keep_reduce_grad_stages=keep)
        # every rank validates the whole schedule and stops at rank 0, which runs stages 0 and PP
        missing = [PP] if kept == "first_stage" else [0, PP]
        with self.assertRaisesRegex(
            ValueError,
            re.escape(
                f"Rank 0 runs backward for stages {missing} but has no REDUCE_GRAD"
            ),
        ):
            self._load_compute_comms(schedule, rows)


instantiate_parametrized_tests(ScheduleComputeCommsReduceGradTest)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < PP * DP, f"NCCL test requires {PP * DP}+ GPUs"
)
class ScheduleComputeCommsReduceGradTestNCCL(ScheduleComputeCommsReduceGradTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
