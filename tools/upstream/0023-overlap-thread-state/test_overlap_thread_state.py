# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""The backward thread of a concurrent OVERLAP_F_B runs under the caller's state.

A copy of the caller's ``contextvars`` context, its autocast state and
intra-op thread count, and what ``ep_overlap.register_thread_state``
registered (thread-local state of other libraries) are in effect on the
worker thread while the backward sub-action runs.
"""

import contextlib
import contextvars
import threading

import torch
from torch.distributed.pipelining import ep_overlap
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.testing._internal.common_utils import run_tests, TestCase


REQUEST = contextvars.ContextVar("request", default=None)


def run_pair(backward):
    _run_overlapped(lambda: None, backward, global_rank=0, action="a", timeout=30.0)


class ThreadStateTest(TestCase):
    def test_contextvars_autocast_and_threads(self):
        seen = {}

        def backward():
            seen["request"] = REQUEST.get()
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            seen["dtype"] = torch.get_autocast_dtype("cpu")
            seen["threads"] = torch.get_num_threads()
            seen["thread"] = threading.current_thread()

        token = REQUEST.set("step 7")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run_pair(backward)
        finally:
            REQUEST.reset(token)
            torch.set_num_threads(threads)
        self.assertIsNot(seen["thread"], threading.current_thread())
        self.assertEqual(seen["request"], "step 7")
        self.assertTrue(seen["autocast"])
        self.assertEqual(seen["dtype"], torch.bfloat16)
        self.assertEqual(seen["threads"], 1)

    def test_registered_thread_state(self):
        local = threading.local()
        local.mesh = "pp mesh"

        @contextlib.contextmanager
        def use_mesh(mesh):
            local.mesh = mesh
            try:
                yield
            finally:
                del local.mesh

        seen = {}
        handle = ep_overlap.register_thread_state(lambda: local.mesh, use_mesh)
        try:
            run_pair(lambda: seen.setdefault("mesh", getattr(local, "mesh", None)))
        finally:
            handle.remove()
        self.assertEqual(seen["mesh"], "pp mesh")
        seen.clear()
        run_pair(lambda: seen.setdefault("mesh", getattr(local, "mesh", None)))
        self.assertIsNone(seen["mesh"])


if __name__ == "__main__":
    run_tests()
