# mypy: allow-untyped-defs
"""Hugging Face causal LMs as pipeline stages.

Upstream target: none in ``torch.distributed.pipelining`` itself (it must not
depend on transformers); this is the integration layer a trainer, or
transformers' own pipeline-parallel support, would carry.  Needs the ``hf``
extra (``pip install torch_pipelining_ext[hf]``).

A Hugging Face decoder-only causal LM is cut by module names with
:mod:`torch_pipelining_ext.stage_split` (original FQNs, only the kept
subtrees ever copied) and each stage model is wrapped in
:class:`HFCausalLMStage`, whose forward takes and returns plain tensors:

* the first stage maps ``input_ids`` to hidden states,
* middle stages map hidden states to hidden states,
* the last stage maps hidden states to logits;

every stage computes its position ids, rotary embeddings and causal mask
from the tensor it receives (see ``[Note: HF stage forward]``).

:func:`pipeline_hf_causal_lm` does it all for one rank: it takes a model (or
a config, to build it on the meta device), finds its layout, balances the
stages, builds only this rank's stages, materialises them and reads only
their tensors from a safetensors checkpoint.  :class:`CausalLMLoss` is the
last stage's loss (its microbatch losses add up to Hugging Face's loss on the
whole batch), and :func:`sync_tied_gradients` makes gradients of weights
tied across stages (GPT-2's embedding and head) right.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Callable, TYPE_CHECKING

import torch
import torch.nn as nn

from torch_pipelining_ext import stage_split as _ss

from torch_pipelining_ext.hf import _compat as _hf_compat

from torch_pipelining_ext.hf import _expert_parallel as _hf_expert_parallel

from torch_pipelining_ext.hf import _selfcheck as _hf_selfcheck
from torch_pipelining_ext.hf._layout import DecoderLayout, detect_layout, VERIFIED_MODEL_TYPES
from torch_pipelining_ext.hf._loading import checkpoint_entries, CheckpointKeys, read_tensors, rows, summarize_keys


if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage


__all__ = [
    "CausalLMLoss",
    "self_check",
    "HFCausalLMStage",
    "estimate_layer_costs",
    "fully_shard_replicated",
    "hf_module_names_per_stage",
    "load_stage_weights",
    "meta_causal_lm",
    "pipeline_hf_causal_lm",
    "reduce_expert_parallel_gradients",
    "sync_tied_gradients",
]

logger = logging.getLogger(__name__)


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "torch_pipelining_ext.hf needs transformers: pip install 'torch_pipelining_ext[hf]'"
        ) from e
    return transformers


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


def meta_causal_lm(config: Any, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Build ``AutoModelForCausalLM.from_config(config)`` with every
    parameter on the meta device (nothing allocated for weights).

    Non-persistent buffers (rotary frequencies, embedding scales), which no
    checkpoint holds, are real after :func:`pipeline_hf_causal_lm` has
    materialised a stage: on transformers 5.x the model is built entirely on
    meta and the stage's buffers are restored with the model's own
    ``_init_weights``; on 4.57 they are built for real (see
    ``[Note: meta build]`` in ``_hf_compat.py``).

    Args:
        config: a transformers ``PretrainedConfig``.
        dtype: dtype of the floating-point parameters (default: as built,
            i.e. ``torch.get_default_dtype()``; loading a checkpoint into
            meta parameters keeps the checkpoint's dtype anyway).
    """
    transformers = _transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    if _hf_compat.builds_buffers_on_meta():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        if dtype is not None:
            for old, places in _tensor_slots(model).values():  # parameters only: buffers keep their dtype
                if isinstance(old, nn.Parameter) and old.is_floating_point():
                    _replace(places, old.to(dtype), old)
        return model
    with _parameters_on_meta(dtype):
        return transformers.AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------
# Stage lists
# ---------------------------------------------------------------------------


def estimate_layer_costs(model: nn.Module) -> list[float]:
    """Per-layer cost estimates for :func:`hf_module_names_per_stage`: the
    parameters a token goes through (for MoE layers only ``top_k`` of the
    routed experts), relative to the cheapest layer.

    Works on meta models.  Experts are the submodules named ``experts``:
    an ``nn.ModuleList`` of per-expert modules (transformers 4.57) or one
    module whose parameters hold every expert along their first dimension
    (fused, 5.x); ``top_k`` is ``config.num_experts_per_tok``.
    """
    layout = detect_layout(model)
    layers = model.get_submodule(layout.layers_prefix)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    costs = []
    for layer in layers:
        total = 0.0
        expert_params: set[int] = set()
        for name, mod in layer.named_modules():
            if name.rsplit(".", 1)[-1] != "experts" or not top_k:
                continue
            if isinstance(mod, nn.ModuleList):
                num_experts = len(mod)
            else:
                num_experts = _num_fused_experts(mod, model.config)
            if not num_experts:
                continue
            share = min(1.0, top_k / num_experts)
            for p in mod.parameters():
                expert_params.add(id(p))
                total += p.numel() * share
        total += sum(p.numel() for p in layer.parameters() if id(p) not in expert_params)
        costs.append(total)
    low = min((c for c in costs if c > 0), default=1.0)
    return [c / low for c in costs]


