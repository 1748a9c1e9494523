"""Random numbers the backward side draws outside recomputation.

See [Note: random numbers outside recomputation].
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from torch_pipelining_ext.overlap._operators import operators
from torch_pipelining_ext.overlap.policy import Side


if TYPE_CHECKING:
    from torch_pipelining_ext.overlap._turns import _CommCoordinator


__all__: list[str] = []

# [Note: random numbers outside recomputation]
# The sequential handler runs one sub-action, then the other: the second one
# draws its random numbers from where the first one left the generators.  A
# backward draws random numbers outside activation-checkpointing
# recomputation when a custom backward uses dropout or noise (stochastic
# rounding, say).  Run concurrently, such a draw would take numbers from the
# middle of the forward side's sequence.  So while the backward side runs the
# backward of a Python autograd Function (``BackwardCFunction.apply``, which
# the overlap patch wraps; elsewhere the wrapper is one thread-local look-up)
# a TorchFunctionMode watches the torch functions it calls (autograd's own
# formulas draw nothing): before a function that
# draws -- an aten operator tagged ``nondeterministic_seeded``, or a
# ``torch.nn.functional`` / ``torch.nn.init`` function built on them -- the
# backward side, when it is the second sub-action, waits until the forward
# side has finished, giving up its turns meanwhile (the order of the STRICT
# collectives stays the same on every rank: the forward side's remaining
# ones, then the backward side's); it then draws exactly what the sequential
# handler would.  Where the backward sub-action comes first (a CSV schedule's
# ``(1B0;0F2)``), or the draw is inside a communication region, the numbers
# cannot be had without running the pair sequentially: the action raises.
# Inside a recomputation the mode steps aside (the RNG windows of [Note:
# random numbers in an overlapped action] give the recomputation its saved
# states).  Not seen: a draw in a tensor or module backward hook, or hidden
# in a C++ operator whose name is not a random one (a custom kernel that
# draws), which still takes numbers from the shared generator.

# Python-level functions that draw but have no tagged aten operator of their name.
_COMPOSITES = frozenset(
    {
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "gumbel_softmax",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "fractional_max_pool2d_with_indices",
        "fractional_max_pool3d_with_indices",
        "trunc_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    }
)


@functools.cache
def random_function_names() -> frozenset[str]:
    """Names of the torch functions that draw random numbers (computed once)."""
    names = set(_COMPOSITES)
    for _, base, op in operators("aten"):
        if torch.Tag.nondeterministic_seeded in op.tags:
            names.add(base)
    return frozenset(names)


class _BackwardDraws(TorchFunctionMode):
    """On the backward thread: makes a random draw wait for the forward side (see the Note)."""

    def __init__(self, coordinator: _CommCoordinator, side: Side) -> None:
        super().__init__()
        self.coordinator, self.side = coordinator, side
        self.names = random_function_names()

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.names:
            self.coordinator.random_draw(self.side, name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside a recomputation: take the watching mode off this thread's stack."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    if not stack or not isinstance(stack[-1], _BackwardDraws):
        yield
        return
    mode = torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)
