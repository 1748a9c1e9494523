"""Selective activation checkpointing under a split (input, then weight) backward.

torch only, one process, CPU.  A region checkpointed with
``create_selective_checkpoint_contexts`` is differentiated the way the
zero-bubble pipeline schedules do it (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): ``stage_backward_input``
(``torch.autograd.grad`` for the input, keeping the graph), then
``stage_backward_weight`` (for the weights).  The region is recomputed once
per pass.  Plain ``torch.autograd.grad`` twice with ``retain_graph=True`` is
checked too.

Run with a stock torch:  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import sys

import torch
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts


def context_fn():
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])


def split_backward(block, x, w1, w2) -> str | None:
    """The input pass, then the weight pass; None, or what went wrong."""
    loss = checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum()
    try:
        (dx,), groups = stage_backward_input([loss], None, [x], iter([w1, w2]))
        stage_backward_weight(iter([w1, w2]), groups)
    except RuntimeError as e:
        return f"the weight pass raised: {e}"
    expected = torch.autograd.grad(block(x).sum(), [x, w1, w2])
    if not all(torch.allclose(g, e) for g, e in zip((dx, w1.grad, w2.grad), expected)):
        return "the gradients differ from autograd's"
    return None


def retain_graph_twice(block, x, w1, w2) -> str | None:
    """Two torch.autograd.grad calls over one graph; None, or what went wrong."""
    loss = checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum()
    try:
        first = torch.autograd.grad(loss, [x, w1, w2], retain_graph=True)
        second = torch.autograd.grad(loss, [x, w1, w2])
    except RuntimeError as e:
        return f"the second backward raised: {e}"
    expected = torch.autograd.grad(block(x).sum(), [x, w1, w2])
    wrong = [
        name
        for name, grads in (("first", first), ("second", second))
        if not all(torch.allclose(g, e) for g, e in zip(grads, expected))
    ]
    if wrong:
        return f"the {' and '.join(wrong)} pass's gradients differ from autograd's"
    return None


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, policy [aten.mm.default]")
    w1 = torch.nn.Parameter(torch.randn(8, 8))
    w2 = torch.nn.Parameter(torch.randn(8, 8))

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w1) @ w2

    x = torch.randn(4, 8, requires_grad=True)
    problems = {}
    for name, check in (
        (
            "split backward (stage_backward_input, stage_backward_weight)",
            split_backward,
        ),
        ("retain_graph=True, then a second torch.autograd.grad", retain_graph_twice),
    ):
        problem = check(block, x, w1, w2)
        print(
            f"{name}: {problem or 'gradients equal to autograd without checkpointing'}"
        )
        if problem:
            problems[name] = problem
    if problems:
        print(
            "defect present: a selectively checkpointed region cannot be "
            f"differentiated twice ({len(problems)} of 2 checks failed)"
        )
        return 1
    print(
        "defect absent: both backward passes over the region give autograd's gradients"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
