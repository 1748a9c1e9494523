"""The pipeline stage module of a Hugging Face causal LM.

Private helper of :mod:`torch_pipelining_ext.hf`: :class:`HFCausalLMStage`
holds a stage's modules under their original names and runs them with plain
tensors (see ``[Note: HF stage forward]``); what the stage forward
cannot train is refused up front.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, TYPE_CHECKING
from collections.abc import Callable

import torch
import torch.nn as nn

from torch_pipelining_ext.hf import _compat
from torch_pipelining_ext.hf._layout import DecoderLayout
from torch_pipelining_ext.hf._expert_load import LoadCounter
from torch_pipelining_ext.hf._router_aux import RouterAuxLoss, RunningSums
from torch_pipelining_ext.hf._routing import (
    experts_modules,
    install_hooks,
    record_layer,
    Routing,
)


if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


__all__: list[str] = []

TiedGroup = tuple[tuple[str, ...], torch.Size, torch.dtype]


# [Note: HF stage forward]
# Hugging Face's base-model forward embeds the tokens, builds the position
# ids, the rotary tables and the causal mask(s), runs every layer and applies
# the final norm; the causal-LM forward then applies the head and returns a
# ModelOutput.  A stage holds only some of those modules, so HFCausalLMStage
# runs the same steps itself, each only where its modules are present:
#   * positions are 0..seq-1 (no padding, no KV cache: training), derived
#     from the received tensor, so every stage recomputes them locally;
#   * the mask comes from transformers.masking_utils, per layer, by the
#     layer's attention type (``config.layer_types[i]`` where the config
#     lists them, else the layer's ``attention_type``, else sliding-window
#     when ``config.sliding_window`` is set), exactly as the families' own
#     forwards choose (_compat.layer_kind);
#   * rotary tables: one per rotary module, or one per attention type where
#     the rotary module takes the layer type (Gemma3);
#   * ``config.final_logit_softcapping`` is applied to the logits (Gemma2/3);
#   * a layer gets only the arguments its forward names.
# Model types not in VERIFIED_MODEL_TYPES may do more in their forwards; they
# are compared with the unsplit forward on a tiny config of the same type
# before any stage is built (``[Note: HF self-check]``).


class HFCausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder-only causal LM.

    Holds the stage's modules under their original names (its
    ``state_dict()`` keys are the model's own keys) and runs them with plain
    tensors: ``input_ids -> hidden`` (first stage), ``hidden -> hidden``
    (middle), ``hidden -> logits`` (last; a single stage maps ``input_ids``
    to logits).  Built by :func:`pipeline_hf_causal_lm`.

    Attributes:
        config: the model's config.
        stage_index: this stage's index.
        num_stages: the number of stages of the pipeline.
        tied_groups: FQN groups that are one tensor in the whole model
            (e.g. ``("transformer.wte.weight", "lm_head.weight")``), each
            with its shape and dtype.
    """

    def __init__(
        self,
        part: nn.Module,
        layout: DecoderLayout,
        stage_index: int,
        num_stages: int,
        *,
        tied_groups: Sequence[TiedGroup] = (),
        full_state_keys: frozenset[str] = frozenset(),
        ignore_unexpected: Sequence[str] = (),
        checkpoint_conversions: Any = None,
        save_conversions: list | None = None,
        ignore_on_save: Sequence[str] = (),
        router_aux: RouterAuxLoss | None = None,
        routing: Routing | None = None,
    ) -> None:
        super().__init__()
        if any(p is not None for p in part._parameters.values()):
            raise ValueError(
                f"{type(part).__name__} holds parameters on its root; they cannot be placed"
            )
        for name, child in part._modules.items():
            if child is not None:
                self.add_module(name, child)
        self.config: PretrainedConfig = part.config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.tied_groups = tuple(tied_groups)
        self._layout = layout
        self._full_state_keys = full_state_keys
        self._ignore_unexpected = tuple(ignore_unexpected)
        self._checkpoint_conversions = checkpoint_conversions
        # what PreTrainedModel.save_pretrained reverses (transformers 5.x; the
        # attribute transformers itself reads) and leaves out: see [Note: HF export]
        self._weight_conversions = save_conversions
        self._keys_to_ignore_on_save = tuple(ignore_on_save)
        # the model's own initialisation restores non-persistent buffers of a meta build (5.x)
        self._init_weights_fn = getattr(part, "_init_weights", None)
        # fused expert parameters holding only experts [start, stop) of the model's (expert parallelism)
        self.expert_ranges: dict[str, tuple[int, int]] = {}
        self._layer_args: dict[type, frozenset[str]] = {}
        self._checkpoint_context: Any = None  # set by set_activation_checkpointing
        base = part._modules.get(layout.base)
        self._embedding_normalizer = (
            _compat.embedding_normalizer(base) if base is not None else None
        )
        self._check_placement()
        # [Note: HF routing records], [Note: HF router auxiliary loss]
        self._router_aux = router_aux
        self._routing = routing or (router_aux.routing if router_aux else None)
        self._routers: dict[int, nn.Module] = {}
        self._expert_load: LoadCounter | None = None
        if self._routing is not None:
            self._record_routing(self._routing)

    def _record_routing(self, routing: Routing) -> None:
        """Hooks that record the routing; this stage's MoE layers, their
        routers and the counter of their expert load."""
        install_hooks(self, routing)
        moe_layers = []
        for index, layer in self._layers():
            if not experts_modules(layer):
                continue
            moe_layers.append(index)
            if routing.router_cls is not None:
                for m in layer.modules():
                    if isinstance(m, routing.router_cls):
                        self._routers[index] = m
                        break
        self._expert_load = LoadCounter(moe_layers, routing.num_experts)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _base_child(self, name: str | None) -> nn.Module | None:
        base = self._modules.get(self._layout.base)
        return None if base is None or name is None else base._modules.get(name)

    @staticmethod
    def _placed(module: nn.Module | None) -> nn.Module:
        """``module``, which this stage holds: the split gives the first stage
        the input modules and the last the output ones (``_check_placement``)."""
        assert module is not None
        return module

    def _layers(self) -> list[tuple[int, nn.Module]]:
        """(index in the whole model, layer) of this stage's layers."""
        container = self._base_child(self._layout.layers)
        if container is None:
            return []
        return [
            (int(name), m) for name, m in container._modules.items() if m is not None
        ]

    def set_activation_checkpointing(
        self, mode: str | Callable | Sequence | None
    ) -> None:
        """Recompute each decoder layer in backward (non-reentrant
        ``torch.utils.checkpoint``).

        Args:
            mode: ``None`` (off), ``"full"`` (save only each layer's input),
                or selective: a policy function for
                ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
                or a sequence of ops whose outputs are saved (e.g.
                ``[torch.ops.aten.mm.default]``).
        """
        if mode is None or mode == "full":
            self._checkpoint_context = mode
        elif callable(mode) or (
            isinstance(mode, Sequence) and not isinstance(mode, str)
        ):
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            self._checkpoint_context = functools.partial(
                create_selective_checkpoint_contexts, mode
            )
        else:
            raise ValueError(
                f"activation_checkpointing must be None, 'full', a policy function or a sequence of ops, got {mode!r}"
            )

    def _check_placement(self) -> None:
        lay = self._layout
        where = f"stage {self.stage_index} of {self.num_stages}"
        rules = [(lay.fqn(lay.embed), self._base_child(lay.embed), "first")]
        if lay.pos_embed is not None:
            rules.append(
                (lay.fqn(lay.pos_embed), self._base_child(lay.pos_embed), "first")
            )
        rules.append((lay.fqn(lay.norm), self._base_child(lay.norm), "last"))
        rules.append((lay.head, self._modules.get(lay.head), "last"))
        for fqn, module, role in rules:
            wanted = self.is_first if role == "first" else self.is_last
            if wanted and module is None:
                raise ValueError(
                    f"{where} must hold {fqn!r}: the stage forward needs it there"
                )
            if not wanted and module is not None:
                raise ValueError(
                    f"{where} holds {fqn!r}, which only the {role} stage can run "
                    "(the forward is embedding -> layers -> norm -> head)"
                )
        for rotary in lay.rotaries:
            if self._layers() and self._base_child(rotary) is None:
                raise ValueError(
                    f"{where} runs layers but lacks {lay.fqn(rotary)!r}: list it in every stage "
                    "(it holds no parameters)"
                )

    def _call_layer(
        self, index: int, layer: nn.Module, h: torch.Tensor, available: dict[str, Any]
    ) -> torch.Tensor:
        names = self._layer_args.get(type(layer))
        if names is None:
            names = frozenset(inspect.signature(layer.forward).parameters)
            self._layer_args[type(layer)] = names
        check_not_reentrant(layer, f"{self._layout.layers_prefix}.{index}")
        kwargs = {k: v for k, v in available.items() if k in names}
        if self._checkpoint_context is None:
            out = layer(h, **kwargs)
        else:
            from torch.utils.checkpoint import checkpoint

            extra = (
                {}
                if self._checkpoint_context == "full"
                else {"context_fn": self._checkpoint_context}
            )
            out = checkpoint(layer, h, use_reentrant=False, **kwargs, **extra)
        return out[0] if isinstance(out, tuple) else out

    def _position_embeddings(
        self, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
    ) -> dict:
        """Rotary tables by attention type: ``{kind: {argument name: table}}``."""
        tables: dict[str, dict[str, Any]] = {kind: {} for kind in kinds}
        for name in self._layout.rotaries:
            rotary = self._base_child(name)
            assert rotary is not None  # _check_placement: every stage with layers
            if _compat.rotary_takes_layer_type(rotary):
                for kind in kinds:
                    tables[kind]["position_embeddings"] = rotary(h, position_ids, kind)
                continue
            # Gemma3 on 4.57: ``rotary_emb`` (global) and ``rotary_emb_local``
            suffix = name.removeprefix("rotary_emb").strip("_")
            keys = (
                [f"position_embeddings_{suffix}"]
                if suffix
                else ["position_embeddings", "position_embeddings_global"]
            )
            table = rotary(h, position_ids)
            for kind in kinds:
                tables[kind].update(dict.fromkeys(keys, table))
        return tables

    def forward(self, x: torch.Tensor, *carried: torch.Tensor) -> Any:
        """Run this stage (see the class docstring); see ``[Note: HF stage forward]``.

        With a router auxiliary loss (``config.output_router_logits`` or
        ``router_aux_loss``) it also takes and returns the carried router
        tensors, and the last stage returns ``(logits, auxiliary loss)``:
        see ``[Note: HF carried router tensors]``."""
        sums = None
        if self._router_aux is not None:
            sums = RunningSums(self._router_aux, x, carried)
        elif carried:
            raise TypeError(
                f"stage {self.stage_index} takes one tensor, got {1 + len(carried)} "
                "(more only with a router auxiliary loss)"
            )
        counted = self._expert_load is not None and self._expert_load.counting(x)
        h = self._embed(x) if self.is_first else x
        cache_position = torch.arange(h.shape[1], device=h.device)
        position_ids = cache_position.unsqueeze(0)
        if self.is_first:
            h = self._embed_positions(h, position_ids)
        layers = self._layers()
        if layers:
            kinds = {
                index: _compat.layer_kind(self.config, layer, index)
                for index, layer in layers
            }
            tables = self._position_embeddings(h, position_ids, set(kinds.values()))
            masks = {
                k: _compat.attention_mask(k, self.config, h, position_ids)
                for k in set(kinds.values())
            }
            available: dict[str, Any] = dict(
                position_ids=position_ids,
                cache_position=cache_position,
                past_key_values=None,
                cache=None,
                use_cache=False,
            )
            for index, layer in layers:
                available["attention_mask"] = masks[kinds[index]]
                available.update(tables[kinds[index]])
                call = functools.partial(self._call_layer, index, layer, h, available)
                h = self._run_layer(index, call, sums, counted)
        if counted:
            assert self._expert_load is not None
            self._expert_load.forwards += 1
        if self.is_last:
            h = self._head(h)
            return h if sums is None else (h, sums.loss())
        return h if sums is None else sums.outputs(h)

    def _run_layer(
        self,
        index: int,
        call: Callable[[], torch.Tensor],
        sums: RunningSums | None,
        counted: bool,
    ) -> torch.Tensor:
        """Run one layer; for a MoE model, record its routing (auxiliary
        loss; expert load if ``counted``)."""
        if self._routing is None:
            return call()
        h, record = record_layer(call)
        if record.indices is not None:
            if counted:
                assert self._expert_load is not None
                mask = None if sums is None else sums.mask
                self._expert_load.add(index, record.indices, mask)
            if sums is not None:
                sums.add(record)
        return h

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            raise TypeError(f"the first stage takes token ids, got a {x.dtype} tensor")
        h = self._placed(self._base_child(self._layout.embed))(x)
        if self._embedding_normalizer is not None:
            # in the embeddings' dtype, as the model's own forward rounds it
            h = h * torch.tensor(self._embedding_normalizer, dtype=h.dtype)
        return h

    def _embed_positions(
        self, h: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        lay = self._layout
        if lay.pos_embed is not None:
            h = h + self._placed(self._base_child(lay.pos_embed))(position_ids)
        if lay.embed_dropout is not None:
            h = self._placed(self._base_child(lay.embed_dropout))(h)
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = self._placed(self._base_child(self._layout.norm))(h)
        h = self._placed(self._modules[self._layout.head])(h)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            h = torch.tanh(h / cap) * cap
        return h


def check_not_reentrant(layer: nn.Module, fqn: str) -> None:
    """Refuse Hugging Face's reentrant gradient checkpointing (the default of
    ``gradient_checkpointing_enable()``): the reentrant ``checkpoint`` runs
    its backward inside autograd's engine as a new backward, which the
    pipeline schedules' own backward calls cannot drive."""
    if not getattr(layer, "gradient_checkpointing", False):
        return
    func = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(func, "keywords", None) or {}
    if keywords.get("use_reentrant", True):
        raise ValueError(
            f"{fqn} uses reentrant activation checkpointing (model.gradient_checkpointing_enable() defaults to it), "
            "which pipeline schedules cannot run. Pass activation_checkpointing='full' (or a selective policy) to "
            "pipeline_hf_causal_lm, or call model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})"
        )


def check_trainable(model: PreTrainedModel, layout: DecoderLayout) -> None:
    """Refuse a model whose stages cannot be trained as it is configured:
    reentrant activation checkpointing (the router auxiliary loss is checked
    by ``_router_aux.router_aux_loss``)."""
    for i, layer in enumerate(model.get_submodule(layout.layers_prefix)):
        check_not_reentrant(layer, f"{layout.layers_prefix}.{i}")
