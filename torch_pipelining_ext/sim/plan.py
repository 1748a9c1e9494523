"""Planner: rank pipeline configurations of a model on a cluster by *predicted* step time.

``python -m torch_pipelining_ext.plan --model deepseek-v3 --gpus 2048 --preset H800 --pp 16 --ep 64``

For every candidate (schedule, PP, stages per rank, microbatches, EP,
OVERLAP_F_B overlap on/off) the per-action costs come from the model shape
and the hardware description (:meth:`torch_pipelining_ext.sim.CostOptions.layer_costs`),
torch's schedule is simulated (:mod:`torch_pipelining_ext.sim`), and the
candidates that fit the memory limit are printed fastest first.  Every number
printed is a prediction from a roofline-style cost model, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from torch_pipelining_ext.sim import (
    CostOptions,
    HARDWARE_PRESETS,
    Hardware,
    LinkCost,
    ModelShape,
    OverlapModel,
    SimulationResult,
    StageCost,
    plot_timeline,
    simulate_schedule,
    stage_costs_from_layers,
    write_chrome_trace,
)
from torch_pipelining_ext.sim._cost_model import Recompute
from torch_pipelining_ext.sim._inputs import check_number
from torch_pipelining_ext.sim._layers import even_layer_split
from torch_pipelining_ext.sim._memory import stage_params, static_memory_bytes


__all__ = ["MODEL_PRESETS", "Candidate", "main", "plan"]

logger = logging.getLogger(__name__)

# Fields of the public config.json files (Hugging Face Hub), by preset name.
MODEL_PRESETS: dict[str, dict[str, Any]] = json.loads(
    Path(__file__).with_name("model_presets.json").read_text()
)


class _Schedule(NamedTuple):
    """A schedule the planner offers."""

    label: str  # the planner's name (``--schedules``, the printed table)
    torch_name: str  # the torch schedule that is simulated
    stages_per_rank: int


# 1F1B runs as torch's Interleaved1F1B with one stage per rank (Schedule1F1B's
# own pipeline_order is not a valid IR, see docs/simulator.md).
_SCHEDULES: dict[str, _Schedule] = {
    s.label: s
    for s in (
        _Schedule("1F1B", "Interleaved1F1B", 1),
        _Schedule("Interleaved1F1B", "Interleaved1F1B", 2),
        _Schedule("ZB1P", "InterleavedZeroBubble", 1),
        _Schedule("InterleavedZeroBubble", "InterleavedZeroBubble", 2),
        _Schedule("ZBVZeroBubble", "ZBVZeroBubble", 2),
        _Schedule("DualPipeV", "DualPipeV", 2),
    )
}


class _GridPoint(NamedTuple):
    """One (PP, DP, EP, microbatches) of the search."""

    pp: int
    dp: int
    ep: int
    microbatches: int


@dataclasses.dataclass
class Candidate:
    """One predicted configuration."""

    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    ep: int
    overlap: bool | None  # None: the schedule has no OVERLAP_F_B actions
    step_time: float
    bubble: float
    exposed_comm: float
    memory_bytes: float
    fits: bool
    result: SimulationResult | None = dataclasses.field(default=None, repr=False)


def _configurations(
    shape: ModelShape,
    n_stages_per_pp: int,
    gpus: int,
    global_batch: int,
    pps: Sequence[int],
    eps: Sequence[int],
    microbatches: Sequence[int] | None,
    at_least_stages: bool,
) -> Iterator[_GridPoint]:
    """Every (PP, DP, EP, microbatches) that divides the GPUs, the experts and the batch."""
    for pp in pps:
        if gpus % pp:
            continue
        dp = gpus // pp
        n_stages = pp * n_stages_per_pp
        for ep in eps:
            if dp % ep or (shape.num_experts and shape.num_experts % ep):
                continue
            for m in microbatches or (n_stages, 2 * n_stages):
                if global_batch % (dp * m) or (at_least_stages and m < n_stages):
                    continue
                yield _GridPoint(pp, dp, ep, m)


def _stage_inputs(
    shape: ModelShape,
    hardware: Hardware,
    schedule: _Schedule,
    point: _GridPoint,
    *,
    seq_len: int,
    global_batch: int,
    options: CostOptions,
) -> tuple[list[StageCost], list[tuple[float, float]]]:
    """The per-stage costs and (dense, expert) parameters of ``point``'s even layer split."""
    tokens = global_batch // (point.dp * point.microbatches) * seq_len
    layers, embed, head = options.layer_costs(
        shape, hardware, tokens=tokens, seq_len=seq_len, ep=point.ep
    )
    split = even_layer_split(shape.num_layers, point.pp * schedule.stages_per_rank)
    costs = stage_costs_from_layers(layers, split, first_extra=embed, last_extra=head)
    return costs, stage_params(shape, split, point.ep)


