"""Gradient scaling that leaves gradients carried over from earlier steps alone.

Upstream file: ``torch/distributed/pipelining/stage.py``
(``_PipelineStageBase.scale_grads`` and ``clear_runtime_states``).

With ``scale_grads=True`` every schedule divides a stage's gradients by the
number of microbatches once the stage's last backward of the step is done
(``stage.scale_grads(n)``, directly or through REDUCE_GRAD's
``perform_reduce_grad``).  ``scale_grads`` divides ``p.grad`` in place -- the
whole of it, including what ``p.grad`` held before the step.  Accumulating
gradients over two ``step()`` calls without ``zero_grad()`` therefore gives
``(1 + 1/n)`` times one step's gradients instead of twice them (and with
FSDP the same happens to the sharded gradient, which the reduce-scatter adds
to).

The fix: when a step starts (``clear_runtime_states``, which every schedule
calls on each stage at the start of ``step()``) the stage remembers the
gradients it carries in, and ``scale_grads`` scales only what the step added.
Nothing is copied when gradients are ``None`` at the start of the step (the
usual ``optimizer.zero_grad()``); in the case this is for -- accumulation
across steps -- every step but the first clones every gradient and holds the
copy for the step (``tools/upstream/bench_scale_grads.py`` measures it: about
as much again as an AdamW step on the same parameters, for large ones).

The copy is kept on the stage, not in the schedule's ``_ScheduleState``: every
schedule class (single-stage ones too) calls these two methods, and neither
is given the schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


__all__: list[str] = []

# Stage instance attribute: [(parameter, its gradient when the step started)] while a step runs.
_CARRIED_GRADS = "_pipelining_ext_carried_grads"


def _make_clear_runtime_states(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``clear_runtime_states`` to remember the gradients a training step starts with."""

    @functools.wraps(original)
    def clear_runtime_states(self: Any) -> None:
        original(self)
        params = list(self.submod.parameters()) if self.has_backward else []
        if _reduction_deferred(self.submod, params):
            # An earlier step(finalize_gradients=False) (torch 2.15+) left FSDP's
            # parameters unsharded with the reduction pending: the step that
            # finalizes scales what the deferred steps added, so the gradients
            # recorded when the first of them started stay recorded.
            return
        carried = [(p, p.grad.detach().clone()) for p in params if p.grad is not None]
        if carried:
            self.__dict__[_CARRIED_GRADS] = carried
        else:
            self.__dict__.pop(_CARRIED_GRADS, None)

    return clear_runtime_states


def _reduction_deferred(submod: torch.nn.Module, params: list[torch.Tensor]) -> bool:
    """Whether ``submod`` is an FSDP module whose parameters are still unsharded from a deferred step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(submod, FSDPModule) and any(
        not isinstance(p, DTensor) for p in params
    )


def _make_scale_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``scale_grads`` to scale only the gradient accumulated in this step."""

    @functools.wraps(original)
    def scale_grads(self: Any, grad_scale_factor: int) -> None:
        carried = self.__dict__.pop(_CARRIED_GRADS, None)
        if not carried or grad_scale_factor == 1:
            return original(self, grad_scale_factor)
        for p, start in carried:
            if p.grad is not None:
                p.grad.sub_(start)
        original(self, grad_scale_factor)
        for p, start in carried:
            if p.grad is None:
                p.grad = start
            else:
                p.grad.add_(start)

    return scale_grads
