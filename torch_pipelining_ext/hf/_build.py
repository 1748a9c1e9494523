"""Building this rank's stages of a Hugging Face causal LM.

Private helper of :mod:`torch_pipelining_ext.hf`: the model on the meta
device (see ``[Note: meta build]`` in ``_compat.py``), the checks, the
stage lists, the split with each stage wrapped (and sharded for expert
parallelism) by ``_factory.StageFactory``, and the stage weights: initialised,
loaded from a checkpoint, or moved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast, TYPE_CHECKING

import torch
import torch.nn as nn

from torch_pipelining_ext import stage_split
from torch_pipelining_ext.hf import _compat, _config
from torch_pipelining_ext.hf._checkpoint import load_stage_weights
from torch_pipelining_ext.hf._costs import module_names_per_stage
from torch_pipelining_ext.hf._expert_load import count_schedule_forwards
from torch_pipelining_ext.hf._factory import StageFactory
from torch_pipelining_ext.hf._layout import detect_layout, VERIFIED_MODEL_TYPES
from torch_pipelining_ext.hf._loading import checkpoint_entries
from torch_pipelining_ext.hf._mesh import MeshOrGroup, stage_layout
from torch_pipelining_ext.hf._selfcheck import check_stages_match
from torch_pipelining_ext.hf._stage import check_trainable, HFCausalLMStage
from torch_pipelining_ext.hf._tensors import replace, tensor_slots


if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


__all__: list[str] = []


# ---------------------------------------------------------------------------
# Building on the meta device
# ---------------------------------------------------------------------------


@contextmanager
def _parameters_on_meta(dtype: torch.dtype | None) -> Iterator[None]:
    """Every parameter registered inside the block is moved to the meta
    device (and cast to ``dtype`` if floating); buffers stay where they are
    built, so non-persistent ones (rotary tables, GPT-2's causal masks) keep
    their values and need no checkpoint."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def to_meta(
        module: nn.Module, name: str, param: nn.Parameter | None
    ) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return (
                None  # already meta: keep the object (ties are re-registrations of it)
            )
        cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
        return nn.Parameter(
            param.to(device="meta", dtype=cast), requires_grad=param.requires_grad
        )

    # torch annotates the hook as returning None; its docstring (and
    # register_parameter) take the new parameter it may return
    handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


def build_on_meta(config: Any, dtype: torch.dtype | None) -> nn.Module:
    """See :func:`torch_pipelining_ext.hf.meta_causal_lm`."""
    transformers = _compat.require_transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(
            f"config must be a transformers PretrainedConfig, got {type(config).__name__}"
        )
    if _compat.builds_buffers_on_meta():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        if dtype is not None:
            for old, places in tensor_slots(
                model
            ).values():  # parameters only: buffers keep their dtype
                if isinstance(old, nn.Parameter) and old.is_floating_point():
                    replace(places, old.to(dtype), old)
        return model
    with _parameters_on_meta(dtype):
        return transformers.AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------
# Building this rank's stages
# ---------------------------------------------------------------------------


def build_stages(
    model: Any,
    pp_mesh_or_group: MeshOrGroup,
    schedule: type | str,
    device: torch.device | str | int,
    names: Sequence[Sequence[str]] | None,
    options: _config.StageOptions,
) -> tuple[list[PipelineStage], list[HFCausalLMStage]]:
    """See :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm`."""
    transformers = _compat.require_transformers()
    layout = stage_layout(pp_mesh_or_group, options.ep_group)
    layout.make_ep_twin()  # each side of an overlapped action its own communicator
    if isinstance(model, transformers.PretrainedConfig):
        model = build_on_meta(model, options.dtype)
    schedule_cls = stage_split.resolve_schedule_class(schedule)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__} {model!r}"
        )
    decoder = detect_layout(model)
    check_trainable(model, decoder)
    _config.check_checkpointing_schedule(options.activation_checkpointing, schedule_cls)
    model_type = getattr(model.config, "model_type", None)
    if options.verify or (
        options.verify is None and model_type not in VERIFIED_MODEL_TYPES
    ):
        check_stages_match(model.config)
    _, _, pp_size = stage_split.pipeline_group(layout.pipeline)
    if names is None:
        n = (
            options.num_stages
            if options.num_stages is not None
            else _config.default_num_stages(schedule_cls, pp_size)
        )
        names = module_names_per_stage(
            model, decoder, n, options.layer_costs, input_weight=1, output_weight=1
        )
    elif options.num_stages is not None and options.num_stages != len(names):
        raise ValueError(
            f"num_stages={options.num_stages} but {len(names)} stage lists were given"
        )
    on_meta = any(t.is_meta for t in model.parameters())
    _check_weights_source(on_meta, options)
    device = as_device(device)
    factory = StageFactory(model, decoder, on_meta, device, options, layout.ep)
    stages, split_parts = stage_split.pipeline_module_split(
        model,
        layout.pipeline,
        schedule_cls,
        device,
        names,
        prepare_part=factory,
        **options.stage_kwargs,
    )
    # each part as the factory (prepare_part) made it
    parts = cast(list[HFCausalLMStage], split_parts)
    _place_weights(parts, on_meta, device, options)
    for stage, part in zip(stages, parts):
        count_schedule_forwards(stage, part)  # [Note: HF expert load]
    return stages, parts


def as_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device`` (an int is a CUDA device index)."""
    return (
        torch.device(device)
        if not isinstance(device, int)
        else torch.device("cuda", device)
    )


def _check_weights_source(on_meta: bool, options: _config.StageOptions) -> None:
    if on_meta and options.checkpoint is None and not options.init_weights:
        raise ValueError(
            "the model is on the meta device: pass checkpoint= to load this rank's weights, or init_weights=True "
            "to initialise them"
        )
    if options.checkpoint is not None:
        checkpoint_entries(
            options.checkpoint
        )  # fail on a bad path before building anything


def _place_weights(
    parts: list[HFCausalLMStage],
    on_meta: bool,
    device: torch.device,
    options: _config.StageOptions,
) -> None:
    """Load the stages' weights from the checkpoint, or move real ones to ``device``
    (initialised ones are there already)."""
    if options.checkpoint is not None:
        load_stage_weights(parts, options.checkpoint, device, options.dtype)
    elif not on_meta:
        for part in parts:
            part.to(
                device=device, dtype=options.dtype
            ) if options.dtype is not None else part.to(device)