def _peak_memory_bytes(
    result: SimulationResult,
    params: Sequence[tuple[float, float]],
    point: _GridPoint,
) -> float:
    """The most any rank holds: its stages' parameters and optimizer state, plus its peak activations."""
    return max(
        static_memory_bytes(
            [params[s] for s, r in result.stage_to_rank.items() if r == rank],
            point.dp,
            point.ep,
        )
        + result.ranks[rank].peak_activation_bytes
        for rank in range(point.pp)
    )


def _point_candidates(
    schedule: _Schedule,
    point: _GridPoint,
    costs: Sequence[StageCost],
    params: Sequence[tuple[float, float]],
    link: LinkCost,
    memory_limit: float,
) -> list[Candidate]:
    """``point`` simulated: with and without OVERLAP_F_B overlap for DualPipeV, once otherwise."""
    rows: list[Candidate] = []
    dual = schedule.torch_name == "DualPipeV"
    for overlap in (True, False) if dual else (None,):
        try:
            result = simulate_schedule(
                schedule.torch_name,
                point.pp,
                point.microbatches,
                costs,
                stages_per_rank=schedule.stages_per_rank,
                link=link,
                overlap=OverlapModel(enabled=bool(overlap)),
            )
        except ValueError as e:  # torch's constructor refuses this (PP, microbatches)
            logger.debug(
                "skipping %s pp=%d m=%d: %s",
                schedule.label,
                point.pp,
                point.microbatches,
                e,
            )
            break
        mem = _peak_memory_bytes(result, params, point)
        rows.append(
            Candidate(
                schedule.label,
                point.pp,
                schedule.stages_per_rank,
                point.microbatches,
                point.ep,
                overlap,
                result.step_time,
                result.bubble_fraction,
                result.exposed_comm,
                mem,
                mem <= memory_limit,
                result,
            )
        )
    return rows


def plan(
    shape: ModelShape,
    hardware: Hardware,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    pps: Sequence[int],
    eps: Sequence[int],
    microbatches: Sequence[int] | None,
    schedules: Sequence[str],
    memory_limit: float,
    a2a_bytes: int = 2,
    recompute: Recompute | bool = False,
    combine_bytes: int | None = None,
    fp8_gemms: bool = False,
) -> list[Candidate]:
    """Every feasible candidate, predicted; fitting ones first, fastest first.

    ``a2a_bytes`` (the dispatch's, and the combine's unless
    ``combine_bytes``), ``recompute`` and ``fp8_gemms`` are the cost model's
    options (:class:`~torch_pipelining_ext.sim.CostOptions`).

    Raises:
        ValueError: an argument is invalid (the message names it and its value).
    """
    _check_plan_args(
        {"gpus": gpus, "seq_len": seq_len, "global_batch": global_batch},
        {"pps": pps, "eps": eps, "microbatches": microbatches},
        schedules,
    )
    check_number("memory_limit", memory_limit, positive=True)
    check_number("a2a_bytes", a2a_bytes, positive=True)
    options = CostOptions(
        a2a_dtype_bytes=a2a_bytes,
        combine_dtype_bytes=combine_bytes,
        recompute=recompute,
        fp8_gemms=fp8_gemms,
    )
    link = LinkCost(hardware.p2p_latency, hardware.inter_node_a2a_gbps * 1e9)
    rows: list[Candidate] = []
    for label in schedules:
        schedule = _SCHEDULES[label]
        grid = _configurations(
            shape,
            schedule.stages_per_rank,
            gpus,
            global_batch,
            pps,
            eps,
            microbatches,
            schedule.torch_name == "DualPipeV",
        )
        for point in grid:
            costs, params = _stage_inputs(
                shape,
                hardware,
                schedule,
                point,
                seq_len=seq_len,
                global_batch=global_batch,
                options=options,
            )
            rows.extend(
                _point_candidates(schedule, point, costs, params, link, memory_limit)
            )
    rows.sort(key=lambda c: (not c.fits, c.step_time))
    return rows


