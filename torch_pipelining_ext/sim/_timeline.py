"""A simulated step as a Chrome trace (``chrome://tracing``, Perfetto) and as a PNG.

The PNG has the demo's layout (``demo/_timeline.py``): two lanes per rank,
forward and backward, solid bars for compute, red for expert-parallel
communication, a grey band behind OVERLAP_F_B pairs -- so a predicted and a
profiled timeline can be laid side by side.
"""

from __future__ import annotations

import json
import os
from torch_pipelining_ext.sim._engine import ActionRecord, SimulationResult


def _lane(rec: ActionRecord) -> int:
    if rec.overlapped:
        return rec.lane
    return 0 if rec.computation == "F" else 1


def chrome_trace(
    result: SimulationResult, *, title: str = "predicted"
) -> dict[str, object]:
    """The trace events (microseconds): one process per rank, a forward and a backward thread."""
    events: list[dict[str, object]] = []
    for rank in sorted({r.rank for r in result.ranks}):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"rank {rank} ({title})"},
            }
        )
        for tid, name in ((0, "forward"), (1, "backward")):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": name},
                }
            )
    for rec in result.records:
        tid = _lane(rec)
        events.append(
            {
                "ph": "X",
                "name": f"PP:{rec.action}",
                "pid": rec.rank,
                "tid": tid,
                "ts": rec.start * 1e6,
                "dur": (rec.end - rec.start) * 1e6,
                "args": {"overlapped": rec.overlapped, "prediction": True},
            }
        )
        for s, e, kind in rec.intervals:
            if kind == "comm":
                events.append(
                    {
                        "ph": "X",
                        "name": "ep all-to-all",
                        "pid": rec.rank,
                        "tid": tid,
                        "ts": s * 1e6,
                        "dur": (e - s) * 1e6,
                    }
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"kind": "simulated prediction"},
    }


def write_chrome_trace(
    result: SimulationResult, path: str | os.PathLike, *, title: str = "predicted"
) -> None:
    """Write :func:`chrome_trace` of ``result`` to ``path`` as JSON."""
    with open(path, "w") as f:
        json.dump(chrome_trace(result, title=title), f)


def plot_timeline(
    result: SimulationResult, path: str | os.PathLike, *, title: str = ""
) -> None:
    """Draw the predicted step into a PNG (needs matplotlib: the ``plot`` extra)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    colors = {"F": "#4C72B0", "B": "#DD8452", "comm": "#C44E52", "overlap": "#E8E8E8"}
    ranks = sorted({r.rank for r in result.ranks})
    scale, unit = (1e3, "ms") if result.step_time < 10 else (1.0, "s")
    fig = Figure(figsize=(14, 1.4 + 0.55 * 2 * len(ranks)), dpi=110)
    ax = fig.subplots()
    pairs: dict[int, list[tuple[float, float]]] = {}
    for rec in result.records:
        if rec.overlapped:
            pairs.setdefault(rec.rank, []).append((rec.start, rec.end))
    for rank in ranks:
        base = 2 * ranks.index(rank)
        spans = pairs.get(rank, [])
        ax.broken_barh(
            [(s * scale, (e - s) * scale) for s, e in spans],
            (base - 0.45, 1.9),
            facecolors=colors["overlap"],
            zorder=0,
        )
    for rec in result.records:
        y = 2 * ranks.index(rec.rank) + _lane(rec)
        color = colors["F"] if rec.computation == "F" else colors["B"]
        comp = [
            (s * scale, (e - s) * scale) for s, e, k in rec.intervals if k == "compute"
        ]
        comm = [
            (s * scale, (e - s) * scale) for s, e, k in rec.intervals if k == "comm"
        ]
        ax.broken_barh(
            comp,
            (y - 0.3, 0.6),
            facecolors=color,
            edgecolors="white",
            linewidth=0.3,
            zorder=2,
        )
        ax.broken_barh(comm, (y - 0.3, 0.6), facecolors=colors["comm"], zorder=3)
    labels = [f"rank {r} {lane}" for r in ranks for lane in ("forward", "backward")]
    ax.set_yticks(range(2 * len(ranks)))
    ax.set_yticklabels(labels)
    ax.set_ylim(2 * len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, result.step_time * scale * 1.01)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(f"time since the start of the step ({unit})")
    ax.set_title(
        title
        or f"predicted step {result.step_time * scale:.4g} {unit} (simulation, not a measurement)",
        loc="left",
        fontsize=11,
    )
    handles = [
        Patch(color=colors["F"], label="forward compute"),
        Patch(color=colors["B"], label="backward compute (I, W, B)"),
        Patch(color=colors["comm"], label="expert-parallel all-to-all"),
        Patch(color=colors["overlap"], label="OVERLAP_F_B action"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
