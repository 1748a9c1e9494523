# mypy: allow-untyped-defs
"""Building this rank's stages of a Hugging Face causal LM.

Private helper of :mod:`torch_pipelining_ext.hf`: the model on the meta
device (see ``[Note: meta build]`` in ``_compat.py``), the checks, the
stage lists, the split with each stage wrapped (and sharded for expert
parallelism) by :class:`_StageFactory`, and the stage weights: initialised,
loaded from a checkpoint, or moved.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_pipelining_ext import stage_split
from torch_pipelining_ext.hf import _compat, _config
from torch_pipelining_ext.hf._checkpoint import load_stage_weights
from torch_pipelining_ext.hf._costs import module_names_per_stage
from torch_pipelining_ext.hf._expert_parallel import shard_experts
from torch_pipelining_ext.hf._layout import DecoderLayout
from torch_pipelining_ext.hf._loading import checkpoint_entries
from torch_pipelining_ext.hf._stage import HFCausalLMStage
from torch_pipelining_ext.hf._tensors import replace, state_keys, tensor_slots, tied_groups


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
    stage_kwargs: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Building on the meta device
# ---------------------------------------------------------------------------


@contextmanager
def _parameters_on_meta(dtype: torch.dtype | None):
    """Every parameter registered inside the block is moved to the meta
    device (and cast to ``dtype`` if floating); buffers stay where they are
    built, so non-persistent ones (rotary tables, GPT-2's causal masks) keep
    their values and need no checkpoint."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None):
        if param is None or param.is_meta:
            return None  # already meta: keep the object (ties are re-registrations of it)
        cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
        return nn.Parameter(param.to(device="meta", dtype=cast), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def build_on_meta(config: Any, dtype: torch.dtype | None) -> nn.Module:
    """See :func:`torch_pipelining_ext.hf.meta_causal_lm`."""
    transformers = _compat.require_transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    if _compat.builds_buffers_on_meta():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        if dtype is not None:
            for old, places in tensor_slots(model).values():  # parameters only: buffers keep their dtype
                if isinstance(old, nn.Parameter) and old.is_floating_point():
                    replace(places, old.to(dtype), old)
        return model
    with _parameters_on_meta(dtype):
        return transformers.AutoModelForCausalLM.from_config(config)


def _init_stage_weights(hf_part: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Materialise meta tensors of a split HF model on ``device`` and run the
    model's own ``_init_weights`` on every submodule."""
    for old, places in tensor_slots(hf_part).values():
        if old.is_meta:
            target = dtype if dtype is not None and old.is_floating_point() else old.dtype
            replace(places, torch.empty(old.shape, dtype=target, device=device), old)
        elif old.device != device:
            replace(places, old.to(device), old)
    with torch.no_grad():
        for module in hf_part.modules():
            hf_part._init_weights(module)


# ---------------------------------------------------------------------------
# Building this rank's stages
# ---------------------------------------------------------------------------


class _StageFactory:
    """Turns each stage model the split builds into its
    :class:`HFCausalLMStage` (``prepare_part`` of the split): what every stage
    keeps of the whole model, read from it once."""

    def __init__(
        self,
        model: nn.Module,
        layout: DecoderLayout,
        on_meta: bool,
        device: torch.device,
        options: StageOptions,
        ep_group: Any,
    ) -> None:
        self.layout = layout
        self.on_meta = on_meta
        self.device = device
        self.options = options
        self.ep_group = ep_group
        self.config = model.config
        self.tied_groups = tied_groups(model)
        self.full_state_keys = state_keys(model)
        self.ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        self.conversions = _compat.conversion_mapping(model) if options.checkpoint is not None else None

    def __call__(self, part: nn.Module, stage_id: int, num_stages: int) -> nn.Module:
        if self.options.checkpoint is None and self.on_meta:
            _init_stage_weights(part, self.device, self.options.dtype)
        stage = HFCausalLMStage(
            part,
            self.layout,
            stage_id,
            num_stages,
            tied_groups=self.tied_groups,
            full_state_keys=self.full_state_keys,
            ignore_unexpected=self.ignore_unexpected,
            checkpoint_conversions=self.conversions,
        )
        stage.set_activation_checkpointing(self.options.activation_checkpointing)
        if self.ep_group is not None:
            shard_experts(stage, self.ep_group, self.config, self.layout.layers_prefix)
        return stage


def build_stages(
    model: Any,
    pp_mesh_or_group: Any,
    schedule: type | str,
    device: torch.device | str | int,
    names: Sequence[Sequence[str]] | None,
    options: StageOptions,
) -> tuple[list, list[HFCausalLMStage]]:
    """See :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm`."""
    transformers = _compat.require_transformers()
    pp_mesh_or_group, ep_group = _config.pp_and_ep(pp_mesh_or_group, options.ep_group)
    if isinstance(model, transformers.PretrainedConfig):
        model = build_on_meta(model, options.dtype)
    schedule_cls = stage_split._schedule_class(schedule)
    layout = _config.validated_layout(
        model,
        schedule_cls=schedule_cls,
        activation_checkpointing=options.activation_checkpointing,
        verify=options.verify,
    )
    _, _, pp_size = stage_split._pp_group(pp_mesh_or_group)
    if names is None:
        n = options.num_stages if options.num_stages is not None else _config.default_num_stages(schedule_cls, pp_size)
        names = module_names_per_stage(model, layout, n, options.layer_costs, input_weight=1, output_weight=1)
    elif options.num_stages is not None and options.num_stages != len(names):
        raise ValueError(f"num_stages={options.num_stages} but {len(names)} stage lists were given")
    on_meta = any(t.is_meta for t in model.parameters())
    _check_weights_source(on_meta, options)
    device = as_device(device)
    factory = _StageFactory(model, layout, on_meta, device, options, ep_group)
    stages, parts = stage_split._pipeline_split(
        model,
        pp_mesh_or_group,
        schedule,
        device,
        names,
        move=False,
        allow_uncovered=False,
        stage_kwargs=options.stage_kwargs,
        prepare_part=factory,
    )
    _place_weights(parts, on_meta, device, options)
    return stages, parts


def as_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device`` (an int is a CUDA device index)."""
    return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)


def _check_weights_source(on_meta: bool, options: StageOptions) -> None:
    if on_meta and options.checkpoint is None and not options.init_weights:
        raise ValueError(
            "the model is on the meta device: pass checkpoint= to load this rank's weights, or init_weights=True "
            "to initialise them"
        )
    if options.checkpoint is not None:
        checkpoint_entries(options.checkpoint)  # fail on a bad path before building anything


def _place_weights(parts: list[HFCausalLMStage], on_meta: bool, device: torch.device, options: StageOptions) -> None:
    """Load the stages' weights from the checkpoint, or move real ones to ``device``
    (initialised ones are there already)."""
    if options.checkpoint is not None:
        load_stage_weights(parts, options.checkpoint, device, options.dtype)
    elif not on_meta:
        for part in parts:
            part.to(device=device, dtype=options.dtype) if options.dtype is not None else part.to(device)
