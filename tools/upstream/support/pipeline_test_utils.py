# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Helpers shared by the schedule tests of this directory.

* :class:`PipelineTestCase`: ``MultiProcContinuousTest`` on gloo/CPU, and
  :func:`nccl_variant`, its twin on NCCL/CUDA (one GPU per rank), skipped
  where NCCL or the GPUs are missing;
* a toy stage model (:class:`MLP`), the stage placement of loop and V
  schedules, a seeded batch, the stages cut from one reference model, the
  single-process reference step and the comparison of every gradient with it;
* :func:`stage_api_forward`, a custom FORWARD written against the stage API.
"""

import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import skip_but_pass_in_sandcastle_if


DIM = 8
N_MICROBATCHES = 4
MB_SIZE = 2
V_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


class MLP(nn.Module):
    """Two Linear+ReLU layers; with ``fail`` set its forward raises a ValueError."""

    def __init__(self, dim: int = DIM) -> None:
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


def stage_indices(
    schedule_class: type, pp_rank: int, pp_size: int, stages_per_rank: int = 2
) -> list[int]:
    """The stages of ``pp_rank``: a V for V schedules, else a loop."""
    if schedule_class in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(stages_per_rank)]


def random_batch(
    device: torch.device, seed: int = 1, n_microbatches: int = N_MICROBATCHES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n_microbatches * MB_SIZE, DIM)
    x, y = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return x.to(device), y.to(device)


def build_pipeline(
    indices: Sequence[int],
    n_stages: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    make_stage: Callable[[], nn.Module] = MLP,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[nn.Sequential, list[nn.Module], list[PipelineStage]]:
    """A reference model of ``n_stages`` blocks and this rank's stages, copied from it.

    ``wrap`` (``fully_shard``, for instance) is applied to each stage's copy.
    """
    torch.manual_seed(0)
    ref = nn.Sequential(*(make_stage() for _ in range(n_stages))).to(device)
    modules = [copy.deepcopy(ref[i]) for i in indices]
    if wrap is not None:
        modules = [wrap(m) for m in modules]
    stages = [
        PipelineStage(m, i, n_stages, device, group=group)
        for m, i in zip(modules, indices)
    ]
    return ref, modules, stages


def reference_step(
    ref: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    n_microbatches: int = N_MICROBATCHES,
    loss_kwargs: dict | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process step a schedule must match: outputs and losses.

    Each microbatch's loss is divided by ``n_microbatches`` before its
    backward, as the schedules scale the gradients.
    """
    outputs, losses = [], []
    for x_mb, y_mb in zip(x.chunk(n_microbatches), y.chunk(n_microbatches)):
        out = ref(x_mb)
        loss = loss_fn(out, y_mb, **(loss_kwargs or {}))
        (loss / n_microbatches).backward()
        outputs.append(out.detach())
        losses.append(loss.detach())
    return torch.cat(outputs), losses


def full_grads(modules: Sequence[nn.Module]) -> list[list[torch.Tensor | None]]:
    """Every parameter's gradient, gathered when it is a DTensor (a collective)."""
    return [
        [
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for p in module.parameters()
        ]
        for module in modules
    ]


def assert_grads_match(
    modules: Sequence[nn.Module],
    indices: Sequence[int],
    ref: nn.Module,
    grads: list[list[torch.Tensor | None]] | None = None,
    **tolerance: float,
) -> None:
    """Every parameter's gradient equals the reference's (``grads``: already gathered)."""
    grads = full_grads(modules) if grads is None else grads
    for module, i, module_grads in zip(modules, indices, grads):
        named = zip(module.named_parameters(), ref[i].parameters(), module_grads)
        for (name, _), ref_p, grad in named:
            msg = f"stage {i} {name}"
            if grad is None:
                raise AssertionError(f"{msg}: no gradient")
            torch.testing.assert_close(
                grad, ref_p.grad, msg=lambda m, msg=msg: f"{msg}: {m}", **tolerance
            )


def stage_api_forward(action, ctx) -> None:
    """A custom FORWARD written against the stage API, as users write one.

    It honours the step's ``return_outputs`` and ``loss_kwargs`` as far as
    ``ctx`` carries them.
    """
    return_outputs = getattr(ctx, "return_outputs", True)
    loss_kwargs = getattr(ctx, "loss_kwargs", None)
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


def run_step(
    test,
    schedule_class: type,
    register: Callable | None = None,
    schedule_type: type | None = None,
    seed: int = 1,
):
    """One step of ``schedule_class`` over :class:`MLP` stages on all ranks.

    ``register(schedule)`` registers custom functions first; ``schedule_type``
    (a subclass of ``schedule_class``) is built instead when given.  Every
    gradient is checked against the single-process reference; returns the
    schedule and (output, losses, gradients) of this rank.
    """
    indices = stage_indices(schedule_class, test.rank, test.world_size)
    ref, modules, stages = build_pipeline(indices, 2 * test.world_size, test.device)
    schedule = (schedule_type or schedule_class)(
        stages, N_MICROBATCHES, loss_fn=loss_fn
    )
    if register is not None:
        register(schedule)
    x, y = random_batch(test.device, seed)
    losses: list[torch.Tensor] = []
    out = schedule.step(x, target=y, losses=losses)
    grads = full_grads(modules)
    reference_step(ref, x, y)
    test.assert_on_all_ranks(lambda: assert_grads_match(modules, indices, ref, grads))
    return schedule, (out, losses, grads)


class PipelineTestCase(MultiProcContinuousTest):
    """Two ranks on gloo/CPU; see :func:`nccl_variant` for NCCL/CUDA."""

    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        torch.set_num_threads(1)
        if self.device_type() == "cuda":
            torch.cuda.set_device(self.rank)
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def assert_on_all_ranks(self, check: Callable[[], None]) -> None:
        """Run ``check`` on every rank; all fail together, so none is left waiting."""
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
            raise AssertionError(f"the check failed on {int(failed.item())} rank(s)")

    def assert_grads_match_reference(
        self, modules: Sequence[nn.Module], indices: Sequence[int], ref: nn.Module
    ) -> None:
        """:func:`assert_grads_match` on every rank, the gradients gathered first
        (the same collectives on every rank)."""
        grads = full_grads(modules)
        self.assert_on_all_ranks(
            lambda: assert_grads_match(modules, indices, ref, grads)
        )

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]):
        """A device mesh over all ranks, made once per test class."""
        from torch.distributed.device_mesh import init_device_mesh

        cls = type(self)
        if getattr(cls, "_mesh", None) is None:
            cls._mesh = init_device_mesh(
                self.device_type(), shape, mesh_dim_names=names
            )
        return cls._mesh


def nccl_variant(cls: type[PipelineTestCase]) -> type[PipelineTestCase]:
    """``cls`` on NCCL/CUDA, one GPU per rank; skipped without NCCL or the GPUs.

    ``TestX``'s module gets ``TestXNCCL = nccl_variant(TestX)``.
    """
    variant = type(
        f"{cls.__name__}NCCL",
        (cls,),
        {
            "backend_str": classmethod(lambda c: "nccl"),
            "device_type": classmethod(lambda c: "cuda"),
            "__module__": cls.__module__,
        },
    )
    variant = skip_but_pass_in_sandcastle_if(
        torch.cuda.device_count() < cls.world_size,
        f"NCCL test requires {cls.world_size}+ GPUs",
    )(variant)
    return requires_nccl()(variant)
