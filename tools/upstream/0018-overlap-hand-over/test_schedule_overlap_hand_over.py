# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Concurrent OVERLAP_F_B hands the processor over at the communication marks.

* A stage pair whose overlapped action passed no mark (a dense model) runs
  the rest of the step's OVERLAP_F_B actions sequentially: only its first
  backward runs on the worker thread.
* With marks, whenever a side computes the other is not computing too.
* One boundary at a time (an injected clock): a side that leaves a region at
  least ``hand_over_min_region_s`` long waits for the other side's next
  region before computing on; after a shorter one it does not.
"""

import threading
from collections import Counter
from unittest import mock

from overlap_test_utils import MarkedBlock, run_dual_pipe_v
from pipeline_test_utils import DIM, nccl_variant, PipelineTestCase

import torch
import torch.nn as nn
from torch.distributed.pipelining import _ep_marks, _ep_turns, ep_overlap
from torch.distributed.pipelining._ep_turns import _CommCoordinator, _Side, _TurnState
from torch.distributed.pipelining.schedules import OVERLAP_F_B
from torch.testing._internal.common_utils import run_tests, TestCase


class _BackwardProbe(torch.autograd.Function):
    """Identity whose backward records its thread (and the other side's state)."""

    log: list = []
    lock = threading.Lock()

    @staticmethod
    def forward(ctx, x):
        _BackwardProbe.record()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _BackwardProbe.record()
        return grad

    @staticmethod
    def record():
        binding = _ep_marks._current_binding()
        other = (
            None
            if binding is None
            else binding.coordinator.state_of(binding.side.other)
        )
        with _BackwardProbe.lock:
            _BackwardProbe.log.append((threading.get_ident(), other))


class DenseBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(DIM, DIM)

    def forward(self, x):
        return _BackwardProbe.apply(torch.tanh(self.w(x)))


class ProbedMarkedBlock(MarkedBlock):
    def forward(self, x):
        return super().forward(_BackwardProbe.apply(x))


class ScheduleOverlapHandOverTest(PipelineTestCase):
    def test_pairs_without_marks_run_sequentially(self):
        _BackwardProbe.log.clear()
        run_dual_pipe_v(self, overlap=True, make_stage=DenseBlock)
        off_main = [t for t, _ in _BackwardProbe.log if t != threading.get_ident()]
        # DualPipeV's OVERLAP_F_B actions of this rank, by stage pair: only the
        # first of each pair ran concurrently (forward and backward probes)
        pairs = Counter(
            tuple(a.stage_index for a in action.sub_actions)
            for action in self._schedule_actions()
            if action.computation_type == OVERLAP_F_B
        )
        self.assertGreater(sum(pairs.values()), len(pairs))
        self.assertEqual(len(off_main), len(pairs))

    def test_compute_is_handed_over(self):
        # every region long enough to hand over: whenever a side computes,
        # the other is communicating, parked in the coordinator, or done
        _BackwardProbe.log.clear()
        with mock.patch.object(_ep_turns, "_HAND_OVER_MIN_REGION_S", 0.0, create=True):
            run_dual_pipe_v(self, overlap=True, make_stage=ProbedMarkedBlock)
        states = [other for _, other in _BackwardProbe.log if other is not None]
        self.assertGreater(len(states), 0)
        both_computing = [
            s for s, parked in states if s is _TurnState.COMPUTING and not parked
        ]
        self.assertEqual(both_computing, [])

    def _schedule_actions(self):
        from pipeline_test_utils import build_pipeline, loss_fn, stage_indices

        from torch.distributed.pipelining import ScheduleDualPipeV

        indices = stage_indices(ScheduleDualPipeV, self.rank, self.world_size)
        stages = build_pipeline(indices, 2 * self.world_size, self.device)[2]
        schedule = ScheduleDualPipeV(stages, 4, loss_fn=loss_fn)
        return schedule.pipeline_order_with_comms[self.rank]


ScheduleOverlapHandOverTestNCCL = nccl_variant(ScheduleOverlapHandOverTest)


class HandOverTest(TestCase):
    def _coordinator(self, now):
        return _CommCoordinator(
            rank=0,
            action="a",
            timeout=0.05,
            clock=lambda: now[0],
            hand_over_min_region_s=1.0,
        )

    def test_long_regions_are_handed_over(self):
        now = [0.0]
        coordinator = self._coordinator(now)
        coordinator.open(_Side.BACKWARD, "b", "combine")
        now[0] += 1.0
        with self.assertRaisesRegex(
            ep_overlap.CommWaitTimeoutError,
            "at b for the forward thread to start communicating before computing on",
        ):
            coordinator.close(_Side.BACKWARD, "b")

    def test_short_regions_are_not_handed_over(self):
        now = [0.0]
        coordinator = self._coordinator(now)
        coordinator.open(_Side.BACKWARD, "b", "combine")
        now[0] += 0.999
        coordinator.close(_Side.BACKWARD, "b")  # no wait
        self.assertEqual(coordinator.state_of(_Side.BACKWARD)[0], _TurnState.COMPUTING)


if __name__ == "__main__":
    run_tests()
