"""The model a run trains: a Hugging Face model directory, or a tiny config
of a model type for trying the trainer out.

Private helper of :mod:`torch_pipelining_ext.train`: everything here runs
before any process group exists (the checks of ``_plan.py``) or on every
rank alike (the initial weights of a tiny model).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch


__all__: list[str] = []

MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3", "llama")
"""Model types :func:`tiny_config` builds."""


def tiny_config(
    model_type: str,
    *,
    vocab_size: int,
    layers: int = 4,
    experts: int = 8,
    hidden_size: int = 128,
    max_positions: int = 2048,
) -> Any:
    """A tiny transformers config of ``model_type`` whose experts do most of
    a layer's work, as in real MoEs (top-2 routing; DeepSeek-V3: one dense
    first layer, a shared expert and group-limited routing).

    Raises:
        ValueError: ``model_type`` is not one of :data:`MODEL_TYPES`.
    """
    import transformers

    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} has no tiny config; choose one of {', '.join(MODEL_TYPES)}"
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    moe = dict(num_experts_per_tok=2)
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            **moe,
            head_dim=hidden_size // 4,
            num_experts=experts,
            moe_intermediate_size=4 * hidden_size,
        )
    if model_type == "mixtral":
        return transformers.MixtralConfig(**common, **moe, num_local_experts=experts)
    if model_type == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common,
            **moe,
            **_DEEPSEEK_V3,
            moe_intermediate_size=4 * hidden_size,
            n_routed_experts=experts,
        )
    if model_type == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden_size // 4)
    return transformers.LlamaConfig(**common)


# DeepSeek-V3's tiny routing and attention: one dense first layer, a shared
# expert, group-limited routing, low-rank query and key-value projections
_DEEPSEEK_V3 = {
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
}


def load_config(model_dir: str) -> Any:
    """The config of a Hugging Face model directory (``config.json``; nothing
    is downloaded).

    Raises:
        ValueError: no readable ``config.json``, or no safetensors weights.
    """
    import transformers

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {model_dir}: no config.json there")
    weights = [
        f
        for f in os.listdir(model_dir)
        if f in ("model.safetensors", "model.safetensors.index.json")
    ]
    if not weights:
        raise ValueError(
            f"--model {model_dir}: no model.safetensors or model.safetensors.index.json there"
        )
    try:
        return transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model_dir}: cannot read its config: {e}") from e


def initial_model(config: Any, seed: int) -> torch.nn.Module:
    """The whole model of a tiny config with its initial weights: the same on
    every rank and in every layout (built from ``seed`` alone)."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config)
