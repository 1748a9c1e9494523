# Owner(s): ["oncall: distributed"]
"""Thread-level tests of the expert-parallel communication boundaries (``torch_pipelining_ext.overlap``).

Two threads run as in an overlapped OVERLAP_F_B action (``_overlap._run_overlapped``):
the forward of one toy MoE stack on the calling thread, the backward of another
on a worker thread.  Each MoE layer communicates through a fake collective that
records every call and any moment two threads were inside a collective at once.
Its sleeps, and those of ``Jitter``, stand for the duration of communication and
compute (random, to vary the interleaving); no test uses them to order events or
asserts on elapsed time: the threads are ordered by events, and the hand-over
threshold is tested with an injected clock.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import math
import os
import random
import threading
import time
import unittest
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.utils.checkpoint import checkpoint

from common_pipelining import OneRankGroupTestCase

import torch_pipelining_ext
from torch_pipelining_ext import overlap
from torch_pipelining_ext.overlap._handler import _run_overlapped, _StreamPlan
from torch_pipelining_ext.overlap import _marks as _ep_marks
from torch_pipelining_ext.overlap import _collectives
from torch_pipelining_ext.overlap import _turns as _ep_turns
from torch_pipelining_ext.overlap._settings import SETTINGS
from torch_pipelining_ext.overlap._turns import _CommCoordinator, _TurnState
from torch_pipelining_ext.overlap import CommWaitTimeoutError
from torch_pipelining_ext.overlap.policy import Order, Side


DIM = 8
TIMEOUT = 20.0  # coordinator timeout of the tests that must not time out


class FakeComm:
    """Stands in for a process group: records collectives, flags concurrent ones."""

    def __init__(self, delay: float = 0.002, jitter: float = 0.0) -> None:
        self.delay = delay
        self.jitter = jitter
        self.lock = threading.Lock()
        self.active: str | None = None
        self.log: list[str] = []
        self.violations: list[tuple[str, str]] = []
        self.hook = None  # called inside the collective with its tag

    def collective(self, tag: str) -> None:
        # issued as the interception issues a real collective on a
        # communicator both sides use (a STRICT one)
        binding = _ep_marks._current_binding()
        if binding is None:
            self._run(tag)
            return
        with binding.coordinator.collective(binding.side, tag, "fake", Order.STRICT):
            self._run(tag)

    def _run(self, tag: str) -> None:
        with self.lock:
            if self.active is not None:
                self.violations.append((self.active, tag))
            self.active = tag
        time.sleep(self.delay + random.uniform(0, self.jitter))
        if self.hook is not None:
            self.hook(tag)
        with self.lock:
            self.active = None
            self.log.append(tag)


class FakeAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: FakeComm, tag: str, x: torch.Tensor) -> torch.Tensor:
        ctx.comm, ctx.tag = comm, tag
        comm.collective(f"{tag}.fwd")
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.comm.collective(f"{ctx.tag}.bwd")
        return None, None, grad.clone()


class Jitter(torch.autograd.Function):
    """Sleeps a random time in forward and backward (compute of random length)."""

    @staticmethod
    def forward(ctx, jitter: float, x: torch.Tensor) -> torch.Tensor:
        ctx.jitter = jitter
        time.sleep(random.uniform(0, jitter))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(random.uniform(0, ctx.jitter))
        return None, grad


class BackwardNoise(torch.autograd.Function):
    """Identity in forward; its backward draws random numbers (stochastic rounding, say)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        noise = torch.randn_like(grad) * 1e-3
        return nn.functional.dropout(grad, p=0.2, training=True) + noise


