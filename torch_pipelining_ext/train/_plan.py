"""What a run trains on, prepared before any process group starts.

Private helper of :mod:`torch_pipelining_ext.train`.  Once the flags passed
``_options.check_options``, :func:`make_plan` reads the model's config, the
tokenizer and the data, checks them against each other (positions, experts,
the split into stages on a meta model, the vocabulary, the checkpoint to
resume), then creates the run directory and writes the data into it.  It
raises :class:`UsageError` (exit status 2) for what it finds wrong and
leaves nothing behind: see ``[Note: a refused run writes nothing]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from torch_pipelining_ext import hf
from torch_pipelining_ext.train import _balance, _checkpoints, _data, _model
from torch_pipelining_ext.train._options import Layout, SYNTHETIC_VOCAB, UsageError


__all__: list[str] = []

# [Note: a refused run writes nothing]
# Every check that needs no file of the run comes first (``_options.py``:
# the flags; here: the config, the tokenizer, the token file, the meta model,
# the checkpoint to resume), and the run directory is created only when they
# all passed (a training run that main locked has its run directory already:
# ``[Note: the run-directory lock]`` in _checkpoints.py; what that created,
# main removes).  Writing the data (text tokenized, or synthetic sequences) is
# the one step that must come before the last check (whether the data holds one step's batch): if that check fails,
# the run directory is removed again when this call created it (else what it
# wrote into data/), so a refused command leaves the file system as it found it.  A comparison without
# --run-dir keeps its data in a temporary directory, removed after the run.


@dataclass
class RunPlan:
    """What a run does, decided before any rank starts (picklable: the local
    ranks receive it)."""

    args: argparse.Namespace
    layout: Layout
    config: Any
    num_experts: int
    stream: _data.TokenStream
    resume: _checkpoints.Checkpoint | None
    temporary_run_dir: bool = False
    balancing: _balance.Balancing | None = None  # also written into args


def make_plan(args: argparse.Namespace, layout: Layout) -> RunPlan:
    """Read and check the model, the tokenizer and the data of ``args``
    (checked by ``check_options``), then create the run directory (a
    temporary one for a comparison without ``--run-dir``) and write the data
    into it (the text tokenized, or ``--synthetic-data``); raises
    :class:`UsageError` with a message saying what to change."""
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        stream = _token_file(args, tokenizer)
        config = _config(args, stream, tokenizer)
        resume = _resume_point(args, config)
        # the flags', the recipe's, the config's or the checkpoint's
        balancing = _balance.resolve(args, config, resume)
        num_experts = _check_model(args, layout, config)
        if args.run_dir is None:  # --compare-sequential
            args.run_dir = tempfile.mkdtemp(prefix="torch_pipelining_ext_compare_")
            temporary, created = True, args.run_dir
        else:  # main locked (and made) it first, unless under torchrun
            temporary, created = False, _checkpoints.first_missing(args.run_dir)
            os.makedirs(args.run_dir, exist_ok=True)
    except (_data.DataError, UsageError):
        raise
    except ImportError as e:
        raise UsageError(
            f"the trainer needs transformers: pip install 'torch_pipelining_ext[hf]' ({e})"
        ) from e
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from e
    data = os.path.join(args.run_dir, "data")
    had = set(os.listdir(data)) if os.path.isdir(data) else None
    try:
        if args.synthetic_data:
            # one epoch: the whole run, and the held-out part after it
            sequences = args.steps * args.batch_size + _data.held_out_sequences(args)
            stream = _data.synthetic_stream(
                config.vocab_size, args.seq_len, sequences, args.seed, data
            )
        elif stream is None:  # text
            stream = _tokenized(args, tokenizer, data)
        plan = RunPlan(
            args,
            layout,
            config,
            num_experts,
            stream,
            resume,
            temporary_run_dir=temporary,
            balancing=balancing,
        )
        _check_data_size(plan)
        _check_held_out(plan)  # [Note: held-out data]
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:  # only what this call wrote into a run directory that existed
            _remove_new(data, had)
        raise
    return plan


def _check_held_out(plan: RunPlan) -> None:
    """The held-out part fits the data besides a training batch, and a
    resume keeps the split of its checkpoint; raises :class:`UsageError`."""
    args = plan.args
    held_out = _data.held_out_sequences(args)
    if held_out:
        sequences = plan.stream.num_tokens // args.seq_len
        if sequences - held_out < args.batch_size:
            raise UsageError(
                f"the data holds {sequences} sequences of --seq-len {args.seq_len}: holding out "
                f"--eval-batches {args.eval_batches} x --batch-size {args.batch_size} = {held_out} leaves "
                f"fewer than one training batch; use fewer --eval-batches or more data"
            )
    if plan.resume is not None:
        recorded = _data.recorded_held_out(plan.resume.path)
        if recorded != held_out:
            raise UsageError(
                f"the checkpoint {plan.resume.path} was trained with {recorded} sequences held out for "
                f"evaluation, this command holds out {held_out} (--eval-batches x --batch-size): the "
                f"training data would change; give the run's --eval-batches and --batch-size, or --no-resume"
            )


def _remove_new(directory: str, had: set[str] | None) -> None:
    """Remove ``directory`` if it was missing (``had`` is ``None``), else its
    entries that are not in ``had``."""
    if had is None:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for name in set(os.listdir(directory)) - had if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _token_file(args: argparse.Namespace, tokenizer: Any) -> _data.TokenStream | None:
    """The run's token file where ``--data`` is one (``None``: text)."""
    if args.synthetic_data:
        return None
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