def _check_plan_args(
    counts: dict[str, int],
    lists: dict[str, Sequence[int] | None],
    schedules: Sequence[str],
) -> None:
    """``ValueError`` naming the first argument of :func:`plan` that is not valid."""
    for name, value in counts.items():
        check_number(name, value, positive=True, integer=True)
    for name, values in lists.items():
        if values is None and name == "microbatches":
            continue
        if not values:
            raise ValueError(f"{name} must name at least one value, got {values!r}")
        for v in values:
            check_number(f"{name} item", v, positive=True, integer=True)
    unknown = [x for x in schedules if x not in _SCHEDULES]
    if not schedules or unknown:
        raise ValueError(
            f"schedules must be some of {', '.join(_SCHEDULES)}, got {list(schedules)!r}"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_pipelining_ext.plan",
        description="Rank pipeline configurations by PREDICTED step time (a simulation, not a measurement).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(MODEL_PRESETS), help="a built-in config")
    src.add_argument("--config", help="a Hugging Face config.json (dense or MoE)")
    p.add_argument(
        "--gpus",
        type=int,
        required=True,
        help="GPUs of the job (PP x DP; EP divides DP)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(HARDWARE_PRESETS),
        default="H100",
        help="the GPU and its links (default: %(default)s)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a hardware field, e.g. achieved_fraction=0.35 (repeatable)",
    )
    _add_grid_flags(p)
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="memory per GPU a candidate may use, GiB (default: 90%% of the preset's HBM)",
    )
    p.add_argument(
        "--a2a-bytes",
        type=int,
        default=2,
        help="bytes per element of the all-to-alls (1: FP8 dispatch)",
    )
    p.add_argument(
        "--combine-bytes",
        type=int,
        default=None,
        help="bytes per element of the combine (default: --a2a-bytes; 2 with --a2a-bytes 1: FP8 dispatch, BF16 combine)",
    )
    p.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        default="none",
        choices=("none", "full", "deepseek"),
        help="full activation checkpointing (no value or 'full'), or 'deepseek': recompute RMSNorm "
        "and the MLA up-projections only (selective checkpointing at run time: under split-backward "
        "schedules it needs the package's checkpoint_split_backward patch)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 weight matmuls (the preset's fp8_tflops)",
    )
    p.add_argument(
        "--top", type=int, default=10, help="candidates printed (default: %(default)s)"
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="write the best candidate's timeline (best.json, best.png)",
    )
    p.add_argument("--quiet", action="store_true", help="print nothing (for tests)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when no candidate fits the memory limit (default: 0, "
        "the table and a line saying why)",
    )
    return p


def _add_grid_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the candidates' grid: batch, PP, EP, microbatches, schedules."""
    p.add_argument(
        "--seq-len",
        type=int,
        default=4096,
        help="tokens per sequence (default: %(default)s)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step (default: 64 per DP rank of the smallest PP)",
    )
    p.add_argument("--pp", default="4,8,16", help="comma-separated PP degrees")
    p.add_argument(
        "--ep",
        default=None,
        help="comma-separated EP degrees (default: 1 for dense, 8,16,32,64 for MoE)",
    )
    p.add_argument(
        "--microbatches",
        default=None,
        help="comma-separated counts (default: stages and 2x stages)",
    )
    p.add_argument(
        "--schedules",
        default="1F1B,Interleaved1F1B,ZB1P,ZBVZeroBubble,DualPipeV",
        help=f"comma-separated, of {', '.join(_SCHEDULES)}",
    )


def _model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``--config``'s file, or of the ``--model`` preset."""
    if args.config:
        with open(args.config) as f:
            return json.load(f)
    return MODEL_PRESETS[args.model]


