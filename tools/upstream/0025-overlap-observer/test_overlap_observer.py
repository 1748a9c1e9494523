# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""``ep_overlap.observe_actions``: timestamps of concurrent OVERLAP_F_B actions.

An observer set with ``observe_actions`` gets each side's compute and every
turn-taking transition (start, open, close, finish), on the thread it
happened on; blocks nest, and anything but an ``ActionObserver`` is refused.
"""

import threading

import torch
from torch.distributed.pipelining import ep_overlap
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.testing._internal.common_utils import run_tests, TestCase


class Recorder(ep_overlap.ActionObserver):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, str]] = []

    def sub_action(self, side, start, end):
        with self.lock:
            self.events.append(("compute", side, threading.current_thread().name))

    def transition(self, name, side, call, ret):
        with self.lock:
            self.events.append((name, side, threading.current_thread().name))


def marked():
    x = ep_overlap.dispatch_begin(torch.ones(2))
    ep_overlap.dispatch_end(x)


class ObserverTest(TestCase):
    def test_observer_gets_computes_and_transitions(self):
        recorder = Recorder()
        with ep_overlap.observe_actions(recorder):
            _run_overlapped(marked, marked, global_rank=0, action="a", timeout=30.0)
        main = threading.current_thread().name
        kinds = {(name, side) for name, side, _ in recorder.events}
        for side in ("forward", "backward"):
            for name in ("start", "open", "close", "finish", "compute"):
                self.assertIn((name, side), kinds)
        threads = {
            side: {t for _, s, t in recorder.events if s == side}
            for side in ("forward", "backward")
        }
        self.assertEqual(threads["forward"], {main})
        self.assertNotIn(main, threads["backward"])

    def test_observe_actions_nests_and_checks_its_argument(self):
        outer, inner = Recorder(), Recorder()
        with ep_overlap.observe_actions(outer):
            with ep_overlap.observe_actions(inner):
                _run_overlapped(marked, marked, global_rank=0, action="a", timeout=30.0)
            self.assertEqual(outer.events, [])
        self.assertGreater(len(inner.events), 0)
        with self.assertRaises(TypeError):
            with ep_overlap.observe_actions(object()):
                pass


if __name__ == "__main__":
    run_tests()
