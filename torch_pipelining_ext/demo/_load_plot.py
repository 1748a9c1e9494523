"""The demo's expert-load plot (``--trace``): tokens per expert of every MoE
layer in the last step, as a multiple of the layer's mean."""

from __future__ import annotations

from typing import Any


__all__ = ["plot_expert_load"]


def plot_expert_load(load: Any, path: str, *, title: str = "") -> None:
    """Draw an :class:`torch_pipelining_ext.hf.ExpertLoad` into a small PNG:
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
