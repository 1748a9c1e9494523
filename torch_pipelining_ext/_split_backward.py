"""Split (input / weight) backward of pipeline stages.

Upstream file: ``torch/distributed/pipelining/_backward.py``
(``stage_backward_input`` and ``stage_backward_weight``).

Schedules that run BACKWARD_INPUT and BACKWARD_WEIGHT as two actions
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, CSV schedules with I/W) compute a stage's input
gradient first, saving the gradient that reached each "intermediate" (an
autograd node where a weight's subgraph joins the input's), then its weight
gradients from those saved gradients.  Three ways this goes wrong are fixed
here, each behind a probe that runs the failing case on the installed torch:

* :func:`stage_backward_weight`, shared weights: a parameter used at two
  sites on one path (``x @ w @ w``) has two intermediates, one an ancestor
  of the other.  The weight pass starts from both with their saved
  gradients, so the descendant gets its saved gradient plus what flows from
  the ancestor again: its contribution is counted twice.  See
  [Note: saved gradients are final].
* :func:`stage_backward_weight`, multi-output intermediates: an intermediate
  with several outputs (a custom ``autograd.Function`` returning two
  tensors) had its output gradients summed and applied to output 0: wrong
  where they have the same shape, an error where not.  Each output's saved
  gradient is applied to that output here.
* :func:`_make_stage_backward_input`, non-tensor stage inputs: a stage input
  that is not a tensor (a FlexAttention ``BlockMask`` passed as a keyword
  argument to every stage) raised ``AttributeError: 'BlockMask' object has
  no attribute 'requires_grad'``.  Such inputs have no gradient; the wrapper
  hands torch a placeholder tensor in their place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.nn import Parameter


__all__: list[str] = []

logger = logging.getLogger(__name__)


def _grad_acc(param: torch.Tensor) -> Node | None:
    """The gradient accumulator of ``param``; None for a parameter that does not require grad."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    return _get_grad_fn_or_grad_acc(param)


# [Note: saved gradients are final]
# The input pass saves, for every intermediate of a parameter group, the whole
# gradient that reached it: every path from the stage outputs, including the
# paths through other intermediates of the group.  The weight pass then runs
# autograd from all the group's intermediates at once, which also sends each
# intermediate's gradient down to the intermediates below it.  A prehook on
# every intermediate replaces what arrives with the saved gradient, so each
# node's gradient is the saved one exactly once, whatever reaches it.  (With
# one intermediate nothing arrives from above and the hooks are not needed.)


def _saved_edges(
    intermediates: list[Node], saved: list[tuple[torch.Tensor | None, ...] | None]
) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """One edge per intermediate output that received a gradient in the input pass."""
    edges: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    for node, node_grads in zip(intermediates, saved, strict=True):
        for output_nr, grad in enumerate(node_grads or ()):
            if grad is not None:
                edges.append(GradientEdge(node, output_nr))
                grads.append(grad)
    return edges, grads


def _weight_grads_of_group(
    param_group: dict[str, Any], retain_graph: bool
) -> dict[Node, torch.Tensor]:
    intermediates: list[Node] = list(param_group.pop("intermediates"))
    saved = param_group.pop("grads", None) or [None] * len(intermediates)
    edges, grads = _saved_edges(intermediates, saved)
    if not edges:
        return {}
    accumulators = tuple(param_group["params"])
    with contextlib.ExitStack() as hooks:
        if len(intermediates) > 1:  # see [Note: saved gradients are final]
            for node, node_grads in zip(intermediates, saved, strict=True):
                if node_grads is not None:
                    hooks.callback(
                        node.register_prehook(lambda _, g=node_grads: g).remove
                    )
        dweights = torch.autograd.grad(
            edges,
            tuple(GradientEdge(acc, 0) for acc in accumulators),
            grad_outputs=grads,
            retain_graph=retain_graph,
        )
    return dict(zip(accumulators, dweights, strict=True))


def stage_backward_weight(
    weights: Iterator[Parameter],
    param_groups: list[dict[str, Any]],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Accumulate the weight gradients of the stage from ``stage_backward_input``'s groups.

    Same contract as torch's: ``param_groups`` is what ``stage_backward_input``
    returned (consumed here); each gradient is added to ``weight.grad``; the
    returned tuple holds the ``weight.grad`` objects from before the call.
    """
    by_acc: dict[Node, Parameter] = {}
    previous: list[torch.Tensor | None] = []
    for weight in weights:
        acc = _grad_acc(weight)
        if acc is not None:  # frozen parameters are in no group
            by_acc[acc] = weight
        previous.append(weight.grad)
    for param_group in param_groups:
        for acc, dweight in _weight_grads_of_group(param_group, retain_graph).items():
            weight = by_acc[acc]
            if weight.grad is None:
                weight.grad = dweight
            else:
                weight.grad += dweight
    return tuple(previous)


def _make_stage_backward_input(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``stage_backward_input``: non-tensor stage inputs are replaced by a placeholder tensor.

    The placeholder does not require grad, so torch skips it as it skips any
    input without a gradient, and its result keeps the positions torch gives
    it (``None`` for such inputs where torch returns one entry per input).
    """

    @functools.wraps(original)
    def stage_backward_input(
        stage_outputs_or_loss: list[torch.Tensor],
        output_grads: list[torch.Tensor] | None,
        input_values: list[Any],
        weights: Iterator[Parameter],
    ) -> Any:
        if all(isinstance(v, torch.Tensor) for v in input_values):
            return original(stage_outputs_or_loss, output_grads, input_values, weights)
        placeholder = torch.empty(0)
        tensors_only = [
            v if isinstance(v, torch.Tensor) else placeholder for v in input_values
        ]
        logger.debug(
            "stage_backward_input: %d non-tensor stage inputs have no gradient",
            sum(v is placeholder for v in tensors_only),
        )
        return original(stage_outputs_or_loss, output_grads, tensors_only, weights)

    return stage_backward_input
