"""Per-layer costs of a Hugging Face causal LM and its balanced stage lists.

Private helper of :mod:`torch_pipelining_ext.hf`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.nn as nn

from torch_pipelining_ext import stage_split
from torch_pipelining_ext.hf import _families
from torch_pipelining_ext.hf._layout import DecoderLayout


if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


__all__: list[str] = []


def layer_costs(model: PreTrainedModel, layout: DecoderLayout) -> list[float]:
    """The parameters a token goes through in each layer (for MoE layers
    only ``top_k`` of the routed experts), relative to the cheapest layer."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    costs = [
        _layer_cost(layer, model.config, top_k)
        for layer in model.get_submodule(layout.layers_prefix)
    ]
    low = min((c for c in costs if c > 0), default=1.0)
    return [c / low for c in costs]


def _layer_cost(layer: nn.Module, config: PretrainedConfig, top_k: int | None) -> float:
    total = 0.0
    expert_params: set[int] = set()
    for name, mod in layer.named_modules():
        if name.rsplit(".", 1)[-1] != "experts" or not top_k:
            continue
        num_experts = (
            len(mod)
            if isinstance(mod, nn.ModuleList)
            else _num_fused_experts(mod, config)
        )
        if not num_experts:
            continue
        share = min(1.0, top_k / num_experts)
        for p in mod.parameters():
            expert_params.add(id(p))
            total += p.numel() * share
    return total + sum(
        p.numel() for p in layer.parameters() if id(p) not in expert_params
    )


def _num_fused_experts(experts: nn.Module, config: PretrainedConfig) -> int:
    """Number of experts of a fused experts module (0: not fused), from the
    module's or the config's expert count, checked against its parameters."""
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int):
        n = _families.num_routed_experts(config)
    params = list(experts.parameters(recurse=False))
    if n and params and all(p.dim() >= 2 and p.shape[0] == n for p in params):
        return n
    return 0


def module_names_per_stage(
    model: PreTrainedModel,
    layout: DecoderLayout,
    num_stages: int,
    costs: Sequence[float] | str | None,
    input_weight: float,
    output_weight: float,
) -> list[list[str]]:
    """Balanced FQN lists per stage, the layers weighted by ``costs``
    (``"auto"``: :func:`layer_costs`)."""
    if isinstance(costs, str):
        if costs != "auto":
            raise ValueError(
                f"layer_costs must be 'auto', None or a sequence of numbers, got {costs!r}"
            )
        costs = layer_costs(model, layout)
    return stage_split.generate_module_names_per_stage(
        num_stages,
        layout.num_layers,
        input_weight=input_weight,
        output_weight=output_weight,
        layer_costs=costs,
        layers_prefix=layout.layers_prefix,
        input_modules=layout.input_modules,
        output_modules=layout.output_modules,
        replicated_modules=layout.replicated_modules,
    )
