"""Selective activation checkpointing under a split (input, then weight) backward.

torch only.  A region checkpointed with ``create_selective_checkpoint_contexts``
is differentiated the way the zero-bubble pipeline schedules do it
(``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``): ``stage_backward_input`` (``torch.autograd.grad`` for
the input, keeping the graph), then ``stage_backward_weight`` (for the
weights).  The region is recomputed once per pass; the second recompute
raises "Trying to backward an extra time".  Plain ``torch.autograd.grad``
twice with ``retain_graph=True`` shows the same.

Exits 0 when both passes give autograd's gradients, 1 when torch raises.

    python repro.py
"""

import sys

import torch
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts


def main() -> int:
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(8, 8))
    w2 = torch.nn.Parameter(torch.randn(8, 8))

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w1) @ w2

    def context_fn():
        return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

    x = torch.randn(4, 8, requires_grad=True)
    loss = checkpoint(block, x, use_reentrant=False, context_fn=context_fn).sum()
    try:
        (dx,), groups = stage_backward_input([loss], None, [x], iter([w1, w2]))
        stage_backward_weight(iter([w1, w2]), groups)
    except RuntimeError as e:
        print(f"torch {torch.__version__}: the weight pass raised: {e}")
        return 1
    expected = torch.autograd.grad(block(x).sum(), [x, w1, w2])
    torch.testing.assert_close((dx, w1.grad, w2.grad), expected)
    print(f"torch {torch.__version__}: split backward of a selective region is correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