_NUM_EXPERTS_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts")


def _num_fused_experts(experts: nn.Module, config: Any) -> int:
    """Number of experts of a fused experts module (0: not fused), from the
    module's or the config's expert count, checked against its parameters."""
    n = getattr(experts, "num_experts", None)
    if not isinstance(n, int):
        n = next((getattr(config, a) for a in _NUM_EXPERTS_ATTRS if isinstance(getattr(config, a, None), int)), 0)
    params = list(experts.parameters(recurse=False))
    if n and params and all(p.dim() >= 2 and p.shape[0] == n for p in params):
        return n
    return 0


def hf_module_names_per_stage(
    model: nn.Module,
    num_stages: int,
    *,
    layer_costs: Sequence[float] | str | None = "auto",
    input_weight: float = 1,
    output_weight: float = 1,
) -> list[list[str]]:
    """Balanced FQN lists per stage for a Hugging Face causal LM.

    :func:`~torch_pipelining_ext.stage_split.generate_module_names_per_stage`
    with the model's own names: the token embedding (and GPT-2's position
    embedding and dropout) in the first stage, the final norm and ``lm_head``
    in the last, the rotary embedding replicated into every stage.

    Args:
        model: the causal LM (any device, meta included).
        num_stages: number of pipeline stages.
        layer_costs: ``"auto"`` (:func:`estimate_layer_costs`: MoE layers
            cost their active parameters), ``None`` (every layer 1), or one
            number per layer.
        input_weight: cost of the embedding, in layers of cost 1.
        output_weight: cost of the norm and head, in layers of cost 1.
    """
    layout = detect_layout(model)
    if isinstance(layer_costs, str):
        if layer_costs != "auto":
            raise ValueError(f"layer_costs must be 'auto', None or a sequence of numbers, got {layer_costs!r}")
        layer_costs = estimate_layer_costs(model)
    return _ss.generate_module_names_per_stage(
        num_stages,
        layout.num_layers,
        input_weight=input_weight,
        output_weight=output_weight,
        layer_costs=layer_costs,
        layers_prefix=layout.layers_prefix,
        input_modules=layout.input_modules,
        output_modules=layout.output_modules,
        replicated_modules=layout.replicated_modules,
    )


