# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Streams of a concurrent OVERLAP_F_B on accelerators (``_ep_streams._StreamPlan``).

Each side computes on its stage's own stream; both side streams wait for the
caller's stream before either side starts, and the caller's stream waits for
both before the action returns, whether a side failed or not (fake streams,
on CPU).  On CPU there is no plan.  On a GPU, each side's kernels run on its
stage's stream and the caller's stream sees their results.  ScheduleDualPipeV
with ``ep_overlap.overlap_f_b`` on NCCL gives bitwise the built-in results.
"""

import threading
import unittest
from types import SimpleNamespace

from overlap_test_utils import run_dual_pipe_v
from pipeline_test_utils import nccl_variant, PipelineTestCase

import torch
from torch.distributed.pipelining._ep_streams import _StreamPlan
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.distributed.pipelining.schedules import _Action, BACKWARD_INPUT, FORWARD
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(
            (threading.current_thread().name, f"{self.name} waits {other.name}")
        )


def run_pair(compute, plan):
    """The two sides' ``compute(side)`` as one overlapped action on ``plan``."""
    _run_overlapped(
        compute("forward"),
        compute("backward"),
        global_rank=0,
        action="a",
        streams=plan,
        timeout=60.0,
    )


class StreamPlanTest(TestCase):
    @parametrize("failing", ["none", "forward", "backward"])
    def test_streams_joined_around_the_action(self, failing):
        log: list = []
        current = threading.local()
        caller = FakeStream("caller", log)
        streams = {0: FakeStream("s0", log), 3: FakeStream("s3", log)}
        plan = _StreamPlan(caller, streams, 0, 3, lambda s: setattr(current, "s", s))
        seen = {}

        def compute(side):
            def fn():
                seen[side] = current.s.name
                if failing == side:
                    raise RuntimeError("boom")

            return fn

        try:
            run_pair(compute, plan)
        except RuntimeError:
            self.assertNotEqual(failing, "none")
        self.assertEqual(seen, {"forward": "s0", "backward": "s3"})
        events = [e for _, e in log]
        self.assertEqual(events[:2], ["s0 waits caller", "s3 waits caller"])
        self.assertEqual(events[2:], ["caller waits s0", "caller waits s3"])
        self.assertEqual({t for t, _ in log}, {threading.current_thread().name})

    def test_no_plan_on_cpu(self):
        for device in ("cpu", torch.device("cpu")):  # as PipelineStage keeps it
            stages = {
                0: SimpleNamespace(device=device),
                3: SimpleNamespace(device=device),
            }
            plan = _StreamPlan.for_action(
                SimpleNamespace(stage_streams=None),
                stages,
                _Action(0, FORWARD, 1),
                _Action(3, BACKWARD_INPUT, 0),
            )
            self.assertIsNone(plan)

    @unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
    def test_sides_compute_on_their_stage_streams(self):
        device = torch.device("cuda", 0)
        stages = {0: SimpleNamespace(device=device), 3: SimpleNamespace(device=device)}
        state = SimpleNamespace(stage_streams=None)
        fwd, bwd = _Action(0, FORWARD, 1), _Action(3, BACKWARD_INPUT, 0)
        plan = _StreamPlan.for_action(state, stages, fwd, bwd)
        self.assertIsNotNone(plan)
        x = torch.randn(1024, 1024, device=device)
        seen, out = {}, {}

        def compute(side):
            def fn():
                seen[side] = torch.cuda.current_stream(device)
                out[side] = (x @ x).sum()

            return fn

        run_pair(compute, plan)
        self.assertEqual(seen["forward"], state.stage_streams[0])
        self.assertEqual(seen["backward"], state.stage_streams[3])
        self.assertEqual(torch.cuda.current_stream(device), plan.caller)
        expected = (x @ x).sum()
        torch.testing.assert_close(out["forward"], expected)
        torch.testing.assert_close(out["backward"], expected)


instantiate_parametrized_tests(StreamPlanTest)


class ScheduleOverlapStreamsTest(PipelineTestCase):
    def test_overlapped_matches_sequential(self):
        sequential = run_dual_pipe_v(self, overlap=False)
        overlapped = run_dual_pipe_v(self, overlap=True)
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)


# The gloo run covers no stream; the NCCL variant is the one this PR is for.
ScheduleOverlapStreamsTestNCCL = nccl_variant(ScheduleOverlapStreamsTest)
del ScheduleOverlapStreamsTest


if __name__ == "__main__":
    run_tests()
