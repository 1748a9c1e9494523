"""The body of ``overlap.all_to_all``: a differentiable, marked all-to-all on the side's communicator."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torch_pipelining_ext.overlap import _marks
from torch_pipelining_ext.overlap._marks import _Boundary


__all__: list[str] = []

_PHASES = {
    "dispatch": (_Boundary.DISPATCH_BEGIN, _Boundary.DISPATCH_END),
    "combine": (_Boundary.COMBINE_BEGIN, _Boundary.COMBINE_END),
}


def _exchange(
    x: torch.Tensor,
    output_splits: list[int] | None,
    input_splits: list[int] | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``all_to_all_single`` of ``x`` on the communicator the calling side uses for ``group``."""
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(
        out,
        x.contiguous(),
        output_splits,
        input_splits,
        group=_marks.side_group(group),
    )
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange; its backward is the reverse one, on the backward's side's communicator."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        # the group as given: the side is looked up again when backward runs
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: dist.ProcessGroup | None,
    phase: str,
) -> torch.Tensor:
    """The body of ``overlap.all_to_all``."""
    if phase not in _PHASES:
        raise ValueError(
            f"all_to_all: phase must be 'dispatch' or 'combine', got {phase!r}"
        )
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError(
            "all_to_all: give both output_split_sizes and input_split_sizes, or neither"
        )
    begin, end = _PHASES[phase]
    x = _marks.mark(begin, (input,))
    out = _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
    return _marks.mark(end, (out,))
