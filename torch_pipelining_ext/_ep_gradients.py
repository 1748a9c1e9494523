"""The gradient reduction of an expert-parallel model (private helper of
:mod:`torch_pipelining_ext.expert_parallel`).

[Note: expert-parallel gradient reduction]
Each rank that trains on its own data (the ``dp x ep`` ranks) computes the
loss of its own tokens.  With each rank's loss the mean over its tokens and
the ranks' batches of one size, the global loss is the mean of the ranks'
losses, so:

* a parameter every data rank holds (embedding, attention, router, norms,
  head) has, on each rank, the gradient of that rank's loss: their mean over
  the data ranks is the global loss's gradient (one all-reduce, divided by
  ``dp x ep``);
* an expert sharded over the EP ranks has, on its rank, the gradient of
  every EP peer's loss through the tokens they sent it (the all-to-all's
  backward brings those back): the sum over its ``dp`` replicas, divided by
  ``dp x ep``, is the global loss's gradient.

The reduction runs after the schedule's step, before clipping and the
optimizer, as one float32 buffer per group (a missing gradient counts as
zeros, so every rank issues the same collectives).  DTensor parameters
(FSDP2's) are left alone: FSDP reduces its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


__all__: list[str] = []

Sharded = Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter]


@dataclass(frozen=True)
class DataGroups:
    """The ranks that hold the same stages and train on different data:
    ``ep`` (the experts' group: experts differ between its ranks), ``dp``
    (the replicas of this rank's experts), ``data`` (all of them, ``dp x
    ep``) and its ``data_mesh`` (for FSDP; ``None`` without a mesh); a
    dimension of one rank is ``None``."""

    ep: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    data: dist.ProcessGroup | None = None
    data_mesh: Any = None

    @property
    def data_size(self) -> int:
        return _size(self.data)


def _is_mesh(value: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


def _group_of(mesh: Any, name: str) -> dist.ProcessGroup | None:
    if name not in (mesh.mesh_dim_names or ()):
        return None
    sub = mesh[name]
    return sub.get_group() if sub.size() > 1 else None


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def data_groups(mesh_or_group: Any) -> DataGroups:
    """The data-parallel groups of a job's mesh, a 1-D mesh, or an
    expert-parallel ``ProcessGroup`` alone (no ``dp``)."""
    from torch_pipelining_ext import launcher

    if _is_mesh(mesh_or_group) and mesh_or_group.ndim > 1:
        names = mesh_or_group.mesh_dim_names or ()
        if "ep" not in names and "dp" not in names:
            raise ValueError(
                f"the mesh has neither an 'ep' nor a 'dp' dimension (its dimensions: {names})"
            )
        data_mesh = launcher.data_parallel_mesh(mesh_or_group)
        return DataGroups(
            ep=_group_of(mesh_or_group, "ep"),
            dp=_group_of(mesh_or_group, "dp"),
            data=data_mesh.get_group() if data_mesh.size() > 1 else None,
            data_mesh=data_mesh,
        )
    if _is_mesh(mesh_or_group):
        name = (mesh_or_group.mesh_dim_names or (None,))[0]
        if name == "pp":  # a pipeline alone: every rank has the same data
            return DataGroups()
        group = mesh_or_group.get_group() if mesh_or_group.size() > 1 else None
        if name == "dp":  # data parallelism alone: experts (if any) not sharded
            return DataGroups(dp=group, data=group, data_mesh=mesh_or_group)
        return DataGroups(ep=group, data=group, data_mesh=mesh_or_group)
    if mesh_or_group is not None and not isinstance(mesh_or_group, dist.ProcessGroup):
        raise TypeError(
            "expected the job's DeviceMesh, a 1-D DeviceMesh or the expert-parallel "
            f"ProcessGroup, got {type(mesh_or_group).__name__}"
        )
    group = mesh_or_group if _size(mesh_or_group) > 1 else None
    return DataGroups(ep=group, data=group)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _named_parameters(
    modules: nn.Module | Sequence[nn.Module],
) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of ``modules`` once (a parameter shared by two of
    them, or two names of one, counts once)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    seen: set[int] = set()
    named = []
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected nn.Module objects, got {type(module).__name__}")
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    return named


def _ids_of(
    arg: str, given: Iterable[nn.Parameter], named: list[tuple[str, nn.Parameter]]
) -> set[int]:
    given = list(given)
    held = {id(p) for _, p in named}
    stray = sum(id(p) not in held for p in given)
    if stray:
        raise ValueError(
            f"{stray} of the {len(given)} parameters given as {arg} are not "
            "parameters of the modules passed"
        )
    return {id(p) for p in given}


def split_parameters(
    modules: nn.Module | Sequence[nn.Module],
    sharded: Sharded,
    ignore: Iterable[nn.Parameter] = (),
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(replicated, sharded)`` parameters of ``modules`` that need a
    reduction (trainable, not FSDP2's, not ignored)."""
    named = _named_parameters(modules)
    if callable(sharded):
        is_sharded = {id(p) for name, p in named if sharded(name, p)}
    else:
        is_sharded = _ids_of("sharded", sharded, named)
    ignored = _ids_of("ignore", ignore, named)
    replicated, experts = [], []
    for _, p in named:
        if not p.requires_grad or _is_dtensor(p) or id(p) in ignored:
            continue
        (experts if id(p) in is_sharded else replicated).append(p)
    return replicated, experts


def all_reduce_divided(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, size: int
) -> None:
    """Sum the gradients of ``params`` over ``group`` (``None``: this rank
    alone) and divide by ``size``: one all-reduce of one float32 buffer; a
    missing gradient counts as zeros."""
    if not params:
        return
    if group is None:
        for p in params:
            if p.grad is not None and size != 1:
                p.grad.div_(size)
        return
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in params
        ]
    )
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    offset = 0
    for p in params:
        total = flat[offset : offset + p.numel()].view(p.shape).to(p.dtype)
        offset += p.numel()
        if p.grad is None:
            p.grad = total
        else:
            p.grad.copy_(total)


def reduce_gradients(
    modules: nn.Module | Sequence[nn.Module],
    mesh_or_group: Any,
    sharded: Sharded,
    ignore: Iterable[nn.Parameter] = (),
) -> None:
    """See :func:`torch_pipelining_ext.expert_parallel.reduce_expert_parallel_gradients`."""
    groups = data_groups(mesh_or_group)
    replicated, experts = split_parameters(modules, sharded, ignore)
    all_reduce_divided(replicated, groups.data, groups.data_size)
    all_reduce_divided(experts, groups.dp, groups.data_size)
