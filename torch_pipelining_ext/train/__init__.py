"""Train a Hugging Face causal LM with pipeline, data and expert parallelism.

``python -m torch_pipelining_ext.train`` (also under ``torchrun
--nproc-per-node N -m torch_pipelining_ext.train ...``; without torchrun it
starts its own gloo ranks on this machine) takes a Hugging Face model
directory (config + safetensors, each rank reading only its stages) or a
model type with a tiny config, and text (plain text, JSON lines, a local
``datasets`` dataset) with a tokenizer directory, or token ids already
prepared (a flat ``uint16``/``uint32`` file); it trains with AdamW, linear
warm-up and cosine decay, and clipping by the whole model's gradient norm::

    python -m torch_pipelining_ext.train --model-type qwen3_moe \\
        --tokenizer tok/ --data docs.jsonl --ep 2 --steps 100 \\
        --run-dir run/ --export model/

The run directory (``--run-dir``) holds:

* ``checkpoints/step-NNNNNNNN/``: distributed checkpoints (model, AdamW,
  learning-rate schedule, data position, every rank's random number
  generators, step), every ``--checkpoint-every`` steps and at the end,
  the last ``--keep`` of them; a checkpoint appears under that name only once
  complete.  A run started again resumes the latest automatically, in any
  layout (``--no-resume`` starts afresh);
* ``metrics.jsonl``: one JSON object per step (loss, learning rate,
  gradient norm, tokens/s, tokens/s per rank, step time, expert-load
  imbalance, data position, ETA); rank 0 prints the same as one line per
  step (and a progress bar on a terminal);
* ``training.png``: loss, gradient norm, throughput and expert-load
  imbalance over the steps (with matplotlib);
* ``data/``: the text tokenized and packed, once.

With ``--compare-sequential`` (:mod:`torch_pipelining_ext.train.compare`;
``python -m torch_pipelining_ext.demo`` is its preset) the run trains every
step twice from the same weights, with ScheduleDualPipeV's concurrent
OVERLAP_F_B and with the sequential one (what stock torch runs), over a
simulated slow link for the expert-parallel all-to-alls
(``--comm-latency-ms``), and rank 0 trains the unsplit Hugging Face model on
the global batches as the reference; it prints both runs' step times and a
table, and exits with status 1 unless both runs' losses and weights are
bitwise equal and the reference's losses equal within float rounding.
``--trace DIR`` profiles the last step (Chrome traces, ``timeline.png``,
``expert_load.png``).  It writes no checkpoint; ``--synthetic-data`` trains
on sequences that follow a random permutation of the vocabulary, and
without ``--run-dir`` the data goes to a temporary directory.

With ``--export DIR`` the trained model is written as a Hugging Face
checkpoint, reloaded with ``from_pretrained`` and compared with the trained
weights (``--no-verify-export`` skips that) before the run says it is done.

Exit status: 0 when the run finished, 1 when a rank failed (the others are
stopped), 2 for bad input, found before any process group starts (a layout
that does not fit the world, experts not divisible by ``--ep``, a sequence
longer than the model's positions, empty or unreadable data, a tokenizer
larger than the model's vocabulary, a checkpoint of another model, ...).

The trainer is built from the public API of :mod:`torch_pipelining_ext.hf`
and :mod:`torch_pipelining_ext.launcher` only: its private modules are the
worked example of that API (``_options.py``: the flags; ``_plan.py``: the
model, tokenizer and data, checked; ``_pipeline.py``: the stages and one
step; ``_loop.py``: resume, training, checkpoints, export).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from torch_pipelining_ext import launcher
from torch_pipelining_ext.train import _checkpoints, _loop, compare
from torch_pipelining_ext.train._data import DataError
from torch_pipelining_ext.train._metrics import read_metrics
from torch_pipelining_ext.train._model import MODEL_TYPES, tiny_config
from torch_pipelining_ext.train._options import (
    build_parser,
    check_options,
    UsageError,
)
from torch_pipelining_ext.train._plan import make_plan, RunPlan


__all__ = ["MODEL_TYPES", "build_parser", "main", "read_metrics", "tiny_config"]


def main(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> int:
    """Entry point of ``python -m torch_pipelining_ext.train``; returns the
    exit status (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    torchrun = launcher.under_torchrun(environ)
    quiet = torchrun and environ.get("RANK") != "0"
    lock = None
    try:
        layout = check_options(args, environ)
        # [Note: the run-directory lock] (_checkpoints.py); [Note: torchrun and the
        # run-directory lock]
        if not (args.compare_sequential or torchrun):
            lock = _checkpoints.lock_run_dir(args.run_dir)
            if lock is None:
                raise UsageError(
                    f"another run uses --run-dir {args.run_dir} (it holds "
                    f"{os.path.join(args.run_dir, _checkpoints.LOCK_FILE)}): wait for "
                    "it to end, or pass another --run-dir"
                )
        plan = make_plan(args, layout)
    except BaseException as e:
        if lock is not None:  # refused: what the lock created goes
            lock.discard()
        if not isinstance(e, (UsageError, DataError)):
            raise
        if not quiet:  # under torchrun rank 0 alone explains
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.compare_sequential:
            return _launch(compare.run_rank, plan)
        return _train(plan)
    except launcher.RankFailedError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.close()
        if plan.temporary_run_dir:
            shutil.rmtree(args.run_dir, ignore_errors=True)


# [Note: torchrun and the run-directory lock]
# Under torchrun no rank takes the run-directory lock.  The lock is a flock
# held by one process for the whole job (the launching process, whose forked
# ranks share it); a torchrun job has no such process: each agent starts its
# node's ranks as processes of their own, on machines that share the run
# directory over a network file system, where flock is emulated or missing
# (NFS maps it to a byte-range lock, Lustre needs -o flock).  A lock taken by
# rank 0 alone would refuse rank 0 while the other ranks wait for it in the
# rendezvous; telling them needs the process group, after every rank's
# checks.  So under torchrun the scheduler that starts the job keeps two jobs
# off one run directory, and every rank plans the run on its own as before:
# make_plan removes a run directory it created when a check refuses the run
# (every rank refuses the same command), so a refused command still writes
# nothing.


def _train(plan: RunPlan) -> int:
    """The training run of ``plan`` (its run directory locked by
    :func:`main` unless under torchrun: ``[Note: torchrun and the
    run-directory lock]``); the summary printed."""
    summary = _launch(_loop.run_rank, plan)
    if summary:
        _print_summary(summary)
    return 0


def _launch(fn: Callable[[int, RunPlan], Any], plan: RunPlan) -> Any:
    """``fn(rank, plan)`` on every rank; what it returned on rank 0 (under
    torchrun: on this rank)."""
    return launcher.launch(
        fn,
        plan.layout.world_size,
        plan,
        backend="nccl" if plan.args.device == "cuda" else "gloo",
        timeout=timedelta(seconds=plan.args.timeout),
    )


def _print_summary(summary: dict[str, Any]) -> None:
    lines = [f"done: {summary['steps']} steps"]
    if summary["first_loss"] is not None:
        lines[0] += f", loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
    lines.append(f"checkpoint: {summary['checkpoint']}")
    if summary["plot"]:
        lines.append(f"plot: {summary['plot']}")
    if summary["export"]:
        checked = (
            ""
            if summary["export_unchecked"]
            else " (reloaded with from_pretrained: equal)"
        )
        lines.append(f"export: {summary['export']}{checked}")
    print("\n".join(lines), flush=True)