def _hardware(
    parser: argparse.ArgumentParser, preset_name: str, override: Sequence[str]
) -> Hardware:
    """The preset with the ``--override FIELD=VALUE`` items applied (converted to the field's type)."""
    preset = HARDWARE_PRESETS[preset_name]
    fields = [f.name for f in dataclasses.fields(preset)]
    overrides = {}
    for item in override:
        key, _, value = item.partition("=")
        if key not in fields or key == "name":
            parser.error(
                f"--override {item}: not a hardware field ({', '.join(fields)})"
            )
        try:
            overrides[key] = type(getattr(preset, key))(value)
        except ValueError:
            parser.error(f"--override {item}: {value!r} is not a {key} value")
    try:
        return preset.with_overrides(**overrides)
    except ValueError as e:
        parser.error(f"--override: {e}")


def _peak(args: argparse.Namespace, hardware: Hardware) -> str:
    """The peak the cost model uses, for the header."""
    if args.fp8:
        return f"FP8 GEMMs {hardware.fp8_tflops:g} TFLOP/s, attention {hardware.bf16_tflops:g}"
    return f"{hardware.bf16_tflops:g} TFLOP/s"


def _print_table(
    out: Callable[..., None],
    args: argparse.Namespace,
    hardware: Hardware,
    global_batch: int,
    limit: float,
    rows: Sequence[Candidate],
) -> None:
    """The header and the ``--top`` best candidates, one line each."""
    out(
        f"PREDICTIONS (simulated, not measured): {args.model or args.config} on {args.gpus} x {hardware.name} "
        f"({_peak(args, hardware)} x {hardware.achieved_fraction:g}), seq {args.seq_len}, "
        f"global batch {global_batch} sequences, memory limit {limit / 2**30:.0f} GiB"
    )
    out(
        f"{'schedule':<16}{'pp':>4}{'v':>3}{'mb':>5}{'ep':>5} {'overlap':<8}{'step s':>10}{'bubble':>8}"
        f"{'exp.comm s':>11}{'mem GiB':>9}  fits"
    )
    for c in rows[: args.top]:
        ov = "-" if c.overlap is None else ("on" if c.overlap else "off")
        out(
            f"{c.schedule:<16}{c.pp:>4}{c.stages_per_rank:>3}{c.microbatches:>5}{c.ep:>5} {ov:<8}{c.step_time:>10.3f}"
            f"{c.bubble:>8.1%}{c.exposed_comm:>11.3f}{c.memory_bytes / 2**30:>9.1f}  {'yes' if c.fits else 'no'}"
        )
    if not rows:
        out(
            "no candidate: check that --gpus is divisible by PP x EP and --global-batch by DP x microbatches"
        )


def _write_trace(out: Callable[..., None], directory: str, best: Candidate) -> None:
    """``best``'s predicted timeline as ``best.json`` (Chrome trace) and ``best.png``."""
    if best.result is None:
        raise ValueError(f"{best} holds no simulated timeline to write")
    os.makedirs(directory, exist_ok=True)
    write_chrome_trace(
        best.result,
        os.path.join(directory, "best.json"),
        title=f"{best.schedule} predicted",
    )
    try:
        plot_timeline(best.result, os.path.join(directory, "best.png"))
    except ImportError:
        out("matplotlib is not installed: wrote best.json only (pip install .[plot])")


def _int_list(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``text`` as comma-separated integers, or a usage error naming ``flag``."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")


