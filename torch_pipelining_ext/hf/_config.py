# mypy: allow-untyped-defs
"""What :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm` is given,
checked before anything is built.

Private helper of :mod:`torch_pipelining_ext.hf`: its options, the
activation checkpointing mode against the schedule, the pipeline and
expert-parallel dimensions, and the default number of stages.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch


__all__: list[str] = []


@dataclass(frozen=True)
class StageOptions:
    """The keyword arguments of ``pipeline_hf_causal_lm``."""

    num_stages: int | None = None
    layer_costs: Sequence[float] | str | None = "auto"
    checkpoint: str | os.PathLike | None = None
    init_weights: bool = False
    dtype: torch.dtype | None = None
    activation_checkpointing: str | Callable | Sequence | None = None
    verify: bool | None = None
    ep_group: Any = None
    router_aux_loss: str | None = None
    router_aux_loss_coef: float | None = None
    stage_kwargs: dict[str, Any] = field(default_factory=dict)


_SPLIT_BACKWARD_SCHEDULES = (
    "ScheduleDualPipeV",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
)


def check_checkpointing_schedule(mode: Any, schedule_cls: type) -> None:
    """Selective activation checkpointing allows one backward per region;
    schedules that split the backward (input, then weight) run two."""
    if mode is None or mode == "full":
        return
    if schedule_cls.__name__ in _SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"selective activation checkpointing cannot run under {schedule_cls.__name__}: it splits each backward "
            "into an input and a weight pass, and torch allows one backward per selectively checkpointed region. "
            "Use activation_checkpointing='full', or a schedule with full backwards"
        )


def pp_and_ep(mesh_or_group: Any, ep_group: Any) -> tuple[Any, Any]:
    """(pipeline dimension, expert-parallel process group or None)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.ndim > 1:
        names = tuple(mesh_or_group.mesh_dim_names or ())
        if names not in (("pp", "ep"), ("pp", "dp", "ep")):
            raise ValueError(
                "a mesh of more than one dimension must have the dimensions ('pp', 'ep') or "
                f"('pp', 'dp', 'ep') (torch_pipelining_ext.launcher.device_mesh), got {names}"
            )
        if ep_group is not None:
            raise ValueError(
                "ep_group given twice: as the 'ep' dimension of the mesh and as ep_group"
            )
        ep = mesh_or_group["ep"]
        # an expert-parallel dimension of one rank: no expert parallelism
        return mesh_or_group["pp"], ep.get_group() if ep.size() > 1 else None
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(
                f"ep_group must be a 1-D mesh, got {ep_group.ndim} dimensions"
            )
        ep_group = ep_group.get_group()
    return mesh_or_group, ep_group


def default_num_stages(schedule_cls: type, pp_size: int) -> int:
    """One stage per rank for single-stage schedules, two otherwise."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return pp_size if issubclass(schedule_cls, PipelineScheduleSingle) else 2 * pp_size
