# Owner(s): ["oncall: distributed"]
# Upstream path: test/distributed/pipelining/test_schedule_overlap_f_b.py
"""Concurrent OVERLAP_F_B (``ep_overlap.overlap_f_b``) and its communication marks.

* ScheduleDualPipeV with ``ep_overlap.overlap_f_b`` registered gives bitwise
  the outputs, losses and gradients of the sequential (built-in) OVERLAP_F_B,
  and those of a single-process reference; backward sub-actions really ran on
  the worker thread.
* A model with dispatch/combine marks: inside overlapped actions, whenever a
  thread is inside a marked communication region the other thread is not;
  and, one boundary at a time, a side cannot open a region while the other
  side is inside one.
* A recomputation (RNG window) that the backward side reaches before the
  forward side has started waiting does not stall the two threads until the
  wait timeout: the side that starts waiting wakes the other.

No test sleeps or measures time: threads are ordered by events, and a wait
that must not happen shows as the coordinator's timeout error.
"""

import copy
import threading
from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    _ep_marks,
    ep_overlap,
    PipelineStage,
    ScheduleDualPipeV,
)
from torch.distributed.pipelining._ep_rng import _RNGDevices
from torch.distributed.pipelining._ep_turns import _CommCoordinator, _Side, _TurnState
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.distributed.pipelining.schedules import OVERLAP_F_B
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    run_tests,
    skip_but_pass_in_sandcastle_if,
    TestCase,
)


N_MICROBATCHES = 4
MB_SIZE = 2
DIM = 8


class Recorder:
    """What ran where: backward threads; inside regions, the thread and the other side's state."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.backward_threads: set[int] = set()
        self.events: list[tuple[int, _TurnState]] = []

    def clear(self) -> None:
        with self.lock:
            self.backward_threads.clear()
            self.events.clear()


RECORDER = Recorder()


class _Probe(torch.autograd.Function):
    """Identity that records its backward thread; inside a region, a region event."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, in_region: bool) -> torch.Tensor:
        ctx.in_region = in_region
        if in_region:
            _region_event()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with RECORDER.lock:
            RECORDER.backward_threads.add(threading.get_ident())
        if ctx.in_region:
            _region_event()
        return grad, None


def _region_event() -> None:
    binding = _ep_marks._current_binding()
    if binding is None:
        return  # not inside an overlapped action
    other_state, _ = binding.coordinator.state_of(binding.side.other)
    with RECORDER.lock:
        RECORDER.events.append((threading.get_ident(), other_state))


