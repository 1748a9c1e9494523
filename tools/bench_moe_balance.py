"""Benchmark: what MoE load balancing costs per training step, side by side in one run.

    python tools/bench_moe_balance.py                     # about 2 minutes on 2 CPU cores
    python tools/bench_moe_balance.py --model deepseek_v3 --rounds 10 --pp 2

The demo's tiny MoE (``torch_pipelining_ext.demo.train.tiny_moe_config``:
Qwen3-MoE by default, built from a transformers 5.x config) trained with
``pipeline_hf_causal_lm`` on a ``("pp", "dp", "ep")`` mesh (``launcher.parallel_layout``) and ``ScheduleDualPipeV``
(the concurrent OVERLAP_F_B), loopback all-to-alls (no simulated link: the
balancing adds compute, not communication).  One pipeline per mode, all from
the same initial weights; round by round, in rotating order so that machine
drift hits every mode alike, one training step of each:

* ``none``: no auxiliary loss (the baseline);
* ``pooled``: Hugging Face's router auxiliary loss
  (``config.output_router_logits``; not for DeepSeek-V3);
* ``per_layer``: the per-layer (Switch / Megatron-Core) form (not for DeepSeek-V3);
* ``sequence``: DeepSeek-V3's sequence-wise loss (coefficient 1e-4);
* ``load``: no auxiliary loss, ``hf.expert_load`` over the EP group after
  every step (and ``hf.update_expert_bias`` for DeepSeek-V3).

The first round is warm-up (shape inference) and not counted.  Reported:
the median step time of each mode (slowest rank per step) and its ratio to
``none``.  The last line is machine-readable::

    moe_balance_pooled_ratio=... moe_balance_per_layer_ratio=... moe_balance_sequence_ratio=...
    moe_balance_load_ratio=... none_ms=... model=... layout=ppNxepM rounds=...

(one line; the modes a model does not have are left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_pipelining_ext.demo import harness, train

_SEQUENCE_COEF = 1e-4
_BIAS_RATE = 1e-3


def _modes(model: str) -> dict[str, dict[str, Any]]:
    """Mode name -> the keyword arguments of pipeline_hf_causal_lm."""
    modes: dict[str, dict[str, Any]] = {"none": {}}
    if model != "deepseek_v3":  # DeepSeek-V3 has no load_balancing_loss_func
        modes["pooled"] = {"router_aux_loss": "pooled"}
        modes["per_layer"] = {"router_aux_loss": "per_layer"}
    modes["sequence"] = {
        "router_aux_loss": "sequence",
        "router_aux_loss_coef": _SEQUENCE_COEF,
    }
    modes["load"] = {}
    return modes


class _Run:
    """One mode's stages, schedule and optimizer on this rank."""

    def __init__(self, model, mesh, names, args, mode: str, options: dict) -> None:
        from torch.distributed.pipelining import ScheduleDualPipeV

        from torch_pipelining_ext import hf

        self.hf, self.mode = hf, mode
        self.ep_group = mesh["ep"].get_group()
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            model, mesh, ScheduleDualPipeV, "cpu", names, **options
        )
        self.loss_fn = hf.CausalLMLoss(n_microbatches=args.microbatches)
        self.schedule = ScheduleDualPipeV(
            self.stages,
            n_microbatches=args.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )
        self.optimizer = torch.optim.SGD(
            [p for part in self.parts for p in part.parameters()], lr=train.LR
        )
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.bias = args.model == "deepseek_v3"

    def step(self, ids: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        self.loss_fn.set_labels(ids, group=self.ep_group)
        self.schedule.step(
            *((ids,) if self.has_first else ()),
            target=ids if self.has_last else None,
            losses=[],
        )
        self.hf.reduce_expert_parallel_gradients(self.parts, self.ep_group)
        self.optimizer.step()
        if self.mode == "load":
            load = self.hf.expert_load(self.parts, self.ep_group)
            if self.bias:
                self.hf.update_expert_bias(self.parts, load, _BIAS_RATE)


def _worker(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import transformers

    from torch_pipelining_ext import hf, launcher

    mesh = launcher.parallel_layout(pp=args.pp, ep=args.ep).mesh
    ep_rank = mesh["ep"].get_local_rank()
    torch.manual_seed(args.seed)
    config = train.tiny_moe_config(args)
    if args.model != "deepseek_v3":
        config.router_aux_loss_coef = 0.01
    model = transformers.AutoModelForCausalLM.from_config(config)
    names = hf.hf_module_names_per_stage(
        model, 2 * args.pp, input_weight=0.25, output_weight=0.5
    )
    runs = {
        mode: _Run(model, mesh, names, args, mode, options)
        for mode, options in _modes(args.model).items()
    }
    step_s: dict[str, list[float]] = {m: [] for m in runs}
    modes = list(runs)
    for r in range(args.rounds):
        ids = train.global_batch(args, r).chunk(args.ep)[ep_rank]
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            dist.barrier()
            t0 = time.perf_counter()
            runs[mode].step(ids)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank
            if r > 0:  # round 0: shape inference, warm-up
                step_s[mode].append(dt.item())
        if rank == 0:
            times = (
                ", ".join(f"{m} {step_s[m][-1] * 1e3:.0f} ms" for m in modes)
                if r
                else "warm-up"
            )
            print(f"  round {r + 1}/{args.rounds}: {times}", flush=True)
    return {m: statistics.median(v) * 1e3 for m, v in step_s.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", choices=train.MODELS, default="qwen3_moe")
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks (2 stages each)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks")
    p.add_argument(
        "--rounds", type=int, default=6, help="rounds (the first is warm-up)"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (the first is warm-up)")
    for flag in ("pp", "ep", "layers", "experts", "microbatches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    if args.experts % args.ep:
        p.error(f"--experts {args.experts} must be divisible by --ep {args.ep}")
    min_layers = 2 * args.pp + (1 if args.model == "deepseek_v3" else 0)
    if args.layers < min_layers or args.microbatches < 2 * args.pp:
        p.error(
            f"ScheduleDualPipeV on --pp {args.pp} needs --layers >= {min_layers} and "
            f"--microbatches >= {2 * args.pp}"
        )
    problem = harness.fused_experts_problem()
    if problem:
        p.error(problem)
    layout = f"pp{args.pp}xep{args.ep}"
    print(
        f"torch {torch.__version__}; tiny {args.model}, {args.layers} layers, {args.experts} experts, "
        f"ScheduleDualPipeV on {args.pp * args.ep} gloo ranks ({layout}), {args.microbatches} microbatches "
        f"per EP rank; {harness.cpu_cores()} CPU cores",
        flush=True,
    )
    median_ms = harness.launch(args, _worker)
    base = median_ms["none"]
    print()
    for mode, ms in median_ms.items():
        print(f"  {mode:<10} {ms:8.1f} ms per step (median)  x{ms / base:.3f} of none")
    fields = [
        f"moe_balance_{mode}_ratio={ms / base:.3f}"
        for mode, ms in median_ms.items()
        if mode != "none"
    ]
    fields += [
        f"none_ms={base:.1f}",
        f"model={args.model}",
        f"layout={layout}",
        f"rounds={args.rounds}",
    ]
    print()
    print(" ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
