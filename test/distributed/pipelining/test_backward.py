# Owner(s): ["oncall: distributed"]
"""Tests of the split (input / weight) backward
(``torch_pipelining_ext/_split_backward.py``): the weight gradients of
``stage_backward_input`` + ``stage_backward_weight`` equal autograd's for a
parameter used twice on one path and for a node with two outputs, and a
non-tensor stage input (a FlexAttention ``BlockMask``) is accepted, also
through a zero-bubble schedule.  Where
the patch is applied, stock torch's functions are checked to be wrong on the
same case, so that each test shows what the patch fixes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    _backward,
    PipelineStage,
    ScheduleZBVZeroBubble,
    stage as stage_module,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext
from torch_pipelining_ext._patching._table import _REGISTRY


def _stock(patch: str, attr: str) -> Callable[..., Any] | None:
    """Stock torch's ``_backward.<attr>`` where ``patch`` replaced it, else None."""
    (p,) = (p for p in _REGISTRY.patches() if p.name == patch)
    if _REGISTRY.status(patch) is not torch_pipelining_ext.PatchStatus.APPLIED:
        return None
    (original,) = (
        o for t, o in p._saved if t.module.endswith("._backward") and t.attr == attr
    )
    return original


class _TwiceOnOnePath(nn.Module):
    """``lin(tanh(lin(x)))``: one weight at two sites, one feeding the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class _ScaledPair(torch.autograd.Function):
    """``(x @ w, 3 * x @ w)``: one autograd node with two outputs of one shape."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        y = x @ w
        return y, 3 * y

    @staticmethod
    def backward(
        ctx: Any, g0: torch.Tensor, g1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        g = g0 + 3 * g1
        return g @ w.T, x.T @ g


class _TwoOutputNode(nn.Module):
    """A custom function with two same-shaped outputs, each feeding another weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _ScaledPair.apply(torch.relu(x), self.w)
        return self.head(a) * b


_MODULES = {"twice_on_one_path": _TwiceOnOnePath, "two_output_node": _TwoOutputNode}
# the probe's name of each case, as its reason lists the cases it found wrong
_PROBE_CASES = {
    "twice_on_one_path": "a parameter used twice on one path",
    "two_output_node": "an intermediate with two outputs",
}


def _probe_found_wrong(patch: str, case: str) -> bool:
    """Whether ``patch``'s probe reported stock torch wrong for ``case`` on this torch."""
    (record,) = (r for r in torch_pipelining_ext.patch_report() if r.name == patch)
    return _PROBE_CASES[case] in record.reason


def _split_grads(
    module: nn.Module,
    x: torch.Tensor,
    backward_input: Callable[..., Any],
    backward_weight: Callable[..., Any],
    extra_inputs: tuple[Any, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = module(x).square().sum()
    dinputs, groups = backward_input(
        [loss], None, [x, *extra_inputs], module.parameters()
    )
    backward_weight(module.parameters(), groups)
    return x.grad, [p.grad for p in module.parameters()]


def _autograd_grads(
    module: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_()
    dx, *dparams = torch.autograd.grad(
        module(x).square().sum(), [x, *module.parameters()]
    )
    return dx, dparams


class SplitBackwardTest(TestCase):
    @parametrize("case", list(_MODULES))
    def test_weight_gradients_match_autograd(self, case: str) -> None:
        # stage.py calls the names it imported from _backward.py: both are the same function
        self.assertIs(
            stage_module.stage_backward_weight, _backward.stage_backward_weight
        )
        self.assertIs(stage_module.stage_backward_input, _backward.stage_backward_input)
        torch.manual_seed(0)
        module, x = _MODULES[case](), torch.randn(3, 4)
        ref_dx, ref_dparams = _autograd_grads(module, x)
        dx, dparams = _split_grads(
            module, x, _backward.stage_backward_input, _backward.stage_backward_weight
        )
        torch.testing.assert_close(dx, ref_dx)
        for name, got, ref in zip(
            (n for n, _ in module.named_parameters()), dparams, ref_dparams, strict=True
        ):
            torch.testing.assert_close(got, ref, msg=lambda m: f"{case} {name}: {m}")

        stock = _stock("split_backward_weight", "stage_backward_weight")
        if stock is not None:
            # the probe found stock torch wrong for some cases: stock is wrong here exactly for those
            # (torch releases differ: 2.12 is wrong for one case only)
            stock_wrong = _probe_found_wrong("split_backward_weight", case)
            try:
                _, stock_dparams = _split_grads(
                    module, x, _backward.stage_backward_input, stock
                )
            except RuntimeError as e:  # stock torch raises (a multi-output node with outputs of different shapes)
                self.assertTrue(
                    stock_wrong,
                    f"stock stage_backward_weight raises for {case} ({e}), but the probe said it is right",
                )
                return
            stock_right = all(
                torch.allclose(g, r)
                for g, r in zip(stock_dparams, ref_dparams, strict=True)
            )
            self.assertEqual(
                stock_right,
                not stock_wrong,
                f"stock stage_backward_weight is {'right' if stock_right else 'wrong'} for {case}, "
                f"but the probe said it is {'wrong' if stock_wrong else 'right'}",
            )

    def test_gradients_accumulate_over_microbatches(self) -> None:
        torch.manual_seed(0)
        module, xs = _TwiceOnOnePath(), torch.randn(2, 3, 4)
        for x in xs:
            x = x.clone().requires_grad_()
            _, groups = _backward.stage_backward_input(
                [module(x).square().sum()], None, [x], module.parameters()
            )
            _backward.stage_backward_weight(module.parameters(), groups)
        ref = [torch.zeros_like(p) for p in module.parameters()]
        for x in xs:
            for r, g in zip(ref, _autograd_grads(module, x)[1], strict=True):
                r += g
        for p, r in zip(module.parameters(), ref, strict=True):
            torch.testing.assert_close(p.grad, r)

    def test_frozen_parameter(self) -> None:
        torch.manual_seed(0)
        module, x = _TwiceOnOnePath(), torch.randn(3, 4)
        module.lin.bias.requires_grad_(False)
        x = x.requires_grad_()
        _, groups = _backward.stage_backward_input(
            [module(x).square().sum()], None, [x], module.parameters()
        )
        _backward.stage_backward_weight(module.parameters(), groups)
        self.assertIsNone(module.lin.bias.grad)
        (ref,) = torch.autograd.grad(
            module(x.detach()).square().sum(), [module.lin.weight]
        )
        torch.testing.assert_close(module.lin.weight.grad, ref)

    def test_non_tensor_stage_input(self) -> None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            mask: Any = create_block_mask(
                lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu"
            )
        except Exception:
            mask = object()
        torch.manual_seed(0)
        module, x = nn.Linear(4, 4), torch.randn(3, 4)
        ref_dx, ref_dparams = _autograd_grads(module, x)
        dx, dparams = _split_grads(
            module,
            x,
            _backward.stage_backward_input,
            _backward.stage_backward_weight,
            extra_inputs=(mask,),
        )
        torch.testing.assert_close(dx, ref_dx)
        for got, ref in zip(dparams, ref_dparams, strict=True):
            torch.testing.assert_close(got, ref)

        stock = _stock("split_backward_non_tensor_inputs", "stage_backward_input")
        if stock is not None:
            with self.assertRaisesRegex(AttributeError, "requires_grad"):
                _split_grads(
                    module,
                    x,
                    stock,
                    _backward.stage_backward_weight,
                    extra_inputs=(mask,),
                )


class _Mask:
    """A non-tensor stage argument, as a FlexAttention ``BlockMask`` is."""

    scale = 0.5


class _TiedStage(nn.Module):
    """A stage that applies its weight twice on one path and takes a non-tensor keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: _Mask | None = None) -> torch.Tensor:
        if not isinstance(mask, _Mask):
            raise AssertionError(f"the stage got mask={mask!r}")
        return self.lin(torch.tanh(self.lin(x))) * mask.scale


class SplitBackwardScheduleTest(TestCase):
    """ScheduleZBVZeroBubble (input and weight backwards apart) with both stages on one rank."""

    def setUp(self) -> None:
        super().setUp()
        if dist.is_initialized():
            self.skipTest("a process group exists in this process")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.addCleanup(dist.destroy_process_group)

    def test_zero_bubble_with_shared_weight_and_non_tensor_kwarg(self) -> None:
        torch.manual_seed(0)
        reference = nn.Sequential(_TiedStage(), _TiedStage())
        parts = [copy.deepcopy(m) for m in reference]
        stages = [
            PipelineStage(part, i, 2, torch.device("cpu"))
            for i, part in enumerate(parts)
        ]
        schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=nn.functional.mse_loss)
        mask = _Mask()
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # the second step accumulates
            x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)
            losses: list[torch.Tensor] = []
            schedule.step(x, target=y, losses=losses, mask=mask)
            ref_losses = []
            for xb, yb in zip(x.chunk(2), y.chunk(2)):
                out = reference[1](reference[0](xb, mask=mask), mask=mask)
                loss = nn.functional.mse_loss(out, yb)
                (loss / 2).backward()
                ref_losses.append(loss.detach())
            torch.testing.assert_close(losses, ref_losses)
            for i, (part, ref) in enumerate(zip(parts, reference)):
                for (name, p), ref_p in zip(part.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(
                        p.grad, ref_p.grad, msg=lambda m: f"stage {i} {name}: {m}"
                    )


instantiate_parametrized_tests(SplitBackwardTest)


if __name__ == "__main__":
    run_tests()