class MarkedLayer(nn.Module):
    """Linear layers around a "dispatch" and a "combine" communication region (MoE-like)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, dim)
        self.w2 = nn.Linear(dim, dim)
        self.w3 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Probe.apply(torch.relu(self.w1(x)), False)
        x = ep_overlap.dispatch_begin(x)
        x = _Probe.apply(x, True)
        x = ep_overlap.dispatch_end(x)
        x = torch.tanh(self.w2(x))
        x = ep_overlap.combine_begin(x)
        x = _Probe.apply(x, True)
        x = ep_overlap.combine_end(x)
        return self.w3(x)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class ScheduleOverlapFBTest(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cuda":
            torch.cuda.set_device(self.rank)
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    def _run(self, overlap: bool):
        n_stages = 2 * self.world_size
        stage_indices = [self.rank, n_stages - 1 - self.rank]
        torch.manual_seed(0)
        ref = nn.Sequential(*(MarkedLayer(DIM) for _ in range(n_stages))).to(
            self.device
        )
        modules = [copy.deepcopy(ref[i]) for i in stage_indices]
        stages = [
            PipelineStage(m, i, n_stages, self.device)
            for m, i in zip(modules, stage_indices)
        ]
        schedule = ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=loss_fn)
        if overlap:
            schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
        y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen).to(self.device)
        losses: list[torch.Tensor] = []
        RECORDER.clear()
        out = schedule.step(x, target=y, losses=losses)
        with RECORDER.lock:
            threads = set(RECORDER.backward_threads)
            events = list(RECORDER.events)
        grads = [[p.grad.clone() for p in m.parameters()] for m in modules]
        # single-process reference
        for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
            (loss_fn(ref(x_mb), y_mb) / N_MICROBATCHES).backward()
        for i, stage_grads in zip(stage_indices, grads):
            for g, ref_p in zip(stage_grads, ref[i].parameters()):
                torch.testing.assert_close(g, ref_p.grad, msg=f"stage {i}")
        return (out, losses, grads), threads, events

    def test_overlapped_matches_sequential(self):
        torch.set_num_threads(1)
        sequential, seq_threads, _ = self._run(overlap=False)
        overlapped, threads, _ = self._run(overlap=True)
        # On CPU the same kernels run on the same data: identical results.
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)
        main = threading.get_ident()
        self.assertEqual(seq_threads, {main})
        self.assertIn(main, threads)
        self.assertGreater(
            len(threads - {main}), 0, "no backward ran on the worker thread"
        )

    def test_marked_regions_are_exclusive(self):
        torch.set_num_threads(1)
        _, threads, events = self._run(overlap=True)
        self.assertGreater(len(threads), 1)
        self.assertGreater(len(events), 0)
        # one thread in a region at a time
        both = [
            i
            for i, (_, other) in enumerate(events)
            if other is _TurnState.COMMUNICATING
        ]
        self.assertEqual(both, [], "regions of two threads overlap")
        self.assertGreater(len({tid for tid, _ in events}), 1)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < 2, "NCCL test requires 2+ GPUs"
)
class ScheduleOverlapFBTestNCCL(ScheduleOverlapFBTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"


class CommCoordinatorTest(TestCase):
    def test_a_region_excludes_the_other_side(self):
        coordinator = _CommCoordinator(rank=0, action="0F0;1B0", timeout=0.05)
        coordinator.open(_Side.BACKWARD, "combine_end (backward)", "combine")
        # the forward side would wait for ever: the coordinator's timeout says so
        with self.assertRaisesRegex(
            ep_overlap.CommWaitTimeoutError, "for its turn to communicate"
        ):
            coordinator.open(_Side.FORWARD, "dispatch_begin (forward)", "dispatch")

    def test_recomputation_that_starts_before_the_forward_waits(self):
        # The backward side has the first turn, so it runs at once and reaches
        # its recomputation, where it waits for the forward side to pause,
        # before the forward side has reached the coordinator at all.  The
        # forward side then waits for the backward side's first communication
        # region.  Each waits for the other: the forward side's starting to
        # wait must wake the backward side, or both sleep until the timeout.
        timeout = 30.0
        backward_waits = threading.Event()
        start, wait = _CommCoordinator.start, _CommCoordinator._wait

        def late_forward_start(coordinator, side):
            if side is _Side.FORWARD:
                # the backward side calls _wait holding the coordinator's lock:
                # once the forward side gets the lock, the backward side waits
                self.assertTrue(backward_waits.wait(timeout))
            start(coordinator, side)

        def noting_wait(coordinator, side, where, *args):
            if where == "the start of a recomputation":
                backward_waits.set()
            return wait(coordinator, side, where, *args)

        def backward():
            binding = _ep_marks._current_binding()
            # what checkpoint recomputation does: an RNG window around fork_rng
            with binding.coordinator.rng_window(
                binding.side, _RNGDevices(None, ()), preserve=True
            ):
                with torch.random.fork_rng(devices=[]):
                    torch.rand(2)

        drawn = {}
        torch.manual_seed(5)
        with (
            mock.patch.object(_CommCoordinator, "start", late_forward_start),
            mock.patch.object(_CommCoordinator, "_wait", noting_wait),
        ):
            # a stall would end in CommWaitTimeoutError after `timeout`, raised here
            _run_overlapped(
                lambda: drawn.setdefault("forward", torch.rand(2)),
                backward,
                global_rank=0,
                action="0F0;1B0",
                timeout=timeout,
            )
        self.assertTrue(backward_waits.is_set())
        # the forward side drew the numbers it draws without the recomputation
        torch.manual_seed(5)
        torch.testing.assert_close(drawn["forward"], torch.rand(2), rtol=0, atol=0)


if __name__ == "__main__":
    run_tests()
