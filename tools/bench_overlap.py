"""Benchmark: concurrent OVERLAP_F_B (torch_pipelining_ext) vs the sequential one, side by side.

    python tools/bench_overlap.py                 # both parts, a few minutes on 2 CPU cores
    python tools/bench_overlap.py --rounds 12 --latency-ms 5 --no-ep
    python tools/bench_overlap.py --no-ep --pp 1  # one rank: both stages of the V on it
    python tools/bench_overlap.py --no-ep --switch-interval 5e-4  # GIL switch interval of the ranks

Part 1 -- simulated communication latency (the headline numbers).  PP=2 on two
gloo ranks (``--pp 1``: one rank), ``ScheduleDualPipeV``, each of the
``2 * pp`` stages ``--layers`` MoE-like layers: an attention-like block, a
dispatch region, an expert block, a combine region.  Inside each region
(between the ``overlap`` marks) an op sleeps L ms in forward and in
backward, releasing the GIL -- a stand-in for the interconnect.  L defaults to
one forward block's compute time, measured at start-up.  Round by round, in
rotating order so that machine drift hits every mode alike, one step of each
mode:

* ``sequential`` / ``overlap``: the sequential and the concurrent OVERLAP_F_B
  handler, latency L;
* ``sequential L=0`` / ``overlap L=0``: marks, no latency (T_0 is the first);
* ``sequential dense`` / ``overlap dense``: no marks and no regions at all
  (on CPU the overlap handler runs each stage pair concurrently once per step,
  then sequentially: nothing to hide);
* ``sequential dense again``: the same as ``sequential dense``, measured once
  more each round.  Two identical modes differ only by noise, so their ratio
  (``repeat_no_marks``) is the noise floor of every step-time ratio here.

It reports step-time medians (slowest rank) and the time spent inside
OVERLAP_F_B actions (summed over ranks): warm-up and cool-down forward and
backward actions of DualPipeV are not OVERLAP_F_B actions and cannot hide
anything.  The fraction of communication hidden inside the actions is
``(T_seq - T_overlap) / (T_seq - T_0)``.

Where the time goes (see [Note: lock-step ideal] and [Note: hand-over
latency]): per mode, the *ideal* time of the OVERLAP_F_B actions -- the
bookkeeping of the sequential run plus a zero-cost lock-step of the two
sub-actions' measured compute and communication segments under the
coordinator's policy -- and ``efficiency = ideal / achieved``; the hand-over
latency of the overlapped runs (median and p90); the waits at the start and
the end of an action; and a CPU probe: a fixed busy loop timed on every rank
before and after every round, against the best time seen (the launching
process alone, or any probe; 1.0: a whole core each; 0.5: half a core), so
that a run on a starved machine shows.  ``--no-breakdown`` measures without the timestamps.

Part 2 -- real expert parallelism (skip with ``--no-ep``).  PP=2 x EP=2 on four
gloo ranks with the tests' DeepSeek-style MoE transformer (real
``all_to_all_single`` dispatch and combine), sequential vs overlapped step
time, the overlap both with one communicator per EP group (the strict rule:
the two sides' all-to-alls take turns) and with a twin per EP group
(``overlap.create_twin_group``: each side its own communicator, the free
rule).  On a 2-core machine four ranks already oversubscribe the cores, so
there is little idle time for the overlap to fill; the ratios are reported as
measured.

Part 3 -- what coordinating every collective costs outside overlapped
actions (``--collectives-only``: this part alone): one rank, a 4-element gloo
``all_reduce`` timed without the coordination kernels, with them where a
schedule installs them
(at the key only the threads of an action include, see [Note: where the
coordination kernels sit]) and at c10d's BackendSelect key (where they sat
before: every collective of the process reaches them), interleaved rounds in
rotating order, 100 collectives a round after 20 not timed, the garbage collector
off while timing; beside it what a thread running a side pays instead: entering
and leaving the key, once per side, and the key's fallback on every operator
(a 4-element ``torch.add`` with and without the key).  Medians with the
rounds' quartiles, as this machine gives them.

The last line is machine-readable::

    hidden_fraction=... hidden_fraction_e2e=... efficiency=... handover_us=... overhead_no_marks=...
    overhead_marks_L0=... handover_p90_us=... cpu_probe=... hidden_fraction_paired=... ep_step_ratio=...
    ep_step_ratio_twin=... repeat_no_marks=... collective_us=... collective_us_p25=...
    collective_us_p75=... collective_us_backend_select=... action_key_us=... op_in_action_us=...

(one line; ratios are overlapped / sequential; ``efficiency`` is the ideal /
achieved time inside the OVERLAP_F_B actions of the ``overlap`` mode;
``handover_us`` the median hand-over latency; ``cpu_probe`` the median of the
probes; ``ep_step_ratio`` / ``ep_step_ratio_twin`` are ``nan`` with --no-ep;
``collective_us`` the added microseconds per collective of part 3 (the
difference of the modes' medians over the rounds; ``_p25`` / ``_p75`` the
same of their quartiles), ``_backend_select`` the same
with the kernels at BackendSelect; ``action_key_us`` entering and leaving
the key, ``op_in_action_us`` what it adds to an operator; with
``--collectives-only`` these fields alone).  Every
mode computes the same losses (weights are not updated); the script checks
that they are bitwise equal across modes.  The stand-in regions of part 1
issue no collective, so they take no turns: part 1 times the free rule (each
side its own communicator); part 2 times both rules with real all-to-alls.

The timestamps of the overlapped actions come from
``overlap.observe_actions`` (the sub-actions' computes and the
turn-taking's transitions ``start``, ``open``, ``close``, ``finish``); the
sequential handler's from this script's own OVERLAP_F_B function, which runs
each sub-action as ``runtime.sequential_overlap_f_b`` does
(``runtime.prepare_compute_action``, then the compute) and times the compute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_pipelining_ext import launcher, overlap
from torch_pipelining_ext.runtime import prepare_compute_action, sequential_overlap_f_b


# --------------------------------------------------------------------------- #
# CPU probe                                                                    #
# --------------------------------------------------------------------------- #

_PROBE_ITERS = 40_000  # about 2 ms of pure Python on a free core


def _busy_loop(n: int = _PROBE_ITERS) -> float:
    """Seconds a fixed pure-Python loop takes (holds the GIL and one core)."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - t0


