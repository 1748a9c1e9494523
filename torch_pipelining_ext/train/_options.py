"""The trainer's command line: parsing, and the checks of the flags alone.

Private helper of :mod:`torch_pipelining_ext.train`.  :func:`check_options`
reads nothing but the flags and the environment and writes nothing: it
returns the run's :class:`Layout` or raises :class:`UsageError` (exit
status 2): numbers out of range, a layout that does not fit the world, a
batch that does not split over the data ranks and microbatches, flags that
contradict each other, a run or export directory that cannot be used.  What
needs the model, the tokenizer or the data is checked by ``_plan.py``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from torch_pipelining_ext import hf, launcher
from torch_pipelining_ext.train import _data, _model


__all__: list[str] = []

SCHEDULES = (
    "DualPipeV",
    "ZBVZeroBubble",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "LoopedBFS",
    "1F1B",
    "GPipe",
)
AUX_LOSSES = ("none", "pooled", "per_layer", "sequence")
CHECKPOINTING = ("none", "full", "selective")
PROG = "python -m torch_pipelining_ext.train"
SYNTHETIC_VOCAB = 256  # --synthetic-data's default vocabulary
MAX_LATENCY_MS = 1000.0
# the tiny config's flags (a --model directory has its own config)
_TINY_DEFAULTS = {"layers": 4, "experts": 8, "hidden_size": 128, "vocab_size": None}


class UsageError(ValueError):
    """Bad input, found before any process group (exit status 2)."""


_DESCRIPTION = (
    "Train a Hugging Face causal LM (dense or MoE) with pipeline, data and expert "
    "parallelism: checkpoints, resume after a crash, logs, a plot and export."
)


# The flags in ``--help`` order, by group: (flag, ``add_argument``'s keywords).
_FLAGS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "model": (
        ("--model", dict(metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")),
        ("--model-type", dict(choices=_model.MODEL_TYPES, help="a tiny config of this model type instead, for trying the trainer out")),
        ("--layers", dict(type=int, default=_TINY_DEFAULTS["layers"], help="decoder layers (--model-type)")),
        ("--experts", dict(type=int, default=_TINY_DEFAULTS["experts"], help="routed experts per MoE layer (--model-type)")),
        ("--hidden-size", dict(type=int, default=_TINY_DEFAULTS["hidden_size"], help="hidden size (--model-type)")),
        ("--vocab-size", dict(type=int, help="vocabulary (--model-type; default: the tokenizer's, or the token file's largest id + 1)")),
    ),
    "data": (
        ("--data", dict(nargs="+", metavar="PATH", help="plain text (.txt: one document per file), JSON lines (.jsonl: a text field per line) or token ids (.bin)")),
        ("--synthetic-data", dict(action="store_true", help=f"sequences that follow a random permutation of the vocabulary (--vocab-size, default {SYNTHETIC_VOCAB}) instead: no text, no tokenizer")),
        ("--dataset", dict(metavar="NAME_OR_PATH", help="a local datasets dataset instead (optional package; nothing is downloaded)")),
        ("--dataset-split", dict(default="train", help="the split of --dataset")),
        ("--text-field", dict(default="text", help="the text field of JSON lines and datasets")),
        ("--tokenizer", dict(metavar="DIR", help="a Hugging Face tokenizer directory (needed for text)")),
        ("--token-dtype", dict(choices=tuple(_data.TOKEN_DTYPES), default="uint16", help="the ids of .bin files")),
        ("--seq-len", dict(type=int, default=128, help="tokens per sequence")),
        ("--batch-size", dict(type=int, default=16, help="sequences per step, over all data-parallel ranks")),
        ("--no-shuffle", dict(action="store_true", help="read the sequences in file order")),
    ),
    "layout": (
        ("--pp", dict(type=int, default=1, help="pipeline-parallel ranks")),
        ("--dp", dict(type=int, help="data-parallel ranks (default: the world over pp x ep)")),
        ("--ep", dict(type=int, default=1, help="expert-parallel ranks (inside data parallelism)")),
        ("--nproc", dict(type=int, help="local ranks to start without torchrun (default: pp x dp x ep)")),
        ("--no-fsdp", dict(action="store_true", help="replicate over dp x ep instead of FSDP2")),
        ("--schedule", dict(choices=SCHEDULES, default="DualPipeV", help="pipeline schedule")),
        ("--microbatches", dict(type=int, default=4, help="microbatches per step and data-parallel rank")),
        ("--no-overlap", dict(action="store_true", help="run OVERLAP_F_B sequentially (what stock torch does)")),
        ("--activation-checkpointing", dict(choices=CHECKPOINTING, default="none")),
        ("--router-aux-loss", dict(choices=AUX_LOSSES, help="MoE router auxiliary loss (default: --model-type qwen3_moe and mixtral per_layer, deepseek_v3 sequence; --model: its config's, pooled where output_router_logits; a resumed run: its checkpoint's)")),
        ("--router-aux-loss-coef", dict(type=float, help="its coefficient (default: per_layer 0.02 and sequence 1e-4 for --model-type, else the config's; required for another sequence)")),
        ("--expert-bias-rate", dict(type=float, help="DeepSeek-V3's auxiliary-loss-free bias update rate (0: off; default: 1e-2 for --model-type deepseek_v3, else 0)")),
    ),
    "optimization": (
        ("--steps", dict(type=int, default=100, help="optimizer steps of the whole run")),
        ("--lr", dict(type=float, default=3e-3, help="peak learning rate (AdamW)")),
        ("--min-lr", dict(type=float, default=3e-4, help="learning rate at the end of the cosine decay")),
        ("--warmup-steps", dict(type=int, default=10, help="linear warm-up steps")),
        ("--weight-decay", dict(type=float, default=0.1)),
        ("--betas", dict(type=float, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2"))),
        ("--max-grad-norm", dict(type=float, default=1.0, help="clip the whole model's gradient norm (0: no clipping)")),
        ("--dtype", dict(choices=("float32", "bfloat16"), default="float32", help="compute dtype (weights, gradients and their reductions stay float32)")),
        ("--seed", dict(type=int, default=0, help="initial weights, data order, random ops")),
    ),
    "run": (
        ("--run-dir", dict(metavar="DIR", help="checkpoints, metrics.jsonl, training.png (required; with --compare-sequential only the data, by default in a temporary directory)")),
        ("--checkpoint-every", dict(type=int, default=50, help="steps between checkpoints (0: only the last)")),
        ("--keep", dict(type=int, default=2, help="complete checkpoints to keep")),
        ("--no-resume", dict(action="store_true", help="start afresh (removes the run's checkpoints)")),
        ("--export", dict(metavar="DIR", help="write the trained model there as a Hugging Face checkpoint")),
        ("--overwrite-export", dict(action="store_true", help="replace an existing --export directory")),
        ("--no-verify-export", dict(action="store_true", help="skip reloading the export with from_pretrained")),
        ("--device", dict(choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL, one GPU per rank")),
        ("--timeout", dict(type=float, default=600.0, help="seconds a collective may wait for its peers")),
        ("--no-progress", dict(action="store_true", help="no progress bar (the step lines stay)")),
    ),
    "evaluation and logs": (
        ("--eval-every", dict(type=int, metavar="N", help="evaluate on the held-out data every N steps and after the last (needs --eval-batches)")),
        ("--eval-batches", dict(type=int, metavar="K", help="hold out the data's last K x --batch-size sequences for evaluation (training never reads them, evaluating or not); default: none")),
        ("--tensorboard", dict(metavar="DIR", help="also write metrics.jsonl's scalars as TensorBoard events there (optional package tensorboard)")),
    ),
    "comparison": (
        ("--compare-sequential", dict(action="store_true", help="train every step twice from the same weights, with the concurrent OVERLAP_F_B of ScheduleDualPipeV and with the sequential one (what stock torch runs), and the unsplit model on the global batch: a table of both, exit status 1 unless their losses and weights are bitwise equal and the unsplit model's losses equal within float rounding; no checkpoints")),
        ("--comm-latency-ms", dict(type=float, metavar="L", help="simulated link: L ms per token all-to-all, forward and backward (default: one layer's local expert compute, measured at start-up; 0: loopback only)")),
        ("--trace", dict(metavar="DIR", help="profile the last step of both runs: Chrome traces per rank, timeline.png, expert_load.png")),
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m torch_pipelining_ext.train``."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        PROG, description=_DESCRIPTION, formatter_class=formatter
    )
    for title, flags in _FLAGS.items():
        group = p.add_argument_group(title)
        for flag, keywords in flags:
            group.add_argument(flag, **keywords)
    return p


@dataclass(frozen=True)
class Layout:
    """The ranks of a run and how they divide the work (from the flags alone)."""

    world_size: int
    pp: int
    dp: int
    ep: int
    num_stages: int

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep


def check_options(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Layout:
    """Check the flags (nothing is read or written); raises
    :class:`UsageError` with a message saying what to change."""
    environ = os.environ if environ is None else environ
    _check_numbers(args)
    _check_combinations(args)
    world, dp = _world_and_dp(args, environ)
    schedule_cls = getattr(pipelining, f"Schedule{args.schedule}")
    single = issubclass(schedule_cls, PipelineScheduleSingle)
    if args.activation_checkpointing == "selective":
        try:  # refused under split-backward schedules where torch cannot run it
            hf.check_checkpointing_schedule("selective", schedule_cls)
        except ValueError as e:
            raise UsageError(f"--activation-checkpointing selective: {e}") from e
    layout = Layout(world, args.pp, dp, args.ep, args.pp if single else 2 * args.pp)
    _check_batch(args, layout)
    if args.compare_sequential:
        _check_comparison(args)
    elif args.run_dir is None:
        raise UsageError(
            "--run-dir DIR is required (checkpoints, metrics.jsonl, training.png)"
        )
    for flag, path in (("--run-dir", args.run_dir), ("--trace", args.trace)):
        if path is not None:
            _check_creatable(flag, path)
    _check_export(args)
    _check_eval_and_logs(args)
    return layout


# (flags, the smallest value) of the numbers that must be whole and large enough
_AT_LEAST = (
    (("pp", "ep", "layers", "experts", "hidden_size", "seq_len", "batch_size",
      "microbatches", "steps", "keep", "dp", "nproc", "vocab_size"), 1),
    (("checkpoint_every", "warmup_steps"), 0),
)  # fmt: skip
_FINITE = ("lr", "min_lr", "weight_decay", "max_grad_norm", "expert_bias_rate", "timeout", "router_aux_loss_coef")  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_numbers(args: argparse.Namespace) -> None:
    for names, least in _AT_LEAST:
        for name in names:
            value = getattr(args, name)
            if value is not None and value < least:
                raise UsageError(f"{_flag(name)} must be at least {least}, got {value}")
    for name in _FINITE:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{_flag(name)} must be a finite number >= 0, got {value}")
    if not args.timeout > 0:
        raise UsageError(
            f"--timeout must be a number of seconds > 0, got {args.timeout}"
        )
    if not args.lr > 0 or args.min_lr > args.lr:
        raise UsageError(
            f"need 0 < --min-lr <= --lr, got --lr {args.lr} --min-lr {args.min_lr}"
        )
    if not all(0 <= b < 1 for b in args.betas):
        raise UsageError(f"--betas must lie in [0, 1), got {list(args.betas)}")


def _check_combinations(args: argparse.Namespace) -> None:
    if (args.model is None) == (args.model_type is None):
        raise UsageError(
            "give the model: --model DIR (a Hugging Face directory) or --model-type TYPE (a tiny config)"
        )
    if [args.data is not None, args.dataset is not None, args.synthetic_data].count(
        True
    ) != 1:
        raise UsageError(
            "give the data: --data PATH..., --dataset NAME_OR_PATH or --synthetic-data"
        )
    tiny = [f for f, default in _TINY_DEFAULTS.items() if getattr(args, f) != default]
    if args.model is not None and tiny:
        raise UsageError(
            f"{', '.join(_flag(t) for t in tiny)} set the tiny config of --model-type; "
            "a --model directory has its own config"
        )
    if args.router_aux_loss == "none" and args.router_aux_loss_coef is not None:
        raise UsageError("--router-aux-loss-coef without --router-aux-loss")
    # (the rest of the balancing flags: _balance.resolve, with the model)


def _world_and_dp(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[int, int]:
    """(world size, dp) of the run; the layout must fill the world."""
    if launcher.under_torchrun(environ):
        world = int(environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            raise UsageError(
                f"--nproc {args.nproc} differs from torchrun's world of {world} processes"
            )
    else:
        world = args.nproc or args.pp * (args.dp or 1) * args.ep
    dp = args.dp
    if dp is None:
        if world % (args.pp * args.ep):
            raise UsageError(
                f"the world of {world} ranks is not divisible by --pp {args.pp} x --ep {args.ep}: "
                "change the layout or the number of processes"
            )
        dp = world // (args.pp * args.ep)
    problem = launcher.layout_problem(world, args.pp, dp, args.ep)
    if problem is not None:
        raise UsageError(f"{problem}: change --pp/--dp/--ep or the number of processes")
    return world, dp


def _check_batch(args: argparse.Namespace, layout: Layout) -> None:
    if args.batch_size % layout.data_ranks:
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by the {layout.data_ranks} data-parallel ranks "
            f"(dp {layout.dp} x ep {layout.ep})"
        )
    local = args.batch_size // layout.data_ranks
    if local % args.microbatches:
        raise UsageError(
            f"each data-parallel rank's {local} sequences cannot be cut into --microbatches {args.microbatches}"
        )
    if args.schedule not in ("1F1B", "GPipe") and args.microbatches < layout.num_stages:
        raise UsageError(
            f"Schedule{args.schedule} needs at least as many microbatches as stages ({layout.num_stages}); "
            f"got --microbatches {args.microbatches}"
        )


def _check_comparison(args: argparse.Namespace) -> None:
    """What ``--compare-sequential`` runs: ScheduleDualPipeV both ways, in
    float32, the losses of the unsplit model comparable."""
    latency = args.comm_latency_ms
    # (not "< 0": nan compares false with everything; inf would reach time.sleep)
    if latency is not None and not 0 <= latency <= MAX_LATENCY_MS:
        raise UsageError(
            f"--comm-latency-ms must be a number of milliseconds >= 0 and <= {MAX_LATENCY_MS:g}, got {latency:g}: "
            "it is spent in every all-to-all, forward and backward, dozens of times per step"
        )
    conflicts = {
        "--schedule": args.schedule != "DualPipeV",
        "--no-overlap": args.no_overlap,
        "--export": args.export is not None,
        "--dtype": args.dtype != "float32",
        "--router-aux-loss": args.router_aux_loss not in (None, "none"),
        "--expert-bias-rate": bool(args.expert_bias_rate),
    }
    given = [flag for flag, conflict in conflicts.items() if conflict]
    if given:
        raise UsageError(
            f"--compare-sequential runs ScheduleDualPipeV's OVERLAP_F_B both ways in float32 and compares with the "
            f"unsplit Hugging Face model: drop {', '.join(given)}"
        )


def _check_creatable(flag: str, directory: str) -> None:
    """``directory`` is one, or can be made (it is, once the run is planned)."""
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {directory} is not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"{flag} {directory}: cannot create it or write there ({existing} is not a writable directory)"
        )


def _check_export(args: argparse.Namespace) -> None:
    export = args.export
    if export is not None and (
        os.path.isfile(export)
        or (os.path.isdir(export) and os.listdir(export) and not args.overwrite_export)
    ):
        raise UsageError(
            f"--export {export} exists and is not empty: pass --overwrite-export to replace it, or another directory"
        )


def _check_eval_and_logs(args: argparse.Namespace) -> None:
    """--eval-every, --eval-batches, --tensorboard."""
    for name in ("eval_every", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{_flag(name)} must be at least 1, got {value}")
    if args.eval_every is not None and args.eval_batches is None:
        raise UsageError(
            "--eval-every needs --eval-batches K: the held-out data, the last K x --batch-size sequences"
        )
    if args.compare_sequential and (
        args.eval_every or args.eval_batches or args.tensorboard
    ):
        raise UsageError(
            "--compare-sequential neither evaluates nor logs to TensorBoard: drop --eval-every, "
            "--eval-batches and --tensorboard"
        )
    if args.tensorboard is not None:
        _check_creatable("--tensorboard", args.tensorboard)
        problem = check_tensorboard(args)
        if problem is not None:
            raise UsageError(problem)


def check_tensorboard(args: argparse.Namespace) -> str | None:
    """Why ``--tensorboard`` cannot be used here, or ``None``."""
    import importlib.util

    if args.tensorboard is None:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        return (
            "--tensorboard needs the tensorboard package: pip install 'torch_pipelining_ext[tensorboard]' "
            "(it is optional)"
        )
    return None
