"""Compare the cost model with a PyTorch-profiler trace of one overlapped forward+backward chunk pair.

The trace this is written for is DeepSeek's public training profile
(``train.json`` of ``deepseek-ai/profile-data``; not part of this package,
pass its path): one DualPipe chunk pair of 4 DeepSeek-V3 MoE layers on H800,
EP64, TP1, 4K sequence, balanced routing, without pipeline communication, with
one ``user_annotation`` per phase (``attn(F)``, ``dispatch(F)``, ``mlp(F)``,
``combine(F)``, ``attn(B)``, ``mlp(B)``, ``mlp(W)``, ``attn(W)``,
``dispatch(B)``, ``combine(B)``).

Measured: a phase's time is the summed device time of the kernels launched
while its annotation was open (a kernel's launch is found through its
correlation id); the chunk pair's time is the annotated span (first to last
phase annotation, host clock) and the kernel span (first kernel start to last
kernel end).  Predicted: :func:`torch_pipelining_ext.sim.layer_phase_times`
and the all-to-all model of :func:`~torch_pipelining_ext.sim.layer_costs` for
the same shape and machine, the pair by
:func:`~torch_pipelining_ext.sim.overlap_pair`.  ``--fit`` also prints the
achieved fraction that makes the predicted compute equal the measured one.

One row per phase, then the groups (attention, MLP, dispatch+combine) and the
pair; the last line is machine-readable::

    pair_measured_ms=... pair_predicted_ms=... pair_err=...% attention_err=...% ... within_targets=yes|no
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import sys
from collections import defaultdict
from collections.abc import Mapping

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_pipelining_ext.sim import (
    CostOptions,
    HARDWARE_PRESETS,
    Hardware,
    ModelShape,
    OverlapModel,
    overlap_pair,
    stage_costs_from_layers,
)
from torch_pipelining_ext.sim.plan import MODEL_PRESETS


PHASES = (
    "attn(F)",
    "dispatch(F)",
    "mlp(F)",
    "combine(F)",
    "combine(B)",
    "mlp(B)",
    "dispatch(B)",
    "attn(B)",
    "mlp(W)",
    "attn(W)",
)
GROUPS = {
    "attention": ("attn(F)", "attn(B)", "attn(W)"),
    "MLP": ("mlp(F)", "mlp(B)", "mlp(W)"),
    "dispatch+combine": ("dispatch(F)", "combine(F)", "dispatch(B)", "combine(B)"),
}
_COMPUTE = GROUPS["attention"] + GROUPS["MLP"]
PAIR_TARGET, GROUP_TARGET = 0.15, 0.30


@dataclasses.dataclass
class TracePhases:
    """What one trace measured (seconds)."""

    phases: dict[str, float]  # summed kernel time per phase
    layers: int  # chunk layers (annotations of attn(F))
    annotated_span: float
    kernel_span: float


def read_trace(path: str) -> TracePhases:
    """The per-phase kernel times and the spans of the profiler trace at ``path``."""
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, Mapping) else events
    notes = sorted(
        (
            e
            for e in events
            if e.get("cat") == "user_annotation" and e.get("name") in PHASES
        ),
        key=lambda e: e["ts"],
    )
    if not notes:
        raise ValueError(f"{path}: no phase annotations ({', '.join(PHASES)})")
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in e.get("args", {})
    }
    starts = [n["ts"] for n in notes]
    phases: dict[str, float] = defaultdict(float)
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    for k in kernels:
        t = launches.get(k.get("args", {}).get("correlation"))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i >= 0 and t <= notes[i]["ts"] + notes[i]["dur"]:
            phases[notes[i]["name"]] += k["dur"] * 1e-6
    return TracePhases(
        phases={p: phases.get(p, 0.0) for p in PHASES},
        layers=sum(n["name"] == "attn(F)" for n in notes),
        annotated_span=(max(n["ts"] + n["dur"] for n in notes) - notes[0]["ts"]) * 1e-6,
        kernel_span=(
            max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
        )
        * 1e-6,
    )


def predict(
    shape: ModelShape,
    hardware: Hardware,
    layers: int,
    options: CostOptions,
    *,
    tokens: int,
    seq_len: int,
    ep: int,
) -> tuple[dict[str, float], float]:
    """Predicted per-phase seconds of ``layers`` MoE layers of ``tokens`` tokens
    each, and the overlapped pair's time."""
    first = shape.first_dense_layers
    index = range(first, first + layers)
    phases = dict.fromkeys(PHASES, 0.0)
    for i in index:
        times = options.phase_times(shape, hardware, i, tokens=tokens, seq_len=seq_len)
        for name, t in times.items():
            phases[name] += t
    all_layers, _, _ = options.layer_costs(
        shape, hardware, tokens=tokens, seq_len=seq_len, ep=ep
    )
    mine = [all_layers[i] for i in index]
    for layer in mine:
        phases["dispatch(F)"] += layer.dispatch
        phases["dispatch(B)"] += layer.backward_dispatch
        phases["combine(F)"] += layer.combine
        phases["combine(B)"] += layer.backward_combine
    (stage,) = stage_costs_from_layers(mine, [layers])
    f_end, b_end, _ = overlap_pair(
        stage.segments("F"), stage.segments("B"), OverlapModel()
    )
    return phases, max(f_end, b_end)


