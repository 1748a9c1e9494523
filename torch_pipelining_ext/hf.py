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

import inspect
import logging
import os
import re
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, TYPE_CHECKING

import torch
import torch.nn as nn

from torch_pipelining_ext import stage_split as _ss
from torch_pipelining_ext._hf_layout import DecoderLayout, detect_layout, VERIFIED_MODEL_TYPES
from torch_pipelining_ext._hf_loading import checkpoint_entries, read_tensors


if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage


__all__ = [
    "CausalLMLoss",
    "HFCausalLMStage",
    "estimate_layer_costs",
    "hf_module_names_per_stage",
    "load_stage_weights",
    "meta_causal_lm",
    "pipeline_hf_causal_lm",
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

    Buffers are built for real: they are small, and non-persistent ones
    (rotary frequencies) are not in checkpoints.

    Args:
        config: a transformers ``PretrainedConfig``.
        dtype: dtype of the floating-point parameters (default: as built,
            i.e. ``torch.get_default_dtype()``; loading a checkpoint into
            meta parameters keeps the checkpoint's dtype anyway).
    """
    transformers = _transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
    with _parameters_on_meta(dtype):
        return transformers.AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------
# Stage lists
# ---------------------------------------------------------------------------


def estimate_layer_costs(model: nn.Module) -> list[float]:
    """Per-layer cost estimates for :func:`hf_module_names_per_stage`: the
    parameters a token goes through (for MoE layers only ``top_k`` of the
    routed experts), relative to the cheapest layer.

    Works on meta models.  Experts are found as ``nn.ModuleList`` children
    named ``experts``; ``top_k`` is ``config.num_experts_per_tok``.
    """
    layout = detect_layout(model)
    layers = model.get_submodule(layout.layers_prefix)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    costs = []
    for layer in layers:
        total = 0.0
        expert_params: set[int] = set()
        for name, mod in layer.named_modules():
            if name.rsplit(".", 1)[-1] == "experts" and isinstance(mod, nn.ModuleList) and len(mod) and top_k:
                share = min(1.0, top_k / len(mod))
                for p in mod.parameters():
                    expert_params.add(id(p))
                    total += p.numel() * share
        total += sum(p.numel() for p in layer.parameters() if id(p) not in expert_params)
        costs.append(total)
    low = min((c for c in costs if c > 0), default=1.0)
    return [c / low for c in costs]


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
#   * the mask comes from transformers.masking_utils, per layer: a layer with
#     an ``attention_type`` (Qwen2/Qwen3) gets the mask of that type, others
#     a sliding-window mask when ``config.sliding_window`` is set
#     (Mixtral, Qwen3-MoE) and the full causal mask otherwise, exactly as the
#     families' own forwards choose;
#   * a layer gets only the arguments its forward names.
# Model types not in VERIFIED_MODEL_TYPES may do more in their forwards
# (e.g. scale the embeddings) and get a warning.


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
        self._layer_args: dict[type, frozenset[str]] = {}
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

    def _layers(self) -> list[nn.Module]:
        container = self._base_child(self._layout.layers)
        return [] if container is None else [m for m in container._modules.values() if m is not None]

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
        if self._layers() and lay.rotary is not None and self._base_child(lay.rotary) is None:
            raise ValueError(
                f"{where} runs layers but lacks {lay.fqn(lay.rotary)!r}: list it in every stage "
                "(it holds no parameters)"
            )

    def _call_layer(self, layer: nn.Module, h: torch.Tensor, available: dict[str, Any]) -> torch.Tensor:
        names = self._layer_args.get(type(layer))
        if names is None:
            names = frozenset(inspect.signature(layer.forward).parameters)
            self._layer_args[type(layer)] = names
        out = layer(h, **{k: v for k, v in available.items() if k in names})
        return out[0] if isinstance(out, tuple) else out

    def _mask(self, kind: str, h: torch.Tensor, cache_position: torch.Tensor, position_ids: torch.Tensor):
        from transformers import masking_utils

        make = (
            masking_utils.create_sliding_window_causal_mask
            if kind == "sliding_attention"
            else masking_utils.create_causal_mask
        )
        return make(
            config=self.config,
            input_embeds=h,
            attention_mask=None,
            cache_position=cache_position,
            past_key_values=None,
            position_ids=position_ids,
        )

    def _mask_kind(self, layer: nn.Module) -> str:
        kind = getattr(layer, "attention_type", None)
        if kind is not None:
            return kind
        return "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage (see the class docstring); see ``[Note: HF stage forward]``."""
        lay = self._layout
        if self.is_first:
            if x.is_floating_point():
                raise TypeError(f"the first stage takes token ids, got a {x.dtype} tensor")
            h = self._base_child(lay.embed)(x)
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
            available: dict[str, Any] = dict(
                position_ids=position_ids, cache_position=cache_position, past_key_values=None, use_cache=False
            )
            if lay.rotary is not None:
                available["position_embeddings"] = self._base_child(lay.rotary)(h, position_ids)
            masks: dict[str, Any] = {}
            for layer in layers:
                kind = self._mask_kind(layer)
                if kind not in masks:
                    masks[kind] = self._mask(kind, h, cache_position, position_ids)
                available["attention_mask"] = masks[kind]
                h = self._call_layer(layer, h, available)
        if self.is_last:
            h = self._base_child(lay.norm)(h)
            h = self._modules[lay.head](h)
        return h


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
    entries = checkpoint_entries(checkpoint)
    layout = parts[0]._layout
    prefix = layout.base + "."
    full_keys = parts[0]._full_state_keys
    aliases: dict[str, tuple[str, ...]] = {}
    for names, _, _ in parts[0].tied_groups:
        for n in names:
            aliases[n] = names

    def source_key(fqn: str) -> str | None:
        for cand in aliases.get(fqn, (fqn,)):
            for key in (cand, cand[len(prefix) :] if cand.startswith(prefix) else None):
                if key is not None and key in entries:
                    return key
        return None

    ignore = [re.compile(p) for p in parts[0]._ignore_unexpected]
    unexpected = sorted(
        k
        for k in entries
        if k not in full_keys and prefix + k not in full_keys and not any(p.search(k) for p in ignore)
    )
    missing: list[str] = []
    mismatched: list[str] = []
    meta_left: list[str] = []
    plan = []  # (old tensor, places, entry)
    for part in parts:
        persistent = _state_keys(part)
        for old, places in _tensor_slots(part).values():
            fqns = [fqn for *_, fqn in places if fqn in persistent]
            if not fqns:
                if old.is_meta:
                    meta_left.append(places[0][3])
                plan.append((old, places, None))
                continue
            key = next((k for k in map(source_key, fqns) if k is not None), None)
            if key is None:
                missing.extend(fqns)
                continue
            entry = entries[key]
            if entry.shape != tuple(old.shape):
                mismatched.append(f"{fqns[0]!r}: checkpoint {list(entry.shape)} vs model {list(old.shape)}")
            plan.append((old, places, entry))
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {', '.join(map(repr, sorted(missing)))}")
    if unexpected:
        problems.append(f"not in the model ({len(unexpected)}): {', '.join(map(repr, unexpected))}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched)}")
    if meta_left:
        problems.append(
            f"non-persistent buffers on the meta device, which no checkpoint holds: {meta_left}; build the model "
            "with meta_causal_lm(config) (parameters on meta, buffers real)"
        )
    if problems:
        raise ValueError(f"cannot load {checkpoint}: " + "; ".join(problems) + ". Nothing was loaded")

    loaded: list[tuple[torch.Tensor, list, torch.Tensor]] = []
    requests = []
    for old, places, entry in plan:
        if entry is None:
            continue
        target = entry.dtype
        if dtype is not None and entry.dtype.is_floating_point:
            target = dtype
        buf = torch.empty(entry.shape, dtype=entry.dtype)
        requests.append((entry, buf))
        loaded.append((old, places, buf, target))
    read_tensors(requests)
    for old, places, buf, target in loaded:
        _replace(places, buf.to(device=device, dtype=target), old)
    for old, places, entry in plan:
        if entry is None and old.device != device:
            _replace(places, old.to(device), old)
    logger.info(
        "loaded %d tensors (%.1f MiB) of stages %s from %s",
        len(requests),
        sum(e.nbytes for e, _ in requests) / 2**20,
        [p.stage_index for p in parts],
        checkpoint,
    )


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
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_MODEL_TYPES:
        warnings.warn(
            f"model type {model_type!r} has not been verified against its unsplit forward (verified: "
            f"{sorted(VERIFIED_MODEL_TYPES)}); compare a split run with the whole model before training",
            UserWarning,
            stacklevel=3,
        )


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
    **stage_kwargs: Any,
) -> tuple[list[PipelineStage], list[HFCausalLMStage]]:
    """Build this rank's pipeline stages of a Hugging Face causal LM.

    Args:
        model: a transformers causal LM (with real weights, or on the meta
            device, e.g. from :func:`meta_causal_lm`), or its config (then it
            is built with :func:`meta_causal_lm`).  It is not modified.
        pp_mesh_or_group: the pipeline dimension (1-D ``DeviceMesh`` or
            ``ProcessGroup``).
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
    if isinstance(model, transformers.PretrainedConfig):
        model = meta_causal_lm(model, dtype=dtype)
    _ss._check_model(model)
    layout = detect_layout(model)
    _check_training_config(model)
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

    def prepare(part: nn.Module, stage_id: int, n_stages: int) -> nn.Module:
        if checkpoint is None and on_meta:
            _init_stage_weights(part, device, dtype)
        return HFCausalLMStage(
            part, layout, stage_id, n_stages, tied_groups=tied, full_state_keys=full_keys, ignore_unexpected=ignore
        )

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

    def set_labels(self, labels: torch.Tensor) -> None:
        """Count the predicted tokens of the step's whole batch."""
        n = int((labels[..., 1:] != self.ignore_index).sum())
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


def _group_device(group: Any) -> torch.device:
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
