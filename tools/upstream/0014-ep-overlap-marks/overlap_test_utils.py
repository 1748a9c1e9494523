# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""A marked MoE-shaped block and ScheduleDualPipeV runs over it, for the overlap tests.

:class:`MarkedBlock` puts the ``ep_overlap`` marks around two stand-ins for
an expert-parallel all-to-all (identities that call :data:`COMM_HOOKS` on the
thread that "communicates", in forward and backward).  :func:`run_dual_pipe_v`
runs one step of ScheduleDualPipeV over such blocks, with the built-in
OVERLAP_F_B or ``ep_overlap.overlap_f_b``, and checks every gradient against
a single-process reference.
"""

import threading
from collections.abc import Callable

import pipeline_test_utils as ptu

import torch
import torch.nn as nn
from torch.distributed.pipelining import ep_overlap, ScheduleDualPipeV
from torch.distributed.pipelining.schedules import OVERLAP_F_B


# Called with the region's tag ("dispatch", "combine", "... backward") on the
# thread that communicates.
COMM_HOOKS: list[Callable[[str], None]] = []


class _Communicate(torch.autograd.Function):
    """Identity standing for an all-to-all: calls the hooks in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tag: str) -> torch.Tensor:
        ctx.tag = tag
        for hook in COMM_HOOKS:
            hook(tag)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for hook in COMM_HOOKS:
            hook(f"{ctx.tag} backward")
        return grad.clone(), None


class MarkedBlock(nn.Module):
    """Linear layers around a dispatch and a combine, each between its marks."""

    def __init__(self, dim: int = ptu.DIM, dropout: float = 0.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, dim)
        self.w2 = nn.Linear(dim, dim)
        self.w3 = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ep_overlap.dispatch_begin(torch.relu(self.w1(x)))
        h = ep_overlap.dispatch_end(_Communicate.apply(h, "dispatch"))
        h = torch.tanh(self.w2(h))
        h = nn.functional.dropout(h, self.dropout, training=self.dropout > 0)
        h = ep_overlap.combine_begin(h)
        h = ep_overlap.combine_end(_Communicate.apply(h, "combine"))
        return self.w3(h)


class ThreadLog:
    """The threads that ran backward communication, recorded by a comm hook.

    Keeps the thread objects, not their idents, which a new thread may reuse.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.backward_threads: set[threading.Thread] = set()

    def __call__(self, tag: str) -> None:
        if tag.endswith("backward"):
            with self.lock:
                self.backward_threads.add(threading.current_thread())


def run_dual_pipe_v(
    test,
    overlap: bool,
    make_stage: Callable[[], nn.Module] = MarkedBlock,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    group=None,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    seed: int = 1,
    check_reference: bool = True,
    prepare: Callable | None = None,
):
    """One ScheduleDualPipeV step; returns (output, losses, gradients) of this rank.

    With ``overlap`` the schedule runs ``ep_overlap.overlap_f_b``.  Every
    gradient is checked against the single-process reference (unless the
    stages draw random numbers, which the reference draws in another order).
    ``prepare(schedule)`` runs before the step.
    """
    pp_rank = test.rank if pp_rank is None else pp_rank
    pp_size = test.world_size if pp_size is None else pp_size
    indices = ptu.stage_indices(ScheduleDualPipeV, pp_rank, pp_size)
    ref, modules, stages = ptu.build_pipeline(
        indices, 2 * pp_size, test.device, group, make_stage, wrap
    )
    schedule = ScheduleDualPipeV(stages, ptu.N_MICROBATCHES, loss_fn=ptu.loss_fn)
    if overlap:
        schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)
    if prepare is not None:
        prepare(schedule)
    x, y = ptu.random_batch(test.device, seed)
    losses: list[torch.Tensor] = []
    out = schedule.step(x, target=y, losses=losses)
    grads = ptu.full_grads(modules)
    if check_reference:
        ptu.reference_step(ref, x, y)
        test.assert_on_all_ranks(
            lambda: ptu.assert_grads_match(modules, indices, ref, grads)
        )
    return out, losses, grads