# ---------------------------------------------------------------------------
# The stage module
# ---------------------------------------------------------------------------

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
#     forwards choose (_hf_compat.layer_kind);
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
        tied_groups: Sequence[tuple[tuple[str, ...], torch.Size, torch.dtype]] = (),
        full_state_keys: frozenset[str] = frozenset(),
        ignore_unexpected: Sequence[str] = (),
        checkpoint_conversions: Any = None,
    ) -> None:
        super().__init__()
        if any(p is not None for p in part._parameters.values()):
            raise ValueError(f"{type(part).__name__} holds parameters on its root; they cannot be placed")
        for name, child in part._modules.items():
            if child is not None:
                self.add_module(name, child)
        self.config = part.config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.tied_groups = tuple(tied_groups)
        self._layout = layout
        self._full_state_keys = full_state_keys
        self._ignore_unexpected = tuple(ignore_unexpected)
        self._checkpoint_conversions = checkpoint_conversions
        # the model's own initialisation restores non-persistent buffers of a meta build (5.x)
        self._init_weights_fn = getattr(part, "_init_weights", None)
        # fused expert parameters holding only experts [start, stop) of the model's (expert parallelism)
        self.expert_ranges: dict[str, tuple[int, int]] = {}
        self._layer_args: dict[type, frozenset[str]] = {}
        self._checkpoint_context: Any = None  # set by set_activation_checkpointing
        base = part._modules.get(layout.base)
        self._embedding_normalizer = _hf_compat.embedding_normalizer(base) if base is not None else None
        self._check_placement()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _base_child(self, name: str | None) -> nn.Module | None:
        base = self._modules.get(self._layout.base)
        return None if base is None or name is None else base._modules.get(name)

    def _layers(self) -> list[tuple[int, nn.Module]]:
        """(index in the whole model, layer) of this stage's layers."""
        container = self._base_child(self._layout.layers)
        if container is None:
            return []
        return [(int(name), m) for name, m in container._modules.items() if m is not None]

    def set_activation_checkpointing(self, mode: str | Callable | Sequence | None) -> None:
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
        elif callable(mode) or (isinstance(mode, Sequence) and not isinstance(mode, str)):
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            self._checkpoint_context = functools.partial(create_selective_checkpoint_contexts, mode)
        else:
            raise ValueError(
                f"activation_checkpointing must be None, 'full', a policy function or a sequence of ops, got {mode!r}"
            )

    def _check_placement(self) -> None:
        lay = self._layout
        where = f"stage {self.stage_index} of {self.num_stages}"
        rules = [(lay.fqn(lay.embed), self._base_child(lay.embed), "first")]
        if lay.pos_embed is not None:
            rules.append((lay.fqn(lay.pos_embed), self._base_child(lay.pos_embed), "first"))
        rules.append((lay.fqn(lay.norm), self._base_child(lay.norm), "last"))
        rules.append((lay.head, self._modules.get(lay.head), "last"))
        for fqn, module, role in rules:
            wanted = self.is_first if role == "first" else self.is_last
            if wanted and module is None:
                raise ValueError(f"{where} must hold {fqn!r}: the stage forward needs it there")
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

    def _call_layer(self, index: int, layer: nn.Module, h: torch.Tensor, available: dict[str, Any]) -> torch.Tensor:
        names = self._layer_args.get(type(layer))
        if names is None:
            names = frozenset(inspect.signature(layer.forward).parameters)
            self._layer_args[type(layer)] = names
        _check_not_reentrant(layer, f"{self._layout.layers_prefix}.{index}")
        kwargs = {k: v for k, v in available.items() if k in names}
        if self._checkpoint_context is None:
            out = layer(h, **kwargs)
        else:
            from torch.utils.checkpoint import checkpoint

            extra = {} if self._checkpoint_context == "full" else {"context_fn": self._checkpoint_context}
            out = checkpoint(layer, h, use_reentrant=False, **kwargs, **extra)
        return out[0] if isinstance(out, tuple) else out

    def _position_embeddings(self, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]) -> dict:
        """Rotary tables by attention type: ``{kind: {argument name: table}}``."""
        tables: dict[str, dict[str, Any]] = {kind: {} for kind in kinds}
        for name in self._layout.rotaries:
            rotary = self._base_child(name)
            if _hf_compat.rotary_takes_layer_type(rotary):
                for kind in kinds:
                    tables[kind]["position_embeddings"] = rotary(h, position_ids, kind)
                continue
            # Gemma3 on 4.57: ``rotary_emb`` (global) and ``rotary_emb_local``
            suffix = name.removeprefix("rotary_emb").strip("_")
            keys = [f"position_embeddings_{suffix}"] if suffix else ["position_embeddings", "position_embeddings_global"]
            table = rotary(h, position_ids)
            for kind in kinds:
                tables[kind].update(dict.fromkeys(keys, table))
        return tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage (see the class docstring); see ``[Note: HF stage forward]``."""
        lay = self._layout
        if self.is_first:
            if x.is_floating_point():
                raise TypeError(f"the first stage takes token ids, got a {x.dtype} tensor")
            h = self._base_child(lay.embed)(x)
            if self._embedding_normalizer is not None:
                # in the embeddings' dtype, as the model's own forward rounds it
                h = h * torch.tensor(self._embedding_normalizer, dtype=h.dtype)
        else:
            h = x
        cache_position = torch.arange(h.shape[1], device=h.device)
        position_ids = cache_position.unsqueeze(0)
        if self.is_first:
            if lay.pos_embed is not None:
                h = h + self._base_child(lay.pos_embed)(position_ids)
            if lay.embed_dropout is not None:
                h = self._base_child(lay.embed_dropout)(h)
        layers = self._layers()
        if layers:
            kinds = {index: _hf_compat.layer_kind(self.config, layer, index) for index, layer in layers}
            tables = self._position_embeddings(h, position_ids, set(kinds.values()))
            masks = {k: _hf_compat.attention_mask(k, self.config, h, position_ids) for k in set(kinds.values())}
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
                h = self._call_layer(index, layer, h, available)
        if self.is_last:
            h = self._base_child(lay.norm)(h)
            h = self._modules[lay.head](h)
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap:
                h = torch.tanh(h / cap) * cap
        return h


def _check_not_reentrant(layer: nn.Module, fqn: str) -> None:
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


def _tied_groups(model: nn.Module) -> list[tuple[tuple[str, ...], torch.Size, torch.dtype]]:
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    return [(tuple(names), tensors[i].shape, tensors[i].dtype) for i, names in by_id.items() if len(names) > 1]


def _state_keys(model: nn.Module) -> frozenset[str]:
    keys = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                keys.add(f"{mod_name}.{b_name}" if mod_name else b_name)
    return frozenset(keys)


# ---------------------------------------------------------------------------
# Materialising and loading
# ---------------------------------------------------------------------------


def _tensor_slots(part: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str, str]]]]:
    """Every parameter/buffer of ``part`` (by identity) with the places that
    hold it: (module, "_parameters"/"_buffers", attribute, FQN)."""
    slots: dict[int, tuple[torch.Tensor, list]] = {}
    for mod_name, mod in part.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(mod, table).items():
                if t is None:
                    continue
                fqn = f"{mod_name}.{key}" if mod_name else key
                slots.setdefault(id(t), (t, []))[1].append((mod, table, key, fqn))
    return slots


def _replace(places: list, new: torch.Tensor, old: torch.Tensor) -> None:
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for mod, table, key, _ in places:
        getattr(mod, table)[key] = new


def load_stage_weights(
    parts: Sequence[HFCausalLMStage],
    checkpoint: str | os.PathLike,
    *,
    device: torch.device | str | int = "cpu",
    dtype: torch.dtype | None = None,
) -> None:
    """Read this rank's stage tensors from a Hugging Face safetensors checkpoint.

    Only the tensors the stages hold are read, each straight into its new
    storage, and keep the checkpoint's dtype (floating-point ones are cast
    to ``dtype`` when it is given).
    Weights tied in the model (e.g. ``lm_head.weight`` saved only as the
    input embedding) are read from whichever of their names the checkpoint
    holds.  Checkpoints of the bare base model (keys without the
    ``base_model_prefix``, as GPT-2's) are understood.

    Everything is checked first: keys the stages need that the checkpoint
    lacks, checkpoint keys the model does not have (except those transformers
    declares ignorable), and shape mismatches are reported together in one
    ``ValueError``, and nothing is changed.  Tensors are swapped into the
    stages only after all were read.

    Args:
        parts: this rank's :class:`HFCausalLMStage` modules.
        checkpoint: a directory with ``model.safetensors`` or
            ``model.safetensors.index.json``, or one of those files.
        device: where the loaded tensors go (non-persistent buffers are
            moved there too).
        dtype: cast floating-point tensors to this dtype.
    """
    if not parts or not all(isinstance(p, HFCausalLMStage) for p in parts):
        raise TypeError("parts must be a non-empty sequence of HFCausalLMStage modules")
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    layout = parts[0]._layout
    keys = CheckpointKeys(
        checkpoint_entries(checkpoint),
        parts[0]._full_state_keys,
        layout.base + ".",
        parts[0]._checkpoint_conversions,
    )
    aliases: dict[str, tuple[str, ...]] = {}
    for names, _, _ in parts[0].tied_groups:
        for n in names:
            aliases[n] = names

    for part in parts:
        if part._init_weights_fn is not None and any(b.is_meta for b in part.buffers()):
            _hf_compat.restore_buffers(part._init_weights_fn, part, device)
    ignore = [re.compile(p) for p in parts[0]._ignore_unexpected]
    unexpected = [k for k in keys.unmatched if not any(p.search(k) for p in ignore)]
    missing: list[str] = []
    mismatched: list[str] = []
    unsupported: list[str] = []
    meta_left: list[str] = []
    plan = []  # (old tensor, places, [(entry, index into the new tensor)])
    for part in parts:
        persistent = _state_keys(part)
        for old, places in _tensor_slots(part).values():
            fqns = [fqn for *_, fqn in places if fqn in persistent]
            if not fqns:
                if old.is_meta:
                    meta_left.append(places[0][3])
                plan.append((old, places, None))
                continue
            key = next((a for f in fqns for a in aliases.get(f, (f,)) if keys.has(a)), None)
            if key is None:
                missing.extend(fqns)
                continue
            start, stop = part.expert_ranges.get(key, (0, None))
            reads, problem = _reads_for(keys, key, tuple(old.shape), start, stop)
            if problem is None:
                plan.append((old, places, reads))
            elif problem[0] == "missing":
                missing.extend(problem[1])
            elif problem[0] == "unsupported":
                unsupported.append(f"{key!r} needs {problem[1]}")
            else:
                mismatched.append(f"{key!r}: {problem[1]}")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint {summarize_keys(missing)}")
    if unexpected:
        problems.append(f"not in the model {summarize_keys(unexpected)}")
    if mismatched:
        problems.append(
            f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched[:5])}{'; ...' if len(mismatched) > 5 else ''}"
        )
    if unsupported:
        problems.append(f"conversions per-stage loading cannot do ({len(unsupported)}): {'; '.join(unsupported[:3])}")
    if meta_left:
        problems.append(
            f"non-persistent buffers on the meta device, which no checkpoint holds: {meta_left}; build the model "
            "with meta_causal_lm(config) (parameters on meta, buffers real)"
        )
    if problems:
        raise ValueError(f"cannot load {checkpoint}: " + "; ".join(problems) + ". Nothing was loaded")

    loaded = []
    requests = []
    for old, places, reads in plan:
        if reads is None:
            continue
        stored = reads[0][0].dtype
        target = dtype if dtype is not None and stored.is_floating_point else stored
        buf = torch.empty(old.shape, dtype=stored)
        for entry, index in reads:
            requests.append((entry, buf[index] if index is not None else buf))
        loaded.append((old, places, buf, target))
    read_tensors(requests)
    for old, places, buf, target in loaded:
        _replace(places, buf.to(device=device, dtype=target), old)
    for old, places, reads in plan:
        if reads is None and old.device != device:
            _replace(places, old.to(device), old)
    logger.info(
        "loaded %d tensors (%.1f MiB) of stages %s from %s",
        len(requests),
        sum(e.nbytes for e, _ in requests) / 2**20,
        [p.stage_index for p in parts],
        checkpoint,
    )


def _reads_for(
    keys: CheckpointKeys, key: str, shape: tuple[int, ...], start: int, stop: int | None
) -> tuple[list[tuple[Any, Any]], tuple[str, Any] | None]:
    """What to read for model tensor ``key`` of ``shape`` (holding experts
    ``start:stop`` when it is a fused expert tensor sliced for expert
    parallelism): ``([(entry, index into the tensor or None)], None)``, or
    ``([], (kind, detail))`` with kind ``"missing"`` (detail: the absent
    pieces), ``"unsupported"`` or ``"shape"``."""
    sliced = stop is not None
    if key in keys.direct:
        entry = keys.entries[keys.direct[key]]
        if sliced:
            if entry.shape[1:] != shape[1:] or entry.shape[0] < stop:
                return [], ("shape", f"checkpoint {list(entry.shape)} vs model experts {start}:{stop} of shape {list(shape)}")
            entry = rows(entry, start, stop)
        if entry.shape != shape:
            return [], ("shape", f"checkpoint {list(entry.shape)} vs model {list(shape)}")
        return [(entry, None)], None
    ops = keys.ops[key]
    if ops not in CheckpointKeys.SUPPORTED_OPS:
        return [], ("unsupported", ' then '.join(ops))
    pieces = {(p.expert, p.part): p for p in keys.pieces[key]}
    num_parts = 1 + max(p.part for p in pieces.values())
    first = start
    last = stop if sliced else shape[0] + start
    if last - first != shape[0]:
        return [], ("shape", f"model holds {shape[0]} experts, expected {last - first}")
    absent = [f"{key}[expert {e}, source {k}]" for e in range(first, last) for k in range(num_parts) if (e, k) not in pieces]
    if absent:
        return [], ("missing", absent)
    reads = []
    offsets = [0]
    for k in range(num_parts):
        offsets.append(offsets[-1] + pieces[(first, k)].entry.shape[0])
    if num_parts > 1 and offsets[-1] != shape[1]:
        return [], ("shape", f"{num_parts} stored parts of {offsets[-1]} rows vs model {list(shape)}")
    for e in range(first, last):
        for k in range(num_parts):
            entry = pieces[(e, k)].entry
            index = (e - first,) if num_parts == 1 else (e - first, slice(offsets[k], offsets[k + 1]))
            want = shape[1:] if num_parts == 1 else (offsets[k + 1] - offsets[k], *shape[2:])
            if entry.shape != tuple(want):
                return [], ("shape", f"expert {e}: checkpoint {list(entry.shape)} vs model slice {list(want)}")
            reads.append((entry, index))
    return reads, None


def _init_stage_weights(hf_part: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Materialise meta tensors of a split HF model on ``device`` and run the
    model's own ``_init_weights`` on every submodule."""
    for old, places in _tensor_slots(hf_part).values():
        if old.is_meta:
            target = dtype if dtype is not None and old.is_floating_point() else old.dtype
            _replace(places, torch.empty(old.shape, dtype=target, device=device), old)
        elif old.device != device:
            _replace(places, old.to(device), old)
    with torch.no_grad():
        for module in hf_part.modules():
            hf_part._init_weights(module)


# ---------------------------------------------------------------------------
# Building this rank's stages
# ---------------------------------------------------------------------------


def _check_training_config(model: nn.Module) -> None:
    config = model.config
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits is set: the router auxiliary loss is computed over all layers in the "
            "Hugging Face forward and is not part of CausalLMLoss; set it to False (or add the auxiliary loss "
            "yourself) for pipeline training"
        )
    layout = detect_layout(model)
    for i, layer in enumerate(model.get_submodule(layout.layers_prefix)):
        _check_not_reentrant(layer, f"{layout.layers_prefix}.{i}")


