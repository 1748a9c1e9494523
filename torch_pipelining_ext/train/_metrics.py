"""What a person watches: one line per step, the same as JSON lines in the
run directory, a progress bar.

Private helper of :mod:`torch_pipelining_ext.train`; rank 0 alone writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, TextIO


__all__: list[str] = []

METRICS_FILE = "metrics.jsonl"


@dataclass
class StepRecord:
    """One optimizer step of the run, as logged (``metrics.jsonl``: one JSON
    object per step with these fields)."""

    step: int  # optimizer steps done, 1 after the first
    loss: float  # the global batch's training loss (auxiliary terms included)
    lr: float  # the learning rate of the step
    grad_norm: float  # the whole model's gradient norm, before clipping
    tokens: int  # tokens of the global batch
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    imbalance: float | None  # max / mean tokens per expert, the worst MoE layer
    imbalance_per_layer: dict[str, float] | None  # the same per MoE layer (index)
    data_position: int  # sequences consumed by the run after this step
    eta_s: float  # the rest of the run at the recent steps' pace
    # --eval-every: the held-out batches' loss and its exponential (steps it ran)
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    # each rank's peak resident set and (CUDA) device memory of the step, MiB
    peak_rss_mib: list[float] | None = None
    peak_device_mib: list[float] | None = None

    def line(self, steps: int) -> str:
        """The step's log line."""
        width = len(str(steps))
        parts = [
            f"step {self.step:>{width}}/{steps}",
            f"loss {self.loss:.4f}",
            f"lr {self.lr:.2e}",
            f"grad_norm {self.grad_norm:.3f}",
            f"tokens/s {self.tokens_per_s:,.0f} ({self.tokens_per_s_per_rank:,.0f}/rank)",
            f"step {self.step_time_s:.3f} s",
        ]
        if self.imbalance is not None:
            parts.append(f"expert imbalance {self.imbalance:.2f}")
        if self.eval_loss is not None and self.eval_perplexity is not None:
            parts.append(
                f"eval loss {self.eval_loss:.4f} ppl {self.eval_perplexity:,.2f}"
            )
        if self.peak_rss_mib:
            parts.append(f"peak rss {max(self.peak_rss_mib):,.0f} MiB")
        if self.peak_device_mib:
            parts.append(f"peak device {max(self.peak_device_mib):,.0f} MiB")
        parts.append(f"eta {_duration(self.eta_s)}")
        return "  ".join(parts)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (a line cut short by a crash
    is left out)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the last line of a killed run
    return records


class MetricsLog:
    """``metrics.jsonl`` of a run, continued from ``from_step``: records of
    later steps (written before a crash, after the resumed checkpoint) are
    dropped, as the resumed run writes them again."""

    def __init__(self, run_dir: str, from_step: int) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= from_step]
        self.records = kept
        partial = f"{self.path}.partial"
        with open(partial, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(partial, self.path)

    def append(self, record: StepRecord) -> dict[str, Any]:
        """Write ``record``; returns it as written."""
        values = dataclasses.asdict(record)
        self.records.append(values)
        with open(self.path, "a") as f:
            f.write(json.dumps(values) + "\n")
        return values


class Progress:
    """A progress bar of the steps on rank 0 (``tqdm``, where the output is
    a terminal), with the step lines printed above it."""

    def __init__(
        self, steps: int, done: int, enabled: bool, out: TextIO | None = None
    ) -> None:
        self.out = out or sys.stdout
        self.bar: Any = None
        if enabled and self.out.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=steps,
                initial=done,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, record: StepRecord, steps: int) -> None:
        line = record.line(steps)
        if self.bar is None:
            print(line, file=self.out, flush=True)
            return
        self.bar.write(line, file=self.out)
        self.bar.set_postfix(
            loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:,.0f}"
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
