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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torch_pipelining_ext._parallel_layout import ParallelLayout


__all__: list[str] = []

Sharded = Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter]


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
    replicated: list[nn.Parameter] = []
    experts: list[nn.Parameter] = []
    for _, p in named:
        if not p.requires_grad or isinstance(p, DTensor) or id(p) in ignored:
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
    layout: ParallelLayout,
    sharded: Sharded,
    ignore: Iterable[nn.Parameter] = (),
) -> None:
    """See :func:`torch_pipelining_ext.expert_parallel.reduce_expert_parallel_gradients`."""
    replicated, experts = split_parameters(modules, sharded, ignore)
    all_reduce_divided(replicated, layout.data, layout.data_size)
    all_reduce_divided(experts, layout.dp, layout.data_size)