_SPLIT_BACKWARD_SCHEDULES = ("ScheduleDualPipeV", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")


def _check_checkpointing_schedule(mode: Any, schedule: Any) -> None:
    """Selective activation checkpointing allows one backward per region;
    schedules that split the backward (input, then weight) run two."""
    if mode is None or mode == "full":
        return
    cls = _ss._schedule_class(schedule)
    if cls.__name__ in _SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"selective activation checkpointing cannot run under {cls.__name__}: it splits each backward into an "
            "input and a weight pass, and torch allows one backward per selectively checkpointed region. Use "
            "activation_checkpointing='full', or a schedule with full backwards"
        )


def _chain_stages(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` cut into stages of one layer each (at most 4
    stages), run one after the other in this process."""
    layout = detect_layout(model)
    n = max(2, min(4, layout.num_layers))
    names = hf_module_names_per_stage(model, n, layer_costs=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ties split across stages
        parts = _ss._split_stages(model, names, list(range(n)))
    h = ids
    for i, part in enumerate(parts):
        h = HFCausalLMStage(part, layout, i, n)(h)
    return h


def self_check(config: Any) -> float:
    """Compare the pipeline stages of ``config``'s model type with its
    unsplit Hugging Face forward on a tiny config of the same type (see
    ``[Note: HF self-check]``); returns the max abs logit difference, raises
    ``ValueError`` when the stages are wrong or cannot be checked."""
    return _hf_selfcheck.check_stages_match(config, _chain_stages)


def _pp_and_ep(mesh_or_group: Any, ep_group: Any) -> tuple[Any, Any]:
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


def _default_num_stages(schedule: Any, pp_size: int) -> int:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    cls = _ss._schedule_class(schedule)
    return pp_size if issubclass(cls, PipelineScheduleSingle) else 2 * pp_size


def pipeline_hf_causal_lm(
    model: Any,
    pp_mesh_or_group: Any,
    schedule: type | str,
    device: torch.device | str | int,
    module_names_per_stage: Sequence[Sequence[str]] | None = None,
    *,
    num_stages: int | None = None,
    layer_costs: Sequence[float] | str | None = "auto",
    checkpoint: str | os.PathLike | None = None,
    init_weights: bool = False,
    dtype: torch.dtype | None = None,
    activation_checkpointing: str | Callable | Sequence | None = None,
    verify: bool | None = None,
    ep_group: Any = None,
    **stage_kwargs: Any,
) -> tuple[list[PipelineStage], list[HFCausalLMStage]]:
    """Build this rank's pipeline stages of a Hugging Face causal LM.

    Args:
        model: a transformers causal LM (with real weights, or on the meta
            device, e.g. from :func:`meta_causal_lm`), or its config (then it
            is built with :func:`meta_causal_lm`).  It is not modified.
        pp_mesh_or_group: the pipeline dimension (1-D ``DeviceMesh`` or
            ``ProcessGroup``), or a 2-D ``DeviceMesh`` with dimensions
            ``("pp", "ep")`` (pipeline and expert parallelism).
        schedule: schedule class or name (decides loop- or V-style placement).
        device: device of the stages.
        module_names_per_stage: FQN lists per stage; default
            :func:`hf_module_names_per_stage` with ``num_stages`` and
            ``layer_costs``.
        num_stages: number of stages when the lists are generated (default:
            the pipeline size for single-stage schedules, twice it otherwise).
        layer_costs: see :func:`hf_module_names_per_stage`.
        checkpoint: a safetensors checkpoint to read this rank's tensors from
            (see :func:`load_stage_weights`).
        init_weights: for a meta model without checkpoint, initialise the
            stage weights with the model's own ``_init_weights``.
        dtype: cast floating-point weights to this dtype.
        activation_checkpointing: recompute each decoder layer in backward
            (non-reentrant): ``"full"``, or selective with a policy function
            or a sequence of ops to save (see
            :meth:`HFCausalLMStage.set_activation_checkpointing`).  Hugging
            Face's reentrant ``gradient_checkpointing_enable()`` is refused.
        verify: compare the stages of this model type with its unsplit
            forward on a tiny config first (:func:`self_check`); default:
            only for model types outside the verified list, which are
            refused if the check fails.
        ep_group: the expert-parallel dimension (``ProcessGroup`` or 1-D
            ``DeviceMesh``; or the ``"ep"`` dimension of a 2-D mesh): every
            MoE layer keeps ``E / ep`` of its experts and exchanges tokens by
            all-to-all inside ``ep_overlap`` regions (see
            ``[Note: HF expert parallelism]``; fused experts of
            transformers 5.x).  Ranks of the group feed different data; call
            ``CausalLMLoss.set_labels(labels, group=ep_group)``, and
            :func:`reduce_expert_parallel_gradients` after each step (or
            :func:`fully_shard_replicated` once).
        **stage_kwargs: further ``PipelineStage`` arguments.

    Returns:
        ``(stages, model_parts)``: this rank's ``PipelineStage`` objects and
        their :class:`HFCausalLMStage` modules, in ascending stage order.

    Raises:
        ValueError: a model layout this cannot run (the message names what is
            missing), a bad split, a meta model with neither ``checkpoint``
            nor ``init_weights``, or checkpoint problems.

    Tensors tied across stages (``tie_word_embeddings``) are reported with a
    warning; call :func:`sync_tied_gradients` after each backward.
    Run the schedule with ``scale_grads=False`` and :class:`CausalLMLoss`.
    """
    transformers = _transformers()
    pp_mesh_or_group, ep_group = _pp_and_ep(pp_mesh_or_group, ep_group)
    if isinstance(model, transformers.PretrainedConfig):
        model = meta_causal_lm(model, dtype=dtype)
    _ss._check_model(model)
    layout = detect_layout(model)
    _check_training_config(model)
    _check_checkpointing_schedule(activation_checkpointing, schedule)
    if verify or (verify is None and getattr(model.config, "model_type", None) not in VERIFIED_MODEL_TYPES):
        self_check(model.config)
    group, _, pp_size = _ss._pp_group(pp_mesh_or_group)
    if module_names_per_stage is None:
        n = num_stages if num_stages is not None else _default_num_stages(schedule, pp_size)
        module_names_per_stage = hf_module_names_per_stage(model, n, layer_costs=layer_costs)
    elif num_stages is not None and num_stages != len(module_names_per_stage):
        raise ValueError(f"num_stages={num_stages} but {len(module_names_per_stage)} stage lists were given")
    on_meta = any(t.is_meta for t in model.parameters())
    if on_meta and checkpoint is None and not init_weights:
        raise ValueError(
            "the model is on the meta device: pass checkpoint= to load this rank's weights, or init_weights=True "
            "to initialise them"
        )
    if checkpoint is not None:
        checkpoint_entries(checkpoint)  # fail on a bad path before building anything
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    tied = _tied_groups(model)
    full_keys = _state_keys(model)
    ignore = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    conversions = _hf_compat.conversion_mapping(model) if checkpoint is not None else None

    def prepare(part: nn.Module, stage_id: int, n_stages: int) -> nn.Module:
        if checkpoint is None and on_meta:
            _init_stage_weights(part, device, dtype)
        stage = HFCausalLMStage(
            part,
            layout,
            stage_id,
            n_stages,
            tied_groups=tied,
            full_state_keys=full_keys,
            ignore_unexpected=ignore,
            checkpoint_conversions=conversions,
        )
        stage.set_activation_checkpointing(activation_checkpointing)
        if ep_group is not None:
            _hf_expert_parallel.shard_experts(stage, ep_group, model.config, layout.layers_prefix)
        return stage

    stages, parts = _ss._pipeline_split(
        model,
        group,
        schedule,
        device,
        module_names_per_stage,
        move=False,
        allow_uncovered=False,
        stage_kwargs=stage_kwargs,
        prepare_part=prepare,
    )
    if checkpoint is not None:
        load_stage_weights(parts, checkpoint, device=device, dtype=dtype)
    elif not on_meta:
        for part in parts:
            part.to(device=device, dtype=dtype) if dtype is not None else part.to(device)
    return stages, parts


# ---------------------------------------------------------------------------
# Loss and tied gradients
# ---------------------------------------------------------------------------


class CausalLMLoss:
    """Loss for the last stage: Hugging Face's causal-LM loss, split so that
    the microbatch losses add up to the loss of the whole batch.

    Labels are shifted (token ``t`` predicts label ``t + 1``) and
    ``ignore_index`` labels are skipped, as in transformers'
    ``ForCausalLMLoss``.  Each microbatch returns its summed cross entropy
    divided by the number of predicted tokens of the *whole* batch, so the
    sum over microbatches equals Hugging Face's mean over the batch even when
    microbatches hold different numbers of labelled tokens.  Hence:

    * call :meth:`set_labels` with the whole step's labels before each
      ``schedule.step``;
    * build the schedule with ``scale_grads=False`` (the division is already
      in the loss).

    Example::

        loss_fn = CausalLMLoss()
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
        loss_fn.set_labels(labels)
        schedule.step(input_ids, target=labels, losses=losses)
        step_loss = torch.stack(losses).sum()   # == model(input_ids, labels=labels).loss
    """

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index
        self.num_items_in_batch: int | None = None

    def set_labels(self, labels: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Count the predicted tokens of the step's whole batch.

        With ``group`` (the expert-parallel group, whose ranks train on
        different data) the count is that of the global batch over the
        group's size: each rank's losses then average, over the group, to
        the global batch's loss (the data-parallel convention), so the
        gradients of replicated parameters are averaged over the group and
        those of the sharded experts divided by its size
        (:func:`reduce_expert_parallel_gradients`, :func:`fully_shard_replicated`).
        """
        count = (labels[..., 1:] != self.ignore_index).sum()
        if group is not None:
            import torch.distributed as dist

            count = count.to(_group_device(group))
            dist.all_reduce(count, group=group)
            if int(count) == 0:
                raise ValueError(f"labels hold no token to predict on any rank (all but the first are {self.ignore_index})")
            self.num_items_in_batch = int(count) / dist.get_world_size(group)
            return
        n = int(count)
        if n == 0:
            raise ValueError(f"labels hold no token to predict (all but the first are {self.ignore_index})")
        self.num_items_in_batch = n

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.num_items_in_batch is None:
            raise RuntimeError("CausalLMLoss: call set_labels(labels) with the whole batch's labels before the step")
        shifted = nn.functional.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
        loss = nn.functional.cross_entropy(
            logits.float().flatten(0, -2),
            shifted.reshape(-1).to(logits.device),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return loss / self.num_items_in_batch


def sync_tied_gradients(parts: Sequence[HFCausalLMStage], group: dist.ProcessGroup | None = None) -> None:
    """Make the gradient of every weight tied across stages the full one.

    A weight shared by modules of different stages (GPT-2's token embedding
    and ``lm_head``) is copied into each stage, so each copy gets only its
    stage's part of the gradient.  This adds them up: locally over ``parts``,
    then, with ``group`` (the pipeline group), over its ranks.  Every rank of
    ``group`` must call it (ranks holding no copy contribute zeros), after the
    backward and before the optimizer step; the copies then stay equal.

    Args:
        parts: this rank's stage modules.
        group: the pipeline process group; ``None`` when all stages are local.
    """
    if not parts:
        return
    for names, shape, _ in parts[0].tied_groups:
        holders = []
        for part in parts:
            params = dict(part.named_parameters(remove_duplicate=False))
            seen: set[int] = set()
            for n in names:
                p = params.get(n)
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    holders.append(p)
        if group is None and len(holders) < 2:
            continue
        device = holders[0].device if holders else _group_device(group)
        # float32 on every rank: ranks holding no copy do not know the loaded dtype
        total = torch.zeros(shape, dtype=torch.float32, device=device)
        for p in holders:
            if p.grad is not None:
                total += p.grad.float()
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(total, group=group)
        for p in holders:
            if p.grad is None:
                p.grad = total.to(p.dtype)
            else:
                p.grad.copy_(total)


def reduce_expert_parallel_gradients(parts: Sequence[HFCausalLMStage], ep_group: dist.ProcessGroup) -> None:
    """Average the gradients of the parameters replicated over the
    expert-parallel group (everything but the sharded experts) over its
    ranks, and divide the experts' by its size; after the step, before the
    optimizer.  Every rank of ``ep_group`` must call it.

    With ``CausalLMLoss.set_labels(labels, group=ep_group)`` each rank's
    loss is the loss of its tokens as a share of the global batch, times the
    group size (the losses average to the global loss), so the global
    gradient of a replicated parameter is the ranks' average; a sharded
    expert's gradient already sums every rank's tokens (the all-to-all's
    backward brings them back), hence the division.
    """
    import torch.distributed as dist

    # every rank of the group holds the same stages: the same parameters in the same order
    params = [
        p for part in parts for name, p in part.named_parameters() if not _hf_expert_parallel.is_expert_parameter(part, name)
    ]
    if not params:
        return
    size = dist.get_world_size(ep_group)
    for part in parts:
        for name, p in part.named_parameters():
            if p.grad is not None and _hf_expert_parallel.is_expert_parameter(part, name):
                p.grad.div_(size)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    dist.all_reduce(flat, group=ep_group)
    flat.div_(size)
    offset = 0
    for p in params:
        total = flat[offset : offset + p.numel()].view(p.shape).to(p.dtype)
        offset += p.numel()
        if p.grad is None:
            p.grad = total
        else:
            p.grad.copy_(total)


def fully_shard_replicated(parts: Sequence[HFCausalLMStage], mesh: Any, **fsdp_kwargs: Any) -> None:
    """FSDP2 (``fully_shard``) over the data-parallel ``mesh`` for the
    parameters replicated over it, the sharded experts left out.

    The FSDP way to do what :func:`reduce_expert_parallel_gradients` does:
    with ``mesh`` the expert-parallel dimension (whose ranks train on
    different data), the replicated parameters are sharded and their
    gradients averaged by FSDP's reduce-scatter; the experts stay local and
    every gradient they receive is divided by the mesh size (a tensor hook),
    matching ``CausalLMLoss.set_labels(labels, group=...)``.  Call it on
    this rank's stages once, before the first step.
    """
    from torch.distributed.fsdp import fully_shard

    size = mesh.size()
    for part in parts:
        experts = [p for name, p in part.named_parameters() if _hf_expert_parallel.is_expert_parameter(part, name)]
        fully_shard(part, mesh=mesh, ignored_params=set(experts), **fsdp_kwargs)
        for p in experts:
            p.register_hook(lambda grad: grad / size)


def _group_device(group: Any) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
