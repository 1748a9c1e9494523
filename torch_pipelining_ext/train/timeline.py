"""Timeline of a profiled pipeline step: forward/backward compute and communication per thread.

Reads the Chrome traces that ``torch.profiler`` writes for ``--compare-sequential`` (one per
rank and run) and draws, for every rank, two lanes -- the forward and the
backward sub-actions -- so that an overlapped OVERLAP_F_B shows up as bars
stacked on top of each other and a sequential one as bars one after the other.

What a trace contains (and what the lanes are built from):

* ``PP:<action>`` ranges of the schedule runtime on the calling thread, one per
  action (``PP:0F3``, ``PP:3B1``, ``PP:(0F3;3B1)OVERLAP_F_B``, ...);
* ``OVERLAP_F_B forward <sub-action>`` / ``OVERLAP_F_B backward <sub-action>``
  ranges around the two sub-actions of an OVERLAP_F_B action, on the thread
  that ran each (the concurrent OVERLAP_F_B handler adds them when profiling;
  the comparison adds the same names to its sequential run's sub-actions when it traces);
* ``OVERLAP_F_B <phase> communication (<side> thread)`` ranges around the
  expert-parallel communication inside overlapped actions
  (``torch_pipelining_ext.overlap``), plus the all-to-all ops themselves,
  which also mark communication outside them (the simulated link latency
  waits inside these ranges, in no operator);
* the ATen operators each thread ran: the compute time of a sub-action (so
  time a thread spends blocked -- in a collective, or waiting for its turn at
  a communication boundary -- is not drawn as compute).

A sub-action is drawn as a thin frame over its whole span; inside it, the
operators it ran are solid bars (compute), its expert-parallel communication
is red, and white space is time in no operator: waiting (for a peer, or for
the other thread's turn to communicate) or Python between operators.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any


__all__ = [
    "EP_COMM_RANGE",
    "SUB_ACTION_RANGE",
    "phases_from_chrome_trace",
    "plot_timeline",
]

SUB_ACTION_RANGE = re.compile(r"^OVERLAP_F_B (forward|backward) (\S+)$")
_PP_ACTION = re.compile(r"^PP:(\d+)(F|B|I|W)(\d+)$")
_OVERLAP_ACTION = re.compile(r"^PP:\(.*\)OVERLAP_F_B$")
EP_COMM_RANGE = re.compile(r"^OVERLAP_F_B \S+( backward)? communication \(")
# all-to-all ops and autograd nodes (c10d::alltoall_base_, _AlltoAllSingle,
# ...), and the simulated link latency (--comm-latency-ms)
_COMM_OP = re.compile(r"all_?to_?all|_LinkLatency", re.IGNORECASE)
# Operators closer than this (µs) are drawn as one bar.
_MERGE_GAP_US = 100.0

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval], gap: float = 0.0) -> list[Interval]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _subtract(
    intervals: Sequence[Interval], holes: Sequence[Interval]
) -> list[Interval]:
    out = []
    for s, e in intervals:
        cur = s
        for hs, he in holes:
            if he <= cur or hs >= e:
                continue
            if hs > cur:
                out.append((cur, hs))
            cur = max(cur, he)
        if cur < e:
            out.append((cur, e))
    return out


def _clip(
    merged: Sequence[Interval], starts: Sequence[float], s: float, e: float
) -> list[Interval]:
    """The parts of the sorted, disjoint ``merged`` intervals inside ``[s, e]``."""
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    out = []
    while i < len(merged) and merged[i][0] < e:
        a, b = merged[i]
        if b > s:
            out.append((max(a, s), min(b, e)))
        i += 1
    return out


class _Index:
    """Sorted, disjoint intervals of one thread, for fast clipping."""

    def __init__(self, intervals: Iterable[Interval], gap: float = 0.0) -> None:
        self.merged = _union(intervals, gap)
        self.starts = [a for a, _ in self.merged]

    def clip(self, s: float, e: float) -> list[Interval]:
        return _clip(self.merged, self.starts, s, e)


def _iv(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _sub_actions(
    ranges: Sequence[dict[str, Any]],
) -> list[tuple[str, str, Any, Interval]]:
    """``(lane, name, tid, interval)`` of every sub-action of an OVERLAP_F_B
    action, and of every plain action that is not one of those."""
    subs = []
    for e in ranges:
        m = SUB_ACTION_RANGE.match(e["name"])
        if m:
            subs.append(
                ("F" if m.group(1) == "forward" else "B", m.group(2), e["tid"], _iv(e))
            )
    covered = {
        tid: _Index([s for _, _, t, s in subs if t == tid])
        for tid in {t for _, _, t, _ in subs}
    }
    for e in ranges:
        m = _PP_ACTION.match(e["name"])
        if not m:
            continue
        a, b = _iv(e)
        # a plain action, unless it is a sub-action already covered above
        idx = covered.get(e["tid"])
        if idx is not None and any(x <= a and b <= y for x, y in idx.clip(a, b)):
            continue
        subs.append(
            ("F" if m.group(2) == "F" else "B", e["name"][3:], e["tid"], (a, b))
        )
    return subs


def _thread_indices(
    ops: Sequence[dict[str, Any]], ranges: Sequence[dict[str, Any]]
) -> tuple[dict[Any, _Index], dict[Any, _Index]]:
    """Per thread id: when ATen operators ran (close ones merged), and when
    it communicated (all-to-all ops and the overlap's communication ranges)."""
    ops_by_tid: dict[Any, list[Interval]] = {}
    comm_by_tid: dict[Any, list[Interval]] = {}
    for e in ops:
        if e["name"].startswith("aten::"):
            ops_by_tid.setdefault(e["tid"], []).append(_iv(e))
        if _COMM_OP.search(e["name"]):
            comm_by_tid.setdefault(e["tid"], []).append(_iv(e))
    for e in ranges:
        if EP_COMM_RANGE.match(e["name"]):
            comm_by_tid.setdefault(e["tid"], []).append(_iv(e))
    busy_idx = {tid: _Index(v, gap=_MERGE_GAP_US) for tid, v in ops_by_tid.items()}
    comm_idx = {tid: _Index(v) for tid, v in comm_by_tid.items()}
    return busy_idx, comm_idx


def phases_from_chrome_trace(path: str) -> dict[str, Any]:
    """The drawable phases of one trace.

    Returns:
        ``{"t0": µs, "t1": µs, "overlap_actions": [(start, end)], "spans": [...]}``
        where every span is a dict with ``lane`` (``"F"``/``"B"``), ``name``
        (the sub-action), ``thread`` (``"caller"``/``"worker"``), ``start``,
        ``end``, ``compute`` and ``comm`` (lists of ``(start, end)``), all in
        µs of the trace's clock.
    """
    with open(path) as f:
        events = [
            e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e
        ]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    caller_tids = {e["tid"] for e in ranges if e["name"].startswith("PP:")}
    busy_idx, comm_idx = _thread_indices(ops, ranges)
    empty = _Index(())
    spans = []
    for lane, name, tid, (s, e) in sorted(_sub_actions(ranges), key=lambda x: x[3]):
        comm = comm_idx.get(tid, empty).clip(s, e)
        busy = busy_idx.get(tid, empty).clip(s, e)
        spans.append(
            {
                "lane": lane,
                "name": name,
                "thread": "caller" if tid in caller_tids else "worker",
                "start": s,
                "end": e,
                "compute": _subtract(busy, comm),
                "comm": comm,
            }
        )
    overlap_actions = sorted(_iv(e) for e in ranges if _OVERLAP_ACTION.match(e["name"]))
    # The step: from the first to the last range of the runtime/optimizer.
    all_iv = [_iv(e) for e in ranges if e["tid"] in caller_tids] or [
        _iv(e) for e in events
    ]
    return {
        "t0": min(a for a, _ in all_iv) if all_iv else 0.0,
        "t1": max(b for _, b in all_iv) if all_iv else 0.0,
        "overlap_actions": overlap_actions,
        "spans": spans,
    }


_TRACE_NAME = re.compile(r"trace_(?P<mode>[a-z]+)_rank(?P<rank>\d+)\.json$")
_COLORS = {"F": "#4C72B0", "B": "#DD8452", "comm": "#C44E52", "overlap": "#E8E8E8"}


def _by_mode(phases: dict[str, dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """mode -> rank -> phases, from the trace file names."""
    by_mode: dict[str, dict[int, dict[str, Any]]] = {}
    for fname, ph in phases.items():
        m = _TRACE_NAME.search(fname)
        if m:
            by_mode.setdefault(m.group("mode"), {})[int(m.group("rank"))] = ph
    if not by_mode:
        raise ValueError("no trace_<mode>_rank<r>.json phases to draw")
    return by_mode


def _draw_rank(ax: Any, ph: dict[str, Any], base: int, t0: float) -> None:
    """One rank's two lanes (forward at ``base``, backward below it), over
    grey bands where its OVERLAP_F_B actions ran."""

    def bars(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
        return [((a - t0) / 1e3, (b - a) / 1e3) for a, b in intervals]

    ax.broken_barh(
        bars(ph["overlap_actions"]),
        (base - 0.45, 1.9),
        facecolors=_COLORS["overlap"],
        zorder=0,
    )
    for lane, yy in (("F", base), ("B", base + 1)):
        spans = [sp for sp in ph["spans"] if sp["lane"] == lane]
        frames = bars((sp["start"], sp["end"]) for sp in spans)
        ax.broken_barh(
            frames,
            (yy - 0.34, 0.68),
            facecolors="none",
            edgecolors=_COLORS[lane],
            linewidth=0.8,
            zorder=1,
        )
        compute = bars(iv for sp in spans for iv in sp["compute"])
        ax.broken_barh(compute, (yy - 0.3, 0.6), facecolors=_COLORS[lane], zorder=2)
        comm = bars(iv for sp in spans for iv in sp["comm"])
        ax.broken_barh(comm, (yy - 0.3, 0.6), facecolors=_COLORS["comm"], zorder=3)


def _legend_handles() -> list[Any]:
    from matplotlib.patches import Patch

    return [
        Patch(color=_COLORS["F"], label="forward compute"),
        Patch(color=_COLORS["B"], label="backward compute"),
        Patch(color=_COLORS["comm"], label="expert-parallel all-to-all"),
        Patch(
            facecolor="white",
            edgecolor="grey",
            label="sub-action span (white: no operator running)",
        ),
        Patch(color=_COLORS["overlap"], label="OVERLAP_F_B action"),
    ]


def plot_timeline(
    phases: dict[str, dict[str, Any]], path: str, *, title: str = ""
) -> None:
    """Draw the phases of several traces into one PNG.

    Args:
        phases: trace file name (``trace_<mode>_rank<r>.json``) -> the result
            of :func:`phases_from_chrome_trace` for it.
        path: the PNG to write.
        title: figure title.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    by_mode = _by_mode(phases)
    modes = sorted(by_mode, key=lambda m: (m != "overlap", m))
    n_ranks = max(len(v) for v in by_mode.values())
    durations = {
        m: (max(p["t1"] for p in v.values()) - min(p["t0"] for p in v.values())) / 1e3
        for m, v in by_mode.items()
    }
    xmax = max(durations.values())

    fig = Figure(figsize=(14, 1.2 + len(modes) * (0.55 * 2 * n_ranks + 0.9)), dpi=110)
    axes = fig.subplots(len(modes), 1, sharex=True, squeeze=False)[:, 0]
    for ax, mode in zip(axes, modes):
        ranks = by_mode[mode]
        t0 = min(p["t0"] for p in ranks.values())
        labels = []
        for r in sorted(ranks):
            _draw_rank(ax, ranks[r], 2 * r, t0)
            labels += [f"rank {r} forward", f"rank {r} backward"]
        ax.set_yticks(range(2 * n_ranks))
        ax.set_yticklabels(labels)
        ax.set_ylim(2 * n_ranks - 0.5, -0.5)
        ax.set_xlim(0, xmax * 1.01)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(
            f"{mode} OVERLAP_F_B: profiled step {durations[mode]:.0f} ms",
            loc="left",
            fontsize=11,
        )
    axes[-1].set_xlabel("time since the start of the step (ms)")
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    fig.legend(
        handles=_legend_handles(), loc="lower center", ncol=5, fontsize=9, frameon=False
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path)