def calibrate_probe(repeats: int = 30, gap_s: float = 2e-3) -> float:
    """The best time of :func:`_busy_loop` in this process, spread over a while: the probe's first baseline."""
    best = math.inf
    for _ in range(repeats):
        best = min(best, _busy_loop())
        time.sleep(gap_s)
    return best


# --------------------------------------------------------------------------- #
# Timestamps of the OVERLAP_F_B actions                                        #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _ActionTrace:
    """perf_counter timestamps of one OVERLAP_F_B action on one rank."""

    start: float
    end: float = math.nan
    # (kind "F" or "B", thread id, compute start, compute end): the sub-actions' closures
    subs: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)
    # (thread id, start, end): the simulated communication inside the regions
    regions: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    # (method, thread id, call, return): the coordinator's transitions
    coord: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)


class _Tracer(overlap.ActionObserver):
    """Records :class:`_ActionTrace` s while an OVERLAP_F_B handler runs (this process only).

    Under ``overlap.observe_actions`` for the overlapped handler; the
    sequential handler (:func:`timed_sequential_overlap_f_b`) reports its
    computes to :meth:`sub_action` itself.
    """

    COORDINATOR_METHODS = ("open", "close", "start", "finish")

    def __init__(self) -> None:
        self.current: _ActionTrace | None = None
        self.actions: list[_ActionTrace] = []
        self.coordinator_hooks: list[str] = list(self.COORDINATOR_METHODS)

    def sub_action(self, side: str, start: float, end: float) -> None:
        trace = self.current
        if trace is not None:
            trace.subs.append(
                ("F" if side == "forward" else "B", threading.get_ident(), start, end)
            )

    def transition(self, name: str, side: str, call: float, ret: float) -> None:
        trace = self.current
        if trace is not None:
            trace.coord.append((name, threading.get_ident(), call, ret))

    def region(self, t0: float, t1: float) -> None:
        trace = self.current
        if trace is not None:
            trace.regions.append((threading.get_ident(), t0, t1))

    def take(self) -> list[_ActionTrace]:
        actions, self.actions = self.actions, []
        return actions


def timed_sequential_overlap_f_b(action: Any, ctx: Any) -> None:
    """``runtime.sequential_overlap_f_b`` that reports each sub-action's compute to the tracer."""
    from torch.distributed.pipelining.schedules import FORWARD

    tracer = _TRACER
    if tracer is None:
        sequential_overlap_f_b(action, ctx)
        return
    for sub in action.sub_actions:
        compute = prepare_compute_action(sub, ctx)
        start = time.perf_counter()
        try:
            compute()
        finally:
            tracer.sub_action(
                "forward" if sub.computation_type == FORWARD else "backward",
                start,
                time.perf_counter(),
            )


_TRACER: _Tracer | None = None  # per process, when the breakdown is on


# [Note: lock-step ideal]
# A sub-action is a sequence of segments, compute and communication
# alternating: c0, r1, c1, ..., rn, cn.  The ideal lock-step of the two
# sub-actions of an action runs them on one processor (a compute segment of one
# side never overlaps one of the other side: on a rank with one core, or one
# GIL, that is the best there is) with zero-cost hand-overs, under the
# coordinator's policy: regions strictly alternate, the backward side's first,
# and a side that has finished gives up its turns; a side computes as soon as
# its previous segment is over and the processor is free (the one that was
# ready first gets it; the backward side on a tie, as at the start of an
# action).  Regions only wait for their turn and for each other.


def lockstep_time(backward: Sequence[float], forward: Sequence[float]) -> float:
    """Duration of the ideal lock-step of two segment sequences (see [Note: lock-step ideal])."""
    segs = (list(forward), list(backward))  # indexed by side: 0 forward, 1 backward
    n = (len(segs[0]), len(segs[1]))
    pos, ready = [0, 0], [0.0, 0.0]
    processor_free = comm_free = 0.0
    turn = 1
    while pos[0] < n[0] or pos[1] < n[1]:
        best: tuple[float, int] | None = None
        for side in (1, 0):
            if pos[side] >= n[side]:
                continue
            if pos[side] % 2 == 0:  # compute
                start = max(ready[side], processor_free)
            else:  # communication
                if turn != side and pos[1 - side] < n[1 - side]:
                    continue
                start = max(ready[side], comm_free)
            if best is None or start < best[0]:
                best = (start, side)
        assert best is not None
        start, side = best
        end = start + segs[side][pos[side]]
        if pos[side] % 2:
            comm_free, turn = end, 1 - side
        else:
            processor_free = end
        ready[side] = end
        pos[side] += 1
    return max(ready)


def _blocked(
    coord: list[tuple[str, int, float, float]], thread: int, t0: float, t1: float
) -> float:
    """Time ``thread`` spent inside coordinator calls that lie within [t0, t1]."""
    return sum(r - c for _, th, c, r in coord if th == thread and t0 <= c and r <= t1)


def _segments(
    trace: _ActionTrace, kind: str
) -> tuple[list[float], float, float] | None:
    """(segments, span start, span end) of sub-action ``kind``, coordinator time removed."""
    subs = [s for s in trace.subs if s[0] == kind]
    if len(subs) != 1:
        return None
    _, thread, s0, s1 = subs[0]
    regions = sorted(
        (a, b) for th, a, b in trace.regions if th == thread and s0 <= a and b <= s1
    )
    segs, t = [], s0
    for a, b in regions:
        segs += [a - t - _blocked(trace.coord, thread, t, a), b - a]
        t = b
    segs.append(s1 - t - _blocked(trace.coord, thread, t, s1))
    return segs, s0, s1


# [Note: hand-over latency]
# A thread that waits in the coordinator (open: for its turn; close: for the
# other side to start communicating; start: for the backward side's first
# region) is released by a transition of the other thread: the other side
# opened a region (open returned), closed one (close called) or finished
# (finish called).  The hand-over latency is the time from the last such
# transition of the other thread inside the wait to the waiting thread running
# again (its call returned).  Calls in which no transition of the other thread
# happened did not wait for it and are not hand-overs.

