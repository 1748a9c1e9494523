"""The trainer's command line, and everything checked before any process
group starts.

Private helper of :mod:`torch_pipelining_ext.train`.  :func:`make_plan`
turns the parsed flags into a :class:`RunPlan` (the layout, the model's
config, the tokenized data, the checkpoint to resume) or raises
:class:`UsageError`, which ``main`` reports with exit status 2 before any
rank starts: a layout that does not fit the world, experts not divisible by
EP, a sequence longer than the model's positions, data that is empty or
cannot be read, a tokenizer larger than the model's vocabulary, a checkpoint
of another model, an export directory in use.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_pipelining_ext import hf, launcher
from torch_pipelining_ext.train import _checkpoints, _data, _model


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
CHECKPOINTING = ("none", "full")
PROG = "python -m torch_pipelining_ext.train"
# the tiny config's flags (a --model directory has its own config)
_TINY_DEFAULTS = {"layers": 4, "experts": 8, "hidden_size": 128, "vocab_size": None}


class UsageError(ValueError):
    """Bad input, found before any process group (exit status 2)."""


_DESCRIPTION = (
    "Train a Hugging Face causal LM (dense or MoE) with pipeline, data and expert "
    "parallelism: checkpoints, resume after a crash, logs, a plot and export."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m torch_pipelining_ext.train``."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        PROG, description=_DESCRIPTION, formatter_class=formatter
    )
    for title, add_flags in (
        ("model", _model_flags),
        ("data", _data_flags),
        ("layout", _layout_flags),
        ("optimization", _optimizer_flags),
        ("run", _run_flags),
    ):
        add_flags(p.add_argument_group(title))
    return p


def _model_flags(g: Any) -> None:
    g.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model directory (config.json + safetensors)",
    )
    g.add_argument(
        "--model-type",
        choices=_model.MODEL_TYPES,
        help="a tiny config of this model type instead, for trying the trainer out",
    )
    g.add_argument(
        "--layers",
        type=int,
        default=_TINY_DEFAULTS["layers"],
        help="decoder layers (--model-type)",
    )
    g.add_argument(
        "--experts",
        type=int,
        default=_TINY_DEFAULTS["experts"],
        help="routed experts per MoE layer (--model-type)",
    )
    g.add_argument(
        "--hidden-size",
        type=int,
        default=_TINY_DEFAULTS["hidden_size"],
        help="hidden size (--model-type)",
    )
    g.add_argument("--vocab-size", type=int, help="vocabulary (--model-type; default: the tokenizer's, or the token file's largest id + 1)")  # fmt: skip


def _data_flags(g: Any) -> None:
    g.add_argument("--data", nargs="+", metavar="PATH", help="plain text (.txt: one document per file), JSON lines (.jsonl: a text field per line) or token ids (.bin)")  # fmt: skip
    g.add_argument("--dataset", metavar="NAME_OR_PATH", help="a local datasets dataset instead (optional package; nothing is downloaded)")  # fmt: skip
    g.add_argument("--dataset-split", default="train", help="the split of --dataset")
    g.add_argument(
        "--text-field", default="text", help="the text field of JSON lines and datasets"
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a Hugging Face tokenizer directory (needed for text)",
    )
    g.add_argument("--token-dtype", choices=tuple(_data.TOKEN_DTYPES), default="uint16", help="the ids of .bin files")  # fmt: skip
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    g.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="sequences per step, over all data-parallel ranks",
    )
    g.add_argument(
        "--no-shuffle", action="store_true", help="read the sequences in file order"
    )


def _layout_flags(g: Any) -> None:
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    g.add_argument(
        "--dp", type=int, help="data-parallel ranks (default: the world over pp x ep)"
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (inside data parallelism)",
    )
    g.add_argument(
        "--nproc",
        type=int,
        help="local ranks to start without torchrun (default: pp x dp x ep)",
    )
    g.add_argument(
        "--no-fsdp", action="store_true", help="replicate over dp x ep instead of FSDP2"
    )
    g.add_argument(
        "--schedule", choices=SCHEDULES, default="DualPipeV", help="pipeline schedule"
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per step and data-parallel rank",
    )
    g.add_argument(
        "--no-overlap",
        action="store_true",
        help="run OVERLAP_F_B sequentially (what stock torch does)",
    )
    g.add_argument("--activation-checkpointing", choices=CHECKPOINTING, default="none")
    g.add_argument(
        "--router-aux-loss",
        choices=AUX_LOSSES,
        default="none",
        help="MoE router auxiliary loss",
    )
    g.add_argument("--router-aux-loss-coef", type=float, help="its coefficient (default: the config's; required for sequence)")  # fmt: skip
    g.add_argument("--expert-bias-rate", type=float, default=0.0, help="DeepSeek-V3's auxiliary-loss-free bias update rate (0: off)")  # fmt: skip


def _optimizer_flags(g: Any) -> None:
    g.add_argument(
        "--steps", type=int, default=100, help="optimizer steps of the whole run"
    )
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument(
        "--min-lr",
        type=float,
        default=3e-4,
        help="learning rate at the end of the cosine decay",
    )
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument(
        "--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2")
    )
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the whole model's gradient norm (0: no clipping)")  # fmt: skip
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype (weights, gradients and their reductions stay float32)")  # fmt: skip
    g.add_argument(
        "--seed", type=int, default=0, help="initial weights, data order, random ops"
    )


def _run_flags(g: Any) -> None:
    g.add_argument(
        "--run-dir",
        required=True,
        metavar="DIR",
        help="checkpoints, metrics.jsonl, training.png",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="steps between checkpoints (0: only the last)",
    )
    g.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    g.add_argument(
        "--no-resume",
        action="store_true",
        help="start afresh (removes the run's checkpoints)",
    )
    g.add_argument(
        "--export",
        metavar="DIR",
        help="write the trained model there as a Hugging Face checkpoint",
    )
    g.add_argument(
        "--overwrite-export",
        action="store_true",
        help="replace an existing --export directory",
    )
    g.add_argument(
        "--no-verify-export",
        action="store_true",
        help="skip reloading the export with from_pretrained",
    )
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo; cuda: NCCL, one GPU per rank",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a collective may wait for its peers",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (the step lines stay)",
    )


@dataclass
class RunPlan:
    """What a run does, decided before any rank starts (picklable: the local
    ranks receive it)."""

    args: argparse.Namespace
    world_size: int
    pp: int
    dp: int
    ep: int
    config: Any
    num_stages: int
    num_experts: int
    stream: _data.TokenStream
    resume: _checkpoints.Checkpoint | None

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep


def make_plan(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RunPlan:
    """Check ``args`` and prepare the run (tokenize the data); raises
    :class:`UsageError` with a message saying what to change."""
    environ = os.environ if environ is None else environ
    try:
        _check_numbers(args)
        world, dp = _layout(args, environ)
        _make_run_dir(args.run_dir)
        config = _config(args)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        plan = RunPlan(
            args, world, args.pp, dp, args.ep, config,
            num_stages=0, num_experts=0, stream=None, resume=None,
        )  # fmt: skip
        plan.stream = _token_file(args, tokenizer)
        _fit_vocabulary(plan, len(tokenizer) if tokenizer is not None else None)
        _check_model(plan)
        plan.resume = _resume_point(plan)
        _check_export(args)
        if plan.stream is None:  # text: tokenized last, nothing is written before
            plan.stream = _tokenized(args, tokenizer)
        _check_batch(plan)
        return plan
    except (_data.DataError, UsageError):
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e


def _check_numbers(args: argparse.Namespace) -> None:
    positive = ("pp", "ep", "layers", "experts", "hidden_size", "seq_len", "batch_size", "microbatches", "steps", "keep")  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    for name in ("dp", "nproc", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    for name in ("checkpoint_every", "warmup_steps"):
        if getattr(args, name) < 0:
            raise UsageError(
                f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}"
            )
    finite = (
        "lr",
        "min_lr",
        "weight_decay",
        "max_grad_norm",
        "expert_bias_rate",
        "timeout",
    )
    for name in finite:
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(
                f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}"
            )
    if not args.timeout > 0:
        raise UsageError(
            f"--timeout must be a number of seconds > 0, got {args.timeout}"
        )
    coef = args.router_aux_loss_coef
    if coef is not None and not (math.isfinite(coef) and coef >= 0):
        raise UsageError(
            f"--router-aux-loss-coef must be a finite number >= 0, got {coef}"
        )
    if not args.lr > 0 or args.min_lr > args.lr:
        raise UsageError(
            f"need 0 < --min-lr <= --lr, got --lr {args.lr} --min-lr {args.min_lr}"
        )
    if not all(0 <= b < 1 for b in args.betas):
        raise UsageError(f"--betas must lie in [0, 1), got {list(args.betas)}")
    if (args.model is None) == (args.model_type is None):
        raise UsageError(
            "give the model: --model DIR (a Hugging Face directory) or --model-type TYPE (a tiny config)"
        )
    if (args.data is None) == (args.dataset is None):
        raise UsageError("give the data: --data PATH... or --dataset NAME_OR_PATH")


def _layout(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[int, int]:
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


def _config(args: argparse.Namespace) -> Any:
    if args.model is None:
        return None  # the tiny config needs the vocabulary: _fit_vocabulary
    tiny = [f for f in _TINY_DEFAULTS if _given(args, f)]
    if tiny:
        raise UsageError(
            f"--{', --'.join(t.replace('_', '-') for t in tiny)} set the tiny config of --model-type; "
            "a --model directory has its own config"
        )
    return _model.load_config(args.model)


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name) != _TINY_DEFAULTS[name]


def _make_run_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--run-dir {path}: cannot create it: {e}") from e
    if not os.access(path, os.W_OK):
        raise UsageError(f"--run-dir {path} is not writable")


def _token_file(args: argparse.Namespace, tokenizer: Any) -> _data.TokenStream | None:
    """The run's token file where ``--data`` is one (``None``: text)."""
    if args.data is not None:
        kinds = {_data.source_kind(p) for p in args.data}
        if "binary" in kinds:
            if len(args.data) != 1:
                raise UsageError(
                    "--data takes one token file (.bin), not several or mixed with text"
                )
            return _data.binary_stream(args.data[0], args.token_dtype)
    if tokenizer is None:
        raise UsageError(
            "text needs a tokenizer: --tokenizer DIR (a Hugging Face tokenizer directory)"
        )
    return None