def _tokenized(
    args: argparse.Namespace, tokenizer: Any, directory: str
) -> _data.TokenStream:
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
    return _data.tokenized_stream(docs, tokenizer, fingerprint, directory)


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


def _config(
    args: argparse.Namespace, stream: _data.TokenStream | None, tokenizer: Any
) -> Any:
    """The model's config: a tiny one gets the data's vocabulary; a model's
    vocabulary must hold the tokenizer's and every id of the data."""
    tokenizer_vocab = len(tokenizer) if tokenizer is not None else None
    max_id = stream.max_id() if stream is not None else None
    if args.model is not None:
        config = _model.load_config(args.model)
    else:
        vocab = args.vocab_size or tokenizer_vocab
        vocab = vocab or (SYNTHETIC_VOCAB if max_id is None else max_id + 1)
        config = _model.tiny_config(
            args.model_type, vocab_size=vocab, layers=args.layers, experts=args.experts,
            hidden_size=args.hidden_size,
        )  # fmt: skip
        if args.vocab_size is None:
            return config
    vocab = config.vocab_size
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
    return config


def _check_model(args: argparse.Namespace, layout: Layout, config: Any) -> int:
    """Positions, experts, fused experts, the split into stages, the
    auxiliary loss and the bias update, on the model built on meta; returns
    the number of routed experts per MoE layer (0: dense)."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if positions is not None and args.seq_len > positions:
        raise UsageError(
            f"--seq-len {args.seq_len} is beyond the model's {positions} positions"
        )
    try:
        num_experts = hf.num_routed_experts(config)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from e
    if args.ep > 1:
        if num_experts == 0:
            raise UsageError(
                f"--ep {args.ep}: expert parallelism needs a MoE model; {config.model_type} has no experts"
            )
        if num_experts % args.ep:
            raise UsageError(
                f"the model's {num_experts} experts are not divisible by --ep {args.ep}: every "
                "expert-parallel rank holds the same number of experts"
            )
        if not hf.has_fused_experts():
            raise UsageError(
                "--ep > 1 needs transformers 5.x (fused experts, which expert parallelism shards): "
                "pip install 'transformers>=5,<6'"
            )
    if args.router_aux_loss != "none" and num_experts == 0:
        raise UsageError(
            f"--router-aux-loss {args.router_aux_loss}: the model has no router"
        )
    meta = hf.meta_causal_lm(config)
    # raises ValueError if it cannot split
    hf.hf_module_names_per_stage(meta, layout.num_stages)
    if args.expert_bias_rate > 0 and not hf.has_expert_bias(meta):
        raise UsageError(
            f"--expert-bias-rate: {config.model_type}'s routers have no e_score_correction_bias "
            "(DeepSeek-V3's auxiliary-loss-free balancing)"
        )
    return num_experts


def _resume_point(
    args: argparse.Namespace, config: Any
) -> _checkpoints.Checkpoint | None:
    """The checkpoint to resume (checked against the model: another model's
    is refused before anything is written)."""
    if args.no_resume or args.run_dir is None:
        return None
    latest = _checkpoints.RunCheckpoints(args.run_dir).latest()
    if latest is None:
        return None
    try:
        hf.check_checkpoint(config, latest.path)
    except ValueError as e:
        raise UsageError(
            f"{e}. It is the latest checkpoint of --run-dir {args.run_dir}; pass --no-resume to start afresh "
            "(it removes the run's checkpoints) or another --run-dir"
        ) from e
    return latest


def _check_data_size(plan: RunPlan) -> None:
    args = plan.args
    sequences = plan.stream.num_tokens // args.seq_len
    if sequences < args.batch_size:
        raise UsageError(
            f"the data holds {plan.stream.num_tokens} tokens: {sequences} sequences of --seq-len {args.seq_len}, "
            f"fewer than one step's --batch-size {args.batch_size}"
        )
