# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Concurrent OVERLAP_F_B keeps one backward thread per step.

Every overlapped action of a ScheduleDualPipeV step runs its backward on the
same worker thread (a thread that has run torch code once runs it faster),
and no such thread is left once the step has returned.
"""

import threading

from overlap_test_utils import COMM_HOOKS, run_dual_pipe_v, ThreadLog
from pipeline_test_utils import nccl_variant, PipelineTestCase

from torch.testing._internal.common_utils import run_tests


class ScheduleOverlapWorkerTest(PipelineTestCase):
    def test_one_backward_thread_per_step(self):
        for _ in range(2):  # each step starts its own
            threads = ThreadLog()
            COMM_HOOKS[:] = [threads]
            try:
                run_dual_pipe_v(self, overlap=True)
            finally:
                COMM_HOOKS.clear()
            workers = threads.backward_threads - {threading.current_thread()}
            self.assertEqual(len(workers), 1, "one worker thread serves the step")
            left = [
                t.name
                for t in threading.enumerate()
                if t.name.startswith("OVERLAP_F_B") and t.is_alive()
            ]
            self.assertEqual(left, [])


ScheduleOverlapWorkerTestNCCL = nccl_variant(ScheduleOverlapWorkerTest)


if __name__ == "__main__":
    run_tests()
