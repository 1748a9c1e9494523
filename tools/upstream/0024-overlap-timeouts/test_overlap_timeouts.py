# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""How long a side of a concurrent OVERLAP_F_B waits for the other, and what it says.

``$TORCH_PIPELINING_OVERLAP_TIMEOUT`` and ``ep_overlap.set_wait_timeout``
set the timeout of the actions started afterwards (``inf``: no limit); bad
values are refused.  A timed-out wait says how to raise the limit, and an
action's failure names the root cause of the exception on its first line.
"""

import math
import os
from unittest import mock

from torch.distributed.pipelining import ep_overlap
from torch.distributed.pipelining._ep_turns import _CommCoordinator, _Side
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.testing._internal.common_utils import run_tests, TestCase


ENV = "TORCH_PIPELINING_OVERLAP_TIMEOUT"


def run_pair(forward=lambda: None, backward=lambda: None, **kwargs):
    return _run_overlapped(forward, backward, global_rank=0, action="a", **kwargs)


class TimeoutTest(TestCase):
    def test_environment_variable(self):
        with mock.patch.dict(os.environ, {ENV: "0.25"}):
            self.assertEqual(run_pair().timeout, 0.25)
        with mock.patch.dict(os.environ, {ENV: "inf"}):
            self.assertEqual(run_pair().timeout, math.inf)

    def test_timeout_error_says_how_to_raise_the_limit(self):
        coordinator = _CommCoordinator(rank=0, action="a", timeout=0.05)
        coordinator.open(_Side.BACKWARD, "combine_end (backward)", "combine")
        with self.assertRaisesRegex(
            ep_overlap.CommWaitTimeoutError, f"set_wait_timeout\\(\\) or \\${ENV}"
        ):
            coordinator.open(_Side.FORWARD, "dispatch_begin (forward)", "dispatch")

    def test_failure_names_the_root_cause(self):
        def backward():
            try:
                raise KeyError("expert 3")
            except KeyError as e:
                raise RuntimeError("in the combine") from e

        with self.assertRaisesRegex(
            RuntimeError,
            "the backward sub-action backward failed: KeyError: 'expert 3' "
            "\\(raised as RuntimeError: in the combine\\)",
        ):
            run_pair(backward=backward, timeout=30.0)

    def test_set_wait_timeout(self):
        try:
            ep_overlap.set_wait_timeout(2.5)
            with mock.patch.dict(os.environ, {ENV: "7"}):
                self.assertEqual(ep_overlap.get_wait_timeout(), 2.5)
                ep_overlap.set_wait_timeout(None)
                self.assertEqual(ep_overlap.get_wait_timeout(), 7.0)
            for bad in (0, -1.0, float("nan")):
                with self.assertRaises(ValueError):
                    ep_overlap.set_wait_timeout(bad)
            for bad in (True, "5"):
                with self.assertRaises(TypeError):
                    ep_overlap.set_wait_timeout(bad)
            with mock.patch.dict(os.environ, {ENV: "soon"}):
                with self.assertRaisesRegex(ValueError, "not a number of seconds"):
                    ep_overlap.get_wait_timeout()
        finally:
            ep_overlap.set_wait_timeout(None)


if __name__ == "__main__":
    run_tests()
