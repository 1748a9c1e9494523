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
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torch_pipelining_ext._patching._table import _REGISTRY


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
    ep_group: DeviceMesh | dist.ProcessGroup | None = None
    router_aux_loss: str | None = None
    router_aux_loss_coef: float | None = None
    stage_kwargs: dict[str, Any] = field(default_factory=dict)


_SAC_PATCH = "checkpoint_split_backward"
_SPLIT_BACKWARD_SCHEDULES = (
    "ScheduleDualPipeV",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
)


def check_checkpointing_schedule(mode: Any, schedule_cls: type) -> None:
    """Stock torch allows one backward per selectively checkpointed region;
    schedules that split the backward (input, then weight) run two, which
    the package's ``checkpoint_split_backward`` patch allows
    (``[Note: selective checkpointing under a split backward]`` in
    ``torch_pipelining_ext/_checkpoint.py``).  Refused where that patch is
    not in force (``TORCH_PIPELINING_EXT_DISABLE=1``, ``unpatch()``, a torch
    its probe does not recognise)."""
    if mode is None or mode == "full":
        return
    if schedule_cls.__name__ not in _SPLIT_BACKWARD_SCHEDULES:
        return
    status = _sac_patch_status()
    if status not in ("applied", "upstream"):
        raise ValueError(
            f"selective activation checkpointing under {schedule_cls.__name__} needs the package's "
            f"{_SAC_PATCH} patch, which is {status}: the schedule runs two backward passes (input, then "
            "weight) over each region, which stock torch cannot recompute twice (it raises, or with a weight used twice on "
            "one path computes wrong gradients). "
            "Use activation_checkpointing='full', a schedule with full backwards, or leave the patch on "
            "(python -m torch_pipelining_ext shows its status)"
        )


def _sac_patch_status() -> str:
    """The status of the ``checkpoint_split_backward`` patch in this process."""
    return _REGISTRY.status(_SAC_PATCH).value


def default_num_stages(schedule_cls: type, pp_size: int) -> int:
    """One stage per rank for single-stage schedules, two otherwise."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return pp_size if issubclass(schedule_cls, PipelineScheduleSingle) else 2 * pp_size
