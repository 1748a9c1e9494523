# Owner(s): ["oncall: distributed"]
"""Collectives the model did not mark, inside the concurrent OVERLAP_F_B.

Two gloo ranks, ``ScheduleDualPipeV`` with both stages of the V on each rank
(PP=1) and the two ranks as the expert-parallel group (EP=2), as the demo
runs.  Each stage is a small MoE block whose expert all-to-all is marked
(``overlap.all_to_all``) and which also issues collectives it does not mark:

* ``allreduce``: a tensor-parallel-style all-reduce (an autograd function:
  all-reduce in forward and in backward) before the marked dispatch;
* ``unmarked_dispatch``: the second block's dispatch without marks;
* ``allgather``: a sequence-parallel all-gather (all-reduce in backward);
* ``dtensor``: a DTensor redistribute (Shard to Replicate, a functional
  all-gather);
* ``counts``: a token-count exchange (``all_to_all_single`` of integers).

Every case trains one step overlapped and one sequentially
(``runtime.sequential_overlap_f_b``) and checks: losses and every gradient
bitwise equal, and equal to the same model run without a pipeline (both
ranks run it microbatch by microbatch, so its collectives match); which rule
ordered each collective (``STRICT`` on a group without a twin, ``FREE`` on a
twinned group); and, with a twin, that the forward's all-to-all runs while
the backward still waits for its input.  A backward that reuses the group its
forward captured, on a twinned group, is refused on both ranks at once.  The
process groups' timeout is short, so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import overlap
from torch_pipelining_ext.overlap import _handler
from torch_pipelining_ext.overlap.policy import Order, Side
from torch_pipelining_ext.runtime import sequential_overlap_f_b

from common_pipelining import check_on_all_ranks, mse_loss, PipelineMultiProcTest


DIM, ROWS, N_MB = 4, 4, 4
CASES = ["allreduce", "unmarked_dispatch", "allgather", "dtensor", "counts"]


class _AllReduce(torch.autograd.Function):
    """Tensor parallelism's all-reduce: in forward, and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _AllGather(torch.autograd.Function):
    """Sequence parallelism's all-gather along dim 0; its backward keeps this rank's rows of the sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return g[rank * ctx.rows : (rank + 1) * ctx.rows], None


class _CapturedAllToAll(torch.autograd.Function):
    """An all-to-all whose backward reuses the group captured in forward (wrong with a twin)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class Block(nn.Module):
    """attention-like compute, [unmarked collective], marked dispatch, expert, marked combine."""

    def __init__(self, case: str, index: int, groups: _Groups, ep) -> None:
        super().__init__()
        self.case, self.index, self.groups, self.ep = case, index, groups, ep
        self.pre = nn.Linear(DIM, DIM)
        self.expert = nn.Linear(DIM, DIM)

    def _unmarked(self, h: torch.Tensor) -> torch.Tensor:
        group = self.groups.tp
        if self.case == "allreduce":
            return _AllReduce.apply(h, group) / 2
        if self.case == "allgather":
            full = _AllGather.apply(h, group)
            return full.view(2, *h.shape).mean(0)
        if self.case == "dtensor":
            from torch.distributed.tensor import DTensor, Replicate, Shard

            d = DTensor.from_local(h, self.groups.mesh, [Shard(0)], run_check=False)
            full = d.redistribute(self.groups.mesh, [Replicate()]).to_local()
            return full.view(2, *h.shape).mean(0)
        if self.case == "counts":
            send = torch.full((2,), h.shape[0] // 2, dtype=torch.int64)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            return h * (recv.sum() / h.shape[0])
        return h

    def _exchange(self, h: torch.Tensor, phase: str) -> torch.Tensor:
        if self.case == "captured":
            return _CapturedAllToAll.apply(h, self.ep)
        if self.case == "unmarked_dispatch" and self.index == 1 and phase == "dispatch":
            return _CapturedAllToAll.apply(h, self.ep)  # no twin: captured is fine
        return overlap.all_to_all(h, group=self.ep, phase=phase)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._unmarked(torch.tanh(self.pre(x)))
        h = self._exchange(h, "dispatch")
        h = torch.tanh(self.expert(h))
        return x + self._exchange(h, "combine")


class _Groups:
    """The class's groups, made once per process in one order on every rank."""

    def __init__(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        rank = dist.get_rank()
        self.pp = [dist.new_group([r]) for r in range(2)][rank]  # PP=1 per rank
        self.tp = dist.new_group([0, 1])  # the unmarked collectives' group
        self.ep_strict = dist.new_group([0, 1])  # no twin
        self.ep_free = dist.new_group([0, 1])
        self.twin = overlap.create_twin_group(self.ep_free)
        self.mesh = DeviceMesh.from_group(self.tp, "cpu")


def _model(case: str, groups: _Groups, ep) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(case, 0, groups, ep), Block(case, 1, groups, ep))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(N_MB * ROWS, DIM, generator=g)
    return x, torch.randn(N_MB * ROWS, DIM, generator=g)


class _Recorder:
    """The coordinators of the overlapped actions, and what each side issued."""

    def __init__(self) -> None:
        self.coordinators: list = []
        original = _handler._run_overlapped

        def spy(*args, **kwargs):
            coordinator = original(*args, **kwargs)
            self.coordinators.append(coordinator)
            return coordinator

        self.patch = unittest.mock.patch.object(_handler, "_run_overlapped", spy)

    def orders(self, side: Side) -> set[Order]:
        return {c.order for co in self.coordinators for c in co.collectives(side)}


class OverlapCollectivesTest(PipelineMultiProcTest):
    world_size = 2
    timeout = datetime.timedelta(seconds=60)

    @classmethod
    def _groups(cls) -> _Groups:
        if not hasattr(cls, "_made"):
            overlap.set_wait_timeout(30)
            cls._made = _Groups()
        return cls._made

    def _train(
        self, case: str, ep, overlapped: bool, recorder: _Recorder | None = None
    ):
        model = _model(case, self._groups(), ep)
        stages = [
            PipelineStage(model[i], i, 2, self.device, group=self._groups().pp)
            for i in range(2)
        ]
        schedule = ScheduleDualPipeV(stages, N_MB, loss_fn=mse_loss)
        if not overlapped:
            schedule.register_custom_function(sched.OVERLAP_F_B, sequential_overlap_f_b)
        x, y = _data(0)
        losses: list[torch.Tensor] = []
        with recorder.patch if recorder is not None else contextlib.nullcontext():
            schedule.step(x, target=y, losses=losses)
        grads = {n: p.grad for n, p in model.named_parameters()}
        return torch.stack(losses), grads

    def _reference(self, case: str, ep):
        model = _model(case, self._groups(), ep)
        x, y = _data(0)
        losses = []
        for xb, yb in zip(x.chunk(N_MB), y.chunk(N_MB)):
            loss = mse_loss(model(xb), yb)
            (loss / N_MB).backward()
            losses.append(loss.detach())
        return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}

    def _check(self, case: str, ep, expected: Order) -> None:
        recorder = _Recorder()
        out, grads = self._train(case, ep, True, recorder)
        seq_out, seq_grads = self._train(case, ep, False)
        ref_out, ref_grads = self._reference(case, ep)

        def check() -> None:
            self.assertGreater(len(recorder.coordinators), 0)
            torch.testing.assert_close(out, seq_out, rtol=0, atol=0)
            torch.testing.assert_close(out, ref_out)
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, seq_grads[name], rtol=0, atol=0, msg=name
                )
                torch.testing.assert_close(grad, ref_grads[name], msg=name)
            # every unmarked collective (tp group: no twin) is STRICT; the
            # marked all-to-alls follow the group's rule
            for side in Side:
                self.assertIn(Order.STRICT, recorder.orders(side))
                self.assertIn(expected, recorder.orders(side))

        check_on_all_ranks(check, self.device)

    @parametrize("case", CASES)
    def test_unmarked_collectives_are_coordinated(self, case: str) -> None:
        self._check(case, self._groups().ep_strict, Order.STRICT)

    def test_twin_group_frees_the_order(self) -> None:
        self._check("allreduce", self._groups().ep_free, Order.FREE)

    @parametrize("rule", ["free", "strict"])
    def test_forward_communicates_while_the_backward_waits(self, rule: str) -> None:
        # Every overlapped backward's input is held back (a gradient still in
        # flight) until the forward side has issued its first all-to-all.
        # With the twin (free rule) the forward goes first; without it
        # (strict rule) the backward holds the first turn, so here its input
        # is not held back and its first all-to-all must still come first.
        groups = self._groups()
        ep = groups.ep_free if rule == "free" else groups.ep_strict
        issued: list[str] = []
        forward_issued = threading.Event()
        all_to_all, input_wait = dist.all_to_all_single, _handler._input_wait

        def recording(*args, **kwargs):
            # recorded once done: a side waiting for its turn has not issued yet
            result = all_to_all(*args, **kwargs)
            backward = threading.current_thread().name.startswith("OVERLAP_F_B")
            issued.append("backward" if backward else "forward")
            if not backward:
                forward_issued.set()
            return result

        def held_back() -> None:
            if not forward_issued.wait(20.0):
                raise TimeoutError("the forward side's all-to-all was never issued")

        waits: list = []

        def gated(compute):
            waits.append(compute)
            if rule == "free" and len(waits) % 2 == 0:  # (forward, backward) per action
                return held_back, "the gradients (held back)"
            return input_wait(compute)

        firsts: list[str] = []

        def overlapped(action, ctx) -> None:
            issued.clear()
            forward_issued.clear()
            with unittest.mock.patch.object(_handler, "_input_wait", gated):
                overlap.overlap_f_b(action, ctx)
            firsts.append(issued[0])

        model = _model("plain", groups, ep)
        stages = [
            PipelineStage(model[i], i, 2, self.device, group=groups.pp)
            for i in range(2)
        ]
        schedule = ScheduleDualPipeV(stages, N_MB, loss_fn=mse_loss)
        schedule.register_custom_function(sched.OVERLAP_F_B, overlapped)
        x, y = _data(0)
        with unittest.mock.patch.object(dist, "all_to_all_single", recording):
            schedule.step(x, target=y, losses=[])

        def check() -> None:
            self.assertGreater(len(firsts), 0)
            first = "forward" if rule == "free" else "backward"
            self.assertEqual(firsts, [first] * len(firsts))

        check_on_all_ranks(check, self.device)

    def test_twin_group_api(self) -> None:
        groups = self._groups()
        # a group keeps its twin; outside an action every code uses the group
        self.assertIs(overlap.create_twin_group(groups.ep_free), groups.twin)
        self.assertIs(overlap.twin_group(groups.ep_free), groups.twin)
        self.assertIsNone(overlap.twin_group(groups.ep_strict))
        self.assertIs(overlap.side_group(groups.ep_free), groups.ep_free)
        self.assertIs(overlap.side_group(groups.ep_strict), groups.ep_strict)
        self.assertEqual(
            dist.get_process_group_ranks(groups.twin),
            dist.get_process_group_ranks(groups.ep_free),
        )
        # the helper: equal splits by default, the reverse exchange in backward
        x = (torch.arange(4.0) + 10 * self.rank).requires_grad_()
        y = overlap.all_to_all(x.view(4, 1), group=groups.ep_free)
        (y * torch.arange(1.0, 5.0).view(4, 1)).sum().backward()

        def check() -> None:
            # rows 2k, 2k+1 of every rank r arrive on rank k
            k = self.rank
            expected = [[10.0 * r + 2 * k + j] for r in (0, 1) for j in (0, 1)]
            self.assertEqual(y.tolist(), expected)
            # the gradient comes back from where each row went: x[2k + j] of
            # this rank r sat at row 2r + j on rank k, weighted 2r + j + 1
            r = self.rank
            expected_grad = torch.tensor([2.0 * r + 1, 2.0 * r + 2] * 2)
            torch.testing.assert_close(x.grad, expected_grad)

        check_on_all_ranks(check, self.device)

    def test_backward_on_the_forwards_group_is_refused(self) -> None:
        with self.assertRaises(RuntimeError) as cm:
            self._train("captured", self._groups().ep_free, True)
        message = str(cm.exception)
        cause = cm.exception.__cause__
        while cause is not None and not isinstance(cause, overlap.CollectiveOrderError):
            cause = cause.__cause__

        def check() -> None:
            self.assertIsInstance(cause, overlap.CollectiveOrderError, message)
            text = str(cause)
            self.assertIn(f"rank {self.rank}, action ", text)
            self.assertIn("the backward side issued alltoall_base_", text)
            self.assertIn("forward side's communicator", text)
            self.assertIn("overlap.side_group(group)", text)

        dist.barrier()
        check_on_all_ranks(check, self.device)


instantiate_parametrized_tests(OverlapCollectivesTest)


if __name__ == "__main__":
    run_tests()
