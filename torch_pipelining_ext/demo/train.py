"""The main job: train a tiny Hugging Face MoE with pipeline x expert parallelism.

``python -m torch_pipelining_ext.demo`` (``bash tools/run_demo.sh``) builds a
tiny Qwen3-MoE (``--model``: Mixtral, DeepSeek-V3) from a transformers 5.x
config -- no download -- and trains it on synthetic data with
``ScheduleDualPipeV`` and expert parallelism (:mod:`torch_pipelining_ext.hf`):

* default layout: 2 processes, EP=2, each holding both stages of the V
  (PP=1), so every OVERLAP_F_B action pairs the forward of one local stage
  with the backward of the other; ``--pp 2``: PP=2 x EP=2 on 4 processes;
* each MoE layer keeps ``E / ep`` experts; tokens travel to their experts by
  all-to-all, over a simulated link on which every all-to-all costs what one
  layer's local expert compute costs (measured at start-up;
  ``--comm-latency-ms`` overrides, 0 leaves loopback alone);
* each step runs twice from the same weights: with the package's concurrent
  OVERLAP_F_B and with the sequential one (what stock torch runs).  Their
  losses and weights must be bitwise equal; rank 0 then trains the unsplit
  Hugging Face model on the global batch as the reference (float tolerance);
* after each step :func:`torch_pipelining_ext.hf.expert_load` sums the tokens
  routed to each expert of every MoE layer over all ranks; the last step's
  balance is printed (and plotted with ``--trace``).

Exit status: 0 when all of that holds, 1 when not, 2 for bad arguments.
Under ``torchrun`` the demo joins its env:// rendezvous instead of spawning.
Launching and the simulated link live in :mod:`torch_pipelining_ext.demo.harness`,
the checks and the report in ``demo/_report.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import OVERLAP_F_B

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import hf
from torch_pipelining_ext.demo import _report, harness
from torch_pipelining_ext.runtime import sequential_overlap_f_b
from torch_pipelining_ext.train import tiny_config


__all__ = ["Pipeline", "build_parser", "main", "parse_args", "tiny_moe_config"]

VOCAB, SEQ_LEN, MICROBATCH_SIZE, LR = 256, 256, 2, 0.2
MODELS = ("qwen3_moe", "mixtral", "deepseek_v3")


_LATENCY_HELP = (
    "simulated link: L ms per token all-to-all, forward and backward (default: one "
    "layer's local expert compute, measured at start-up; 0: loopback only)"
)
_TRACE_HELP = "profile the last step of both runs: Chrome traces per rank"
# The demo's options in ``--help`` order: (flag, type, default, help), and the
# further ``add_argument`` keywords of some of them.
_OPTIONS: tuple[tuple[str, type | None, Any, str], ...] = (
    ("--pp", int, 1, "pipeline ranks (each holds 2 stages of the V)"),
    ("--ep", int, 2, "expert-parallel ranks (also data parallel)"),
    ("--model", None, "qwen3_moe", "transformers model type"),
    ("--layers", int, 4, "decoder layers"),
    ("--experts", int, 8, "routed experts per MoE layer (divisible by --ep)"),
    ("--microbatches", int, 8, "microbatches per step and EP rank"),
    ("--steps", int, 6, "training steps (each run in both modes)"),
    ("--seed", int, 0, "seed of the weights and the data"),
    ("--comm-latency-ms", float, None, _LATENCY_HELP),
    ("--trace", None, None, _TRACE_HELP),
)
_EXTRA_KEYWORDS: dict[str, dict[str, Any]] = {
    "--model": {"choices": MODELS},
    "--comm-latency-ms": {"metavar": "L"},
    "--trace": {"metavar": "DIR"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_pipelining_ext.demo",
        description="Train a tiny Hugging Face MoE with PP x EP and the concurrent OVERLAP_F_B of "
        "ScheduleDualPipeV; compare with the sequential OVERLAP_F_B and with the unsplit model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, type_, default, help_ in _OPTIONS:
        extra = _EXTRA_KEYWORDS.get(flag, {})
        p.add_argument(flag, type=type_, default=default, help=help_, **extra)
    return p


def parse_args(
    argv: Sequence[str] | None = None, environ: dict[str, str] | None = None
) -> argparse.Namespace:
    """Parse and validate; bad input exits with status 2 before any process starts."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _report.validate(parser, args, environ)
    return args