_RELEASES = {
    "open": 3,
    "close": 2,
    "finish": 2,
}  # which timestamp of the other thread's call releases


def _handovers(trace: _ActionTrace) -> tuple[list[float], list[float], int]:
    """(hand-over latencies, durations of the coordinator calls that did not wait for the other thread,
    closes that waited for an open the other thread was already blocked in when the close began)."""
    handovers, costs, relay = [], [], 0
    for name, thread, call, ret in trace.coord:
        releases = [
            ev
            for ev in trace.coord
            if ev[1] != thread
            and ev[0] in _RELEASES
            and call <= ev[_RELEASES[ev[0]]] <= ret
        ]
        if releases and name in ("open", "close", "start"):
            last = max(releases, key=lambda ev: ev[_RELEASES[ev[0]]])
            handovers.append(ret - last[_RELEASES[last[0]]])
            # the other thread was already waiting for this turn: two wake-ups in a row, the second
            # only to let this thread compute on
            relay += name == "close" and last[0] == "open" and last[2] < call
        elif name in ("open", "close"):
            costs.append(ret - call)
    return handovers, costs, relay


def summarize_action(trace: _ActionTrace) -> dict[str, Any] | None:
    """What the driver needs of one action: times in seconds, segment lists, hand-overs."""
    f, b = _segments(trace, "F"), _segments(trace, "B")
    if f is None or b is None:
        return None
    f_segs, f0, f1 = f
    b_segs, b0, b1 = b
    f_thread = next(s[1] for s in trace.subs if s[0] == "F")
    b_thread = next(s[1] for s in trace.subs if s[0] == "B")
    starts = {th: c for name, th, c, _ in trace.coord if name == "start"}
    handovers, costs, relay = _handovers(trace)
    return {
        "total": trace.end - trace.start,
        "spans": (f1 - f0)
        + (b1 - b0),  # both sub-actions' compute closures, as if back to back
        "f_segs": f_segs,
        "b_segs": b_segs,
        # the worker thread running after the calling thread handed it the backward
        "worker_wake": starts[b_thread] - starts[f_thread]
        if f_thread in starts and b_thread in starts
        else math.nan,
        # the calling thread running again after the backward, when it finished last
        "join_wake": trace.end - b1 if b1 > f1 else 0.0,
        "handovers": handovers,
        "relay_closes": relay,
        "coord_costs": costs,
    }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# --------------------------------------------------------------------------- #
# Part 1: MoE-like layers with simulated communication                         #
# --------------------------------------------------------------------------- #

# Per process, set by the mode being measured.
_LATENCY_S = 0.0
_MARKS = True


