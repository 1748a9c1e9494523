# mypy: allow-untyped-defs
"""Checks of what :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm` is
given, before anything is built.

Private helper of :mod:`torch_pipelining_ext.hf`: the model and its training
configuration, the activation checkpointing mode against the schedule, the
pipeline and expert-parallel dimensions, and the default number of stages.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from torch_pipelining_ext.hf._layout import DecoderLayout, detect_layout, VERIFIED_MODEL_TYPES
from torch_pipelining_ext.hf._selfcheck import check_stages_match
from torch_pipelining_ext.hf._stage import check_not_reentrant


__all__: list[str] = []

_SPLIT_BACKWARD_SCHEDULES = ("ScheduleDualPipeV", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")


def validated_layout(
    model: Any, *, schedule_cls: type, activation_checkpointing: Any, verify: bool | None
) -> DecoderLayout:
    """The layout of ``model``, once everything about it that the stages
    cannot run is refused: its type and layout, router logits for an
    auxiliary loss, reentrant activation checkpointing, selective
    checkpointing under a schedule that splits the backward, and (where
    ``verify`` asks, see ``[Note: HF self-check]``) stage forwards that do not
    reproduce the model's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__} {model!r}")
    layout = detect_layout(model)
    check_training_config(model, layout)
    check_checkpointing_schedule(activation_checkpointing, schedule_cls)
    if verify or (verify is None and getattr(model.config, "model_type", None) not in VERIFIED_MODEL_TYPES):
        check_stages_match(model.config)
    return layout


def check_training_config(model: nn.Module, layout: DecoderLayout) -> None:
    """Refuse router logits for an auxiliary loss and reentrant activation
    checkpointing."""
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits is set: the router auxiliary loss is computed over all layers in the "
            "Hugging Face forward and is not part of CausalLMLoss; set it to False (or add the auxiliary loss "
            "yourself) for pipeline training"
        )
    for i, layer in enumerate(model.get_submodule(layout.layers_prefix)):
        check_not_reentrant(layer, f"{layout.layers_prefix}.{i}")


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

    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.ndim == 2:
        names = mesh_or_group.mesh_dim_names or ()
        if set(names) != {"pp", "ep"}:
            raise ValueError(f"a 2-D mesh must have the dimensions ('pp', 'ep'), got {names}")
        if ep_group is not None:
            raise ValueError("ep_group given twice: as the 'ep' dimension of the mesh and as ep_group")
        return mesh_or_group["pp"], mesh_or_group["ep"].get_group()
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(f"ep_group must be a 1-D mesh, got {ep_group.ndim} dimensions")
        ep_group = ep_group.get_group()
    return mesh_or_group, ep_group


def default_num_stages(schedule_cls: type, pp_size: int) -> int:
    """One stage per rank for single-stage schedules, two otherwise."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return pp_size if issubclass(schedule_cls, PipelineScheduleSingle) else 2 * pp_size
