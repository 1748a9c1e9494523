"""Benchmark: the trainer's tokens/s with the concurrent OVERLAP_F_B, the sequential one and 1F1B, side by side.

    python tools/bench_train.py                      # 3 rounds of 3 runs, about 3 minutes on 2 CPU cores
    python tools/bench_train.py --rounds 5 --steps 12 --warmup 4
    python tools/bench_train.py --dry-run            # the trainer commands, checked by its parser; nothing runs
    python tools/bench_train.py -- --model-type deepseek_v3 --router-aux-loss per_layer   # more trainer flags

Each run is ``python -m torch_pipelining_ext.train`` itself (a tiny
``--model-type`` on ``--synthetic-data``, ``--ep 2``: two gloo ranks on this
machine, ``--steps`` steps, no checkpoint but the last), in one of three
modes:

* ``overlap``: ``ScheduleDualPipeV`` with the concurrent OVERLAP_F_B (the
  trainer's default);
* ``no_overlap``: the same with ``--no-overlap`` (the sequential
  OVERLAP_F_B, what stock torch runs);
* ``1f1b``: ``--schedule 1F1B`` (one stage per rank, no OVERLAP_F_B).

The runs are interleaved: round after round, one run of each mode in this
order (overlap, no_overlap, 1f1b, overlap, ...), so that a change of the
machine's load between rounds reaches every mode alike.  A run's throughput
is what the trainer itself logs: ``metrics.jsonl``'s tokens/s per step
(tokens over rank 0's time of the whole optimizer step: forward, backward, gradient
reductions, clipping, the update), the first ``--warmup`` steps left out
(torch's first steps, thread pools and allocator warming up), the median
over the other steps (a step slowed down by another process moves a mean,
not the median).

Before and after every run the launching process times a CPU probe (the
busy loop of ``tools/bench_overlap.py``, median of a few) against the best
time it saw, at start-up or in any probe (a machine busy at start-up would
otherwise set a slow baseline): 1.0 means a free core, 0.5 half of one.  The probe
of a round is its lowest.  A round whose probe is at least ``--quiet-probe``
(0.8) is *quiet*; the ratios are reported over all rounds and over the quiet
rounds apart, since the overlapped run's second thread per rank makes it the
mode that loses most when other processes take the cores.

It also checks that the overlapped and the sequential runs trained the same
losses, bitwise, every step of every round (the trainer's guarantee).

The last line is machine-readable::

    tokens_per_s_overlap=... tokens_per_s_no_overlap=... tokens_per_s_1f1b=... ratio_no_overlap=...
    ratio_1f1b=... quiet_rounds=... ratio_no_overlap_quiet=... ratio_1f1b_quiet=... cpu_probe=...
    cpu_probe_min=... rounds=... timed_steps=... losses_identical=...

(one line; ``tokens_per_s_*`` the medians over the rounds; ``ratio_*`` the
median over the rounds of that round's overlapped tokens/s over the other
mode's, so above 1 the overlap is faster; ``_quiet`` the same over the quiet
rounds, ``nan`` when there is none; ``cpu_probe`` the median of the rounds'
probes, ``cpu_probe_min`` the lowest; ``losses_identical`` 1 or 0.)  With
``--dry-run`` the last line is ``bench_train=dry_run runs=...``.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


_TOOLS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TOOLS)
sys.path.insert(0, _REPO)
if _TOOLS not in sys.path:  # loaded from elsewhere (the tests)
    sys.path.insert(0, _TOOLS)

from bench_overlap import _busy_loop, calibrate_probe

from torch_pipelining_ext.train import build_parser, read_metrics


# mode -> the trainer flags that make it (on top of the common ones)
MODES: dict[str, tuple[str, ...]] = {
    "overlap": (),
    "no_overlap": ("--no-overlap",),
    "1f1b": ("--schedule", "1F1B"),
}
_PROBE_SAMPLES = 5
_RUN_TIMEOUT_S = 900.0  # one trainer run; the default one takes 20-60 s here


@dataclass
class Run:
    """One trainer run of a round, as measured."""

    mode: str
    round: int
    tokens_per_s: float
    median_step_s: float
    losses: list[float]
    probe_s: tuple[float, float]  # busy-loop seconds (median) before, after
    probe_best_s: float  # the fastest busy loop of those probes


@dataclass
class Summary:
    """What the rounds add up to (see the module's docstring)."""

    tokens_per_s: dict[str, float]
    ratios: dict[str, float]  # other mode -> median of overlap / other
    quiet_ratios: dict[str, float]
    quiet_rounds: int
    round_probes: list[float]
    losses_identical: bool
    rounds: int
    per_round: list[dict[str, Any]] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        "python tools/bench_train.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument(
        "--warmup", type=int, default=3, help="first steps of a run left out"
    )
    p.add_argument("--model-type", default="qwen3_moe")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument(
        "--quiet-probe",
        type=float,
        default=0.8,
        help="a round whose lowest CPU probe is at least this is quiet",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the trainer commands (checked by the trainer's parser), run nothing",
    )
    p.add_argument(
        "train_args",
        nargs="*",
        metavar="-- TRAIN_FLAG",
        help="more flags for every trainer run (after --)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be at least 1, --warmup at least 0")
    if args.warmup >= args.steps:
        p.error(
            f"--warmup {args.warmup} leaves none of the --steps {args.steps} to time"
        )
    if not 0 < args.quiet_probe <= 1:
        p.error(f"--quiet-probe must be in (0, 1], got {args.quiet_probe}")
    return args


def trainer_flags(args: argparse.Namespace, mode: str, run_dir: str) -> list[str]:
    """The flags of ``python -m torch_pipelining_ext.train`` for one run of ``mode``."""
    return [
        "--model-type", args.model_type, "--synthetic-data",
        "--pp", str(args.pp), "--ep", str(args.ep),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--microbatches", str(args.microbatches), "--steps", str(args.steps),
        "--checkpoint-every", "0", "--keep", "1", "--no-resume", "--no-progress",
        "--run-dir", run_dir,
        *MODES[mode],
        *args.train_args,
    ]  # fmt: skip


def measure(records: Sequence[dict[str, Any]], warmup: int) -> tuple[float, float]:
    """(tokens/s, step seconds) of a run's ``metrics.jsonl`` records: the
    medians over its steps, the first ``warmup`` left out."""
    timed = [r for r in records if r["step"] > warmup]
    if not timed:
        raise ValueError(
            f"no step after the first {warmup} in the run's metrics: {len(records)} records"
        )
    return (
        statistics.median(r["tokens_per_s"] for r in timed),
        statistics.median(r["step_time_s"] for r in timed),
    )


def probe() -> tuple[float, float]:
    """(median, fastest) seconds of a few runs of ``tools/bench_overlap.py``'s
    busy loop, now."""
    times = []
    for _ in range(_PROBE_SAMPLES):
        times.append(_busy_loop())
        time.sleep(2e-3)
    return statistics.median(times), min(times)


def run_once(args: argparse.Namespace, mode: str, round_: int, tmp: str) -> Run:
    """One trainer run of ``mode``, probed before and after."""
    run_dir = os.path.join(tmp, f"{mode}-{round_}")
    cmd = [sys.executable, "-m", "torch_pipelining_ext.train"]
    cmd += trainer_flags(args, mode, run_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
    before, best_before = probe()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=_RUN_TIMEOUT_S
    )
    after, best_after = probe()
    if proc.returncode != 0:
        raise RuntimeError(
            f"round {round_}, {mode}: the trainer exited with status {proc.returncode}\n"
            f"  {shlex.join(cmd)}\n{proc.stderr[-3000:]}"
        )
    records = read_metrics(run_dir)
    tokens_per_s, median_step = measure(records, args.warmup)
    return Run(
        mode,
        round_,
        tokens_per_s,
        median_step,
        [r["loss"] for r in records],
        (before, after),
        min(best_before, best_after),
    )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(runs: Sequence[Run], quiet_probe: float, baseline_s: float) -> Summary:
    """The rounds' medians and ratios (see the module's docstring);
    ``baseline_s``: the fastest busy loop of the start-up."""
    best = min([baseline_s] + [r.probe_best_s for r in runs])
    rounds = sorted({r.round for r in runs})
    by = {(r.round, r.mode): r for r in runs}
    others = [m for m in MODES if m != "overlap"]
    per_round = []
    for n in rounds:
        row: dict[str, Any] = {
            "round": n,
            "probe": min(
                min(1.0, best / t) for r in runs if r.round == n for t in r.probe_s
            ),
        }
        for m in others:
            row[m] = by[n, "overlap"].tokens_per_s / by[n, m].tokens_per_s
        per_round.append(row)
    quiet = [row for row in per_round if row["probe"] >= quiet_probe]
    identical = all(
        by[n, "overlap"].losses == by[n, "no_overlap"].losses
        and len(by[n, "overlap"].losses) > 0
        for n in rounds
    )
    return Summary(
        tokens_per_s={
            m: _median([by[n, m].tokens_per_s for n in rounds]) for m in MODES
        },
        ratios={m: _median([row[m] for row in per_round]) for m in others},
        quiet_ratios={m: _median([row[m] for row in quiet]) for m in others},
        quiet_rounds=len(quiet),
        round_probes=[row["probe"] for row in per_round],
        losses_identical=identical,
        rounds=len(rounds),
        per_round=per_round,
    )


def last_line(summary: Summary, timed_steps: int) -> str:
    """The machine-readable line (see the module's docstring)."""
    fields = [f"tokens_per_s_{m}={v:.1f}" for m, v in summary.tokens_per_s.items()]
    fields += [f"ratio_{m}={v:.3f}" for m, v in summary.ratios.items()]
    fields.append(f"quiet_rounds={summary.quiet_rounds}")
    fields += [f"ratio_{m}_quiet={v:.3f}" for m, v in summary.quiet_ratios.items()]
    fields += [
        f"cpu_probe={_median(summary.round_probes):.2f}",
        f"cpu_probe_min={min(summary.round_probes):.2f}",
        f"rounds={summary.rounds}",
        f"timed_steps={timed_steps}",
        f"losses_identical={int(summary.losses_identical)}",
    ]
    return " ".join(fields)


def _print_summary(summary: Summary, quiet_probe: float) -> None:
    print("\nper round (overlapped tokens/s over the other mode's; CPU probe):")
    for row in summary.per_round:
        quiet = "" if row["probe"] >= quiet_probe else "  (busy)"
        print(
            f"  round {row['round']}: / no_overlap {row['no_overlap']:.3f}  "
            f"/ 1f1b {row['1f1b']:.3f}  probe {row['probe']:.2f}{quiet}"
        )
    print("tokens/s, median over the rounds:")
    for mode, value in summary.tokens_per_s.items():
        print(f"  {mode:<11} {value:,.0f}")
    print(
        f"overlapped / no_overlap {summary.ratios['no_overlap']:.3f}, / 1f1b {summary.ratios['1f1b']:.3f} "
        f"(all {summary.rounds} rounds); over the {summary.quiet_rounds} rounds with probe >= {quiet_probe:g}: "
        f"{summary.quiet_ratios['no_overlap']:.3f}, {summary.quiet_ratios['1f1b']:.3f}"
    )
    print(
        "losses overlapped == no_overlap (bitwise, every step and round): "
        + ("yes" if summary.losses_identical else "NO")
    )


def dry_run(args: argparse.Namespace) -> int:
    """Print every run's trainer command, each parsed by the trainer's parser."""
    parser = build_parser()
    count = 0
    for n in range(1, args.rounds + 1):
        for mode in MODES:
            flags = trainer_flags(args, mode, os.path.join("RUN_DIR", f"{mode}-{n}"))
            parser.parse_args(flags)  # exits with status 2 on a flag it lacks
            print(
                f"round {n} {mode}: python -m torch_pipelining_ext.train {shlex.join(flags)}"
            )
            count += 1
    print(f"bench_train=dry_run runs={count}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    baseline = calibrate_probe()
    print(
        f"{args.rounds} rounds of {', '.join(MODES)}: tiny {args.model_type}, pp={args.pp} x ep={args.ep}, "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, the first {args.warmup} not timed; "
        f"{os.cpu_count()} CPUs; CPU probe baseline {baseline * 1e3:.2f} ms",
        flush=True,
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for n in range(1, args.rounds + 1):
            for mode in MODES:
                run = run_once(args, mode, n, tmp)
                runs.append(run)
                print(
                    f"round {n} {mode:<11} {run.tokens_per_s:8,.0f} tokens/s  median step {run.median_step_s:.3f} s  "
                    f"probe {run.probe_s[0] * 1e3:.2f} / {run.probe_s[1] * 1e3:.2f} ms",
                    flush=True,
                )
    summary = summarize(runs, args.quiet_probe, baseline)
    _print_summary(summary, args.quiet_probe)
    print()
    print(last_line(summary, args.steps - args.warmup))
    return 0 if summary.losses_identical else 1


if __name__ == "__main__":
    sys.exit(main())
