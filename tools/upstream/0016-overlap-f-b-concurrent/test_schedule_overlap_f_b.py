# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Concurrent OVERLAP_F_B: ``ep_overlap.overlap_f_b`` registered on ScheduleDualPipeV.

The backward sub-actions run on a worker thread, the results are bitwise
those of the built-in (sequential) OVERLAP_F_B and equal a single-process
reference, and whenever a thread is inside a marked communication region the
other thread is not.  Importing ``torch.distributed.pipelining`` or
``ep_overlap`` does not import the engine.
"""

import subprocess
import sys
import threading

from overlap_test_utils import COMM_HOOKS, run_dual_pipe_v, ThreadLog
from pipeline_test_utils import nccl_variant, PipelineTestCase

import torch
from torch.distributed.pipelining import _ep_marks
from torch.distributed.pipelining._ep_turns import _TurnState
from torch.testing._internal.common_utils import run_tests, TestCase


class RegionLog:
    """Inside a region: the other side's state (must never be COMMUNICATING)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.others: list[_TurnState] = []

    def __call__(self, tag: str) -> None:
        binding = _ep_marks._current_binding()
        if binding is not None:
            other, _ = binding.coordinator.state_of(binding.side.other)
            with self.lock:
                self.others.append(other)


class ScheduleOverlapFBTest(PipelineTestCase):
    def test_overlapped_matches_sequential(self):
        threads, regions = ThreadLog(), RegionLog()
        sequential = run_dual_pipe_v(self, overlap=False)
        COMM_HOOKS[:] = [threads, regions]
        try:
            overlapped = run_dual_pipe_v(self, overlap=True)
        finally:
            COMM_HOOKS.clear()
        self.assertGreater(
            len(threads.backward_threads - {threading.current_thread()}),
            0,
            "no backward sub-action ran on the worker thread",
        )
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)
        self.assertGreater(len(regions.others), 0)
        self.assertNotIn(_TurnState.COMMUNICATING, regions.others)


ScheduleOverlapFBTestNCCL = nccl_variant(ScheduleOverlapFBTest)


class LazyImportTest(TestCase):
    def test_the_engine_is_imported_on_first_use(self):
        code = (
            "import sys\n"
            "import torch.distributed.pipelining\n"
            "from torch.distributed.pipelining import ep_overlap\n"
            "print('torch.distributed.pipelining._overlap' in sys.modules)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        self.assertEqual(out.stdout.strip(), "False")


if __name__ == "__main__":
    run_tests()
