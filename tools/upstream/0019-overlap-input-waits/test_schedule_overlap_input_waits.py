# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Each side of a concurrent OVERLAP_F_B waits for its own input.

ScheduleDualPipeV with ``ep_overlap.overlap_f_b``: the gradients of each
overlapped backward (a receive from the other rank) arrive only once its
forward has started.  The forward computes meanwhile, the backward waits for
them on the worker thread, and the results are bitwise the sequential
handler's.  A handler that waited for the gradients before the forward ran
would wait for ever: the gate raises instead after a bound.
"""

import threading

from overlap_test_utils import run_dual_pipe_v
from pipeline_test_utils import nccl_variant, PipelineTestCase

import torch
from torch.distributed.pipelining.schedules import OVERLAP_F_B
from torch.testing._internal.common_utils import run_tests


GATE_TIMEOUT_S = 20.0


class _GatedWork:
    """A receive whose wait returns only once ``opened`` is set."""

    def __init__(self, works, opened: threading.Event, on_wait) -> None:
        self.works, self.opened, self.on_wait = works, opened, on_wait

    def wait(self) -> bool:
        if not self.opened.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the gradients were awaited before the forward ran")
        for work in self.works:
            work.wait()
        self.on_wait()
        return True


class GradientGate(dict):
    """``bwd_recv_ops`` whose overlapped backwards get their gradients after their forward started."""

    def __init__(self, schedule, rank: int) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.waited_on: list[str] = []  # threads that waited for gated gradients
        self.started: dict[tuple[int, int], threading.Event] = {}
        self.pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for action in schedule.pipeline_order_with_comms[rank]:
            if action.computation_type == OVERLAP_F_B:
                fwd, bwd = action.sub_actions
                f_key = (fwd.stage_index, fwd.microbatch_index)
                self.pairs[(bwd.stage_index, bwd.microbatch_index)] = f_key
                self.started[f_key] = threading.Event()
        for stage in schedule._stages:
            original = stage.forward_one_chunk

            def spy(mb, *args, _original=original, _idx=stage.stage_index, **kw):
                if (_idx, mb) in self.started:
                    self.started[(_idx, mb)].set()
                return _original(mb, *args, **kw)

            stage.forward_one_chunk = spy

    def _waited(self) -> None:
        with self.lock:
            self.waited_on.append(threading.current_thread().name)

    def __setitem__(self, key, works) -> None:
        if key in self.pairs:
            works = [_GatedWork(works, self.started[self.pairs[key]], self._waited)]
        super().__setitem__(key, works)


class ScheduleOverlapInputWaitsTest(PipelineTestCase):
    def test_forward_runs_while_the_gradients_are_in_flight(self):
        sequential = run_dual_pipe_v(self, overlap=False)
        gates = []

        def gate(schedule):
            gates.append(GradientGate(schedule, self.rank))
            schedule.bwd_recv_ops = gates[0]

        overlapped = run_dual_pipe_v(self, overlap=True, prepare=gate)
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)
        waited_on = gates[0].waited_on
        self.assertGreater(len(waited_on), 0)
        for name in waited_on:
            self.assertTrue(name.startswith("OVERLAP_F_B backward"), name)


ScheduleOverlapInputWaitsTestNCCL = nccl_variant(ScheduleOverlapInputWaitsTest)


if __name__ == "__main__":
    run_tests()
