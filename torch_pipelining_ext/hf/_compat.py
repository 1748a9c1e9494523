"""What differs between the transformers releases :mod:`torch_pipelining_ext.hf`
supports (4.57.x and 5.x), each difference detected by feature, never by
version string.

Private helper of :mod:`torch_pipelining_ext.hf`:

* attention masks: which mask a layer of a given attention type gets, and the
  keyword names of the mask builders (``input_embeds``/``inputs_embeds``,
  ``past_key_values``/``cache``, ``cache_position``);
* per-layer attention types (``config.layer_types`` where the config has it);
* how a model is built on the meta device and how its non-persistent buffers
  are rebuilt (see ``[Note: meta build]``);
* the checkpoint key conversions of fused-expert models (``transformers``'
  own conversion mapping, 5.x).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn


if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.core_model_loading import WeightConverter, WeightRenaming


__all__: list[str] = []


def require_transformers() -> types.ModuleType:
    """The ``transformers`` module, or an ``ImportError`` saying how to install it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "torch_pipelining_ext.hf needs transformers: pip install 'torch_pipelining_ext[hf]'"
        ) from e
    return transformers


# ---------------------------------------------------------------------------
# Attention masks
# ---------------------------------------------------------------------------


def _no_mask(**_: object) -> None:
    # linear-attention (recurrent) layers take a padding mask only, and
    # training batches here have no padding
    return None


@functools.cache
def _mask_builders() -> dict[str, Callable[..., torch.Tensor | BlockMask | None]]:
    from transformers import masking_utils as mu

    table = getattr(mu, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", None)
    builders = {kind: fn for kind, fn in (table or {}).items() if callable(fn)}
    builders.setdefault("full_attention", mu.create_causal_mask)
    for kind, name in (
        ("sliding_attention", "create_sliding_window_causal_mask"),
        ("chunked_attention", "create_chunked_causal_mask"),
    ):
        if kind not in builders and hasattr(mu, name):
            builders[kind] = getattr(mu, name)
    # 4.57 has no builder for linear-attention layers (Qwen3-Next builds its padding mask itself)
    builders.setdefault("linear_attention", _no_mask)
    return builders


@functools.cache
def _parameters(fn: Callable[..., object]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def attention_mask(
    kind: str, config: PretrainedConfig, h: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor | BlockMask | None:
    """The mask Hugging Face's own base-model forward builds for layers of
    attention type ``kind``, for a batch without padding or cache."""
    builder = _mask_builders().get(kind)
    if builder is None:
        raise ValueError(
            f"layers of attention type {kind!r} are not supported by the pipeline stages (known: "
            f"{sorted(_mask_builders())})"
        )
    names = _parameters(builder)
    kwargs: dict[str, object] = {"config": config, "attention_mask": None}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            kwargs[cache_name] = None
            break
    if "cache_position" in names:
        kwargs["cache_position"] = position_ids[0]
    if "position_ids" in names:
        kwargs["position_ids"] = position_ids
    return builder(**kwargs)


def layer_kind(config: PretrainedConfig, layer: nn.Module, index: int) -> str:
    """Attention type of layer ``index``: ``config.layer_types`` where the
    config lists them, else the layer's ``attention_type``, else a sliding
    window whenever ``config.sliding_window`` is set (Mistral, Mixtral, Phi3)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    kind = getattr(layer, "attention_type", None)
    if kind is not None:
        return kind
    return (
        "sliding_attention"
        if getattr(config, "sliding_window", None) is not None
        else "full_attention"
    )


def rotary_takes_layer_type(rotary: nn.Module) -> bool:
    """Whether ``rotary`` holds one table per attention type (Gemma3 on 5.x)."""
    return "layer_type" in _parameters(type(rotary).forward)


def embedding_normalizer(base: PreTrainedModel) -> float | None:
    """The factor the base model's forward multiplies the token embeddings
    by, where its forward does so itself (Gemma and Gemma2 on 4.57:
    ``sqrt(hidden_size)``; on 5.x the embedding module scales)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return None
    if "normalizer" in source and "hidden_size**0.5" in source.replace(" ", ""):
        return base.config.hidden_size**0.5
    return None


# ---------------------------------------------------------------------------
# Building on the meta device
# ---------------------------------------------------------------------------

# [Note: meta build]
# transformers 5.x builds every model on the meta device itself
# (``from_pretrained``) and restores non-persistent buffers (rotary
# frequencies, embedding scales) with the model's ``_init_weights``; its
# modules may create full-size parameters in ``__init__`` (fused experts: one
# ``[E, 2I, H]`` tensor per layer), so only a build under
# ``torch.device("meta")`` allocates nothing.  4.57 does not restore buffers
# in ``_init_weights``; there the parameters are moved to meta as they are
# registered (as accelerate's ``init_empty_weights`` does), buffers are built
# for real, and every parameter is created per expert, so nothing large is
# allocated either.


def builds_buffers_on_meta() -> bool:
    """Whether this transformers restores non-persistent buffers of a model
    built on the meta device (5.x)."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "named_non_persistent_buffers")


def restore_buffers(
    init_weights: Callable[[nn.Module], object], part: nn.Module, device: torch.device
) -> None:
    """Give every meta buffer of ``part`` (a split piece of a model) its
    value, with the model's own ``_init_weights`` (``init_weights``).

    Raises ``ValueError`` naming the buffers the model did not restore.
    """
    owners = []
    for mod_name, mod in part.named_modules():
        names = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
        if not names:
            continue
        for n in names:
            b = mod._buffers[n]
            fill = float("nan") if b.is_floating_point() else 0
            mod._buffers[n] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
        owners.append((mod_name, mod, names))
    with torch.no_grad():
        for _, mod, _ in owners:
            init_weights(mod)
    left = [
        f"{mod_name}.{n}" if mod_name else n
        for mod_name, mod, names in owners
        for n in names
        if mod._buffers[n].is_floating_point() and torch.isnan(mod._buffers[n]).any()
    ]
    if left:
        raise ValueError(
            f"the model's _init_weights did not restore the non-persistent buffers {left} of a model built on the "
            "meta device; pass a model built for real instead of a config"
        )


# ---------------------------------------------------------------------------
# Checkpoint key conversions (fused experts)
# ---------------------------------------------------------------------------


def has_fused_experts() -> bool:
    """Whether this transformers holds MoE experts as fused 3-D parameters
    and converts per-expert checkpoints to them (5.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
    except ImportError:
        return False
    return True


def conversion_mapping(
    model: nn.Module,
) -> tuple[list[WeightRenaming], list[WeightConverter]] | None:
    """``(renamings, converters)``: transformers' own checkpoint conversions
    for ``model`` (5.x), or ``None`` where transformers has none (4.57)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def save_conversions(model: nn.Module) -> list[object] | None:
    """The conversions ``model.save_pretrained`` reverses to write
    transformers' own key layout (5.x: fused experts back to per-expert
    keys), as ``revert_weight_conversion`` takes them for a model not loaded
    with ``from_pretrained``; ``None`` where transformers has none (4.57)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    try:
        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except TypeError:  # a 5.x without add_legacy
        transforms = get_model_conversion_mapping(model)
    return [t for t in transforms if type(t).__name__ != "PrefixChange"]


def describe_ops(converter: WeightConverter) -> tuple[str, ...]:
    """Names of a converter's operations, with their dimensions."""
    out = []
    for op in converter.operations:
        dim = getattr(op, "dim", None)
        out.append(
            f"{type(op).__name__}(dim={dim})" if dim is not None else type(op).__name__
        )
    return tuple(out)