def tiny_moe_config(args: argparse.Namespace):
    """A tiny MoE config whose experts do most of a layer's work, as in real
    MoEs (the trainer's tiny config of ``--model``, sequences of ``SEQ_LEN``)."""
    return tiny_config(
        args.model,
        vocab_size=VOCAB,
        layers=args.layers,
        experts=args.experts,
        hidden_size=128,
        max_positions=SEQ_LEN,
    )


def global_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Token ids of the whole step (all EP ranks): sequences that follow a fixed
    permutation of the vocabulary from a random first token, which the model learns."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(args.seed))
    ids = torch.empty(
        args.ep * args.microbatches * MICROBATCH_SIZE, SEQ_LEN, dtype=torch.long
    )
    ids[:, 0] = torch.randint(0, VOCAB, (ids.shape[0],), generator=gen)
    for t in range(1, SEQ_LEN):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


class Pipeline:
    """This rank's stages of ``model`` (PP x EP), their schedule and optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        names: list[list[str]],
        args,
        *,
        overlap: bool,
    ):
        self.ep_group = mesh["ep"].get_group()
        # every MoE layer keeps E / ep experts; all-to-alls inside the overlap's marked regions
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            model, mesh, ScheduleDualPipeV, "cpu", names
        )
        self.loss_fn = (
            hf.CausalLMLoss()
        )  # EP ranks' losses average to HF's loss of the global batch
        self.schedule = ScheduleDualPipeV(
            self.stages,
            n_microbatches=args.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )
        if (
            not overlap
        ):  # what stock torch does: the two sub-actions one after the other
            self.schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b)
        self.optimizer = torch.optim.SGD(
            [p for part in self.parts for p in part.parameters()], lr=LR, momentum=0.9
        )
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)

    def train_step(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """One step on this EP rank's ``ids``; returns the microbatch losses (last stage)."""
        self.optimizer.zero_grad()
        self.loss_fn.set_labels(
            ids, group=self.ep_group
        )  # EP ranks see different tokens
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *((ids,) if self.has_first else ()),
            target=ids if self.has_last else None,
            losses=losses,
        )
        hf.reduce_expert_parallel_gradients(
            self.parts, self.ep_group
        )  # replicated: average over EP; experts: / ep
        self.optimizer.step()
        return [loss.detach() for loss in losses]


def train(args: argparse.Namespace, rank: int) -> int:
    """One rank's run; returns the exit status (the same on every rank)."""
    import transformers

    mesh = init_device_mesh("cpu", (args.pp, args.ep), mesh_dim_names=("pp", "ep"))
    ep_rank = mesh["ep"].get_local_rank()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = tiny_moe_config(args)
    model = transformers.AutoModelForCausalLM.from_config(config)  # no download
    # 2 stages per pipeline rank (the V); embedding and head cost little here
    names = hf.hf_module_names_per_stage(
        model, 2 * args.pp, input_weight=0.25, output_weight=0.5
    )
    runs = {
        mode: Pipeline(model, mesh, names, args, overlap=mode == "overlap")
        for mode in ("overlap", "sequential")
    }
    # calibrates the simulated link, prints the header
    report = _report.Report(
        args, rank, runs, names, MICROBATCH_SIZE * SEQ_LEN, config.num_experts_per_tok
    )

    for step in range(args.steps):
        ids = global_batch(args, step).chunk(args.ep)[ep_rank]
        order = (
            list(runs) if step % 2 == 0 else list(reversed(runs))
        )  # drift hits both modes alike
        for mode in order:
            with report.timed(mode, step):
                losses = runs[mode].train_step(ids)
            report.losses(mode, step, losses)
            # tokens per expert of every MoE layer, summed over all ranks and microbatches
            report.expert_load(mode, hf.expert_load(runs[mode].parts, dist.group.WORLD))
        report.print_step(step)

    report.params_identical(runs["overlap"].parts, runs["sequential"].parts)
    if rank == 0:
        report.reference(reference_losses(model, args))
    return report.finish()


def reference_losses(model: torch.nn.Module, args: argparse.Namespace) -> list[float]:
    """The unsplit Hugging Face model trained on the global batches: per-step loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = []
    for step in range(args.steps):
        optimizer.zero_grad()
        ids = global_batch(args, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_pipelining_ext.demo``; returns the exit status."""
    args = parse_args(argv)
    return harness.launch(args, train)
