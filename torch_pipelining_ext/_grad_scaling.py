"""``scale_grads`` scales each microbatch's loss, not the gradients; ``eval()`` leaves gradients alone.

Upstream files: ``torch/distributed/pipelining/schedules.py``
(``_PipelineSchedule._maybe_get_loss``, ``PipelineScheduleSingle.step``,
``PipelineScheduleMulti.step``) and ``stage.py`` (``scale_grads``,
``_post_metadata_inference_cleanup``); see
``[Note: scale_grads scales the loss]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast, TYPE_CHECKING

import torch
import torch.nn as nn


if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


__all__: list[str] = []

# [Note: scale_grads scales the loss]
# With ``scale_grads=True`` torch divides a stage's gradients by the number
# of microbatches ``n`` once the stage's last backward of the step is done
# (``scale_grads``, directly or through REDUCE_GRAD / WAIT_REDUCE_GRAD), in
# place: the whole of ``p.grad``, also what it held before the step.  Two
# ``step()`` calls without ``zero_grad()`` give ``(1 + 1/n)`` times one
# step's gradients instead of twice them.
#
# The package scales each microbatch's loss by ``1/n`` before its backward
# instead (as torchtitan did, pytorch/torchtitan#1732), and divides nothing
# afterwards: the loss a backward starts from (``_maybe_get_loss``, and the
# runtime's own lookup) is ``loss / n``, and while a schedule's step runs its
# stages' ``scale_grads(n)`` does nothing.  The gradients a stage carries
# into a step are never touched, so:
#
# * ``step()`` adds the step's gradients to whatever ``.grad`` holds, as
#   ``loss.backward()`` adds to it; ``zero_grad()`` at any time, an exception
#   in a step, DDP's bucket views and FSDP's deferred reductions
#   (``finalize_gradients=False``) need no state of their own;
# * no memory beyond stock torch's;
# * the losses the step returns are the unscaled ones;
# * rounding: a step's gradients are those of ``(loss / n).backward()`` per
#   microbatch -- bitwise what the unpartitioned module computes that way, and
#   stock torch with ``scale_grads=False`` and a loss divided by ``n`` -- not
#   bitwise stock torch's ``grad / n``.
#
# ``eval()`` runs ``step()`` with the backward off; stock single-stage
# schedules end it with ``scale_grads``, which the same rule turns into
# nothing.  Metadata inference, which the switch between eval and training
# re-runs, clears FSDP modules' gradients in its cleanup: the
# ``metadata_inference_keeps_grads`` patch keeps them (upstream patch 0002).

# on a stage: the factor its scale_grads skips while its schedule's step runs
_SKIP_ATTR = "_pipelining_ext_loss_scaled_by"


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages else [schedule._stage]


def _loss_scale(schedule: Any) -> int:
    """The factor ``scale_grads`` divides by: ``n`` microbatches, or 1."""
    return schedule._n_microbatches if schedule.scale_grads else 1


def scaled_loss(schedule: Any, loss: torch.Tensor | None) -> torch.Tensor | None:
    """The loss a backward starts from: ``loss / n`` with ``scale_grads``, see [Note: scale_grads scales the loss]."""
    factor = _loss_scale(schedule)
    return loss if loss is None or factor == 1 else loss / factor


def _make_maybe_get_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineSchedule._maybe_get_loss``: the loss a backward starts from, scaled."""

    @functools.wraps(original)
    def _maybe_get_loss(self: Any, stage: Any, mb_index: int) -> Any:
        return scaled_loss(self, original(self, stage, mb_index))

    return _maybe_get_loss


def _make_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a schedule's ``step`` (and ``eval``): its stages' ``scale_grads(n)`` does nothing while it runs."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        stages = _stages(self)
        before = [stage.__dict__.get(_SKIP_ATTR) for stage in stages]
        for stage in stages:
            stage.__dict__[_SKIP_ATTR] = _loss_scale(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            for stage, factor in zip(stages, before):
                if factor is None:
                    stage.__dict__.pop(_SKIP_ATTR, None)
                else:
                    stage.__dict__[_SKIP_ATTR] = factor

    return step


def _make_scale_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineStageBase.scale_grads``: nothing while a step whose losses were scaled runs."""

    @functools.wraps(original)
    def scale_grads(self: Any, grad_scale_factor: int) -> None:
        if self.__dict__.get(_SKIP_ATTR) == grad_scale_factor:
            return
        original(self, grad_scale_factor)

    return scale_grads


def _make_eval(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineSchedule.eval``: every gradient aside while it runs, then back.

    See [Note: scale_grads scales the loss]: the forward-only step's metadata
    inference and FSDP's hooks must not reach the gradients the training
    steps made.  A single-stage schedule's ``eval()`` leaves the FSDP root
    unsharded, where the next step's reduction would not add to the
    sharded gradient: its FSDP modules are resharded before the gradients
    go back.
    """
    step_marking = _make_step(original)

    @functools.wraps(original)
    def eval(self: Any, *args: Any, **kwargs: Any) -> Any:
        taken = []
        stages = _stages(self)
        for stage in stages:
            for p in stage.submod.parameters():
                if p.grad is not None:
                    taken.append((p, p.grad))
                    p.grad = None
        try:
            return step_marking(self, *args, **kwargs)
        finally:
            for stage in stages:
                for module in _fsdp_modules(stage.submod):
                    module.reshard()
            for p, grad in taken:
                p.grad = grad

    return eval


def _fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _make_metadata_cleanup(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PipelineStage._post_metadata_inference_cleanup``: keep the gradients.

    Torch's cleanup reshards the stage's FSDP modules and clears the gradients
    of every parameter they register then (the modules are resharded first
    here, so that the gradients kept are the sharded ones the steps made),
    the carried ones included (after
    ``step(finalize_gradients=False)``, the unsharded gradients of nested FSDP
    modules a backward probe left unsharded).  Metadata inference computes
    input gradients only (``autograd.grad``), so every gradient there is one
    the user's steps made.
    """

    @functools.wraps(original)
    def _post_metadata_inference_cleanup(self: Any) -> None:
        modules = _fsdp_modules(self.submod)
        for module in modules:  # the registered parameters are the sharded ones
            module.reshard()
        # modules: each an nn.Module that fully_shard made an FSDPModule
        kept = [
            (p, p.grad)
            for module in modules
            for p in cast(nn.Module, module).parameters()
            if p.grad is not None
        ]
        original(self)
        for p, grad in kept:
            p.grad = grad

    return _post_metadata_inference_cleanup