class SimulatedComm(torch.autograd.Function):
    """Sleeps ``_LATENCY_S`` in forward and in backward (the GIL is released)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _simulated_latency()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _simulated_latency()
        return grad


def _simulated_latency() -> None:
    t0 = time.perf_counter()
    if _LATENCY_S:
        time.sleep(_LATENCY_S)
    if _TRACER is not None:
        _TRACER.region(t0, time.perf_counter())


def _comm(
    x: torch.Tensor, begin: Callable[..., Any], end: Callable[..., Any]
) -> torch.Tensor:
    if not _MARKS:
        return x
    return end(SimulatedComm.apply(begin(x)))


class MoELikeLayer(nn.Module):
    """Attention-like block, dispatch, expert block, combine (blocks of equal cost)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_in = nn.Linear(dim, dim)
        self.attn_out = nn.Linear(dim, dim)
        self.expert_in = nn.Linear(dim, dim)
        self.expert_out = nn.Linear(dim, dim)

    def attention_block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn_out(torch.tanh(self.attn_in(x)))

    def expert_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert_out(F.gelu(self.expert_in(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_block(x)
        t = _comm(h, overlap.dispatch_begin, overlap.dispatch_end)
        t = self.expert_block(t)
        t = _comm(t, overlap.combine_begin, overlap.combine_end)
        return h + t


def _stage_model(dim: int, layers: int, stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(*(MoELikeLayer(dim) for _ in range(layers)))


def _block_time(dim: int, tokens: int, repeats: int = 30) -> float:
    """Forward time of one block (attention-like or expert) for one microbatch: the best of ``repeats``.

    The best rather than the median: on a shared machine a burst of load at
    start-up would otherwise make L several times the compute it stands next
    to in the steps, where less of it can be hidden at all (the ideal hidden
    fraction printed shows how much).
    """
    layer = MoELikeLayer(dim)
    x = torch.randn(tokens, dim)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            layer.attention_block(x)
            layer.expert_block(x)
            times.append((time.perf_counter() - t0) / 2)
    return min(times[repeats // 3 :])


class _Timed:
    """Wraps an OVERLAP_F_B function and sums the time spent in it (and traces it with the breakdown on)."""

    def __init__(self, fn: Callable[[Any, Any], None], observed: bool = False) -> None:
        self.fn = fn
        self.observed = (
            observed  # the package's handler: traced through overlap.observe_actions
        )
        self.seconds = 0.0

    def __call__(self, action: Any, ctx: Any) -> None:
        tracer = _TRACER
        t0 = time.perf_counter()
        if tracer is not None:
            tracer.current = _ActionTrace(start=t0)
        try:
            if tracer is not None and self.observed:
                with overlap.observe_actions(tracer):
                    self.fn(action, ctx)
            else:
                self.fn(action, ctx)
        finally:
            t1 = time.perf_counter()
            self.seconds += t1 - t0
            if tracer is not None:
                trace, tracer.current = tracer.current, None
                trace.end = t1
                tracer.actions.append(trace)


class _Switch:
    """The OVERLAP_F_B function registered once on a schedule; each step points it at one handler.

    (The benchmark switches handlers every step; registering each one would
    log a warning each time.)
    """

    def __init__(self, schedule: Any) -> None:
        from torch.distributed.pipelining import schedules

        self.fn: Callable[[Any, Any], None] = sequential_overlap_f_b
        schedule.register_custom_function(schedules.OVERLAP_F_B, self)

    def __call__(self, action: Any, ctx: Any) -> None:
        self.fn(action, ctx)


MODES = {
    # name: (overlap handler?, marks?, latency?)
    "sequential": (False, True, True),
    "overlap": (True, True, True),
    "sequential L=0": (False, True, False),
    "overlap L=0": (True, True, False),
    "sequential dense": (False, False, False),
    "overlap dense": (True, False, False),
    "sequential dense again": (False, False, False),
}
# The sequential mode whose bookkeeping and segments an overlapped mode is compared with.
COUNTERPART = {
    "sequential": "sequential",
    "overlap": "sequential",
    "sequential L=0": "sequential L=0",
    "overlap L=0": "sequential L=0",
    "sequential dense": "sequential dense",
    "overlap dense": "sequential dense",
    "sequential dense again": "sequential dense",
}


def _part1_worker(rank: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Part 1 on one rank; rank 0 returns every rank's result."""
    global _LATENCY_S, _MARKS, _TRACER
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    world = dist.get_world_size()
    n_stages = 2 * world
    tokens = args.microbatch_tokens
    block = torch.tensor([_block_time(args.dim, tokens)])
    dist.all_reduce(block, op=dist.ReduceOp.MAX)
    latency = args.latency_ms / 1e3 if args.latency_ms is not None else float(block)
    if not args.no_breakdown:
        _TRACER = _Tracer()

    stage_ids = [rank, n_stages - 1 - rank]
    stages = [
        PipelineStage(
            _stage_model(args.dim, args.layers, i), i, n_stages, torch.device("cpu")
        )
        for i in stage_ids
    ]
    schedule = ScheduleDualPipeV(
        stages, args.microbatches, loss_fn=lambda y, t: F.mse_loss(y, t)
    )
    handlers = {
        True: _Timed(overlap.overlap_f_b, observed=True),
        False: _Timed(timed_sequential_overlap_f_b),
    }
    switch = _Switch(schedule)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.microbatches * tokens, args.dim, generator=gen)
    target = torch.randn(args.microbatches * tokens, args.dim, generator=gen)

    names = list(MODES)
    step_times: dict[str, list[float]] = {n: [] for n in names}
    inside: dict[str, list[float]] = {n: [] for n in names}
    actions: dict[str, list[list[dict[str, Any] | None]]] = {
        n: [] for n in names
    }  # per round, this rank
    probes: list[tuple[float, float]] = []
    losses_by_mode: dict[str, list[torch.Tensor]] = {}
    for rnd in range(args.warmup + args.rounds):
        measured = rnd >= args.warmup
        dist.barrier()
        probe_before = _busy_loop()
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            use_overlap, marks, with_latency = MODES[name]
            _MARKS, _LATENCY_S = marks, (latency if with_latency else 0.0)
            handler = handlers[use_overlap]
            switch.fn = handler
            for s in stages:
                s.submod.zero_grad(set_to_none=True)
            dist.barrier()
            handler.seconds = 0.0
            losses: list[torch.Tensor] = []
            t0 = time.perf_counter()
            if rank == 0:
                schedule.step(x, target=target, losses=losses)
            else:
                schedule.step(target=target, losses=losses)
            elapsed = torch.tensor([time.perf_counter() - t0, handler.seconds])
            dist.all_reduce(elapsed[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(elapsed[1:], op=dist.ReduceOp.SUM)
            traces = _TRACER.take() if _TRACER is not None else []
            if measured:
                step_times[name].append(float(elapsed[0]))
                inside[name].append(float(elapsed[1]))
                actions[name].append([summarize_action(t) for t in traces])
            if rank == 0:
                if name in losses_by_mode and not all(
                    torch.equal(a, b)
                    for a, b in zip(losses, losses_by_mode[name], strict=True)
                ):
                    raise AssertionError(f"{name}: losses changed between rounds")
                losses_by_mode[name] = losses
        dist.barrier()
        probe_after = _busy_loop()
        if measured:
            probes.append((probe_before, probe_after))
    result: dict[str, Any] = {
        "rank": rank,
        "actions": actions,
        "probes": probes,
        "coordinator_hooks": _TRACER.coordinator_hooks if _TRACER is not None else [],
    }
    if rank == 0:
        reference = losses_by_mode["sequential"]
        result["same_losses"] = all(
            all(torch.equal(a, b) for a, b in zip(ls, reference, strict=True))
            for ls in losses_by_mode.values()
        )
        result["overlap_actions_rank0"] = sum(
            a.computation_type.name == "OVERLAP_F_B"
            for a in schedule.pipeline_order_with_comms[rank]
        )
        result["block_ms"] = float(block) * 1e3
        result["latency_ms"] = latency * 1e3
        result["step_times"] = step_times
        result["inside"] = inside
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    return gathered


@dataclasses.dataclass
class _ModeBreakdown:
    """Per mode, medians over rounds (times summed over ranks and actions, seconds)."""

    ideal: float = math.nan  # bookkeeping + lock-step of the counterpart's segments
    ideal_own: float = math.nan  # bookkeeping + lock-step of this mode's own segments
    efficiency: float = math.nan  # ideal / achieved, per round, median
    # per round: (counterpart's inside time - this mode's) / the counterpart's measured communication
    hidden_paired: float = math.nan
    compute: float = math.nan  # compute segments (coordinator time removed)
    comm: float = math.nan  # communication segments
    worker_wake_us: float = math.nan  # per action, median (see summarize_action)
    join_wake_us: float = math.nan  # per action whose backward finished last, median
    handover_us: float = math.nan  # median
    handover_p90_us: float = math.nan
    handovers_per_action: float = math.nan
    relay_per_action: float = (
        math.nan
    )  # closes that waited for an open already in progress
    coord_call_us: float = (
        math.nan
    )  # median duration of open/close calls that did not wait
    coord_calls_per_action: float = math.nan
    # per round, summed over ranks and actions, medians: where achieved - ideal goes
    lost_wake: float = math.nan  # worker wake-ups and join wake-ups
    lost_handover: float = math.nan  # hand-over latencies
    lost_coord: float = math.nan  # coordinator calls that did not wait
    comm_per_round: list[float] = dataclasses.field(default_factory=list)


def _breakdown(
    ranks: list[dict[str, Any]], inside: dict[str, list[float]]
) -> dict[str, _ModeBreakdown]:
    """Combine every rank's action summaries into per-mode breakdowns (see the module docstring)."""
    out: dict[str, _ModeBreakdown] = {}
    n_rounds = min(len(v) for v in inside.values())
    for name in MODES:
        counterpart = COUNTERPART[name]
        ideal, ideal_own, eff, compute, comm = [], [], [], [], []
        lost_wake, lost_ho, lost_coord = [], [], []
        worker_w, join_w, handovers, calls, n_actions, relay = [], [], [], [], 0, 0
        ok = True
        for rnd in range(n_rounds):
            i_seq = i_own = c = m = wake = ho = co = 0.0
            for r in ranks:
                mine, theirs = r["actions"][name][rnd], r["actions"][counterpart][rnd]
                if len(mine) != len(theirs) or any(a is None for a in mine + theirs):
                    ok = False
                    continue
                for a, s in zip(mine, theirs):
                    bookkeeping = s["total"] - s["spans"]
                    i_seq += bookkeeping + lockstep_time(s["b_segs"], s["f_segs"])
                    i_own += bookkeeping + lockstep_time(a["b_segs"], a["f_segs"])
                    for segs in (a["f_segs"], a["b_segs"]):
                        c += sum(segs[0::2])
                        m += sum(segs[1::2])
                    if not math.isnan(a["worker_wake"]):
                        worker_w.append(a["worker_wake"] * 1e6)
                        wake += a["worker_wake"]
                    if a["join_wake"]:
                        join_w.append(a["join_wake"] * 1e6)
                        wake += a["join_wake"]
                    handovers += [h * 1e6 for h in a["handovers"]]
                    relay += a["relay_closes"]
                    ho += sum(a["handovers"])
                    calls += [x * 1e6 for x in a["coord_costs"]]
                    co += sum(a["coord_costs"])
                    n_actions += 1
            ideal.append(i_seq)
            ideal_own.append(i_own)
            eff.append(i_seq / inside[name][rnd] if inside[name][rnd] else math.nan)
            compute.append(c)
            comm.append(m)
            lost_wake.append(wake)
            lost_ho.append(ho)
            lost_coord.append(co)
        if not ok or not n_actions:
            out[name] = _ModeBreakdown()
            continue
        paired = []
        if counterpart in out and counterpart != name:
            for rnd in range(n_rounds):
                comm_seq = out[counterpart].comm_per_round[rnd]
                if comm_seq > 1e-3 * inside[counterpart][rnd]:
                    paired.append(
                        (inside[counterpart][rnd] - inside[name][rnd]) / comm_seq
                    )
        out[name] = _ModeBreakdown(
            ideal=_median(ideal),
            ideal_own=_median(ideal_own),
            efficiency=_median(eff),
            compute=_median(compute),
            comm=_median(comm),
            worker_wake_us=_median(worker_w),
            join_wake_us=_median(join_w),
            handover_us=_median(handovers),
            handover_p90_us=_percentile(handovers, 0.9),
            handovers_per_action=len(handovers) / n_actions,
            relay_per_action=relay / n_actions,
            coord_call_us=_median(calls),
            coord_calls_per_action=len(calls) / n_actions,
            lost_wake=_median(lost_wake),
            lost_handover=_median(lost_ho),
            lost_coord=_median(lost_coord),
            hidden_paired=_median(paired),
            comm_per_round=comm,
        )
    return out


# --------------------------------------------------------------------------- #
# Part 2: PP=2 x EP=2 with the tests' toy MoE model                             #
# --------------------------------------------------------------------------- #


_EP_STAGES = 4


def _part2_schedule(
    args: argparse.Namespace, pp_group: Any, ep_group: Any, margs: Any
) -> tuple[Any, list[Any], list[int]]:
    """This rank's two stages of the toy MoE transformer and their DualPipeV schedule."""
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from model_registry import (
        MoETransformer,
    )  # the tests' toy MoE with marked all-to-alls
    from torch_pipelining_ext.stage_split import build_stage_module

    fqns = [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5"],
        ["layers.6", "layers.7", "norm", "output"],
    ]
    torch.manual_seed(0)
    model = MoETransformer(margs, ep_group=ep_group)
    pp_rank = dist.get_rank(pp_group)
    stage_ids = [pp_rank, _EP_STAGES - 1 - pp_rank]
    stages = [
        PipelineStage(
            build_stage_module(model, fqns[i]),
            i,
            _EP_STAGES,
            torch.device("cpu"),
            group=pp_group,
        )
        for i in stage_ids
    ]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return (
        ScheduleDualPipeV(stages, args.microbatches, loss_fn=loss_fn),
        stages,
        stage_ids,
    )


def _part2_worker(rank: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Part 2 on one of its four ranks; rank 0 returns the step times."""
    sys.path.insert(
        0,
        os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            "..",
            "test",
            "distributed",
            "pipelining",
        ),
    )
    from model_registry import MoEModelArgs

    torch.set_num_threads(1)
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    # the same EP groups again, each with a twin: the free order
    twinned = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_group, ep_group = pp_groups[rank % 2], ep_groups[rank // 2]
    overlap.create_twin_group(twinned[rank // 2])
    margs = MoEModelArgs(
        vocab_size=256, dim=args.ep_dim, n_heads=4, n_dense_layers=1, n_moe_layers=7, n_experts=8, top_k=2,
        moe_hidden=args.ep_dim, dense_hidden=2 * args.ep_dim,
    )  # fmt: skip
    one, stages, stage_ids = _part2_schedule(args, pp_group, ep_group, margs)
    twin, twin_stages, _ = _part2_schedule(args, pp_group, twinned[rank // 2], margs)
    # mode -> (schedule, its stages, OVERLAP_F_B function)
    modes = {
        "overlap": (one, stages, _Timed(overlap.overlap_f_b)),
        "sequential": (one, stages, _Timed(sequential_overlap_f_b)),
        "overlap twin": (twin, twin_stages, _Timed(overlap.overlap_f_b)),
    }
    switches = {id(one): _Switch(one), id(twin): _Switch(twin)}
    gen = torch.Generator().manual_seed(rank % 2)
    shape = (args.microbatches * 2, 32)
    tokens = torch.randint(0, margs.vocab_size, shape, generator=gen)
    labels = torch.randint(0, margs.vocab_size, shape, generator=gen)
    times: dict[str, list[float]] = {n: [] for n in modes}
    losses_by_mode: dict[str, list[torch.Tensor]] = {}
    for rnd in range(args.warmup + args.ep_rounds):
        order = list(modes)[rnd % len(modes) :] + list(modes)[: rnd % len(modes)]
        for name in order:
            schedule, mode_stages, fn = modes[name]
            switches[id(schedule)].fn = fn
            for s in mode_stages:
                s.submod.zero_grad(set_to_none=True)
            dist.barrier()
            losses: list[torch.Tensor] = []
            t0 = time.perf_counter()
            if 0 in stage_ids:
                schedule.step(tokens, target=labels, losses=losses)
            else:
                schedule.step(target=labels, losses=losses)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rnd >= args.warmup:
                times[name].append(float(elapsed))
            losses_by_mode[name] = losses
    same = _EP_STAGES - 1 not in stage_ids or all(
        torch.equal(a, b)
        for name in ("overlap", "overlap twin")
        for a, b in zip(losses_by_mode[name], losses_by_mode["sequential"], strict=True)
    )
    flag = torch.tensor([1 if same else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank != 0:
        return None
    return {
        "steps": {n: statistics.median(v) for n, v in times.items()},
        "same_losses": bool(flag),
    }


# Part 3's modes: where the coordination kernels are, per collective outside
# an action.  See [Note: where the coordination kernels sit].
_KERNEL_MODES = ("without", "with", "BackendSelect")


def _install_kernels(mode: str) -> None:
    """Put the kernels where ``mode`` says (part 3); nothing else changes between modes."""
    from torch_pipelining_ext.overlap import _collectives

    _collectives.uninstall()
    if mode == "with":  # where a schedule that overlaps installs them
        _collectives.install()
    elif (
        mode == "BackendSelect"
    ):  # where they sat before: every collective reaches them
        _collectives._INTERCEPTION.install(keys=("BackendSelect",))


def _us_per_call(fn: Callable[[], Any], calls: int = 100) -> float:
    """Microseconds per call of ``fn``, one batch of ``calls``, the garbage collector off."""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        gc.enable()


def _collective_cost_worker(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Part 3 on one rank: microseconds per small all_reduce outside overlapped actions, per mode.

    Modes (:data:`_KERNEL_MODES`): no kernels, the kernels
    as a schedule installs them, and at BackendSelect; and what a thread pays
    while it runs a side: entering and leaving the kernels' key once, and a
    small ``torch.add`` with and without the key.  Interleaved rounds; per
    round, the modes in rotating order; rounds' values returned.
    """
    from torch_pipelining_ext.overlap import _marks

    torch.set_num_threads(1)
    x, a = torch.ones(4), torch.ones(4)
    times: dict[str, list[float]] = {m: [] for m in _KERNEL_MODES}
    key_us: list[float] = []
    add_us: dict[bool, list[float]] = {False: [], True: []}

    def enter_key() -> None:
        with torch._C._IncludeDispatchKeyGuard(_marks.THREAD_KEY):
            pass

    for i in range(args.collective_rounds):
        for k in range(len(_KERNEL_MODES)):
            mode = _KERNEL_MODES[(i + k) % len(_KERNEL_MODES)]
            _install_kernels(mode)
            _us_per_call(lambda: dist.all_reduce(x), calls=20)  # warm up, not timed
            times[mode].append(_us_per_call(lambda: dist.all_reduce(x)))
    # which collectives reach a kernel (each calls _current_binding once)
    reached: dict[str, float] = {}
    current = _marks._current_binding
    for mode in _KERNEL_MODES:
        _install_kernels(mode)
        calls: list[None] = []
        _marks._current_binding = lambda: calls.append(None) or current()  # type: ignore[assignment]
        try:
            for _ in range(100):
                dist.all_reduce(x)
        finally:
            _marks._current_binding = current  # type: ignore[assignment]
        reached[mode] = len(calls) / 100
    for i in range(args.collective_rounds):
        key_us.append(_us_per_call(enter_key))
        for included in (i % 2 == 0, i % 2 != 0):
            with contextlib.ExitStack() as stack:
                if included:
                    stack.enter_context(
                        torch._C._IncludeDispatchKeyGuard(_marks.THREAD_KEY)
                    )
                add_us[included].append(_us_per_call(lambda: torch.add(a, a)))
    _install_kernels("without")
    return {"collective": times, "reached": reached, "key": key_us, "add": add_us}


def _spread(values: Sequence[float]) -> str:
    """``median [p25, p75]`` of per-round values."""
    return f"{_median(values):.1f} [{_percentile(values, 0.25):.1f}, {_percentile(values, 0.75):.1f}]"


def _print_part3(args: argparse.Namespace, cost: dict[str, Any]) -> dict[str, float]:
    """Print part 3; returns its fields of the last line."""
    times = cost["collective"]
    added = {m: _median(times[m]) - _median(times["without"]) for m in _KERNEL_MODES}
    per_op = _median(cost["add"][True]) - _median(cost["add"][False])
    print(
        "\nPart 3: a 4-element gloo all_reduce outside overlapped actions, one rank, "
        f"{args.collective_rounds} interleaved rounds of 100 collectives per mode, us per collective: "
        "median [p25, p75] of the rounds"
    )
    print(f"  no kernels                      {_spread(times['without'])}")
    print(
        f"  kernels at the action's key     {_spread(times['with'])}   added {added['with']:+.2f}"
    )
    print(
        f"  kernels at BackendSelect        {_spread(times['BackendSelect'])}   added "
        f"{added['BackendSelect']:+.2f} (where they sat before)"
    )
    print(
        "  collectives that reach a kernel: "
        + ", ".join(f"{m} {cost['reached'][m]:.2f}" for m in _KERNEL_MODES)
    )
    print(
        f"  per action, each of its two threads: entering and leaving the key {_spread(cost['key'])} us; "
        f"per operator on them: a 4-element add {_spread(cost['add'][False])} us without the key, "
        f"{per_op:+.2f} us with it"
    )
    return {
        "collective_us": added["with"],
        "collective_us_p25": _percentile(times["with"], 0.25)
        - _percentile(times["without"], 0.25),
        "collective_us_p75": _percentile(times["with"], 0.75)
        - _percentile(times["without"], 0.75),
        "collective_us_backend_select": added["BackendSelect"],
        "action_key_us": _median(cost["key"]),
        "op_in_action_us": per_op,
    }


def _part3_fields(fields: dict[str, float]) -> str:
    return " ".join(f"{name}={value:.2f}" for name, value in fields.items())


# --------------------------------------------------------------------------- #
# Driver                                                                       #
# --------------------------------------------------------------------------- #


def _launch(
    worker: Callable[[int, argparse.Namespace], Any],
    world: int,
    args: argparse.Namespace,
) -> Any:
    """Rank 0's result of ``worker(rank, args)`` on ``world`` local gloo ranks
    (``torch_pipelining_ext.launcher``: a rank that fails stops the others)."""
    try:
        return launcher.launch(worker, world, args, threads_per_rank=1)
    except launcher.RankFailedError as e:
        raise SystemExit(f"a rank of {worker.__name__} failed: {e}") from None


def _fmt(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _print_part1(
    args: argparse.Namespace,
    r: dict[str, Any],
    bd: dict[str, _ModeBreakdown],
    world: int,
) -> None:
    print(
        f"\nPart 1: PP={world} on {world} gloo rank(s), {args.layers} MoE-like layers per stage (dim {args.dim}, "
        f"{args.microbatch_tokens} tokens per microbatch), {r['overlap_actions_rank0']} OVERLAP_F_B actions on rank 0"
    )
    print(
        f"  one forward block: {r['block_ms']:.2f} ms; simulated latency L = {r['latency_ms']:.2f} ms per region"
    )
    print(
        f"  medians of {args.rounds} interleaved rounds (step: slowest rank; inside: OVERLAP_F_B time, all ranks; "
        "ideal: see [Note: lock-step ideal])"
    )
    print(
        f"  {'mode':<18} {'step ms':>9} {'inside ms':>10} {'ideal ms':>9} {'effic.':>7} {'ideal own':>10} "
        f"{'compute':>8} {'comm':>7}"
    )
    for name in MODES:
        b = bd.get(name, _ModeBreakdown())
        print(
            f"  {name:<18} {_median(r['step_times'][name]) * 1e3:9.1f} {_median(r['inside'][name]) * 1e3:10.1f} "
            f"{_fmt(b.ideal * 1e3, '9.1f')} {_fmt(b.efficiency, '7.3f')} {_fmt(b.ideal_own * 1e3, '10.1f')} "
            f"{_fmt(b.compute * 1e3, '8.1f')} {_fmt(b.comm * 1e3, '7.1f')}"
        )
    if not bd:
        return
    print(
        "  overlapped modes, per action (µs; medians over the actions of all ranks and rounds; relay: hand-overs "
        "per action where a closing thread waited for an open the other thread was already blocked in)"
    )
    print(
        f"  {'mode':<18} {'hand-over':>10} {'p90':>7} {'/action':>8} {'relay':>6} {'worker wake':>12} "
        f"{'join wake':>10} {'coord call':>11} {'/action':>8}"
    )
    for name in ("overlap", "overlap L=0", "overlap dense"):
        b = bd[name]
        print(
            f"  {name:<18} {_fmt(b.handover_us, '10.0f')} {_fmt(b.handover_p90_us, '7.0f')} "
            f"{_fmt(b.handovers_per_action, '8.1f')} {_fmt(b.relay_per_action, '6.1f')} {_fmt(b.worker_wake_us, '12.0f')} "
            f"{_fmt(b.join_wake_us, '10.0f')} {_fmt(b.coord_call_us, '11.1f')} {_fmt(b.coord_calls_per_action, '8.1f')}"
        )
    print(
        "  where achieved - ideal goes, per step (ms, all ranks; the parts overlap where both threads wait):"
    )
    for name in ("overlap", "overlap L=0", "overlap dense"):
        b, seq = bd[name], bd[COUNTERPART[name]]
        gap = _median(r["inside"][name]) - b.ideal
        print(
            f"  {name:<18} gap {gap * 1e3:7.1f} = wake-ups {b.lost_wake * 1e3:6.1f} + hand-overs "
            f"{b.lost_handover * 1e3:6.1f} + coordinator calls {b.lost_coord * 1e3:5.1f} + compute inflation "
            f"{(b.compute - seq.compute) * 1e3:6.1f} + rest {(gap - b.lost_wake - b.lost_handover - b.lost_coord - b.compute + seq.compute) * 1e3:6.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rounds", type=int, default=6, help="measured rounds of every mode (part 1)"
    )
    p.add_argument("--warmup", type=int, default=2, help="rounds not measured")
    p.add_argument(
        "--pp",
        type=int,
        choices=(1, 2),
        default=2,
        help="pipeline ranks of part 1 (2 stages each)",
    )
    p.add_argument(
        "--layers", type=int, default=4, help="MoE-like layers per stage (part 1)"
    )
    p.add_argument(
        "--dim", type=int, default=384, help="width of the MoE-like layers (part 1)"
    )
    p.add_argument(
        "--microbatch-tokens",
        type=int,
        default=256,
        help="tokens per microbatch (part 1)",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="simulated latency L (default: one block's compute)",
    )
    p.add_argument(
        "--no-breakdown",
        action="store_true",
        help="no timestamps: step times and ratios only",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval() of every rank of part 1, seconds (default: Python's, 0.005)",
    )
    p.add_argument(
        "--no-ep", action="store_true", help="skip part 2 (PP=2 x EP=2 on 4 ranks)"
    )
    p.add_argument("--ep-rounds", type=int, default=4, help="measured rounds of part 2")
    p.add_argument("--ep-dim", type=int, default=128, help="model width of part 2")
    p.add_argument(
        "--collective-rounds",
        type=int,
        default=150,
        help="rounds of the per-collective cost of the coordination kernels (part 3)",
    )
    p.add_argument(
        "--collectives-only",
        action="store_true",
        help="part 3 alone; its fields alone on the last line",
    )
    args = p.parse_args(argv)
    if args.switch_interval is not None and not 0 < args.switch_interval <= 1:
        p.error(
            f"--switch-interval must be in (0, 1] seconds, got {args.switch_interval}"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.collectives_only:
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
        print(
            _part3_fields(_print_part3(args, _launch(_collective_cost_worker, 1, args)))
        )
        return 0

    probe_baseline = calibrate_probe()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; ScheduleDualPipeV, {args.microbatches} microbatches; "
        f"CPU probe baseline {probe_baseline * 1e3:.2f} ms (busy loop, this process alone); GIL switch interval "
        f"{(args.switch_interval or sys.getswitchinterval()) * 1e3:g} ms"
    )
    world = args.pp
    results = sorted(_launch(_part1_worker, world, args), key=lambda x: x["rank"])
    r = results[0]
    bd = {} if args.no_breakdown else _breakdown(results, r["inside"])
    _print_part1(args, r, bd, world)
    steps = {n: _median(v) for n, v in r["step_times"].items()}
    inside = {n: _median(v) for n, v in r["inside"].items()}

    def hidden(times: dict[str, float]) -> float:
        return (times["sequential"] - times["overlap"]) / (
            times["sequential"] - times["sequential L=0"]
        )

    hidden_in, hidden_e2e = hidden(inside), hidden(steps)
    overhead_dense = steps["overlap dense"] / steps["sequential dense"]
    overhead_l0 = steps["overlap L=0"] / steps["sequential L=0"]
    repeat_dense = steps["sequential dense again"] / steps["sequential dense"]
    print(
        f"  communication hidden inside OVERLAP_F_B actions: {hidden_in:.3f} (end to end: {hidden_e2e:.3f})"
    )
    if bd:
        print(
            "  ... per round, (sequential - overlap) / the sequential run's measured communication: "
            f"{bd['overlap'].hidden_paired:.3f} (less exposed to drift between modes)"
        )
        ideal_hidden = (inside["sequential"] - bd["overlap"].ideal) / (
            inside["sequential"] - inside["sequential L=0"]
        )
        print(f"  ... by the ideal lock-step of the same segments: {ideal_hidden:.3f}")
        if r["coordinator_hooks"] != list(_Tracer.COORDINATOR_METHODS):
            print(
                f"  (coordinator transitions timed: {r['coordinator_hooks'] or 'none'}; hand-overs need all four)"
            )
    print(
        f"  overlap / sequential step time: no marks {overhead_dense:.3f}, marks with L=0 {overhead_l0:.3f}"
    )
    print(
        f"  noise floor: sequential dense again / sequential dense = {repeat_dense:.3f} (identical modes; a step-time "
        "ratio this far from 1.0 says nothing)"
    )
    print(f"  losses identical in every mode: {'yes' if r['same_losses'] else 'NO'}")
    marks_cost = steps["sequential L=0"] / steps["sequential dense"]
    print(
        f"  (marks and zero-latency stand-in ops, sequential handler: L=0 / dense = {marks_cost:.3f})"
    )

    # CPU probe: per round, the worst rank; before and after the round.  The
    # baseline is the best time seen anywhere (the launcher's calibration can
    # itself run on a busy machine), so 1.0 is the best this machine gave.
    probe_baseline = min(
        [probe_baseline]
        + [t for res in results for pair in res["probes"] for t in pair]
    )
    per_round = [
        tuple(
            probe_baseline / max(res["probes"][i][j] for res in results) for j in (0, 1)
        )
        for i in range(len(r["probes"]))
    ]
    probe_values = [v for pair in per_round for v in pair]
    cpu_probe = _median(probe_values)
    print(
        f"  CPU probe per round, before/after (busy loop, best time {probe_baseline * 1e3:.2f} ms / the worst "
        "rank's; 1.0: a free core per rank): "
        + " ".join(f"{a:.2f}/{b:.2f}" for a, b in per_round)
        + f"; median {cpu_probe:.2f}, min {min(probe_values):.2f}"
    )
    if min(probe_values) < 0.7:
        print(
            "  note: the machine was busy during some rounds (probe < 0.7): the ranks did not get a core each"
        )

    ep_ratio = ep_twin_ratio = math.nan
    ok = r["same_losses"]
    if not args.no_ep:
        r2 = _launch(_part2_worker, 4, args)
        ep_ratio = r2["steps"]["overlap"] / r2["steps"]["sequential"]
        ep_twin_ratio = r2["steps"]["overlap twin"] / r2["steps"]["sequential"]
        print(
            f"\nPart 2: PP=2 x EP=2 on 4 gloo ranks, the tests' toy MoE transformer (dim {args.ep_dim}, 1 dense + 7 MoE "
            "layers, 8 experts, real all_to_all_single)"
        )
        print(f"  medians of {args.ep_rounds} interleaved rounds, slowest rank")
        for name, t in r2["steps"].items():
            print(f"  {name:<18} {t * 1e3:9.1f} ms")
        print(
            f"  overlap / sequential: {ep_ratio:.3f} (one EP communicator: the strict rule), "
            f"{ep_twin_ratio:.3f} (a twin per EP group: the free rule); losses identical: "
            f"{'yes' if r2['same_losses'] else 'NO'}"
        )
        if (os.cpu_count() or 1) < 4:
            print(
                f"  ({os.cpu_count()} CPU cores for 4 ranks: the ranks already keep every core busy)"
            )
        ok = ok and r2["same_losses"]

    part3 = _print_part3(args, _launch(_collective_cost_worker, 1, args))
    ovl = bd.get("overlap", _ModeBreakdown())
    print(
        f"hidden_fraction={hidden_in:.3f} hidden_fraction_e2e={hidden_e2e:.3f} efficiency={ovl.efficiency:.3f} "
        f"handover_us={ovl.handover_us:.0f} overhead_no_marks={overhead_dense:.3f} "
        f"overhead_marks_L0={overhead_l0:.3f} handover_p90_us={ovl.handover_p90_us:.0f} cpu_probe={cpu_probe:.2f} "
        f"hidden_fraction_paired={ovl.hidden_paired:.3f} ep_step_ratio={ep_ratio:.3f} "
        f"ep_step_ratio_twin={ep_twin_ratio:.3f} repeat_no_marks={repeat_dense:.3f} "
        f"{_part3_fields(part3)}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
