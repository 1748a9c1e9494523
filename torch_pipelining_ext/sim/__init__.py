"""Predict the step time, bubble, memory and exposed EP communication of a pipeline schedule.

Upstream target: none yet -- a candidate ``torch/distributed/pipelining/_simulate.py``
that would replace ``schedules._simulate_comms_compute`` (which checks that a
schedule can run, with unit costs and no overlap) by a timed simulation.

Everything this module returns is a **prediction** from the costs you give
it; :mod:`torch_pipelining_ext.sim.plan` derives costs from a model config and a
hardware preset, ``tools/calibrate_simulator.py`` compares predictions with
measured runs and ``tools/calibrate_trace.py`` the cost model with a profiler
trace.

The schedule is always torch's own: a schedule object (any torch schedule
class, built by :func:`build_schedule` with placeholder stages or your real
one), a ``pipeline_order`` dict or a CSV in torch's format.  Example::

    from torch_pipelining_ext.sim import (
        StageCost,
        simulate_schedule,
        write_chrome_trace,
    )

    cost = StageCost(
        forward=(1.0, 0.3, 1.0), backward_input=(1.0, 0.3, 1.0), backward_weight=1.5
    )
    result = simulate_schedule("DualPipeV", pp=4, n_microbatches=16, costs=cost)
    print(result.summary())
    write_chrome_trace(result, "predicted.json")
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from torch.distributed.pipelining.schedules import _PipelineSchedule

from torch_pipelining_ext.sim._cost_model import (
    CostOptions,
    layer_costs,
    layer_phase_times,
)
from torch_pipelining_ext.sim._hardware import HARDWARE_PRESETS, Hardware
from torch_pipelining_ext.sim._inputs import LinkCost, OverlapModel, StageCost
from torch_pipelining_ext.sim._layers import LayerCost, stage_costs_from_layers
from torch_pipelining_ext.sim._shape import ModelShape
from torch_pipelining_ext.sim._engine import (
    ActionRecord,
    RankSummary,
    SimulationResult,
    overlap_pair,
    run_simulation,
)
from torch_pipelining_ext.sim._schedule import (
    Action,
    build_schedule,
    kind,
    order_from_csv,
    schedule_order,
)
from torch_pipelining_ext.sim._timeline import (
    chrome_trace,
    plot_timeline,
    write_chrome_trace,
)


__all__ = [
    "ActionRecord",
    "CostOptions",
    "HARDWARE_PRESETS",
    "Hardware",
    "LayerCost",
    "LinkCost",
    "ModelShape",
    "OverlapModel",
    "RankSummary",
    "SimulationResult",
    "StageCost",
    "build_schedule",
    "chrome_trace",
    "kind",
    "layer_costs",
    "layer_phase_times",
    "overlap_pair",
    "plot_timeline",
    "schedule_order",
    "simulate",
    "simulate_schedule",
    "stage_costs_from_layers",
    "write_chrome_trace",
]


def simulate(
    schedule: _PipelineSchedule
    | Mapping[int, Sequence[Action | None]]
    | str
    | os.PathLike[str],
    costs: StageCost | Sequence[StageCost],
    *,
    link: LinkCost = LinkCost(),
    overlap: OverlapModel = OverlapModel(),
    csv_format: str = "compute_only",
) -> SimulationResult:
    """Simulate one step of ``schedule`` with per-stage ``costs``.

    Args:
        schedule: a torch schedule object, a dict rank -> actions
            (``pipeline_order`` or ``pipeline_order_with_comms`` style), or
            the path of a CSV in torch's format.
        costs: one :class:`StageCost` for every stage, or one for all.
        link: pipeline send/recv cost.
        overlap: how OVERLAP_F_B actions run.
        csv_format: ``"compute_only"`` or ``"compute_comms"`` for a CSV.

    Raises:
        ValueError: any input is invalid (the message names the field and
            its value, or the missing action and its rank); the costs do not
            match the schedule's stages; an action repeats; a compute-only
            order deadlocks (the message names each stuck rank).  Nothing is
            simulated then.
        RuntimeError: a schedule with communication actions deadlocks (the message names each stuck
            rank, its action and what it waits for).
    """
    _check_models(costs, link, overlap)
    if isinstance(schedule, (str, os.PathLike)):
        order, stage_to_rank = order_from_csv(schedule, csv_format)
    else:
        order, stage_to_rank = schedule_order(schedule)
    if isinstance(costs, StageCost):
        costs = [costs] * len(stage_to_rank)
    return run_simulation(order, stage_to_rank, list(costs), link, overlap)


def _check_models(
    costs: StageCost | Sequence[StageCost], link: object, overlap: object
) -> None:
    """``ValueError`` naming the argument unless the costs, link and overlap are the simulator's types."""
    if not isinstance(link, LinkCost):
        raise ValueError(f"link must be a LinkCost, got {link!r}")
    if not isinstance(overlap, OverlapModel):
        raise ValueError(f"overlap must be an OverlapModel, got {overlap!r}")
    if isinstance(costs, StageCost):
        return
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise ValueError(
            f"costs must be a StageCost or a sequence of them, got {costs!r}"
        )
    for i, c in enumerate(costs):
        if not isinstance(c, StageCost):
            raise ValueError(f"costs[{i}] must be a StageCost, got {c!r}")


def simulate_schedule(
    schedule: str | type,
    pp: int,
    n_microbatches: int,
    costs: StageCost | Sequence[StageCost],
    *,
    stages_per_rank: int | None = None,
    link: LinkCost = LinkCost(),
    overlap: OverlapModel = OverlapModel(),
    **schedule_kwargs: object,
) -> SimulationResult:
    """Build torch's ``schedule`` for ``pp`` ranks (see :func:`build_schedule`) and simulate it."""
    sched = build_schedule(
        schedule, pp, n_microbatches, stages_per_rank, **schedule_kwargs
    )
    return simulate(sched, costs, link=link, overlap=overlap)
