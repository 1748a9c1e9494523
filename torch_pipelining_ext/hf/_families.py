"""What the Hugging Face model families spell differently: the config fields
of their experts and dense layers, and the buffer of their expert bias.

Private helper of :mod:`torch_pipelining_ext.hf`, also read by
:mod:`torch_pipelining_ext.sim` (the planner), which runs without the ``hf``
extra: this module imports torch at most, never transformers.  A config is a
``transformers`` config or a mapping of its fields (``config.json``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch.nn as nn


__all__ = [
    "EXPERT_BIAS_BUFFER",
    "EXPERT_COUNT_ATTRIBUTES",
    "config_value",
    "first_dense_layers",
    "has_expert_bias",
    "moe_layer_step",
    "num_routed_experts",
]

EXPERT_COUNT_ATTRIBUTES = ("num_experts", "n_routed_experts", "num_local_experts")
"""The config field that holds the routed experts per MoE layer: Qwen-MoE and
OLMoE, DeepSeek and GLM-4-MoE, Mixtral and GPT-OSS."""

EXPERT_BIAS_BUFFER = "e_score_correction_bias"
"""The router tensor of auxiliary-loss-free balancing (DeepSeek-V3, GLM-4-MoE
and their kin): a buffer, a frozen parameter in a few families."""


def config_value(config: object, name: str) -> Any:
    """``config``'s field ``name`` (``None`` when it has none); any JSON value."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def num_routed_experts(config: object) -> int:
    """Routed experts per MoE layer of ``config`` (0: a dense model).

    Raises:
        ValueError: the first of :data:`EXPERT_COUNT_ATTRIBUTES` the config
            sets (to neither ``None`` nor 0) is not a positive integer.
    """
    for name in EXPERT_COUNT_ATTRIBUTES:
        value = config_value(config, name)
        if value is None or value == 0:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"the model config's {name} must be a positive integer, got {value!r}"
            )
        return value
    return 0


def first_dense_layers(config: object) -> int:
    """Layers of an MoE ``config`` that have no routed experts, other than
    those its :func:`moe_layer_step` skips (0 for a dense model).

    DeepSeek's and GLM-4-MoE's ``first_k_dense_replace`` leading layers, plus
    Qwen-MoE's ``mlp_only_layers``.  The latter may sit anywhere; they are
    counted here with the leading ones, as their number (what a cost model
    needs) does not depend on where they are.
    """
    if not num_routed_experts(config):
        return 0
    leading = config_value(config, "first_k_dense_replace") or 0
    listed = config_value(config, "mlp_only_layers") or ()
    return int(leading) + len(listed)


def moe_layer_step(config: object) -> int:
    """Every how many layers an MoE ``config`` has routed experts (1: every
    layer): DeepSeek-V2's ``moe_layer_freq``, Qwen-MoE's ``decoder_sparse_step``."""
    step = config_value(config, "moe_layer_freq") or config_value(
        config, "decoder_sparse_step"
    )
    return int(step or 1)


def has_expert_bias(module: nn.Module) -> bool:
    """Whether ``module`` (a router, a stage or a whole model) holds the
    :data:`EXPERT_BIAS_BUFFER` of auxiliary-loss-free balancing."""
    tensors = itertools.chain(module.named_buffers(), module.named_parameters())
    return any(name.rpartition(".")[2] == EXPERT_BIAS_BUFFER for name, _ in tensors)
