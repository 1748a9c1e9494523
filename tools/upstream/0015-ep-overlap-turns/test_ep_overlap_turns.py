# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Turn-taking of the two threads of an overlapped action at the ``ep_overlap`` marks.

Two threads, each bound to one side of a ``_CommCoordinator``
(``_ep_marks.bound``), pass the public marks: their communication regions
alternate, the backward side's first, never overlap, and a side that is done
gives up its turns; a region met inside a region nests.  A wait that cannot
end raises ``CommWaitTimeoutError`` naming rank, action and boundary; a
stopped coordinator releases a waiting side.  No test sleeps: threads are
ordered by the coordinator, and a wait that must not happen shows as its
timeout error.
"""

import threading

import torch
from torch.distributed.pipelining import _ep_marks, ep_overlap
from torch.distributed.pipelining._ep_turns import _CommCoordinator, _Side, _TurnState
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


TIMEOUT = 30.0  # of the runs that must not time out


def side_body(coordinator, side, n_regions, log, lock):
    """Pass ``n_regions`` dispatch regions through the public marks."""
    x = torch.ones(2)
    with _ep_marks.bound(coordinator, side):
        for i in range(n_regions):
            x = ep_overlap.dispatch_begin(x)
            other, _ = coordinator.state_of(side.other)
            with lock:
                log.append((side, i, other))
            x = ep_overlap.dispatch_end(x)


def run_two_sides(n_forward, n_backward):
    coordinator = _CommCoordinator(rank=0, action="0F1;1B0", timeout=TIMEOUT)
    log, lock, errors = [], threading.Lock(), []

    def run(side, n):
        try:
            side_body(coordinator, side, n, log, lock)
        except Exception as e:
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(_Side.FORWARD, n_forward)),
        threading.Thread(target=run, args=(_Side.BACKWARD, n_backward)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return log


class TurnsTest(TestCase):
    @parametrize("n_forward,n_backward", [(2, 2), (3, 1), (0, 2), (2, 0)])
    def test_regions_alternate_backward_first(self, n_forward, n_backward):
        log = run_two_sides(n_forward, n_backward)
        order = [(side, i) for side, i, _ in log]
        expected = []
        for i in range(max(n_forward, n_backward)):
            expected += [(_Side.BACKWARD, i)] if i < n_backward else []
            expected += [(_Side.FORWARD, i)] if i < n_forward else []
        self.assertEqual(order, expected)
        self.assertNotIn(_TurnState.COMMUNICATING, [other for *_, other in log])

    def test_nested_region_does_not_wait(self):
        coordinator = _CommCoordinator(rank=0, action="a", timeout=1.0)
        coordinator.finish(_Side.BACKWARD)  # the forward side runs alone
        with _ep_marks.bound(coordinator, _Side.FORWARD):
            x = ep_overlap.dispatch_begin(torch.ones(1))
            x = ep_overlap.combine_end(ep_overlap.combine_begin(x))  # nested
            ep_overlap.dispatch_end(x)
        self.assertEqual(coordinator.regions_opened(_Side.FORWARD), 1)

    def test_a_region_excludes_the_other_side(self):
        coordinator = _CommCoordinator(rank=3, action="0F0;1B0", timeout=0.05)
        coordinator.open(_Side.BACKWARD, "combine_end (backward)", "combine")
        with self.assertRaisesRegex(
            ep_overlap.CommWaitTimeoutError,
            "rank 3, action 0F0;1B0: the forward thread waited more than 0.05 s at "
            "dispatch_begin .* inside its communication region",
        ):
            coordinator.open(_Side.FORWARD, "dispatch_begin (forward)", "dispatch")

    def test_stop_releases_a_waiting_side(self):
        coordinator = _CommCoordinator(rank=0, action="a", timeout=TIMEOUT)
        coordinator.open(_Side.BACKWARD, "b", "combine")
        waiting = threading.Event()
        original = coordinator._wait_for

        def noting_wait_for(*args):
            waiting.set()
            return original(*args)

        coordinator._wait_for = noting_wait_for
        opened = []
        forward = threading.Thread(
            target=lambda: opened.append(coordinator.open(_Side.FORWARD, "f", "x"))
        )
        forward.start()
        self.assertTrue(waiting.wait(TIMEOUT))
        coordinator.stop()  # a side failed: the other is released
        forward.join(TIMEOUT)
        self.assertFalse(forward.is_alive())
        self.assertEqual(coordinator.regions_opened(_Side.FORWARD), 0)


instantiate_parametrized_tests(TurnsTest)


if __name__ == "__main__":
    run_tests()
