"""Gradient scaling that leaves gradients carried over from earlier steps alone.

Upstream files: ``torch/distributed/pipelining/schedules.py``
(``PipelineScheduleSingle.step`` and ``PipelineScheduleMulti.step``) and
``stage.py`` (``_PipelineStageBase.scale_grads``); see
``[Note: scaling gradients accumulated across steps]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any


__all__: list[str] = []

# [Note: scaling gradients accumulated across steps]
# With ``scale_grads=True`` every schedule divides a stage's gradients by the
# number of microbatches ``n`` once the stage's last backward of the step is
# done (``stage.scale_grads(n)``, directly or through REDUCE_GRAD).
# ``scale_grads`` divides ``p.grad`` in place, the whole of it, including what
# ``p.grad`` held before the step: accumulating over two ``step()`` calls
# without ``zero_grad()`` gives ``(1 + 1/n)`` times one step's gradients
# instead of twice them (with FSDP the same happens to the sharded gradient
# the reduce-scatter adds to).
#
# The fix multiplies the gradients a stage carries into a step by ``n`` when
# the step starts, so the division at its end gives ``carried + added / n``.
# Nothing is copied and nothing is allocated; a step that starts without
# gradients (after ``zero_grad()``) does no arithmetic at all, so its result
# is bitwise stock torch's.  With carried gradients the product and quotient
# may round ``carried`` in its last bit when ``n`` is not a power of two.
#
# ``eval()`` runs ``step()`` with the backward off, and single-stage schedules
# still end it with ``scale_grads``: the gradients of the last training step
# would be divided by ``n`` once more.  A stage that runs no backward scales
# nothing, and a step without backward multiplies nothing.
#
# ``step(finalize_gradients=False)`` (torch 2.15) defers an FSDP stage's
# reduction and scaling to a later step; the stage stays unsharded and its
# gradients accumulate unreduced.  The step after a deferring step therefore
# leaves the stage alone: the sharded gradients were multiplied when the
# deferral began, and the finalizing step divides them together with what
# every deferred step added.  (Until then the sharded gradients read ``n``
# times their value; they are not final before the reduction anyway.)


def _scaled_stages(schedule: Any) -> Iterable[Any]:
    """The stages of ``schedule`` whose gradients its step will divide by ``n``."""
    from torch.distributed.fsdp import FSDPModule

    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    # the option of the previous step: step() sets it anew only once it runs
    deferred = not getattr(schedule, "_finalize_gradients", True)
    # (stage.has_backward is the previous step's too: step() sets it from the
    # schedule's, which scale_up_carried_grads checks)
    return [
        stage
        for stage in stages
        if not (deferred and isinstance(stage.submod, FSDPModule))
    ]


def scale_up_carried_grads(schedule: Any) -> None:
    """Multiply the gradients ``schedule``'s stages carry into a step by ``n``."""
    n = schedule._n_microbatches
    # eval() runs step() with the schedule's _has_backward off: nothing is scaled
    if not (schedule.scale_grads and schedule._has_backward) or n == 1:
        return
    for stage in _scaled_stages(schedule):
        for p in stage.submod.parameters():
            if p.grad is not None:
                p.grad.mul_(n)


def _make_scale_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``scale_grads``: a stage that ran no backward (``eval()``) scales nothing."""

    @functools.wraps(original)
    def scale_grads(self: Any, grad_scale_factor: int) -> None:
        if self.has_backward:
            original(self, grad_scale_factor)

    return scale_grads


def _make_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a schedule's ``step`` to scale up the gradients carried into it."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        scale_up_carried_grads(self)
        return original(self, *args, **kwargs)

    return step