def _tokenized(args: argparse.Namespace, tokenizer: Any) -> _data.TokenStream:
    """The text tokenized into the run directory (once: named by a fingerprint)."""
    if args.dataset is not None:
        docs, fingerprint = _data.dataset_documents(
            args.dataset, args.dataset_split, args.text_field
        )
        fingerprint = f"{fingerprint}|{args.text_field}|{_data.files_fingerprint([], args.tokenizer, '')}"
    else:
        fingerprint = _data.files_fingerprint(
            args.data, args.tokenizer, args.text_field
        )
        docs = _data.documents(args.data, args.text_field)
    return _data.tokenized_stream(
        docs, tokenizer, fingerprint, os.path.join(args.run_dir, "data")
    )


def load_tokenizer(directory: str) -> Any:
    """A tokenizer from a local directory, with an EOS token."""
    import transformers

    if not os.path.isdir(directory):
        raise UsageError(f"--tokenizer {directory}: no such directory")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            directory, local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise UsageError(f"--tokenizer {directory}: cannot load it: {e}") from e
    if tokenizer.eos_token_id is None:
        raise UsageError(
            f"--tokenizer {directory} has no EOS token, which separates the documents"
        )
    return tokenizer


def _fit_vocabulary(plan: RunPlan, tokenizer_vocab: int | None) -> None:
    """The tiny config gets the data's vocabulary; a model's vocabulary must
    hold the tokenizer's and every id of the data."""
    args = plan.args
    max_id = plan.stream.max_id() if plan.stream is not None else None
    if plan.config is None:
        vocab = args.vocab_size or tokenizer_vocab or (max_id + 1)
        plan.config = _model.tiny_config(
            args.model_type, vocab_size=vocab, layers=args.layers, experts=args.experts,
            hidden_size=args.hidden_size,
        )  # fmt: skip
        if args.vocab_size is None:
            return
    vocab = plan.config.vocab_size
    where = f"--model {args.model}" if args.model else f"--vocab-size {vocab}"
    if tokenizer_vocab is not None and tokenizer_vocab > vocab:
        raise UsageError(
            f"the tokenizer {args.tokenizer} has {tokenizer_vocab} tokens, more than the model's vocabulary "
            f"of {vocab} ({where}): its ids would index past the embedding"
        )
    if max_id is not None and max_id >= vocab:
        raise UsageError(
            f"--data {args.data[0]} holds token id {max_id}, beyond the model's vocabulary of {vocab} ({where})"
        )


