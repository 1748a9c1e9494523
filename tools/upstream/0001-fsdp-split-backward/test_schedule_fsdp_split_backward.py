# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_fsdp_split_backward.py
"""Split-backward schedules (I/W) with nested ``fully_shard`` stages.

PP=2 x DP=2: every stage is an FSDP root whose layers are ``fully_shard``-ed
too (the usual FSDP2 recipe), both data-parallel replicas see the same batch,
so every gradient must equal the one of a single-process reference.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
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
V_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


class SquaredWeightLinear(nn.Module):
    """``x @ (w * w).T + b``: the weight gradient reads the weight itself."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim, dim) - 0.5)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.weight, self.bias)


class StageModule(nn.Module):
    """Two Linear+ReLU layers, a squared-weight layer and a gain owned by the root."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.squared = SquaredWeightLinear(dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.squared(x) * self.gain


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class ScheduleFSDPSplitBackwardTest(MultiProcContinuousTest):
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
        [ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, ScheduleDualPipeV],
    )
    def test_nested_fully_shard_gradients(self, ScheduleClass):
        torch.set_num_threads(1)
        mesh = self._mesh()
        pp_rank = mesh["pp"].get_local_rank()
        torch.manual_seed(0)
        ref = nn.Sequential(*(StageModule(DIM) for _ in range(N_STAGES)))
        ref = ref.to(self.device)
        if ScheduleClass in V_SCHEDULES:
            stage_indices = [pp_rank, N_STAGES - 1 - pp_rank]
        else:
            stage_indices = [pp_rank, pp_rank + PP]
        modules = []
        for i in stage_indices:
            module = copy.deepcopy(ref[i])
            for layer in (*module.layers, module.squared):
                fully_shard(layer, mesh=mesh["dp"])
            modules.append(fully_shard(module, mesh=mesh["dp"]))
        stages = [
            PipelineStage(m, i, N_STAGES, self.device, group=mesh["pp"].get_group())
            for m, i in zip(modules, stage_indices)
        ]
        schedule = ScheduleClass(stages, N_MICROBATCHES, loss_fn=loss_fn)

        gen = torch.Generator().manual_seed(1)
        x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
        y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
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
                    msg = f"stage {i} {name}"
                    self.assertIsNotNone(grad, f"{msg}: no gradient")
                    torch.testing.assert_close(
                        grad, ref_p.grad, msg=lambda m, msg=msg: f"{msg}: {m}"
                    )

        self._assert_on_all_ranks(check)


instantiate_parametrized_tests(ScheduleFSDPSplitBackwardTest)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < PP * DP, f"NCCL test requires {PP * DP}+ GPUs"
)
class ScheduleFSDPSplitBackwardTestNCCL(ScheduleFSDPSplitBackwardTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


if __name__ == "__main__":
    run_tests()
