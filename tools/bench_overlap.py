"""Benchmark: concurrent OVERLAP_F_B (torch_pipelining_ext) vs the sequential one, side by side.

    python tools/bench_overlap.py                 # both parts, a few minutes on 2 CPU cores
    python tools/bench_overlap.py --rounds 12 --latency-ms 5 --no-ep

Part 1 -- simulated communication latency (the headline numbers).  PP=2 on two
gloo ranks, ``ScheduleDualPipeV``, each of the 4 stages ``--layers`` MoE-like
layers: an attention-like block, a dispatch region, an expert block, a combine
region.  Inside each region (between the ``ep_overlap`` marks) an op sleeps L
ms in forward and in backward, releasing the GIL -- a stand-in for the
interconnect.  L defaults to one forward block's compute time, measured at
start-up.  Round by round, in rotating order so that machine drift hits every
mode alike, one step of each mode:

* ``sequential`` / ``overlap``: the sequential and the concurrent OVERLAP_F_B
  handler, latency L;
* ``sequential L=0`` / ``overlap L=0``: marks, no latency (T_0 is the first);
* ``sequential dense`` / ``overlap dense``: no marks and no regions at all.

It reports step-time medians (slowest rank) and the time spent inside
OVERLAP_F_B actions (summed over ranks): warm-up and cool-down forward and
backward actions of DualPipeV are not OVERLAP_F_B actions and cannot hide
anything.  The fraction of communication hidden inside the actions is
``(T_seq - T_overlap) / (T_seq - T_0)``.

Part 2 -- real expert parallelism (skip with ``--no-ep``).  PP=2 x EP=2 on four
gloo ranks with the demo's DeepSeek-style MoE transformer (real
``all_to_all_single`` dispatch and combine), sequential vs overlapped step
time.  On a 2-core machine four ranks already oversubscribe the cores, so
there is little idle time for the overlap to fill; the ratio is reported as
measured.

The last line is machine-readable::

    hidden_fraction=... hidden_fraction_e2e=... overhead_no_marks=... overhead_marks_L0=... ep_step_ratio=...

(ratios are overlapped / sequential; ``ep_step_ratio`` is ``nan`` with --no-ep).
Every mode computes the same losses (weights are not updated); the script
checks that they are bitwise equal across modes.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch_pipelining_ext  # noqa: E402, F401  (applies the patches)
from torch_pipelining_ext import _overlap, ep_overlap  # noqa: E402
from torch_pipelining_ext._schedule_runtime import run_action  # noqa: E402


N_STAGES = 4


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
        if _LATENCY_S:
            time.sleep(_LATENCY_S)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _LATENCY_S:
            time.sleep(_LATENCY_S)
        return grad


def _comm(x: torch.Tensor, begin: Callable[..., Any], end: Callable[..., Any]) -> torch.Tensor:
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
        t = _comm(h, ep_overlap.dispatch_begin, ep_overlap.dispatch_end)
        t = self.expert_block(t)
        t = _comm(t, ep_overlap.combine_begin, ep_overlap.combine_end)
        return h + t


def _stage_model(dim: int, layers: int, stage: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(*(MoELikeLayer(dim) for _ in range(layers)))


def _block_time(dim: int, tokens: int, repeats: int = 30) -> float:
    """Median forward time of one block (attention-like or expert) for one microbatch."""
    layer = MoELikeLayer(dim)
    x = torch.randn(tokens, dim)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            layer.attention_block(x)
            layer.expert_block(x)
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[repeats // 3 :])


def _sequential_overlap_f_b(action: Any, ctx: Any) -> None:
    """OVERLAP_F_B as upstream runs it."""
    for sub in action.sub_actions:
        run_action(ctx, sub)


class _Timed:
    """Wraps an OVERLAP_F_B function and sums the time spent in it."""

    def __init__(self, fn: Callable[[Any, Any], None]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, action: Any, ctx: Any) -> None:
        t0 = time.perf_counter()
        try:
            self.fn(action, ctx)
        finally:
            self.seconds += time.perf_counter() - t0


def _set_overlap_function(schedule: Any, fn: Callable[[Any, Any], None]) -> None:
    from torch.distributed.pipelining import schedules

    # (the benchmark switches the function back and forth every step; going
    # through register_custom_function would log a warning each time)
    schedule._comp_type_to_function_map[schedules.OVERLAP_F_B] = fn


MODES = {
    # name: (overlap handler?, marks?, latency?)
    "sequential": (False, True, True),
    "overlap": (True, True, True),
    "sequential L=0": (False, True, False),
    "overlap L=0": (True, True, False),
    "sequential dense": (False, False, False),
    "overlap dense": (True, False, False),
}


def _part1_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    global _LATENCY_S, _MARKS
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokens = args.microbatch_tokens
    block = torch.tensor([_block_time(args.dim, tokens)])
    dist.all_reduce(block, op=dist.ReduceOp.MAX)
    latency = args.latency_ms / 1e3 if args.latency_ms is not None else float(block)

    stage_ids = [rank, N_STAGES - 1 - rank]
    stages = [
        PipelineStage(_stage_model(args.dim, args.layers, i), i, N_STAGES, torch.device("cpu"))
        for i in stage_ids
    ]
    schedule = ScheduleDualPipeV(stages, args.microbatches, loss_fn=lambda y, t: F.mse_loss(y, t))
    handlers = {True: _Timed(_overlap.overlap_f_b), False: _Timed(_sequential_overlap_f_b)}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.microbatches * tokens, args.dim, generator=gen)
    target = torch.randn(args.microbatches * tokens, args.dim, generator=gen)

    names = list(MODES)
    step_times: dict[str, list[float]] = {n: [] for n in names}
    inside: dict[str, list[float]] = {n: [] for n in names}
    losses_by_mode: dict[str, list[torch.Tensor]] = {}
    for rnd in range(args.warmup + args.rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            use_overlap, marks, with_latency = MODES[name]
            _MARKS, _LATENCY_S = marks, (latency if with_latency else 0.0)
            handler = handlers[use_overlap]
            _set_overlap_function(schedule, handler)
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
            if rnd >= args.warmup:
                step_times[name].append(float(elapsed[0]))
                inside[name].append(float(elapsed[1]))
            if rank == 0:
                if name in losses_by_mode and not all(
                    torch.equal(a, b) for a, b in zip(losses, losses_by_mode[name], strict=True)
                ):
                    raise AssertionError(f"{name}: losses changed between rounds")
                losses_by_mode[name] = losses
    if rank == 0:
        reference = losses_by_mode["sequential"]
        same = all(
            all(torch.equal(a, b) for a, b in zip(ls, reference, strict=True)) for ls in losses_by_mode.values()
        )
        n_overlap = sum(
            a.computation_type.name == "OVERLAP_F_B" for a in schedule.pipeline_order_with_comms[rank]
        )
        out.put(
            {
                "block_ms": float(block) * 1e3,
                "latency_ms": latency * 1e3,
                "steps": {n: statistics.median(v) for n, v in step_times.items()},
                "inside": {n: statistics.median(v) for n, v in inside.items()},
                "same_losses": same,
                "overlap_actions_rank0": n_overlap,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# Part 2: PP=2 x EP=2 with the demo MoE model                                  #
# --------------------------------------------------------------------------- #


def _part2_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from torch_pipelining_ext.demo.model import MoEModelArgs, MoETransformer
    from torch_pipelining_ext.stage_split import split_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_group, ep_group = pp_groups[rank % 2], ep_groups[rank // 2]
    pp_rank = dist.get_rank(pp_group)
    margs = MoEModelArgs(
        vocab_size=256, dim=args.ep_dim, n_heads=4, n_dense_layers=1, n_moe_layers=7, n_experts=8, top_k=2,
        moe_hidden=args.ep_dim, dense_hidden=2 * args.ep_dim,
    )  # fmt: skip
    fqns = [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5"],
        ["layers.6", "layers.7", "norm", "output"],
    ]
    torch.manual_seed(0)
    model = MoETransformer(margs, ep_group=ep_group)
    stage_ids = [pp_rank, N_STAGES - 1 - pp_rank]
    stages = [
        PipelineStage(split_module(model, fqns[i]), i, N_STAGES, torch.device("cpu"), group=pp_group) for i in stage_ids
    ]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    schedule = ScheduleDualPipeV(stages, args.microbatches, loss_fn=loss_fn)
    handlers = {"overlap": _Timed(_overlap.overlap_f_b), "sequential": _Timed(_sequential_overlap_f_b)}
    gen = torch.Generator().manual_seed(rank % 2)
    tokens = torch.randint(0, margs.vocab_size, (args.microbatches * 2, 32), generator=gen)
    labels = torch.randint(0, margs.vocab_size, (args.microbatches * 2, 32), generator=gen)
    times: dict[str, list[float]] = {n: [] for n in handlers}
    losses_by_mode: dict[str, list[torch.Tensor]] = {}
    for rnd in range(args.warmup + args.ep_rounds):
        order = list(handlers) if rnd % 2 == 0 else list(reversed(handlers))
        for name in order:
            _set_overlap_function(schedule, handlers[name])
            for s in stages:
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
    if N_STAGES - 1 in stage_ids:
        same = all(torch.equal(a, b) for a, b in zip(losses_by_mode["overlap"], losses_by_mode["sequential"], strict=True))
    else:
        same = True
    flag = torch.tensor([1 if same else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        out.put({"steps": {n: statistics.median(v) for n, v in times.items()}, "same_losses": bool(flag)})
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# Driver                                                                       #
# --------------------------------------------------------------------------- #


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank of {worker.__name__} failed (exit codes {[p.exitcode for p in procs]})")
    return out.get()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="measured rounds of every mode (part 1)")
    p.add_argument("--warmup", type=int, default=2, help="rounds not measured")
    p.add_argument("--layers", type=int, default=4, help="MoE-like layers per stage (part 1)")
    p.add_argument("--dim", type=int, default=384, help="width of the MoE-like layers (part 1)")
    p.add_argument("--microbatch-tokens", type=int, default=256, help="tokens per microbatch (part 1)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--latency-ms", type=float, default=None, help="simulated latency L (default: one block's compute)")
    p.add_argument("--no-ep", action="store_true", help="skip part 2 (PP=2 x EP=2 on 4 ranks)")
    p.add_argument("--ep-rounds", type=int, default=4, help="measured rounds of part 2")
    p.add_argument("--ep-dim", type=int, default=128, help="model width of part 2")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; ScheduleDualPipeV, {args.microbatches} microbatches")
    r = _spawn(_part1_worker, 2, args)
    print(
        f"\nPart 1: PP=2 on 2 gloo ranks, {args.layers} MoE-like layers per stage (dim {args.dim}, "
        f"{args.microbatch_tokens} tokens per microbatch), {r['overlap_actions_rank0']} OVERLAP_F_B actions on rank 0"
    )
    print(f"  one forward block: {r['block_ms']:.2f} ms; simulated latency L = {r['latency_ms']:.2f} ms per region")
    print(f"  medians of {args.rounds} interleaved rounds (step: slowest rank; inside: OVERLAP_F_B time, both ranks)")
    print(f"  {'mode':<18} {'step ms':>9} {'inside ms':>10}")
    for name in MODES:
        print(f"  {name:<18} {r['steps'][name] * 1e3:9.1f} {r['inside'][name] * 1e3:10.1f}")

    def hidden(times: dict[str, float]) -> float:
        return (times["sequential"] - times["overlap"]) / (times["sequential"] - times["sequential L=0"])

    hidden_in, hidden_e2e = hidden(r["inside"]), hidden(r["steps"])
    overhead_dense = r["steps"]["overlap dense"] / r["steps"]["sequential dense"]
    overhead_l0 = r["steps"]["overlap L=0"] / r["steps"]["sequential L=0"]
    print(f"  communication hidden inside OVERLAP_F_B actions: {hidden_in:.2f} (end to end: {hidden_e2e:.2f})")
    print(f"  overlap / sequential step time: no marks {overhead_dense:.3f}, marks with L=0 {overhead_l0:.3f}")
    print(f"  losses identical in every mode: {'yes' if r['same_losses'] else 'NO'}")
    marks_cost = r["steps"]["sequential L=0"] / r["steps"]["sequential dense"]
    print(f"  (marks and zero-latency stand-in ops, sequential handler: L=0 / dense = {marks_cost:.3f})")

    ep_ratio = math.nan
    if not args.no_ep:
        r2 = _spawn(_part2_worker, 4, args)
        ep_ratio = r2["steps"]["overlap"] / r2["steps"]["sequential"]
        print(
            f"\nPart 2: PP=2 x EP=2 on 4 gloo ranks, demo MoE transformer (dim {args.ep_dim}, 1 dense + 7 MoE "
            "layers, 8 experts, real all_to_all_single)"
        )
        print(f"  medians of {args.ep_rounds} interleaved rounds, slowest rank")
        for name, t in r2["steps"].items():
            print(f"  {name:<18} {t * 1e3:9.1f} ms")
        print(f"  overlap / sequential: {ep_ratio:.3f}; losses identical: {'yes' if r2['same_losses'] else 'NO'}")
        if (os.cpu_count() or 1) < 4:
            print(f"  ({os.cpu_count()} CPU cores for 4 ranks: the ranks already keep every core busy)")

    ok = r["same_losses"] and (args.no_ep or r2["same_losses"])
    print(
        f"hidden_fraction={hidden_in:.3f} hidden_fraction_e2e={hidden_e2e:.3f} overhead_no_marks={overhead_dense:.3f} "
        f"overhead_marks_L0={overhead_l0:.3f} ep_step_ratio={ep_ratio:.3f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
