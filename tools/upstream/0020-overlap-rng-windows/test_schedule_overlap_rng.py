# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""Random numbers in a concurrent OVERLAP_F_B are those of the sequential handler.

Dropout, router-style noise, random permutations and multinomial draws on
both sides of an overlapped action, with no, full, selective, nested and
reentrant activation checkpointing (whose recomputation replays the random
numbers of the original forward inside ``torch.random.fork_rng``): the
forward's output, every gradient and the generator state afterwards are
bitwise those of running the forward, then the backward, on one thread.
The two threads' interleaving is varied by random sleeps that stand for the
duration of compute and communication; no test orders threads by sleeping or
asserts on time.  ScheduleDualPipeV over checkpointed blocks with dropout
gives bitwise the built-in OVERLAP_F_B's results.
"""

import random
import threading
import time

from overlap_test_utils import MarkedBlock, run_dual_pipe_v
from pipeline_test_utils import DIM, nccl_variant, PipelineTestCase

import torch
import torch.nn as nn
from torch.distributed.pipelining import ep_overlap
from torch.distributed.pipelining._overlap import _run_overlapped
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.utils.checkpoint import (
    checkpoint,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)


TIMEOUT = 30.0


class FakeComm:
    """Stands for an all-to-all: takes a random time, flags two at once."""

    def __init__(self, jitter: float) -> None:
        self.jitter, self.lock, self.active, self.violations = (
            jitter,
            threading.Lock(),
            0,
            0,
        )

    def __call__(self) -> None:
        with self.lock:
            self.active += 1
            self.violations += self.active > 1
        time.sleep(random.uniform(0, self.jitter))
        with self.lock:
            self.active -= 1


class _Comm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        comm()
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.comm()
        return grad.clone(), None


class RandomLayer(nn.Module):
    """Draws in every way an MoE layer draws, around a marked communication."""

    def __init__(self, comm: FakeComm) -> None:
        super().__init__()
        self.pre, self.post, self.comm = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), comm

    @staticmethod
    def _draw(h):
        h = nn.functional.dropout(h, p=0.3, training=True)
        h = h + 0.01 * torch.rand_like(h) + 0.01 * torch.randn_like(h)
        h = h[torch.randperm(h.shape[0])]
        probs = torch.softmax(h.detach(), dim=-1)
        return h * torch.multinomial(probs, 1).to(h.dtype)

    def forward(self, x):
        h = self._draw(torch.tanh(self.pre(x)))
        h = ep_overlap.dispatch_begin(h)
        h = ep_overlap.dispatch_end(_Comm.apply(h, self.comm))
        h = self._draw(torch.tanh(self.post(h)))
        return x + h


def _selective():
    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.addmm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class RandomStage(nn.Module):
    def __init__(self, comm: FakeComm, ac: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RandomLayer(comm) for _ in range(2))
        self.ac = ac

    def _layers(self, x, ac):
        for layer in self.layers:
            if ac in ("full", "selective", "reentrant"):
                x = checkpoint(
                    layer,
                    x,
                    use_reentrant=ac == "reentrant",
                    **({"context_fn": _selective} if ac == "selective" else {}),
                )
            elif ac == "no_rng":
                x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x)
        return x

    def forward(self, x):
        if self.ac == "nested":
            return checkpoint(self._layers, x, "full", use_reentrant=False)
        return self._layers(x, self.ac)


class PairRun:
    """A forward stage, and a backward stage whose forward already ran."""

    def __init__(self, ac: str, jitter: float = 0.0) -> None:
        torch.manual_seed(0)
        self.comm = FakeComm(jitter)
        self.fwd_stage, self.bwd_stage = (
            RandomStage(self.comm, ac),
            RandomStage(self.comm, ac),
        )
        self.x_fwd = torch.randn(4, DIM, requires_grad=True)
        self.x_bwd = torch.randn(4, DIM, requires_grad=True)
        self.loss = self.bwd_stage(self.x_bwd).square().sum()
        self.out = None
        torch.manual_seed(1)  # the state the pair starts from

    def forward(self):
        self.out = self.fwd_stage(self.x_fwd)

    def backward(self):
        self.loss.backward()

    def overlapped(self):
        _run_overlapped(
            self.forward,
            self.backward,
            global_rank=0,
            action="0F0;1B0",
            timeout=TIMEOUT,
        )
        return self

    def sequential(self):
        self.forward()
        self.backward()
        return self


class RandomNumbersTest(TestCase):
    def assert_same(self, run, ref):
        torch.testing.assert_close(run.out, ref.out, rtol=0, atol=0)
        for p, q in zip(run.bwd_stage.parameters(), ref.bwd_stage.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        torch.testing.assert_close(run.x_bwd.grad, ref.x_bwd.grad, rtol=0, atol=0)

    @parametrize("ac", ["", "full", "selective", "nested", "reentrant"])
    def test_random_ops_match_sequential(self, ac):
        for seed in range(8):
            random.seed(seed)  # the timing jitter
            run = PairRun(ac, jitter=0.002).overlapped()
            state = torch.get_rng_state()
            ref = PairRun(ac).sequential()
            self.assertEqual(run.comm.violations, 0)
            self.assert_same(run, ref)
            # the generator goes on from where the sequential handler leaves it
            torch.testing.assert_close(state, torch.get_rng_state(), rtol=0, atol=0)

    def test_recomputation_without_rng_preservation_that_draws_raises(self):
        with self.assertRaisesRegex(RuntimeError, "preserve_rng_state"):
            PairRun("no_rng").overlapped()

    def test_fork_rng_elsewhere_is_the_original(self):
        torch.manual_seed(3)
        with torch.random.fork_rng():
            torch.rand(3)
        expected = torch.manual_seed(3) and torch.rand(3)
        torch.manual_seed(3)
        torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


instantiate_parametrized_tests(RandomNumbersTest)


class CheckpointedDropoutBlock(MarkedBlock):
    def __init__(self) -> None:
        super().__init__(dropout=0.3)

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


class ScheduleOverlapRNGTest(PipelineTestCase):
    def test_dropout_and_recomputation_match_sequential(self):
        kwargs = {"make_stage": CheckpointedDropoutBlock, "check_reference": False}
        sequential = run_dual_pipe_v(self, overlap=False, **kwargs)
        overlapped = run_dual_pipe_v(self, overlap=True, **kwargs)
        torch.testing.assert_close(overlapped, sequential, rtol=0, atol=0)


ScheduleOverlapRNGTestNCCL = nccl_variant(ScheduleOverlapRNGTest)


if __name__ == "__main__":
    run_tests()
