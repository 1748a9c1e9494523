"""Benchmark: the concurrent OVERLAP_F_B on a real model -- a tiny Hugging Face MoE with expert parallelism.

    python tools/bench_hf_overlap.py                      # both layouts, 2-3 minutes on 2 CPU cores
    python tools/bench_hf_overlap.py --layouts pp2xep2 --rounds 10 --latency-ms 2

The demo's model and training step (``torch_pipelining_ext.demo.train``: a
tiny Qwen3-MoE from a transformers 5.x config, ``pipeline_hf_causal_lm`` with
a ``("pp", "ep")`` mesh, ``ScheduleDualPipeV``) in two layouts:

* ``pp1xep2``: 2 gloo ranks, EP=2, each holding both stages of the V (the
  OVERLAP_F_B actions pair the two local stages);
* ``pp2xep2``: 4 gloo ranks, PP=2 x EP=2 (on 2 cores the ranks share them).

Every token all-to-all waits L ms (the demo's ``SimulatedLink``, an
expert-parallel transport of :mod:`torch_pipelining_ext.hf`; GIL released), L = one MoE layer's local expert compute for one microbatch,
measured at start-up (``--latency-ms`` overrides).  Round by round, in
rotating order so that machine drift hits every mode alike, one training step
of each of four modes from the same initial weights: overlapped and
sequential OVERLAP_F_B with the link latency L, and both again with L = 0
(loopback).  The first round is warm-up (shape inference) and not counted.
Reported per layout (medians over rounds, slowest rank per step):

* ``ratio``: step time overlapped / sequential, latency L;
* ``hidden``: (T_seq - T_overlap) / C, C the time the sequential run spends
  inside its all-to-alls (token counts, tokens and the link; mean over
  ranks) -- which includes waiting for the other EP rank to arrive, also
  hidden by the overlap;
* ``ratio_l0``: the same ratio with L = 0 (loopback only): what the
  overlap costs or gains where there is next to nothing to hide.

Each round checks that the overlapped and sequential modes' losses are
bitwise equal (at L and at 0).  The last line is machine-readable::

    hf_overlap_ratio=... hidden_fraction=... ratio_l0=... layout=... latency_ms=...
    [hf_overlap_ratio_<layout>=... hidden_fraction_<layout>=... ratio_l0_<layout>=... latency_ms_<layout>=...]
    losses_identical=...

(one line; the first keys are of the first layout, then one group per further layout).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_pipelining_ext.demo import harness, train

_LAYOUTS = {"pp1xep2": (1, 2), "pp2xep2": (2, 2)}
# (overlapped?, with the link latency?)
_MODES = {
    "overlap": (True, True),
    "sequential": (False, True),
    "overlap L=0": (True, False),
    "sequential L=0": (False, False),
}


def _worker(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from torch_pipelining_ext import hf

    mesh = init_device_mesh("cpu", (args.pp, args.ep), mesh_dim_names=("pp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    torch.manual_seed(args.seed)
    config = train.tiny_moe_config(args)
    model = transformers.AutoModelForCausalLM.from_config(config)
    names = hf.hf_module_names_per_stage(
        model, 2 * args.pp, input_weight=0.25, output_weight=0.5
    )
    runs = {
        m: train.Pipeline(model, mesh, names, args, overlap=o)
        for m, (o, _) in _MODES.items()
    }
    parts = runs["overlap"].parts
    if args.latency_ms is None:
        tokens = train.MICROBATCH_SIZE * train.SEQ_LEN
        latency = harness.calibrate_link_latency(
            parts, tokens, config.num_experts_per_tok
        )
    else:
        latency = args.latency_ms / 1e3
    n_all_to_all = harness.all_to_alls_per_step(parts, args.microbatches)
    link = harness.SimulatedLink()
    hf.set_expert_parallel_transport(link)
    step_s: dict[str, list[float]] = {m: [] for m in runs}
    comm_s: list[float] = []
    identical = True
    modes = list(runs)
    for r in range(args.rounds):
        ids = train.global_batch(args, r).chunk(args.ep)[ep_rank]
        losses = {}
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            link.latency_s = latency if _MODES[mode][1] else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            with link.measuring() if mode == "sequential" else contextlib.nullcontext():
                losses[mode] = runs[mode].train_step(ids)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            comm = torch.tensor(
                [link.seconds if mode == "sequential" else 0.0], dtype=torch.float64
            )
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank
            dist.all_reduce(comm)  # the mean over ranks, below
            if r > 0:  # round 0: shape inference, warm-up
                step_s[mode].append(dt.item())
                if mode == "sequential":
                    comm_s.append(comm.item() / dist.get_world_size())
        same = all(
            len(losses[a]) == len(losses[b])
            and all(torch.equal(x, y) for x, y in zip(losses[a], losses[b]))
            for a, b in (("overlap", "sequential"), ("overlap L=0", "sequential L=0"))
        )
        identical &= harness.all_ranks(same)
        if rank == 0:
            times = (
                ", ".join(f"{m} {step_s[m][-1] * 1e3:.0f} ms" for m in modes)
                if r
                else "warm-up"
            )
            print(f"  round {r + 1}/{args.rounds}: {times}", flush=True)
    med = {m: statistics.median(v) for m, v in step_s.items()}
    gain = med["sequential"] - med["overlap"]
    return dict(
        median_ms={m: v * 1e3 for m, v in med.items()},
        ratio=med["overlap"] / med["sequential"],
        ratio_l0=med["overlap L=0"] / med["sequential L=0"],
        comm_ms=statistics.median(comm_s) * 1e3,
        hidden=gain / statistics.median(comm_s),
        n_all_to_all=n_all_to_all,
        latency_ms=latency * 1e3,
        losses_identical=identical,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--layouts",
        default="pp1xep2,pp2xep2",
        help="comma-separated: " + ", ".join(_LAYOUTS),
    )
    p.add_argument(
        "--rounds", type=int, default=10, help="rounds (the first is warm-up)"
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="link latency per all-to-all (default: calibrated)",
    )
    p.add_argument("--model", choices=train.MODELS, default="qwen3_moe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [x for x in layouts if x not in _LAYOUTS]
    if unknown or args.rounds < 2:
        p.error(
            f"unknown layouts {unknown}"
            if unknown
            else "--rounds must be at least 2 (the first is warm-up)"
        )
    problem = harness.fused_experts_problem()
    if problem:
        p.error(problem)
    if args.latency_ms is not None and not 0 <= args.latency_ms <= 1000:
        p.error("--latency-ms must be >= 0 and <= 1000")
    print(
        f"torch {torch.__version__}; tiny {args.model}, {args.layers} layers, {args.experts} experts, "
        f"ScheduleDualPipeV, {args.microbatches} microbatches per EP rank; {harness.cpu_cores()} CPU cores",
        flush=True,
    )
    results = {}
    for name in layouts:
        args.pp, args.ep = _LAYOUTS[name]
        print(
            f"\n{name}: {args.pp * args.ep} gloo ranks, PP={args.pp} x EP={args.ep}",
            flush=True,
        )
        r = results[name] = harness.launch(args, _worker)
        m = r["median_ms"]
        print(
            f"  link latency L = {r['latency_ms']:.2f} ms per token all-to-all "
            f"({r['n_all_to_all']} per step and rank)\n"
            f"  step time (median): overlap {m['overlap']:.1f} ms, sequential {m['sequential']:.1f} ms -> ratio "
            f"{r['ratio']:.3f}; at L=0: {m['overlap L=0']:.1f} / {m['sequential L=0']:.1f} ms -> {r['ratio_l0']:.3f}\n"
            f"  sequential run inside all-to-alls: {r['comm_ms']:.0f} ms per step and rank "
            f"({r['n_all_to_all'] * r['latency_ms']:.0f} ms of it the simulated link)\n"
            f"  hidden: {r['hidden']:.3f} of the all-to-all time\n"
            f"  losses overlapped == sequential (bitwise, every round): {'yes' if r['losses_identical'] else 'NO'}",
            flush=True,
        )
    first, *rest = layouts
    r0 = results[first]
    fields = [
        f"hf_overlap_ratio={r0['ratio']:.3f}",
        f"hidden_fraction={r0['hidden']:.3f}",
        f"ratio_l0={r0['ratio_l0']:.3f}",
        f"layout={first}",
        f"latency_ms={r0['latency_ms']:.3f}",
    ]
    for name in rest:
        r = results[name]
        fields += [
            f"hf_overlap_ratio_{name}={r['ratio']:.3f}",
            f"hidden_fraction_{name}={r['hidden']:.3f}",
            f"ratio_l0_{name}={r['ratio_l0']:.3f}",
            f"latency_ms_{name}={r['latency_ms']:.3f}",
        ]
    identical = all(r["losses_identical"] for r in results.values())
    fields.append(f"losses_identical={int(identical)}")
    print()
    print(" ".join(fields))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