def main(argv: Sequence[str] | None = None) -> list[Candidate]:
    """The command line: parse ``argv``, plan, print the best candidates; returns every candidate.

    Invalid arguments exit with status 2 and a message naming them.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shape = ModelShape.from_hf_config(_model_config(args))
    except (OSError, ValueError, TypeError) as e:
        parser.error(f"{args.config or args.model}: {e}")
    hardware = _hardware(parser, args.preset, args.override)
    pps = _int_list(parser, "--pp", args.pp)
    eps = (
        _int_list(parser, "--ep", args.ep)
        if args.ep
        else ([1] if not shape.num_experts else [8, 16, 32, 64])
    )
    if args.gpus < 1 or not pps or min(pps) < 1:
        parser.error(f"--gpus {args.gpus} and --pp {args.pp} must be positive")
    global_batch = (
        args.global_batch
        if args.global_batch is not None
        else 64 * max(1, args.gpus // min(pps))
    )
    limit = (
        (args.memory_limit_gib * 2**30)
        if args.memory_limit_gib is not None
        else 0.9 * hardware.hbm_bytes
    )
    microbatches = (
        _int_list(parser, "--microbatches", args.microbatches)
        if args.microbatches
        else None
    )
    search = functools.partial(
        _plan_args, args, shape, hardware, global_batch, limit, eps, microbatches
    )
    try:
        rows = search(pps, args.recompute)
    except ValueError as e:
        parser.error(str(e))
    out = (lambda *a: None) if args.quiet else print
    _print_table(out, args, hardware, global_batch, limit, rows)
    if rows and not any(c.fits for c in rows) and not args.quiet:
        out(_nothing_fits(args, shape, pps, limit, rows, search))
    if args.trace and rows:
        _write_trace(out, args.trace, rows[0])
    if args.strict and not any(c.fits for c in rows):
        raise SystemExit(1)
    return rows


class _Alternative(NamedTuple):
    """A flag that lowers the memory a candidate needs, and the search with it."""

    flag: str
    recompute: Recompute
    pps: list[int]


def _alternatives(
    args: argparse.Namespace, shape: ModelShape, pps: list[int]
) -> list[_Alternative]:
    """Flags that lower the memory a candidate needs, most specific first."""
    found = []
    if args.recompute == "none" and shape.kv_lora_rank:
        found.append(_Alternative("--recompute deepseek", "deepseek", pps))
    if args.recompute != "full":
        found.append(_Alternative("--recompute full", "full", pps))
    more_pp = 2 * max(pps)
    if args.gpus % more_pp == 0:
        found.append(_Alternative(f"--pp {more_pp}", args.recompute, [more_pp]))
    return found


def _nothing_fits(
    args: argparse.Namespace,
    shape: ModelShape,
    pps: list[int],
    limit: float,
    rows: Sequence[Candidate],
    retry: Callable[[list[int], str], list[Candidate]],
) -> str:
    """Why no candidate fits, and the first flag that makes one fit (tried)."""
    need = sorted(c.memory_bytes for c in rows)
    line = (
        f"nothing fits: each of the {len(rows)} candidates needs more memory than the limit of "
        f"{limit / 2**30:.1f} GiB per GPU (from {need[0] / 2**30:.1f} to {need[-1] / 2**30:.1f} GiB)."
    )
    tried = _alternatives(args, shape, pps)
    for alt in tried:
        fitting = [c for c in retry(alt.pps, alt.recompute) if c.fits]
        if fitting:
            best = fitting[0]
            return (
                f"{line} With {alt.flag}, {len(fitting)} fit (best: {best.schedule}, pp {best.pp}, "
                f"{best.microbatches} microbatches, ep {best.ep}, {best.step_time:.3f} s predicted); "
                "a higher --memory-limit-gib also counts more as fitting."
            )
    flags = ", ".join(alt.flag for alt in tried)
    return (
        f"{line} {'Tried ' + flags + ': none makes one fit. ' if flags else ''}"
        "Try more --gpus, larger --ep or --microbatches values, or --memory-limit-gib."
    )


def _plan_args(
    args: argparse.Namespace,
    shape: ModelShape,
    hardware: Hardware,
    global_batch: int,
    limit: float,
    eps: list[int],
    microbatches: list[int] | None,
    pps: list[int],
    recompute: Recompute,
) -> list[Candidate]:
    """:func:`plan` with the command line's arguments (``pps`` and ``recompute``
    may differ from the command line's: an alternative tried)."""
    return plan(
        shape,
        hardware,
        gpus=args.gpus,
        seq_len=args.seq_len,
        global_batch=global_batch,
        pps=pps,
        eps=eps,
        microbatches=microbatches,
        schedules=args.schedules.split(","),
        memory_limit=limit,
        a2a_bytes=args.a2a_bytes,
        recompute=recompute,
        combine_bytes=args.combine_bytes,
        fp8_gemms=args.fp8,
    )


if __name__ == "__main__":
    main()
