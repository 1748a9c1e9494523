"""FSDP2 (``fully_shard``) modules inside pipeline stages.

Upstream file: ``torch/distributed/pipelining/stage.py``
(``_PipelineStageBase.backward_maybe_with_nosync``) and the UNSHARD / RESHARD
handling of ``torch/distributed/pipelining/schedules.py``.

The split-backward bug this module fixes
----------------------------------------
For a split backward (BACKWARD_INPUT then BACKWARD_WEIGHT, as in
``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble`` and
``ScheduleDualPipeV``) ``backward_maybe_with_nosync`` hands
``self.submod.parameters()`` to ``stage_backward_input`` and
``stage_backward_weight``, which look those parameters up in the autograd
graph by their gradient-accumulator nodes.  FSDP2 swaps the parameters
registered on a module: the sharded DTensors while the module is resharded,
the unsharded parameters (the leaves the forward really used) while it is
unsharded.  After a forward, every nested ``fully_shard`` module with
``reshard_after_forward=True`` (the default for non-root modules) is
resharded, and FSDP's pre-backward unshard only fires inside
``autograd.grad`` -- after the parameter list was taken.  So the list holds
the sharded parameters, none of which is in the graph: the input pass finds no
parameter groups and the weight pass silently computes nothing for that
microbatch.  Gradients come out as a fraction of the right ones (measured
0.45-0.92 of a single-process reference on torch 2.13 and 2.15), some
parameters get none at all.

The fix runs FSDP's unshard before the input and the weight pass, so that the
module's registered parameters -- and so ``submod.parameters()`` -- are the
unsharded leaves of the graph.  Unsharding before the weight pass also covers
a forward of the same stage that resharded the parameters between a
microbatch's input and weight passes: without it the weight pass would read
freed storage wherever the weight gradient needs the weight's values (an
op such as ``x @ (w * w).T``).  FSDP's own pre-backward unshard is a no-op on
an unsharded module, so nothing is all-gathered twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


if TYPE_CHECKING:
    from torch.distributed.fsdp import UnshardHandle
    from torch.distributed.pipelining.stage import _PipelineStageBase


__all__: list[str] = []


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard`` module in ``module``'s tree, ``module`` included, in pre-order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def stage_uses_fsdp(stage: _PipelineStageBase) -> bool:
    """Whether the schedule manages FSDP for ``stage`` (UNSHARD/RESHARD, REDUCE_GRAD).

    Same test as upstream: the stage's submodule is itself ``fully_shard``-ed,
    i.e. it is the FSDP root of the stage.
    """
    return isinstance(stage.submod, FSDPModule)


def unshard_async(stage: _PipelineStageBase) -> list[UnshardHandle]:
    """Start unsharding every FSDP module of ``stage``; return the handles to wait on.

    ``FSDPModule.unshard`` is not recursive and is a no-op for a module that
    is already unsharded, so this all-gathers exactly what is sharded now.
    """
    handles = []
    for module in fsdp_modules(stage.submod):
        handle = module.unshard(async_op=True)
        if handle is not None:
            handles.append(handle)
    return handles


def unshard_stage(stage: _PipelineStageBase) -> None:
    """Unshard every FSDP module of ``stage`` and wait for the all-gathers."""
    for handle in unshard_async(stage):
        handle.wait()


def reshard_stage(stage: _PipelineStageBase) -> None:
    """Reshard every FSDP module of ``stage`` (frees the unsharded parameters)."""
    for module in fsdp_modules(stage.submod):
        module.reshard()


def _make_backward_maybe_with_nosync(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    """Wrap ``_PipelineStageBase.backward_maybe_with_nosync`` to unshard before I and W.

    Only the parameter list of the ``"input"`` and ``"weight"`` passes is
    affected (see the module docstring); the full backward goes through
    ``autograd.backward``, whose FSDP hooks see the real leaves already, and
    data-parallel synchronisation is left exactly as torch does it.
    """

    @functools.wraps(original)
    def backward_maybe_with_nosync(
        self: Any, backward_type: str, *args: Any, **kwargs: Any
    ) -> Any:
        if backward_type in ("input", "weight"):
            unshard_stage(self)
        return original(self, backward_type, *args, **kwargs)

    return backward_maybe_with_nosync
