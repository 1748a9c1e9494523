# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""``ep_overlap``'s communication marks outside an overlapped action.

A mark passes its tensors through unchanged (values, gradients) with one
autograd node; ``wrap_dispatch_combine`` puts the marks around existing
methods of instances only.  ScheduleDualPipeV over marked blocks, with the
built-in OVERLAP_F_B and with ``ep_overlap.overlap_f_b`` registered, gives
bitwise equal results, equal to a single-process reference.
"""

import copy

from overlap_test_utils import MarkedBlock, run_dual_pipe_v
from pipeline_test_utils import nccl_variant, PipelineTestCase

import torch
import torch.nn as nn
from torch.distributed.pipelining import ep_overlap
from torch.testing._internal.common_utils import run_tests, TestCase


class MarksTest(TestCase):
    def test_marks_pass_tensors_and_gradients_through(self):
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(3, 4)
        for begin, end in (
            (ep_overlap.dispatch_begin, ep_overlap.dispatch_end),
            (ep_overlap.combine_begin, ep_overlap.combine_end),
        ):
            y, flag = begin(x * 2, "not a tensor")
            self.assertEqual(flag, "not a tensor")
            z = end(y)
            self.assertIsNotNone(z.grad_fn)
            torch.testing.assert_close(z, x * 2, rtol=0, atol=0)
            (z * w).sum().backward()
            torch.testing.assert_close(x.grad, 2 * w, rtol=0, atol=0)
            x.grad = None
        with torch.no_grad():
            self.assertIs(ep_overlap.dispatch_begin(x), x)

    def test_wrap_dispatch_combine(self):
        class Dispatcher:
            def dispatch(self, x):
                return x + 1

            def combine(self, x):
                return x * 2

        class MoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.dispatcher = Dispatcher()

            def forward(self, x):
                return self.dispatcher.combine(self.dispatcher.dispatch(x))

        model = nn.Sequential(MoE(), MoE())
        self.assertEqual(
            ep_overlap.wrap_dispatch_combine(model), ["0.dispatcher", "1.dispatcher"]
        )
        ep_overlap.wrap_dispatch_combine(model)  # twice changes nothing
        x = torch.randn(2, 3, requires_grad=True)
        torch.testing.assert_close(model(x), ((x + 1) * 2 + 1) * 2)
        self.assertFalse(hasattr(Dispatcher.dispatch, "__wrapped__"))  # the class
        clone = copy.deepcopy(model[0])
        self.assertIs(clone.dispatcher.dispatch.fn.__self__, clone.dispatcher)
        with self.assertRaisesRegex(ValueError, "has both"):
            ep_overlap.wrap_dispatch_combine(nn.Linear(2, 2))


class EPOverlapMarksScheduleTest(PipelineTestCase):
    def test_marked_model_under_dual_pipe_v(self):
        builtin = run_dual_pipe_v(self, overlap=False, make_stage=MarkedBlock)
        registered = run_dual_pipe_v(self, overlap=True, make_stage=MarkedBlock)
        torch.testing.assert_close(registered, builtin, rtol=0, atol=0)


EPOverlapMarksScheduleTestNCCL = nccl_variant(EPOverlapMarksScheduleTest)


if __name__ == "__main__":
    run_tests()
