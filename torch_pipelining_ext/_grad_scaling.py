"""Gradients carried into a step are added to, never rescaled; ``eval()`` leaves gradients alone.

Upstream files: ``torch/distributed/pipelining/schedules.py``
(``PipelineScheduleSingle.step``, ``PipelineScheduleMulti.step``,
``_PipelineSchedule.eval``) and ``stage.py`` (``perform_reduce_grad``,
``_post_metadata_inference_cleanup``); see
``[Note: gradients carried into a step]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


__all__: list[str] = []

# [Note: gradients carried into a step]
# With ``scale_grads=True`` a schedule divides a stage's gradients by the
# number of microbatches ``n`` once the stage's last backward of the step is
# done (``scale_grads``, directly or through REDUCE_GRAD), in place: the whole
# of ``p.grad``, also what it held before the step.  Two ``step()`` calls
# without ``zero_grad()`` give ``(1 + 1/n)`` times one step's gradients
# instead of twice them.
#
# What a step means here: ``step()`` adds the step's gradients -- what it
# computes after ``zero_grad()`` -- to whatever ``.grad`` holds, as
# ``loss.backward()`` adds to it.  So when a training step starts, the
# gradients a stage carries in are set aside (``p.grad`` moved to the side,
# ``p.grad = None``: no copy, no arithmetic); the step computes and divides
# its own gradients from nothing, bitwise what it computes after
# ``zero_grad()``; then each carried gradient gets the step's added in place
# (``carried.add_(new)``, one rounding) and becomes ``p.grad`` again.  The
# carried values are never multiplied or divided: nothing in them changes but
# the addition, and in half precision nothing overflows that the sum itself
# would not.  The price is memory: while the step runs, the carried gradients
# and the step's own exist side by side (one gradient's worth more, at most,
# and only in steps that start with gradients).
#
# A stage with FSDP keeps its gradients on the sharded parameters; its FSDP
# modules are resharded before the gradients are set aside (a no-op after any
# step that finalized, which reshards; after ``eval()`` of a single-stage
# schedule, which leaves the root unsharded, the step's forward gathers again).
# ``step(finalize_gradients=False)`` (torch 2.15) defers an FSDP stage's
# reduction: the gradients set aside stay aside until the step that finalizes
# the stage, and are added after its division.  Whether a stage's gradients
# are aside is the stage's own state (a pending entry here), so ``eval()``
# between such steps neither opens nor closes the window.
#
# ``eval()`` runs ``step()`` with the backward off.  It sets every gradient of
# its stages aside for its duration and puts them back unchanged: stock
# single-stage schedules end it with ``scale_grads`` (the last step's
# gradients divided by ``n`` again), and the switch between eval and training
# re-runs metadata inference, whose cleanup clears the gradients of FSDP
# modules.  The same cleanup runs when the next training step switches back,
# so the package also sets FSDP stages' gradients aside when ``scale_grads`` is
# off; for them that is bitwise neutral, FSDP adding the step's reduced
# gradient to the carried one with one addition either way.  (Upstream, the
# cleanup keeps the gradients instead, patch 0002.)

_CARRIED_ATTR = "_pipelining_ext_carried_grads"

_Carried = list[tuple[nn.Parameter, torch.Tensor]]


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages else [schedule._stage]


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _carried(schedule: Any) -> dict[int, _Carried]:
    """The gradients set aside per stage index, until their stage's window closes."""
    carried = getattr(schedule, _CARRIED_ATTR, None)
    if carried is None:
        carried = {}
        setattr(schedule, _CARRIED_ATTR, carried)
    return carried


def _take_grads(module: nn.Module) -> _Carried:
    """Detach every gradient registered in ``module`` (``p.grad = None``); return them."""
    taken = []
    for p in module.parameters():
        if p.grad is not None:
            taken.append((p, p.grad))
            p.grad = None
    return taken


def set_aside(stage: Any) -> _Carried:
    """Set aside the gradients ``stage`` carries into a step (FSDP: the sharded ones)."""
    for module in _fsdp_modules(stage.submod):
        module.reshard()
    return _take_grads(stage.submod)


def add_back(carried: _Carried) -> None:
    """Add each parameter's gradient of the step to its carried one, which becomes ``.grad``."""
    for p, grad in carried:
        if p.grad is not None:
            grad.add_(p.grad)
        p.grad = grad


def _sets_aside(schedule: Any, stage: Any) -> bool:
    scaled = schedule.scale_grads and schedule._n_microbatches != 1
    return scaled or bool(_fsdp_modules(stage.submod))


def _closes(stage: Any, finalize_gradients: bool) -> bool:
    """Whether the step finalizes ``stage``'s gradients (a deferred FSDP stage does not)."""
    from torch.distributed.fsdp import FSDPModule

    return finalize_gradients or not isinstance(stage.submod, FSDPModule)


def _make_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a schedule's ``step``: carried gradients aside, added back once final."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._has_backward:  # eval(): see _make_eval
            return original(self, *args, **kwargs)
        carried = _carried(self)
        stages = _stages(self)
        for stage in stages:
            if stage.stage_index not in carried and _sets_aside(self, stage):
                carried[stage.stage_index] = set_aside(stage)
        try:
            return original(self, *args, **kwargs)
        finally:
            finalize = kwargs.get("finalize_gradients", True)
            for stage in stages:
                if stage.stage_index in carried and _closes(stage, finalize):
                    add_back(carried.pop(stage.stage_index))

    return step


def _make_eval(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineSchedule.eval``: every gradient aside while it runs, then back."""

    @functools.wraps(original)
    def eval(self: Any, *args: Any, **kwargs: Any) -> Any:
        taken = [_take_grads(stage.submod) for stage in _stages(self)]
        try:
            return original(self, *args, **kwargs)
        finally:
            for p, grad in (pair for pairs in taken for pair in pairs):
                p.grad = grad

    return eval


def _make_metadata_cleanup(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PipelineStage._post_metadata_inference_cleanup``: keep the gradients.

    Torch's cleanup reshards the stage's FSDP modules and clears the gradients
    of every parameter they register then, the carried ones included (after
    ``step(finalize_gradients=False)``, the unsharded gradients of nested FSDP
    modules a backward probe left unsharded).  Metadata inference computes
    input gradients only (``autograd.grad``), so every gradient there is one
    the user's steps made.
    """

    @functools.wraps(original)
    def _post_metadata_inference_cleanup(self: Any) -> None:
        kept = [
            (p, p.grad)
            for module in _fsdp_modules(self.submod)
            for p in module.parameters()
            if p.grad is not None
        ]
        original(self)
        for p, grad in kept:
            p.grad = grad

    return _post_metadata_inference_cleanup