class ToyMoELayer(nn.Module):
    def __init__(
        self,
        name: str,
        comm: FakeComm,
        jitter: float = 0.0,
        random_ops: bool = False,
        backward_noise: bool = False,
    ) -> None:
        super().__init__()
        self.backward_noise = backward_noise
        self.name, self.comm, self.jitter, self.random_ops = (
            name,
            comm,
            jitter,
            random_ops,
        )
        self.pre = nn.Linear(DIM, DIM)
        self.expert = nn.Linear(DIM, DIM)

    def _draw(self, h: torch.Tensor) -> torch.Tensor:
        """Dropout, router noise and random token choices: every kind of draw an MoE layer makes."""
        h = nn.functional.dropout(h, p=0.3, training=True)
        h = h + 0.01 * torch.rand_like(h) + 0.01 * torch.randn_like(h)
        h = h[torch.randperm(h.shape[0])]
        probs = torch.softmax(h.detach(), dim=-1)
        return h * torch.multinomial(probs, 1).to(h.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = Jitter.apply(self.jitter, torch.tanh(self.pre(x)))
        if self.backward_noise:
            h = BackwardNoise.apply(h)
        if self.random_ops:
            h = self._draw(h)
        h = overlap.dispatch_begin(h)
        h = FakeAllToAll.apply(self.comm, f"{self.name}.dispatch", h)
        h = overlap.dispatch_end(h)
        h = Jitter.apply(self.jitter, torch.tanh(self.expert(h)))
        if self.random_ops:
            h = self._draw(h)
        h = overlap.combine_begin(h)
        h = FakeAllToAll.apply(self.comm, f"{self.name}.combine", h)
        h = overlap.combine_end(h)
        return x + h


class ToyStage(nn.Module):
    """MoE layers and a head; ``ac``: "" (none), "full", "selective", "nested" (a checkpoint around
    checkpointed layers), "reentrant", or "no_rng" (full, without RNG state preservation)."""

    def __init__(
        self,
        prefix: str,
        n_layers: int,
        comm: FakeComm,
        jitter: float = 0.0,
        ac: str = "",
        random_ops: bool = False,
        backward_noise: bool = False,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ToyMoELayer(f"{prefix}{i}", comm, jitter, random_ops, backward_noise)
            for i in range(n_layers)
        )
        self.head = nn.Linear(DIM, DIM)
        self.ac = ac

    def _layers(self, x: torch.Tensor, ac: str) -> torch.Tensor:
        for layer in self.layers:
            if ac == "full":
                x = checkpoint(layer, x, use_reentrant=False)
            elif ac == "selective":
                x = checkpoint(
                    layer, x, use_reentrant=False, context_fn=_selective_context
                )
            elif ac == "reentrant":
                x = checkpoint(layer, x, use_reentrant=True)
            elif ac == "no_rng":
                x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac == "nested":
            x = checkpoint(self._layers, x, "full", use_reentrant=False)
        else:
            x = self._layers(x, self.ac)
        return self.head(x)


def _selective_context():
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, op, *args, **kwargs):
        # save matmul outputs, recompute the rest (including the communication)
        return (
            CheckpointPolicy.MUST_SAVE
            if op == torch.ops.aten.addmm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return create_selective_checkpoint_contexts(policy)


def expected_order(fwd: str, n_fwd: int, bwd: str, n_bwd: int) -> list[str]:
    """Strict alternation, backward side first, then whatever one side has left."""
    f = [f"{fwd}{i}.{p}.fwd" for i in range(n_fwd) for p in ("dispatch", "combine")]
    b = [
        f"{bwd}{i}.{p}.bwd"
        for i in reversed(range(n_bwd))
        for p in ("combine", "dispatch")
    ]
    order = []
    for i in range(max(len(f), len(b))):
        order += b[i : i + 1] + f[i : i + 1]
    return order


class PairRun:
    """A forward stage and a backward stage (whose forward already ran), sharing one FakeComm."""

    def __init__(
        self,
        n_fwd: int,
        n_bwd: int,
        jitter: float = 0.0,
        comm_jitter: float = 0.0,
        ac: str = "",
        random_ops: bool = False,
        backward_noise: bool = False,
    ) -> None:
        torch.manual_seed(0)
        self.comm = FakeComm(jitter=comm_jitter)
        kw = {"ac": ac, "random_ops": random_ops, "backward_noise": backward_noise}
        self.fwd_stage = ToyStage("F", n_fwd, self.comm, jitter, **kw)
        self.bwd_stage = ToyStage("B", n_bwd, self.comm, jitter, **kw)
        self.x_fwd = torch.randn(4, DIM, requires_grad=True)
        self.x_bwd = torch.randn(4, DIM, requires_grad=True)
        self.loss = self.bwd_stage(self.x_bwd).square().sum()
        self.comm.log.clear()
        self.out = None
        torch.manual_seed(1)  # the generator state the pair starts from

    def forward(self) -> None:
        self.out = self.fwd_stage(self.x_fwd)

    def backward(self) -> None:
        self.loss.backward()

    def run(
        self, timeout: float = TIMEOUT, rank: int = 0, action: str = "0F0;1B0", **kw
    ) -> _CommCoordinator:
        return _run_overlapped(
            self.forward,
            self.backward,
            global_rank=rank,
            action=action,
            timeout=timeout,
            **kw,
        )


class CoordinatorTest(TestCase):
    def assert_no_threads_left(self) -> None:
        left = [
            t.name for t in threading.enumerate() if t.name.startswith("OVERLAP_F_B")
        ]
        self.assertEqual(left, [])

    @parametrize("n_fwd", [0, 1, 3])
    @parametrize("n_bwd", [0, 1, 3])
    def test_alternation_and_asymmetric_layers(self, n_fwd: int, n_bwd: int) -> None:
        run = PairRun(n_fwd, n_bwd, jitter=0.002)
        coordinator = run.run()
        self.assertEqual(run.comm.violations, [])
        self.assertEqual(run.comm.log, expected_order("F", n_fwd, "B", n_bwd))
        self.assertEqual(coordinator.regions_opened(Side.FORWARD), 2 * n_fwd)
        self.assertEqual(coordinator.regions_opened(Side.BACKWARD), 2 * n_bwd)
        self.assert_no_threads_left()

    def test_order_is_deterministic_under_random_timing(self) -> None:
        logs = []
        for seed in range(4):
            random.seed(seed)
            run = PairRun(3, 2, jitter=0.003, comm_jitter=0.003)
            run.run()
            self.assertEqual(run.comm.violations, [])
            logs.append(run.comm.log)
        self.assertEqual(logs, [expected_order("F", 3, "B", 2)] * 4)

    def test_results_match_sequential(self) -> None:
        run = PairRun(2, 2)
        run.run()
        ref = PairRun(2, 2)
        ref.forward()
        ref.backward()
        torch.testing.assert_close(run.out, ref.out, rtol=0, atol=0)
        for p, q in zip(
            run.bwd_stage.parameters(), ref.bwd_stage.parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        torch.testing.assert_close(run.x_bwd.grad, ref.x_bwd.grad, rtol=0, atol=0)

    @parametrize("slow_side", ["forward", "backward"])
    def test_one_side_finishes_early(self, slow_side: str) -> None:
        # One side has a single layer and no compute; the other three slow layers.
        n_fwd, n_bwd = (3, 1) if slow_side == "forward" else (1, 3)
        run = PairRun(n_fwd, n_bwd)
        slow = run.fwd_stage if slow_side == "forward" else run.bwd_stage
        for layer in slow.layers:
            layer.jitter = 0.02
        run.run()
        self.assertEqual(run.comm.violations, [])
        self.assertEqual(run.comm.log, expected_order("F", n_fwd, "B", n_bwd))

    @parametrize("failing_side", ["forward", "backward"])
    def test_exception_releases_other_side(self, failing_side: str) -> None:
        run = PairRun(3, 3)

        def hook(tag: str) -> None:
            # fail in the failing side's second collective
            if tag == (
                "F1.dispatch.fwd" if failing_side == "forward" else "B1.combine.bwd"
            ):
                raise ValueError(f"boom in {tag}")

        run.comm.hook = hook
        with self.assertRaisesRegex(
            RuntimeError, rf"rank 3, action 2F1;3B0: the {failing_side} sub-action"
        ) as cm:
            run.run(rank=3, action="2F1;3B0")
        self.assertIsInstance(cm.exception.__cause__, ValueError)
        self.assertIn("boom", str(cm.exception))
        # released, not timed out: the other side did not fail as well
        self.assertNotIn("then the", str(cm.exception))
        # the other side ran to the end, uncoordinated
        other = "B" if failing_side == "forward" else "F"
        other_last = "B0.dispatch.bwd" if other == "B" else "F2.combine.fwd"
        self.assertIn(other_last, run.comm.log)
        self.assert_no_threads_left()

    @parametrize("stuck_side", ["forward", "backward"])
    def test_timeout_names_boundary_action_rank(self, stuck_side: str) -> None:
        run = PairRun(1, 1)
        release = threading.Event()
        stuck_tag = "F0.dispatch.fwd" if stuck_side == "forward" else "B0.combine.bwd"

        def hook(tag: str) -> None:
            if tag == stuck_tag:
                release.wait(
                    10.0
                )  # hangs inside its region until the other side timed out

        run.comm.hook = hook
        # The backward side's first region (B0.combine) comes first, then the
        # forward side's first (F0.dispatch): whichever is stuck in its first
        # region, the other side times out at its next boundary.
        waiter = "backward" if stuck_side == "forward" else "forward"
        boundary = (
            "dispatch_end (backward"
            if waiter == "backward"
            else "dispatch_begin (forward)"
        )

        # the stuck side is released once the waiting side has timed out
        waiting_fn = run.backward if waiter == "backward" else run.forward

        def release_after_timeout() -> None:
            try:
                waiting_fn()
            except CommWaitTimeoutError:
                release.set()
                raise

        setattr(run, waiter, release_after_timeout)
        with self.assertRaises(RuntimeError) as cm:
            run.run(timeout=0.5, rank=7, action="0F1;3B2")
        cause = cm.exception.__cause__
        self.assertIsInstance(cause, CommWaitTimeoutError)
        msg = str(cause)
        self.assertIn("rank 7", msg)
        self.assertIn("0F1;3B2", msg)
        self.assertIn(f"the {waiter} thread waited", msg)
        self.assertIn(boundary, msg)
        self.assert_no_threads_left()

    def test_two_coordinators_do_not_interfere(self) -> None:
        # Two schedules' actions run at once in one process, each with its own
        # communicator.  Each forward side blocks inside its first collective
        # until the other pair's forward side is inside its own first
        # collective: a coordinator shared between the pairs would deadlock.
        a, b = PairRun(2, 2), PairRun(2, 2)
        inside = {"a": threading.Event(), "b": threading.Event()}

        def make_hook(me: str, other: str):
            def hook(tag: str) -> None:
                if tag == "F0.dispatch.fwd":
                    inside[me].set()
                    if not inside[other].wait(10.0):
                        raise AssertionError("the other pair never entered its region")

            return hook

        a.comm.hook, b.comm.hook = make_hook("a", "b"), make_hook("b", "a")
        errors = []

        def run_pair(run: PairRun) -> None:
            try:
                run.run(timeout=10.0)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=run_pair, args=(r,)) for r in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        self.assertEqual(errors, [])
        for run in (a, b):
            self.assertEqual(run.comm.violations, [])
            self.assertEqual(run.comm.log, expected_order("F", 2, "B", 2))

    @parametrize("ac", ["full", "selective"])
    def test_activation_checkpointing(self, ac: str) -> None:
        if ac == "selective" and not hasattr(
            torch.utils.checkpoint, "create_selective_checkpoint_contexts"
        ):
            self.skipTest("selective activation checkpointing needs a newer torch")
        logs = []
        for seed in range(2):
            random.seed(seed)
            run = PairRun(2, 2, jitter=0.002, ac=ac)
            run.run()
            self.assertEqual(run.comm.violations, [])
            logs.append(run.comm.log)
            # recomputation re-issued the backward stage's forward collectives
            self.assertIn("B0.dispatch.fwd", run.comm.log)
        self.assertEqual(logs[0], logs[1])
        ref = PairRun(2, 2, ac=ac)
        ref.forward()
        ref.backward()
        for p, q in zip(
            run.bwd_stage.parameters(), ref.bwd_stage.parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(run.x_bwd.grad, ref.x_bwd.grad)

    def test_nested_region_in_one_side(self) -> None:
        coordinator = _CommCoordinator(rank=0, action="a", timeout=1.0)
        coordinator.finish(Side.BACKWARD)  # the forward side runs alone
        with _ep_marks.bound(coordinator, Side.FORWARD):
            coordinator.open(Side.FORWARD, "outer", "dispatch")
            coordinator.open(Side.FORWARD, "inner", "dispatch")  # nested: no wait
            coordinator.close(Side.FORWARD, "inner")
            coordinator.close(Side.FORWARD, "outer")
            coordinator.close(
                Side.FORWARD, "stray"
            )  # a close without an open is ignored
            self.assertEqual(coordinator.regions_opened(Side.FORWARD), 1)

    def test_compute_is_handed_over(self) -> None:
        # Whenever one side computes, the other is communicating, parked in the
        # coordinator, not started or done: the two threads never compute at
        # once.  Every region counts as long enough to hand over.  (The rule
        # itself is checked deterministically, one boundary at a time, by
        # test_long_regions_are_handed_over; this checks the invariant in a
        # real two-thread run.)
        seen: list[tuple[Side, _TurnState, bool]] = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                _record_other_side(seen)
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                _record_other_side(seen)
                return grad

        run = PairRun(3, 3)
        for stage in (run.fwd_stage, run.bwd_stage):
            for layer in stage.layers:
                layer.pre.register_forward_hook(lambda m, i, o: Probe.apply(o))
                layer.expert.register_forward_hook(lambda m, i, o: Probe.apply(o))
        run.loss = run.bwd_stage(run.x_bwd).square().sum()
        seen.clear()
        run.comm.log.clear()
        with unittest.mock.patch.object(SETTINGS, "hand_over_min_region_s", 0.0):
            run.run()
        self.assertEqual(run.comm.violations, [])
        self.assertEqual(
            sorted(collections.Counter(side for side, _, _ in seen).items()),
            [(Side.FORWARD, 6), (Side.BACKWARD, 6)],
        )
        both_computing = [
            (side, state)
            for side, state, waiting in seen
            if state is _TurnState.COMPUTING and not waiting
        ]
        self.assertEqual(both_computing, [])

    def test_long_regions_are_handed_over(self) -> None:
        # A region at least as long as the threshold (by the injected clock)
        # makes the closing side wait while the other side computes, until
        # its next region; here the other side never comes, so the wait
        # times out.
        now = [0.0]
        coordinator = _CommCoordinator(
            rank=0,
            action="a",
            timeout=0.05,
            clock=lambda: now[0],
            hand_over_min_region_s=1.0,
        )
        coordinator.open(Side.BACKWARD, "b", "combine")
        coordinator.start(Side.FORWARD)  # computes while the backward communicates
        now[0] += 1.0
        with self.assertRaisesRegex(
            CommWaitTimeoutError,
            "at b for the forward thread to start communicating before computing on",
        ):
            coordinator.close(Side.BACKWARD, "b")

    def test_short_regions_are_not_handed_over(self) -> None:
        # Regions shorter than the hand-over threshold (by the injected clock)
        # do not make the closing side wait for the other one (the turns still
        # alternate).
        now = [0.0]
        coordinator = _CommCoordinator(
            rank=0,
            action="a",
            timeout=0.05,
            clock=lambda: now[0],
            hand_over_min_region_s=1.0,
        )
        with coordinator.collective(Side.BACKWARD, "b", "g", Order.STRICT):
            now[0] += 0.999
        # (it would have waited and timed out if handed over)
        with self.assertRaisesRegex(
            CommWaitTimeoutError, "at b2 on group g for its turn to issue a collective"
        ):
            # not its turn: the forward side's
            with coordinator.collective(Side.BACKWARD, "b2", "g", Order.STRICT):
                pass


def _record_other_side(seen: list[tuple[Side, _TurnState, bool]]) -> None:
    """Record, from a side's compute, the other side's state and whether it is parked."""
    binding = _ep_marks._current_binding()
    if binding is None:
        return  # outside the overlapped action (the backward stage's own forward)
    seen.append((binding.side, *binding.coordinator.state_of(binding.side.other)))


class RandomNumbersTest(TestCase):
    """Every random op on either thread draws what it draws under the sequential handler."""

    def assert_pair_matches_sequential(self, run: PairRun, ref: PairRun) -> None:
        torch.testing.assert_close(run.out, ref.out, rtol=0, atol=0)
        for p, q in zip(
            run.bwd_stage.parameters(), ref.bwd_stage.parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        torch.testing.assert_close(run.x_bwd.grad, ref.x_bwd.grad, rtol=0, atol=0)

    def run_both(
        self, seed: int, **kwargs
    ) -> tuple[PairRun, torch.Tensor, PairRun, torch.Tensor]:
        random.seed(seed)  # the timing jitter
        run = PairRun(2, 2, jitter=0.002, comm_jitter=0.001, random_ops=True, **kwargs)
        run.run()
        state = torch.get_rng_state()
        ref = PairRun(2, 2, random_ops=True, **kwargs)
        ref.forward()
        ref.backward()
        return run, state, ref, torch.get_rng_state()

    @parametrize("ac", ["", "full", "selective", "nested", "reentrant"])
    def test_random_ops_match_sequential(self, ac: str) -> None:
        if ac == "selective" and not hasattr(
            torch.utils.checkpoint, "create_selective_checkpoint_contexts"
        ):
            self.skipTest("selective activation checkpointing needs a newer torch")
        for seed in range(3):
            run, state, ref, ref_state = self.run_both(seed, ac=ac)
            self.assertEqual(run.comm.violations, [])
            self.assert_pair_matches_sequential(run, ref)
            # the generator goes on from where the sequential handler leaves it
            torch.testing.assert_close(state, ref_state, rtol=0, atol=0)

    def test_random_timing_many_times(self) -> None:
        # random sleeps at every mark and in every compute, 8 repetitions: bitwise equal, no hang
        logs = []
        for seed in range(8):
            run, state, ref_run, ref_state = self.run_both(seed, ac="full")
            self.assertEqual(run.comm.violations, [])
            logs.append(run.comm.log)
            self.assertEqual(
                logs[-1], logs[0]
            )  # the same collectives in the same order, every time
            self.assert_pair_matches_sequential(run, ref_run)
            torch.testing.assert_close(state, ref_state, rtol=0, atol=0)

    def test_recomputation_without_rng_preservation_that_draws_raises(self) -> None:
        with self.assertRaisesRegex(
            RuntimeError,
            "rank 0, action 0F0;1B0: the backward sub-action .*preserve_rng_state",
        ):
            PairRun(1, 1, ac="no_rng", random_ops=True).run()

    def test_recomputation_without_rng_preservation_that_draws_nothing(self) -> None:
        run = PairRun(2, 2, jitter=0.002, ac="no_rng")
        run.run()
        ref = PairRun(2, 2, ac="no_rng")
        ref.forward()
        ref.backward()
        self.assert_pair_matches_sequential(run, ref)

    def test_recomputation_that_starts_before_the_forward_waits(self) -> None:
        # The backward side reaches its recomputation (and waits there for the
        # forward side to pause) before the forward side has reached the
        # coordinator at all: the forward side's starting to wait must wake
        # it.  Seen as a hang on a loaded machine: the forward waited for the
        # backward's first region, the backward for the forward to pause.
        backward_waits = threading.Event()
        start, wait = _CommCoordinator.start, _CommCoordinator._wait

        def late_forward_start(coordinator: _CommCoordinator, side: Side) -> None:
            if side is Side.FORWARD:
                # The backward thread calls _wait with the lock held, so once
                # the forward thread has the lock the backward one is blocked.
                self.assertTrue(backward_waits.wait(TIMEOUT))
            start(coordinator, side)

        def noting_wait(coordinator: _CommCoordinator, side: Side, where: str, *args):  # type: ignore[no-untyped-def]
            if where == "the start of a recomputation":
                backward_waits.set()
            return wait(coordinator, side, where, *args)

        def backward() -> None:
            with torch.random.fork_rng():
                torch.rand(2)

        drawn = {}
        torch.manual_seed(5)
        with (
            unittest.mock.patch.object(_CommCoordinator, "start", late_forward_start),
            unittest.mock.patch.object(_CommCoordinator, "_wait", noting_wait),
        ):
            # a hang would end in CommWaitTimeoutError, raised here
            _run_overlapped(
                lambda: drawn.setdefault("forward", torch.rand(2)),
                backward,
                global_rank=0,
                action="a",
                timeout=TIMEOUT,
            )
        self.assertTrue(backward_waits.is_set())
        torch.testing.assert_close(
            drawn["forward"], torch.manual_seed(5) and torch.rand(2), rtol=0, atol=0
        )

    @parametrize("ac", ["", "full"])
    def test_backward_draws_outside_recomputation_match_sequential(
        self, ac: str
    ) -> None:
        # a custom backward draws (dropout, noise): it waits for the forward
        # side to finish and draws what the sequential handler draws
        for seed in range(2):
            run, state, ref, ref_state = self.run_both(seed, ac=ac, backward_noise=True)
            self.assertEqual(run.comm.violations, [])
            self.assert_pair_matches_sequential(run, ref)
            torch.testing.assert_close(state, ref_state, rtol=0, atol=0)

    def test_backward_draws_when_the_backward_runs_first_raise(self) -> None:
        # a (B;F) pair: the sequential handler draws the backward's numbers
        # first, which the forward side's concurrent draws would have to wait for
        run = PairRun(2, 2, random_ops=True, backward_noise=True)
        with self.assertRaisesRegex(
            RuntimeError,
            r"rank 0, action 0F0;1B0: the backward sub-action .* draws random "
            r"numbers with randn_like outside activation-checkpointing recomputation",
        ):
            run.run(first=Side.BACKWARD)

    def test_fork_rng_elsewhere_is_the_original(self) -> None:
        torch.manual_seed(3)
        with torch.random.fork_rng():
            torch.rand(3)
        torch.testing.assert_close(
            torch.rand(3), torch.manual_seed(3) and torch.rand(3), rtol=0, atol=0
        )


class FailureTest(TestCase):
    def test_worker_set_up_failure_is_raised_at_once(self) -> None:
        def apply(value):
            raise OSError(f"cannot apply {value}")

        handle = overlap.register_thread_state(lambda: "mesh", apply)
        try:
            run = PairRun(2, 2)
            with self.assertRaisesRegex(
                RuntimeError,
                r"^rank 0, action 0F0;1B0: the backward sub-action .* failed: OSError: cannot apply mesh",
            ) as cm:
                run.run(timeout=60.0)
            self.assertIsInstance(cm.exception.__cause__, OSError)
            # at once: the forward side was released, it did not time out waiting for the backward one
            self.assertNotIn("then the", str(cm.exception))
        finally:
            handle.remove()
        self.assertEqual(
            [t.name for t in threading.enumerate() if t.name.startswith("OVERLAP_F_B")],
            [],
        )

    @parametrize("failing_side", ["forward", "backward"])
    def test_first_line_names_the_root_cause(self, failing_side: str) -> None:
        def failing() -> None:
            try:
                raise ValueError("bad routing table")
            except ValueError as e:
                raise RuntimeError("[Stage 3] failed to run forward:\nargs: ...") from e

        run = PairRun(1, 1)
        fwd, bwd = (
            (failing, run.backward)
            if failing_side == "forward"
            else (run.forward, failing)
        )
        with self.assertRaises(RuntimeError) as cm:
            _run_overlapped(
                fwd,
                bwd,
                global_rank=5,
                action="3F4;1B0",
                sub_actions=("3F4", "1B0"),
                timeout=TIMEOUT,
            )
        first_line = str(cm.exception).split("\n")[0]
        sub = "3F4" if failing_side == "forward" else "1B0"
        self.assertTrue(
            first_line.startswith(
                f"rank 5, action 3F4;1B0: the {failing_side} sub-action {sub} failed: ValueError: bad routing table"
            ),
            first_line,
        )
        self.assertIn("[Stage 3] failed to run forward", first_line)


class InputWaitTest(TestCase):
    """A side that waits for its receives (``input_waits``) lets the other side compute meanwhile."""

    @staticmethod
    def _gate(opened: threading.Event, waits: list[str]):
        """A receive wait that returns once ``opened`` is set (a bounded wait: fails instead of hanging)."""

        def wait() -> None:
            waits.append(threading.current_thread().name)
            if not opened.wait(TIMEOUT):
                raise TimeoutError("the input never arrived")

        return wait

    def test_forward_computes_while_the_gradients_are_in_flight(self) -> None:
        # The backward's input arrives only once the forward has computed its
        # first layer: a handler that waited for both inputs first would not
        # get there.
        run = PairRun(2, 2)
        computed = threading.Event()
        run.fwd_stage.layers[0].pre.register_forward_hook(lambda *args: computed.set())
        waits: list[str] = []
        coordinator = run.run(
            input_waits=(None, (self._gate(computed, waits), "the gradients of 1B0"))
        )
        self.assertEqual(waits, ["OVERLAP_F_B backward (rank 0)"])
        # the regions' order is the one of inputs that are there at once
        self.assertEqual(run.comm.violations, [])
        self.assertEqual(run.comm.log, expected_order("F", 2, "B", 2))
        self.assertEqual(coordinator.state_of(Side.BACKWARD)[0], _TurnState.DONE)
        ref = PairRun(2, 2)
        ref.forward()
        ref.backward()
        torch.testing.assert_close(run.out, ref.out, rtol=0, atol=0)
        torch.testing.assert_close(run.x_bwd.grad, ref.x_bwd.grad, rtol=0, atol=0)

    def test_backward_computes_while_the_activations_are_in_flight(self) -> None:
        run = PairRun(2, 2)
        communicated = threading.Event()
        run.comm.hook = lambda tag: communicated.set()
        waits: list[str] = []
        run.run(
            input_waits=(
                (self._gate(communicated, waits), "the activations of 0F0"),
                None,
            )
        )
        self.assertEqual(waits, [threading.current_thread().name])
        self.assertEqual(run.comm.violations, [])
        self.assertEqual(run.comm.log, expected_order("F", 2, "B", 2))

    @parametrize("failing_side", ["forward", "backward"])
    def test_failed_input_wait_names_the_sub_action(self, failing_side: str) -> None:
        def failing() -> None:
            raise RuntimeError("[rank 0] 1B0: waiting for the gradients failed")

        run = PairRun(2, 2)
        wait = (failing, "the inputs")
        waits = (wait, None) if failing_side == "forward" else (None, wait)
        with self.assertRaisesRegex(
            RuntimeError,
            rf"^rank 0, action 0F0;1B0: the {failing_side} sub-action .* failed: "
            "RuntimeError: .* waiting for the gradients failed",
        ) as cm:
            run.run(input_waits=waits)
        self.assertNotIn("then the", str(cm.exception))
        self.assertEqual(
            [t.name for t in threading.enumerate() if t.name.startswith("OVERLAP_F_B")],
            [],
        )


class TimeoutSettingTest(TestCase):
    def tearDown(self) -> None:
        overlap.set_wait_timeout(None)
        super().tearDown()

    def test_set_wait_timeout(self) -> None:
        self.assertEqual(overlap.get_wait_timeout(), overlap.DEFAULT_WAIT_TIMEOUT_S)
        overlap.set_wait_timeout(5)
        self.assertEqual(overlap.get_wait_timeout(), 5.0)
        overlap.set_wait_timeout(math.inf)
        self.assertEqual(overlap.get_wait_timeout(), math.inf)
        overlap.set_wait_timeout(None)
        self.assertEqual(overlap.get_wait_timeout(), 600.0)
        for bad in (True, "5", [5]):
            with self.assertRaisesRegex(
                TypeError, "set_wait_timeout: the timeout must be a number"
            ):
                overlap.set_wait_timeout(bad)
        for bad in (0, -5, math.nan, -math.inf):
            with self.assertRaisesRegex(
                ValueError, "set_wait_timeout: the timeout must be a positive number"
            ):
                overlap.set_wait_timeout(bad)
        self.assertEqual(
            overlap.get_wait_timeout(), 600.0
        )  # a rejected value changes nothing

    def test_environment_variable(self) -> None:
        env = overlap.TIMEOUT_ENV
        for value, expected in (
            ("7", 7.0),
            (" 0.5 ", 0.5),
            ("inf", math.inf),
            ("", 600.0),
        ):
            with unittest.mock.patch.dict(os.environ, {env: value}):
                self.assertEqual(overlap.get_wait_timeout(), expected)
        for value in ("-5", "0", "nan", "abc", "-inf"):
            with unittest.mock.patch.dict(os.environ, {env: value}):
                with self.assertRaisesRegex(ValueError, rf"\${env}='{value}'"):
                    overlap.get_wait_timeout()
        with unittest.mock.patch.dict(os.environ, {env: "abc"}):
            overlap.set_wait_timeout(3)  # the programmatic setting wins
            self.assertEqual(overlap.get_wait_timeout(), 3.0)

    def test_no_limit_runs_and_leaves_no_thread(self) -> None:
        for _ in range(2):  # the step after is fine too
            overlap.set_wait_timeout(math.inf)
            run = PairRun(2, 2, jitter=0.001)
            run.run(timeout=None)
            self.assertEqual(run.comm.log, expected_order("F", 2, "B", 2))
            self.assertEqual(
                [
                    t.name
                    for t in threading.enumerate()
                    if t.name.startswith("OVERLAP_F_B")
                ],
                [],
            )


_LIBRARY_VAR: contextvars.ContextVar[str] = contextvars.ContextVar(
    "library_var", default="unset"
)


class WorkerContextTest(TestCase):
    def test_worker_runs_in_a_copy_of_the_callers_context(self) -> None:
        seen = {}
        token = _LIBRARY_VAR.set("caller")
        try:

            def backward() -> None:
                seen["backward"] = _LIBRARY_VAR.get()
                _LIBRARY_VAR.set("changed on the worker")

            _run_overlapped(
                lambda: None, backward, global_rank=0, action="a", timeout=5.0
            )
            self.assertEqual(seen["backward"], "caller")
            self.assertEqual(
                _LIBRARY_VAR.get(), "caller"
            )  # a copy: the caller's is unchanged
        finally:
            _LIBRARY_VAR.reset(token)

    def test_registered_thread_state(self) -> None:
        local = threading.local()
        local.mesh = "pp x ep mesh"
        applied = []

        @contextlib.contextmanager
        def apply(mesh):
            local.mesh = mesh
            applied.append(threading.current_thread().name)
            try:
                yield
            finally:
                del local.mesh

        seen = {}
        handle = overlap.register_thread_state(lambda: local.mesh, apply)
        try:
            _run_overlapped(
                lambda: None,
                lambda: seen.setdefault("mesh", getattr(local, "mesh", None)),
                global_rank=0,
                action="a",
                timeout=5.0,
            )
        finally:
            handle.remove()
        self.assertEqual(seen["mesh"], "pp x ep mesh")
        self.assertEqual(len(applied), 1)
        self.assertNotEqual(applied[0], threading.current_thread().name)
        seen.clear()
        _run_overlapped(
            lambda: None,
            lambda: seen.setdefault("mesh", getattr(local, "mesh", None)),
            global_rank=0,
            action="a",
            timeout=5.0,
        )
        self.assertIsNone(seen["mesh"])  # removed: not carried any more
        with self.assertRaises(TypeError):
            overlap.register_thread_state(None, apply)


class ThreadStateTest(TestCase):
    def test_worker_inherits_grad_mode_and_autocast(self) -> None:
        seen = {}

        def record(side: str):
            def fn() -> None:
                seen[side] = (
                    torch.is_grad_enabled(),
                    torch.is_autocast_enabled("cpu"),
                    torch.get_autocast_dtype("cpu"),
                    threading.current_thread() is threading.main_thread(),
                )

            return fn

        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _run_overlapped(
                record("forward"),
                record("backward"),
                global_rank=0,
                action="a",
                timeout=5.0,
            )
        self.assertEqual(seen["forward"], (False, True, torch.bfloat16, True))
        self.assertEqual(seen["backward"], (False, True, torch.bfloat16, False))
        _run_overlapped(
            record("forward"),
            record("backward"),
            global_rank=0,
            action="a",
            timeout=5.0,
        )
        self.assertEqual(seen["backward"][:2], (True, False))

    def _on_both_sides(self, probe, state: contextlib.AbstractContextManager):
        """``probe()`` on the forward and the backward side of an action run under ``state``."""
        seen = {}
        with state:
            _run_overlapped(
                lambda: seen.setdefault("forward", probe()),
                lambda: seen.setdefault("backward", probe()),
                global_rank=0,
                action="a",
                timeout=5.0,
            )
        self.assertEqual(seen["backward"], seen["forward"])
        return seen["backward"]

    def test_inference_and_forward_ad_modes(self) -> None:
        self.assertEqual(
            self._on_both_sides(
                torch.is_inference_mode_enabled, torch.inference_mode()
            ),
            True,
        )
        off = contextlib.ExitStack()
        off.callback(torch._C._set_fwd_grad_enabled, True)
        torch._C._set_fwd_grad_enabled(False)
        self.assertEqual(self._on_both_sides(torch._C._is_fwd_grad_enabled, off), False)

    def test_function_modes_and_the_default_device(self) -> None:
        from torch.overrides import TorchFunctionMode

        class Names(TorchFunctionMode):
            def __init__(self) -> None:
                super().__init__()
                self.calls: list[tuple[str, str]] = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.calls.append((threading.current_thread().name, func.__name__))
                return func(*args, **(kwargs or {}))

        mode = Names()
        device = self._on_both_sides(
            lambda: (torch.ones(1).device, torch.get_default_device()),
            _entered(mode, torch.device("meta")),
        )
        self.assertEqual(device, (torch.device("meta"), torch.device("meta")))
        threads = {t for t, name in mode.calls if name == "ones"}
        self.assertEqual(len(threads), 2)  # the caller's mode saw both sides

    def test_dispatch_modes(self) -> None:
        # a dispatch mode set around step() sees the backward's ops
        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.ops: list[tuple[str, str]] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append((threading.current_thread().name, str(func)))
                return func(*args, **(kwargs or {}))

        mode = Ops()
        x = torch.ones(2, requires_grad=True)
        loss = (x * 3).sum()
        with mode:
            _run_overlapped(
                lambda: torch.zeros(1),
                loss.backward,
                global_rank=0,
                action="a",
                timeout=5.0,
            )
        backward_ops = [op for t, op in mode.ops if t.startswith("OVERLAP_F_B")]
        self.assertIn("aten.mul.Tensor", backward_ops)  # mul's backward
        torch.testing.assert_close(x.grad, torch.full((2,), 3.0))

    def test_saved_tensor_hooks(self) -> None:
        packed = []

        def pack(t):
            packed.append(threading.current_thread().name)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        x = torch.ones(2, requires_grad=True)
        self._on_both_sides(lambda: (x * x).sum() is not None, hooks)
        self.assertEqual(len(set(packed)), 2)
        disabled = torch.autograd.graph.disable_saved_tensors_hooks("not here")
        message = self._on_both_sides(
            torch._C._autograd._saved_tensors_hooks_get_disabled_error_message,
            disabled,
        )
        self.assertEqual(message, "not here")

    def test_view_replay_multithreading_and_intra_op_threads(self) -> None:
        probe = lambda: (  # noqa: E731
            torch._C._is_view_replay_enabled(),
            torch._C._is_multithreading_enabled(),
            torch.get_num_threads(),
        )
        state = contextlib.ExitStack()
        state.enter_context(torch.autograd._force_original_view_tracking(True))
        state.enter_context(torch.autograd.set_multithreading_enabled(False))
        threads = torch.get_num_threads()
        state.callback(torch.set_num_threads, threads)
        torch.set_num_threads(1)
        self.assertEqual(self._on_both_sides(probe, state), (True, False, 1))

    def test_process_wide_settings_are_seen_without_carrying(self) -> None:
        # default dtype and deterministic algorithms are process-wide: a new
        # thread sees them (the handler does not carry them)
        probe = lambda: (  # noqa: E731
            torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
        )
        state = contextlib.ExitStack()
        state.callback(torch.set_default_dtype, torch.get_default_dtype())
        state.callback(
            torch.use_deterministic_algorithms,
            torch.are_deterministic_algorithms_enabled(),
        )
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        self.assertEqual(self._on_both_sides(probe, state), (torch.float64, True))

    def test_profiler_ranges_of_both_threads(self) -> None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import profile

        run = PairRun(1, 1)
        with profile(
            experimental_config=_ExperimentalConfig(profile_all_threads=True)
        ) as prof:
            run.run(action="0F1;3B0", sub_actions=("0F1", "3B0"))
        names = {e.name for e in prof.events()}
        self.assertIn("OVERLAP_F_B forward 0F1", names)
        self.assertIn("OVERLAP_F_B backward 3B0", names)
        self.assertIn("OVERLAP_F_B dispatch communication (forward thread)", names)
        self.assertIn(
            "OVERLAP_F_B combine backward communication (backward thread)", names
        )
        # the demo's timeline tells the communication ranges from the
        # sub-actions by these names
        from torch_pipelining_ext.demo._timeline import _EP_COMM, _SUB_ACTION

        ours = sorted(n for n in names if n.startswith("OVERLAP_F_B "))
        comm = [n for n in ours if _EP_COMM.match(n)]
        subs = [n for n in ours if _SUB_ACTION.match(n)]
        self.assertEqual(sorted(comm + subs), ours)
        self.assertEqual(
            sorted(subs), ["OVERLAP_F_B backward 3B0", "OVERLAP_F_B forward 0F1"]
        )
        self.assertIn("OVERLAP_F_B dispatch communication (forward thread)", comm)


@contextlib.contextmanager
def _entered(*managers):
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


class _Recorder(overlap.ActionObserver):
    def __init__(self) -> None:
        self.events: list[
            tuple[str, str, int, float, float]
        ] = []  # (event, side, thread, t0, t1)

    def sub_action(self, side: str, start: float, end: float) -> None:
        self.events.append(("compute", side, threading.get_ident(), start, end))

    def transition(self, name: str, side: str, call: float, ret: float) -> None:
        self.events.append((name, side, threading.get_ident(), call, ret))


class ObserverTest(TestCase):
    def test_observer_gets_computes_and_transitions_on_their_threads(self) -> None:
        recorder = _Recorder()
        with overlap.observe_actions(recorder):
            coordinator = PairRun(2, 1).run()
        self.assertIs(type(coordinator), _ep_turns._ObservedCoordinator)
        threads = {
            side: {e[2] for e in recorder.events if e[1] == side}
            for side in ("forward", "backward")
        }
        self.assertEqual(threads["forward"], {threading.get_ident()})
        self.assertEqual(len(threads["backward"]), 1)
        self.assertNotEqual(threads["backward"], threads["forward"])
        for side, regions in (("forward", 2), ("backward", 1)):
            names = [e[0] for e in recorder.events if e[1] == side]
            # each region: a dispatch and a combine mark pair, see ToyMoELayer
            self.assertEqual(names.count("open"), 2 * regions, names)
            self.assertEqual(names.count("close"), 2 * regions, names)
            self.assertEqual((names[0], names[-1]), ("start", "finish"))
            self.assertEqual(names.count("compute"), 1)
            (compute,) = [
                e for e in recorder.events if e[1] == side and e[0] == "compute"
            ]
            for e in recorder.events:
                if e[1] == side and e[0] in ("open", "close"):
                    self.assertTrue(
                        compute[3] <= e[3] <= e[4] <= compute[4], (compute, e)
                    )
        # outside the block: the plain coordinator, nothing reported
        count = len(recorder.events)
        self.assertIs(type(PairRun(1, 1).run()), _CommCoordinator)
        self.assertEqual(len(recorder.events), count)

    def test_observe_actions_nests_and_checks_its_argument(self) -> None:
        outer, inner = _Recorder(), _Recorder()
        with overlap.observe_actions(outer):
            with overlap.observe_actions(inner):
                PairRun(1, 1).run()
            self.assertEqual(outer.events, [])
            PairRun(1, 1).run()
        self.assertTrue(inner.events and outer.events)
        self.assertIsNone(SETTINGS.observer)
        with self.assertRaisesRegex(TypeError, "expected an ActionObserver"):
            with overlap.observe_actions(object()):
                pass


class MarksTest(TestCase):
    def test_noop_outside_an_action(self) -> None:
        x = torch.randn(3, DIM)
        y = torch.randn(3, DIM, requires_grad=True)
        for mark in (
            overlap.dispatch_begin,
            overlap.dispatch_end,
            overlap.combine_begin,
            overlap.combine_end,
        ):
            self.assertIs(mark(x), x)  # no grad needed: the very same object
            with torch.no_grad():
                self.assertIs(mark(y), y)
            a, b = mark(x, 3)
            self.assertIs(a, x)
            self.assertEqual(b, 3)
            z = mark(y)  # one autograd node, for a backward inside an action later
            self.assertEqual(type(z.grad_fn).__name__, "_MarkBackwardBackward")
            (z * 2).sum().backward()
            torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))
            y.grad = None
        self.assertEqual(_ep_marks._BINDINGS.backward_sides(), [])
        self.assertIsNone(_ep_marks._current_binding())

    def test_marks_in_another_thread_are_not_coordinated(self) -> None:
        # A thread that is not one of the action's two threads is not coordinated,
        # even while an action runs.
        coordinator = _CommCoordinator(rank=0, action="a", timeout=1.0)
        coordinator.finish(Side.BACKWARD)
        seen = []
        with _ep_marks.bound(coordinator, Side.FORWARD):
            coordinator.open(Side.FORWARD, "held", "dispatch")
            t = threading.Thread(
                target=lambda: seen.append(overlap.dispatch_begin(torch.ones(1)))
            )
            t.start()
            t.join(5.0)
            coordinator.close(Side.FORWARD, "held")
        self.assertEqual(len(seen), 1)

    def test_all_to_all_arguments(self) -> None:
        x = torch.ones(2, DIM)
        with self.assertRaisesRegex(
            ValueError, "phase must be 'dispatch' or 'combine'"
        ):
            overlap.all_to_all(x, phase="gather")
        with self.assertRaisesRegex(ValueError, "give both output_split_sizes"):
            overlap.all_to_all(x, [1, 1], None)

    def test_wrap_dispatch_combine(self) -> None:
        class MoE(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Linear(DIM, DIM)
                self.calls = []

            def dispatch(self, x, counts):
                self.calls.append(("dispatch", id(self)))
                return x * 2, counts

            def combine(self, y):
                self.calls.append(("combine", id(self)))
                return y + 1

            def forward(self, x):
                h, _ = self.dispatch(x, [1, 2])
                return self.combine(self.w(h))

        model = nn.Sequential(MoE(), nn.ReLU(), MoE())
        self.assertEqual(overlap.wrap_dispatch_combine(model), ["0", "2"])
        self.assertEqual(overlap.wrap_dispatch_combine(model), ["0", "2"])  # idempotent
        x = torch.randn(2, DIM, requires_grad=True)
        out = model(x)
        self.assertEqual(
            model[0].calls, [("dispatch", id(model[0])), ("combine", id(model[0]))]
        )
        out.sum().backward()
        # the marks sit around the methods: a deep copy calls its own methods
        clone = copy.deepcopy(model)
        clone(x)
        self.assertEqual(
            clone[0].calls[-2:], [("dispatch", id(clone[0])), ("combine", id(clone[0]))]
        )
        self.assertEqual(len(model[0].calls), 2)
        # inside an action, both methods are communication regions
        comm_order = []
        coordinator = _CommCoordinator(rank=0, action="a", timeout=5.0)
        orig_open, orig_close = coordinator.open, coordinator.close
        coordinator.open = lambda side, where, phase: (
            comm_order.append(("open", where)),
            orig_open(side, where, phase),
        )
        coordinator.close = lambda side, where: (
            comm_order.append(("close", where)),
            orig_close(side, where),
        )
        coordinator.finish(Side.BACKWARD)  # the other side has no regions
        with _ep_marks.bound(coordinator, Side.FORWARD):
            model[0](x)
        self.assertEqual(
            comm_order,
            [
                ("open", "dispatch_begin (forward)"),
                ("close", "dispatch_end (forward)"),
                ("open", "combine_begin (forward)"),
                ("close", "combine_end (forward)"),
            ],
        )
        with self.assertRaisesRegex(
            ValueError,
            "nothing in Linear .* has both a 'dispatch' and a 'combine' method",
        ):
            overlap.wrap_dispatch_combine(nn.Linear(2, 2))
        with self.assertRaisesRegex(
            ValueError, "dispatch and combine must be different methods"
        ):
            overlap.wrap_dispatch_combine(
                model, dispatch="dispatch", combine="dispatch"
            )
        del model[0].dispatch, model[0].combine  # undo
        self.assertNotIsInstance(model[0].dispatch, _ep_marks._MarkedMethod)

    def test_wrap_dispatcher_objects(self) -> None:
        class TokenDispatcher:  # a plain object, as MoE libraries keep their dispatchers
            def __init__(self) -> None:
                self.calls = []

            def dispatch(self, x):
                self.calls.append("dispatch")
                return x * 2

            def combine(self, y):
                self.calls.append("combine")
                return y + 1

        class Experts(nn.Module):
            def __init__(self, dispatcher) -> None:
                super().__init__()
                self.w = nn.Linear(DIM, DIM)
                self.dispatcher = dispatcher
                self.top_k = 2  # plain values are not candidates

            def forward(self, x):
                return self.dispatcher.combine(self.w(self.dispatcher.dispatch(x)))

        shared = TokenDispatcher()
        model = nn.Sequential(
            Experts(TokenDispatcher()), Experts(shared), Experts(shared)
        )
        self.assertEqual(
            overlap.wrap_dispatch_combine(model), ["0.dispatcher", "1.dispatcher"]
        )  # shared: once
        self.assertIsInstance(shared.dispatch, _ep_marks._MarkedMethod)
        self.assertIsInstance(model[0].dispatcher.combine, _ep_marks._MarkedMethod)
        order = []
        coordinator = _CommCoordinator(rank=0, action="a", timeout=5.0)
        orig_open = coordinator.open
        coordinator.open = lambda side, where, phase: (
            order.append(where),
            orig_open(side, where, phase),
        )
        coordinator.finish(Side.BACKWARD)
        with _ep_marks.bound(coordinator, Side.FORWARD):
            model[0](torch.randn(2, DIM))
        self.assertEqual(order, ["dispatch_begin (forward)", "combine_begin (forward)"])
        # an explicit object
        other = TokenDispatcher()
        self.assertEqual(overlap.wrap_dispatch_combine(other), [""])
        self.assertIsInstance(other.combine, _ep_marks._MarkedMethod)

        class Slotted:
            __slots__ = ()

            def dispatch(self, x):
                return x

            def combine(self, x):
                return x

        with self.assertRaisesRegex(TypeError, "cannot wrap Slotted.dispatch"):
            overlap.wrap_dispatch_combine(Slotted())


@unittest.skipUnless(
    _collectives._thread_key_passes_modes(),
    "this torch keeps the coordination kernels at BackendSelect, reached by every collective "
    "(its Python fallback asserts under a dispatch mode with a kernel at PythonTLSSnapshot)",
)
class CollectiveKernelTest(OneRankGroupTestCase):
    """Only a thread running a side reaches the coordination kernels.

    See [Note: where the coordination kernels sit].
    """

    def setUp(self) -> None:
        super().setUp()
        from torch_pipelining_ext.overlap import _collectives

        _collectives.install()
        self.reached: list[str] = []
        current = _ep_marks._current_binding

        def counting() -> _ep_marks._Binding | None:
            self.reached.append(threading.current_thread().name)
            return current()

        patcher = unittest.mock.patch.object(_ep_marks, "_current_binding", counting)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_only_the_sides_of_an_action_reach_the_kernels(self) -> None:
        x, other = torch.ones(4), dist.new_group([0])
        dist.all_reduce(x)
        self.assertEqual(self.reached, [])  # outside an action: not reached
        # a thread outside the action keeps issuing collectives meanwhile
        stop, issued, background = threading.Event(), [], []

        def issue() -> None:
            while not stop.is_set():
                y = torch.full((4,), 2.0)
                dist.all_reduce(y, group=other)
                background.append(y)
                if len(background) == 3:
                    issued.append(True)

        thread = threading.Thread(target=issue, name="background")
        coordinator = _CommCoordinator(rank=0, action="a", timeout=5.0)
        coordinator.finish(Side.BACKWARD)
        try:
            with _ep_marks.bound(coordinator, Side.FORWARD):
                thread.start()
                while not issued and thread.is_alive():
                    thread.join(0.01)
                for _ in range(3):
                    dist.all_reduce(x)
                dist.all_gather_into_tensor(torch.empty(4), x)
        finally:
            stop.set()
            thread.join(10.0)
        self.assertFalse(thread.is_alive())
        self.assertGreaterEqual(len(background), 3)
        for y in background:
            self.assertEqual(y, torch.full((4,), 2.0))
        self.assertEqual(self.reached, [threading.current_thread().name] * 4)
        self.assertEqual(
            [c.op for c in coordinator.collectives(Side.FORWARD)],
            ["allreduce_"] * 3 + ["_allgather_base_"],
        )
        dist.all_reduce(x)  # after the action: not reached again
        self.assertEqual(len(self.reached), 4)
        self.assertEqual(x, torch.ones(4))

    def test_a_dispatch_mode_outside_an_action_passes_through(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = []

        class Recording(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        x = torch.ones(4)
        with Recording():
            dist.all_reduce(x)
        # the mode's thread has the kernels' key: the kernel passes it on
        self.assertEqual(len(self.reached), 1)
        self.assertEqual(seen, ["c10d.allreduce_.default"])
        self.assertEqual(x, torch.ones(4))


class PatchTest(TestCase):
    def test_installed_and_removed(self) -> None:
        from torch.distributed.pipelining import schedules

        from torch_pipelining_ext.overlap import _install as _overlap

        runtime = schedules._PipelineScheduleRuntime
        self.assertIsInstance(
            runtime.__dict__["_comp_type_to_function_map"],
            _overlap._FunctionMapWithOverlap,
        )
        try:
            torch_pipelining_ext.unpatch()
            self.assertNotIsInstance(
                runtime.__dict__.get("_comp_type_to_function_map"),
                _overlap._FunctionMapWithOverlap,
            )
            self.assertFalse(
                _overlap._patch_applied()
            )  # schedules built before run OVERLAP_F_B sequentially
        finally:
            torch_pipelining_ext.patch()
        self.assertTrue(_overlap._patch_applied())

    def test_collective_kernels_installed_on_use_and_removed_by_unpatch(self) -> None:
        from torch_pipelining_ext.overlap import _collectives

        def kernel_at(op: str, key: str) -> str:
            table = torch._C._dispatch_dump_table(op).splitlines()
            return next(line for line in table if line.startswith(f"{key}:"))

        PairRun(1, 1).run()  # an overlapped action installs them
        self.assertTrue(_collectives._INTERCEPTION.installed)
        self.assertIsNotNone(_ep_marks._FORK_RNG_WINDOW.handle)
        # at the key only the threads of an action reach, none at BackendSelect
        # BackendSelect where the probe finds PythonTLSSnapshot unusable (2.9, 2.10)
        key = _collectives._keys()[0]
        self.assertEqual(_collectives._INTERCEPTION.operators["allreduce_"], key)
        self.assertEqual(set(_collectives._INTERCEPTION.operators.values()), {key})
        self.assertIn("kernel", kernel_at("c10d::allreduce_", key))
        if key != "BackendSelect":
            self.assertIn("fallthrough", kernel_at("c10d::allreduce_", "BackendSelect"))
        # only operators that take a process group
        self.assertNotIn("check_for_nan", _collectives._INTERCEPTION.operators)
        try:
            torch_pipelining_ext.unpatch()
            self.assertFalse(_collectives._INTERCEPTION.installed)
            self.assertIsNone(_ep_marks._FORK_RNG_WINDOW.handle)
            self.assertNotIn(
                "kernel", kernel_at("c10d::allreduce_", "PythonTLSSnapshot")
            )
        finally:
            torch_pipelining_ext.patch()

    def test_env_opt_out_and_default(self) -> None:
        from torch.distributed.pipelining import schedules

        from torch_pipelining_ext import _schedule_runtime

        from torch_pipelining_ext.overlap import _install as _overlap

        class Owner:
            _comp_type_to_function_map = _overlap._FunctionMapWithOverlap()

        self.assertIs(
            Owner()._comp_type_to_function_map[schedules.OVERLAP_F_B],
            _overlap.default_overlap_f_b,
        )
        self.assertIs(
            Owner()._comp_type_to_function_map[schedules.FORWARD],
            _schedule_runtime.perform_action,
        )
        with unittest.mock.patch.dict(os.environ, {_overlap.OVERLAP_ENV: "0"}):
            sequential = _schedule_runtime.sequential_overlap_f_b
            self.assertIs(
                Owner()._comp_type_to_function_map[schedules.OVERLAP_F_B], sequential
            )
            owner = Owner()
            owner._comp_type_to_function_map = {}  # as upstream __init__ assigns it
            self.assertIs(
                owner._comp_type_to_function_map[schedules.OVERLAP_F_B], sequential
            )
        owner = Owner()
        owner._comp_type_to_function_map = {}
        self.assertIs(
            owner._comp_type_to_function_map[schedules.OVERLAP_F_B],
            _overlap.default_overlap_f_b,
        )

    def test_registering_another_function_replaces_it_quietly(self) -> None:
        from torch.distributed.pipelining import schedules

        from torch_pipelining_ext import _schedule_runtime

        from torch_pipelining_ext.overlap import _install as _overlap

        calls = []

        def original(self, ctype, fn):
            if ctype in self._comp_type_to_function_map:
                calls.append("warned")
            self._comp_type_to_function_map[ctype] = fn

        class Owner:
            _comp_type_to_function_map = _overlap._FunctionMapWithOverlap()
            register_custom_function = _schedule_runtime._make_register_custom_function(
                original
            )

        owner = Owner()
        mine = lambda action, ctx: None  # noqa: E731
        for ctype in (schedules.OVERLAP_F_B, schedules.FORWARD):
            owner.register_custom_function(ctype, mine)
            self.assertEqual(calls, [])
            self.assertIs(owner._comp_type_to_function_map[ctype], mine)
        owner.register_custom_function(
            schedules.OVERLAP_F_B, mine
        )  # replacing a user's function still warns
        self.assertEqual(calls, ["warned"])


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(
            (threading.current_thread().name, f"{self.name} waits {other.name}")
        )


class StreamPlanTest(TestCase):
    @parametrize("failing", ["none", "forward", "backward"])
    def test_streams_joined_around_the_action(self, failing: str) -> None:
        log: list = []
        current = threading.local()
        caller = FakeStream("caller", log)
        stage_streams = {0: FakeStream("s0", log), 3: FakeStream("s3", log)}
        plan = _StreamPlan(
            caller, stage_streams, 0, 3, set_stream=lambda s: setattr(current, "s", s)
        )
        seen = {}

        def compute(side: str):
            def fn() -> None:
                seen[side] = current.s.name
                if failing == side:
                    raise RuntimeError("boom")

            return fn

        try:
            _run_overlapped(
                compute("forward"),
                compute("backward"),
                global_rank=0,
                action="a",
                streams=plan,
                timeout=5.0,
            )
        except RuntimeError:
            self.assertNotEqual(failing, "none")
        self.assertEqual(seen, {"forward": "s0", "backward": "s3"})
        events = [e for _, e in log]
        self.assertEqual(events[:2], ["s0 waits caller", "s3 waits caller"])
        self.assertEqual(events[2:], ["caller waits s0", "caller waits s3"])
        # the caller joins on the calling thread, after the worker finished
        self.assertEqual({t for t, _ in log}, {threading.current_thread().name})

    def test_no_plan_on_cpu_whatever_the_device_is_given_as(self) -> None:
        from types import SimpleNamespace

        from torch.distributed.pipelining.schedules import (
            _Action,
            BACKWARD_INPUT,
            FORWARD,
        )

        for device in (
            "cpu",
            torch.device("cpu"),
        ):  # PipelineStage keeps the device as it was given
            stages = {
                0: SimpleNamespace(device=device),
                3: SimpleNamespace(device=device),
            }
            plan = _StreamPlan.for_action(
                object(), stages, _Action(0, FORWARD, 1), _Action(3, BACKWARD_INPUT, 0)
            )
            self.assertIsNone(plan)


instantiate_parametrized_tests(RandomNumbersTest)
instantiate_parametrized_tests(FailureTest)
instantiate_parametrized_tests(CoordinatorTest)
instantiate_parametrized_tests(MarksTest)
instantiate_parametrized_tests(ThreadStateTest)
instantiate_parametrized_tests(StreamPlanTest)
instantiate_parametrized_tests(PatchTest)
instantiate_parametrized_tests(InputWaitTest)


if __name__ == "__main__":
    run_tests()