def _err(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured else float("nan")


def _report(
    measured: TracePhases, phases: Mapping[str, float], pair: float, label: str
) -> dict[str, float]:
    """Print one comparison table; returns the errors of the groups and of the pair."""
    print(f"\n{label}")
    print(f"{'phase':<18}{'measured ms':>12}{'predicted ms':>14}{'error':>9}")
    for p in PHASES:
        m, q = measured.phases[p], phases[p]
        print(f"{p:<18}{m * 1e3:>12.2f}{q * 1e3:>14.2f}{_err(q, m):>+9.1%}")
    errors = {}
    for group, names in GROUPS.items():
        m, q = sum(measured.phases[n] for n in names), sum(phases[n] for n in names)
        errors[group] = _err(q, m)
        print(f"{group:<18}{m * 1e3:>12.2f}{q * 1e3:>14.2f}{errors[group]:>+9.1%}")
    errors["pair"] = _err(pair, measured.kernel_span)
    print(
        f"{'chunk pair':<18}{measured.kernel_span * 1e3:>12.2f}{pair * 1e3:>14.2f}{errors['pair']:>+9.1%}"
        f"   (kernel span; annotated span {measured.annotated_span * 1e3:.2f} ms,"
        f" error {_err(pair, measured.annotated_span):+.1%})"
    )
    return errors


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "trace", help="the profiler trace (JSON), e.g. DeepSeek's train.json"
    )
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="deepseek-v3")
    p.add_argument("--preset", choices=sorted(HARDWARE_PRESETS), default="H800")
    p.add_argument(
        "--achieved-fraction", type=float, default=None, help="override the preset's"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens per microbatch (one 4K sequence)",
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--ep", type=int, default=64)
    p.add_argument(
        "--bf16", action="store_true", help="bf16 weight matmuls (default: FP8 GEMMs)"
    )
    p.add_argument("--dispatch-bytes", type=int, default=1, help="1: FP8 dispatch")
    p.add_argument("--combine-bytes", type=int, default=2, help="2: BF16 combine")
    p.add_argument(
        "--routing-imbalance", type=float, default=1.0, help="1.0: balanced routing"
    )
    p.add_argument(
        "--recompute", choices=("none", "full", "deepseek"), default="deepseek"
    )
    p.add_argument(
        "--fit",
        action="store_true",
        help="also fit the achieved fraction to the measured compute",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    measured = read_trace(args.trace)
    shape = ModelShape.from_hf_config(MODEL_PRESETS[args.model])
    hardware = HARDWARE_PRESETS[args.preset]
    if args.achieved_fraction is not None:
        hardware = hardware.with_overrides(achieved_fraction=args.achieved_fraction)
    options = CostOptions(
        a2a_dtype_bytes=args.dispatch_bytes,
        combine_dtype_bytes=args.combine_bytes,
        fp8_gemms=not args.bf16,
        routing_imbalance=args.routing_imbalance,
        recompute=args.recompute,
    )
    print(
        f"{args.trace}: {measured.layers} layers of {args.model}; predicted for {hardware.name} "
        f"({'bf16' if args.bf16 else 'FP8'} GEMMs), EP{args.ep}, {args.tokens} tokens/microbatch"
    )
    run = dict(tokens=args.tokens, seq_len=args.seq_len, ep=args.ep)
    phases, pair = predict(shape, hardware, measured.layers, options, **run)
    errors = _report(
        measured, phases, pair, f"achieved fraction {hardware.achieved_fraction:g}"
    )
    fitted = None
    if args.fit:
        m = sum(measured.phases[p] for p in _COMPUTE)
        fitted = round(
            hardware.achieved_fraction * sum(phases[p] for p in _COMPUTE) / m, 3
        )
        hardware = hardware.with_overrides(achieved_fraction=fitted)
        phases, pair = predict(shape, hardware, measured.layers, options, **run)
        errors = _report(
            measured,
            phases,
            pair,
            f"achieved fraction {fitted:g} (fitted to the measured compute)",
        )
    within = abs(errors["pair"]) <= PAIR_TARGET and all(
        abs(errors[g]) <= GROUP_TARGET for g in GROUPS
    )
    fields = [
        f"pair_measured_ms={measured.kernel_span * 1e3:.2f}",
        f"pair_predicted_ms={pair * 1e3:.2f}",
        f"pair_err={errors['pair']:+.1%}",
    ]
    fields += [f"{g.replace('+', '_').lower()}_err={errors[g]:+.1%}" for g in GROUPS]
    fields += [
        f"achieved_fraction={hardware.achieved_fraction:g}",
        f"within_targets={'yes' if within else 'no'}",
    ]
    print(" ".join(fields))


if __name__ == "__main__":
    main()