def _check_model(plan: RunPlan) -> None:
    """Positions, experts, fused experts, the split into stages, the
    auxiliary loss and the bias update, on the model built on meta."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    args, config = plan.args, plan.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if positions is not None and args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} is beyond the model's {positions} positions"
        )
    plan.num_experts = _model.num_experts(config)
    if args.ep > 1:
        if plan.num_experts == 0:
            raise UsageError(
                f"--ep {args.ep}: expert parallelism needs a MoE model; {config.model_type} has no experts"
            )
        if plan.num_experts % args.ep:
            raise UsageError(
                f"the model's {plan.num_experts} experts are not divisible by --ep {args.ep}: every "
                "expert-parallel rank holds the same number of experts"
            )
        if not hf.has_fused_experts():
            raise UsageError(
                "--ep > 1 needs transformers 5.x (fused experts, which expert parallelism shards)"
            )
    schedule_cls = getattr(pipelining, f"Schedule{args.schedule}")
    plan.num_stages = (
        args.pp if issubclass(schedule_cls, PipelineScheduleSingle) else 2 * args.pp
    )
    meta = hf.meta_causal_lm(config)
    hf.hf_module_names_per_stage(
        meta, plan.num_stages
    )  # raises ValueError if it cannot split
    _check_routing(plan, meta)


def _check_routing(plan: RunPlan, meta: Any) -> None:
    args = plan.args
    if args.router_aux_loss == "none" and args.router_aux_loss_coef is not None:
        raise UsageError("--router-aux-loss-coef without --router-aux-loss")
    if args.router_aux_loss == "sequence" and args.router_aux_loss_coef is None:
        raise UsageError(
            "--router-aux-loss sequence needs --router-aux-loss-coef (DeepSeek-V3's alpha)"
        )
    if args.router_aux_loss != "none" and plan.num_experts == 0:
        raise UsageError(
            f"--router-aux-loss {args.router_aux_loss}: the model has no router"
        )
    if args.expert_bias_rate > 0 and not any(
        name.endswith("e_score_correction_bias") for name, _ in meta.named_buffers()
    ):
        raise UsageError(
            f"--expert-bias-rate: {plan.config.model_type}'s routers have no e_score_correction_bias "
            "(DeepSeek-V3's auxiliary-loss-free balancing)"
        )


def _check_batch(plan: RunPlan) -> None:
    args = plan.args
    if args.batch_size % plan.data_ranks:
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by the {plan.data_ranks} data-parallel ranks "
            f"(dp {plan.dp} x ep {plan.ep})"
        )
    local = args.batch_size // plan.data_ranks
    if local % args.microbatches:
        raise UsageError(
            f"each data-parallel rank's {local} sequences cannot be cut into --microbatches {args.microbatches}"
        )
    if args.schedule not in ("1F1B", "GPipe") and args.microbatches < plan.num_stages:
        raise UsageError(
            f"Schedule{args.schedule} needs at least as many microbatches as stages ({plan.num_stages}); "
            f"got --microbatches {args.microbatches}"
        )
    sequences = plan.stream.num_tokens // args.seq_len
    if sequences < args.batch_size:
        raise UsageError(
            f"the data holds {plan.stream.num_tokens} tokens: {sequences} sequences of --seq-len {args.seq_len}, "
            f"fewer than one step's --batch-size {args.batch_size}"
        )


def _resume_point(plan: RunPlan) -> _checkpoints.Checkpoint | None:
    """The checkpoint to resume (checked against the model: another model's
    is refused before anything is written)."""
    args = plan.args
    if args.no_resume:
        return None
    latest = _checkpoints.RunCheckpoints(args.run_dir).latest()
    if latest is None:
        return None
    try:
        hf.check_checkpoint(plan.config, latest.path)
    except ValueError as e:
        raise UsageError(
            f"{e}. It is the latest checkpoint of --run-dir {args.run_dir}; pass --no-resume to start afresh "
            "(it removes the run's checkpoints) or another --run-dir"
        ) from e
    return latest


def _check_export(args: argparse.Namespace) -> None:
    if args.export is None:
        return
    if os.path.isfile(args.export) or (
        os.path.isdir(args.export)
        and os.listdir(args.export)
        and not args.overwrite_export
    ):
        raise UsageError(
            f"--export {args.export} exists and is not empty: pass --overwrite-export to replace it, or another directory"
        )
