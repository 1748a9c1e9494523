"""Each stage model of the split turned into its :class:`HFCausalLMStage`.

Private helper of :mod:`torch_pipelining_ext.hf`: :class:`StageFactory`
reads once from the whole model what every stage keeps of it (weights tied
across stages, the keys of its state dict, the checkpoint conversions) and
wraps, initialises and shards each stage the split builds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_pipelining_ext.hf import _compat
from torch_pipelining_ext.hf._config import StageOptions
from torch_pipelining_ext.hf._expert_parallel import shard_experts
from torch_pipelining_ext.hf._layout import DecoderLayout
from torch_pipelining_ext.hf._router_aux import router_aux_loss
from torch_pipelining_ext.hf._routing import model_routing
from torch_pipelining_ext.hf._stage import HFCausalLMStage, TiedGroup
from torch_pipelining_ext.hf._state_dict import register_expert_hooks
from torch_pipelining_ext.hf._tensors import init_weights, state_keys
from torch_pipelining_ext.hf._training import track_expert_gradients


__all__: list[str] = []


def tied_groups(model: nn.Module) -> list[TiedGroup]:
    """The FQN groups of parameters that are one tensor, with its shape and dtype."""
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    return [
        (tuple(names), tensors[i].shape, tensors[i].dtype)
        for i, names in by_id.items()
        if len(names) > 1
    ]


class StageFactory:
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
        self.ignore_unexpected = list(
            getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
        )
        self.routing = model_routing(model, layout.layers_prefix)
        self.router_aux = router_aux_loss(
            model, self.routing, options.router_aux_loss, options.router_aux_loss_coef
        )
        self.conversions = (
            _compat.conversion_mapping(model)
            if options.checkpoint is not None
            else None
        )
        self.save_conversions = _compat.save_conversions(model)
        self.ignore_on_save = list(
            getattr(model, "_keys_to_ignore_on_save", None) or []
        )

    def __call__(self, part: nn.Module, stage_id: int, num_stages: int) -> nn.Module:
        if self.options.checkpoint is None and self.on_meta:
            init_weights(part, self.device, self.options.dtype)
        stage = HFCausalLMStage(
            part,
            self.layout,
            stage_id,
            num_stages,
            tied_groups=self.tied_groups,
            full_state_keys=self.full_state_keys,
            ignore_unexpected=self.ignore_unexpected,
            checkpoint_conversions=self.conversions,
            save_conversions=self.save_conversions,
            ignore_on_save=self.ignore_on_save,
            router_aux=self.router_aux,
            routing=self.routing,
        )
        stage.set_activation_checkpointing(self.options.activation_checkpointing)
        if self.ep_group is not None:
            shard_experts(stage, self.ep_group, self.config, self.layout.layers_prefix)
            # [Note: HF expert checkpoints], [Note: HF expert gradient state]
            register_expert_hooks(stage)
            track_expert_gradients(stage)
        return stage
