"""Compare the pipeline stages of a model type with its unsplit Hugging Face
forward on a tiny config of the same type.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF self-check]``.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from torch_pipelining_ext import stage_split
from torch_pipelining_ext.hf import _families
from torch_pipelining_ext.hf._costs import module_names_per_stage
from torch_pipelining_ext.hf._layout import detect_layout


if TYPE_CHECKING:
    from transformers import PretrainedConfig
from torch_pipelining_ext.hf._stage import HFCausalLMStage


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF self-check]
# The stage forward re-runs the steps of a base model's forward (embedding,
# positions, masks, rotary tables, layers, norm, head, logit soft-capping).
# A model type whose forward does something else (another embedding scale,
# a new mask kind, a residual across layers) would give wrong logits without
# any error.  So for a model type outside VERIFIED_MODEL_TYPES (and on request
# for any), before a stage is built: the user's config is shrunk to a tiny one
# of the same type (same layer-type pattern, same MoE/dense layer kinds,
# narrow widths, a few experts), that model is built for real with seeded
# weights, cut into as many stages as it has layers, and the chained stage
# forwards are compared with the model's own forward on random token ids.
# A difference beyond float rounding refuses the model; so does a config the
# shrinking cannot build (then nothing was verified).

_WIDTHS = {
    # attribute: tiny value (only attributes the config has are changed)
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "vocab_size": 128,
    "n_embd": 64,
    "n_head": 4,
}
MAX_LAYERS = 8
SEQ = 8


def tiny_config(config: PretrainedConfig) -> PretrainedConfig:
    """A narrow, shallow config of the same model type as ``config``, built
    anew through its class (so values derived in ``__init__`` follow)."""
    cls = type(config)
    accepted = set(inspect.signature(cls.__init__).parameters)
    values = {k: v for k, v in config.to_dict().items() if k in accepted}
    for name, value in _WIDTHS.items():
        if isinstance(values.get(name), int):
            values[name] = value
    if isinstance(values.get("num_key_value_heads"), int):
        values["num_key_value_heads"] = (
            2 if config.num_key_value_heads < config.num_attention_heads else 4
        )
    for name in _families.EXPERT_COUNT_ATTRIBUTES:
        experts = values.get(name)
        if isinstance(experts, int) and experts > 0:
            experts = values[name] = min(experts, 8)
            if isinstance(values.get("num_experts_per_tok"), int):
                values["num_experts_per_tok"] = min(
                    values["num_experts_per_tok"], 2, experts
                )
            if isinstance(values.get("n_group"), int) and values["n_group"] > 1:
                values["n_group"] = 2 if experts % 2 == 0 else 1
                values["topk_group"] = min(
                    values.get("topk_group") or 1, values["n_group"]
                )
    if (
        isinstance(values.get("n_shared_experts"), int)
        and values["n_shared_experts"] > 1
    ):
        values["n_shared_experts"] = 1
    if isinstance(values.get("sliding_window"), int) and values["sliding_window"] > 0:
        values["sliding_window"] = min(values["sliding_window"], SEQ // 2)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(name), int) and values[name] >= _WIDTHS["vocab_size"]:
            values[name] = None
    for name, value in list(values.items()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            values[name] = 0.0
    if "output_router_logits" in values:
        values["output_router_logits"] = False
    _shrink_layers(values, config)
    return cls(**values)


def _shrink_layers(values: dict[str, Any], config: PretrainedConfig) -> None:
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])
    keep = 2
    if types:
        while keep < len(types) and set(types[:keep]) != set(types):
            keep += 1
    # one layer past each pattern's first period: the dense first layers, the
    # sliding-window ones, a full-attention interval, an MoE step
    for value in (
        _families.first_dense_layers(config),
        getattr(config, "max_window_layers", None),
        getattr(config, "full_attention_interval", None),
        _families.moe_layer_step(config),
    ):
        if isinstance(value, int) and 0 < value < n:
            keep = max(keep, value + 1)
    keep = min(keep, n, MAX_LAYERS)
    for name in ("num_hidden_layers", "n_layer"):
        if name in values:
            values[name] = keep
    if types and "layer_types" in values:
        values["layer_types"] = types[:keep]
    if isinstance(values.get("mlp_only_layers"), list):
        values["mlp_only_layers"] = [i for i in values["mlp_only_layers"] if i < keep]


def check_stages_match(config: PretrainedConfig) -> float:
    """Build the tiny model of ``config``'s type, run its stages (one per
    layer) one after the other and compare with ``model(ids).logits``.  Returns the max abs difference; raises
    ``ValueError`` if it is beyond float rounding or the tiny model cannot be
    built."""
    import transformers

    model_type = getattr(config, "model_type", None)
    try:
        cfg = tiny_config(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
            ids = torch.randint(0, cfg.vocab_size, (2, SEQ))
    except Exception as e:
        raise ValueError(
            f"model type {model_type!r} is not verified for pipeline stages and the self-check could not build a "
            f"tiny model of it ({type(e).__name__}: {e}); its stages cannot be checked, so they are refused"
        ) from e
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = _chain_stages(model, ids)
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, scale)):
        raise ValueError(
            f"model type {model_type!r}: the pipeline stages do not reproduce the Hugging Face forward on a tiny "
            f"config of this type (max |logit difference| {diff:.3g}, logits up to {scale:.3g}); its forward does "
            "something the stage forward does not, so it is refused (verified types need no check)"
        )
    logger.debug(
        "self-check of %r: %d layers, max |diff| %.3g",
        model_type,
        cfg.num_hidden_layers,
        diff,
    )
    return diff


def _chain_stages(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` cut into stages of one layer each (at most 4
    stages), run one after the other in this process."""
    layout = detect_layout(model)
    n = max(2, min(4, layout.num_layers))
    names = module_names_per_stage(
        model, layout, n, None, input_weight=1, output_weight=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ties split across stages
        parts = [
            stage_split.build_stage_module(model, stage_names) for stage_names in names
        ]
    h = ids
    for i, part in enumerate(parts):
        h = HFCausalLMStage(part, layout, i, n)(h)
    return h
