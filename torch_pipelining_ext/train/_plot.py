"""The run's PNG: loss (and the held-out loss), gradient norm, throughput,
expert-load imbalance and, with evaluation, perplexity over the steps
(matplotlib, the ``plot`` extra).

Private helper of :mod:`torch_pipelining_ext.train`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any


__all__: list[str] = []

logger = logging.getLogger(__name__)

PLOT_FILE = "training.png"
_PANELS = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tokens_per_s", "tokens / s"),
    ("imbalance", "expert load: max / mean (worst layer)"),
)
_EVAL_PANEL = ("eval_perplexity", "held-out perplexity")


def plot_run(records: Sequence[dict[str, Any]], path: str, title: str) -> bool:
    """Draw the records of ``metrics.jsonl`` into ``path``; ``False`` (and a
    warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("no matplotlib: %s not drawn (pip install matplotlib)", path)
        return False
    evaluated = any(r.get("eval_loss") is not None for r in records)
    panels = _PANELS + ((_EVAL_PANEL,) if evaluated else ())
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 2.5 * len(panels)), sharex=True
    )
    steps = [r["step"] for r in records]
    for ax, (field, label) in zip(axes, panels):
        values = [r.get(field) for r in records]
        points = [(s, v) for s, v in zip(steps, values) if v is not None]
        if points:
            ax.plot(
                *zip(*points),
                linewidth=1.2,
                marker="o" if field == "eval_perplexity" else None,
                markersize=3,
            )
        else:
            ax.text(
                0.5,
                0.5,
                "no MoE layer",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        if field == "loss" and evaluated:
            held = [
                (s, r["eval_loss"])
                for s, r in zip(steps, records)
                if r.get("eval_loss") is not None
            ]
            ax.plot(
                *zip(*held), linewidth=1.2, marker="o", markersize=3, label="held out"
            )
            ax.legend(fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_expert_load(load: Any, path: str, *, title: str = "") -> None:
    """Draw an :class:`torch_pipelining_ext.hf.ExpertLoad` (``--compare-sequential
    --trace``: the last step's) into a small PNG:
    per MoE layer, the tokens routed to each expert as a multiple of the mean
    (1 = balanced).

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    tokens = load.tokens_per_expert.double()
    relative = (tokens / tokens.mean(dim=-1, keepdim=True).clamp(min=1e-12)).tolist()
    n = len(load.layers)
    fig = Figure(figsize=(1.2 + 2.4 * max(n, 1), 2.6), dpi=110)
    axes = fig.subplots(1, max(n, 1), sharey=True, squeeze=False)[0]
    top = max((max(r) for r in relative), default=1.0)
    for ax, layer, row in zip(axes, load.layers, relative):
        ax.bar(range(len(row)), row, color="tab:blue")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(f"layer {layer}: max/mean {max(row):.2f}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_ylim(0, top * 1.1)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("tokens / mean", fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path)
