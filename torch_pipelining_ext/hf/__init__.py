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
tied across stages (GPT-2's embedding and head) right.  A MoE stays balanced
with a router auxiliary loss (``router_aux_loss=``), :func:`expert_load` and
DeepSeek-V3's :func:`update_expert_bias`.

The training state of a PP x DP x EP job: :func:`save_checkpoint` and
:func:`load_checkpoint` (``torch.distributed.checkpoint``; every expert kept,
any layout loads into any other: :func:`get_state_dict`,
:func:`set_state_dict`), :func:`clip_grad_norm_` by the whole model's
gradient norm, and :func:`save_pretrained` back to a Hugging Face checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TYPE_CHECKING
from collections.abc import Callable

import torch
import torch.nn as nn

from torch_pipelining_ext.hf import (
    _build,
    _checkpoint,
    _clip,
    _compat,
    _config,
    _costs,
    _dcp,
    _expert_load,
    _expert_parallel,
    _export,
    _selfcheck,
    _state_dict,
    _training,
)
from torch_pipelining_ext.hf._config import check_checkpointing_schedule
from torch_pipelining_ext.hf._expert_load import ExpertLoad
from torch_pipelining_ext.hf._families import has_expert_bias, num_routed_experts
from torch_pipelining_ext.hf._expert_parallel import (
    ExpertParallelTransport,
    ExpertShard,
)
from torch_pipelining_ext.hf._layout import detect_layout
from torch_pipelining_ext.hf._mesh import MeshOrGroup
from torch_pipelining_ext.hf._stage import HFCausalLMStage
from torch_pipelining_ext.hf._training import CausalLMLoss


if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

    from torch_pipelining_ext._parallel_layout import ParallelLayout


__all__ = [
    "CausalLMLoss",
    "ExpertLoad",
    "ExpertParallelTransport",
    "ExpertShard",
    "HFCausalLMStage",
    "check_checkpoint",
    "check_checkpointing_schedule",
    "clip_grad_norm_",
    "estimate_layer_costs",
    "expert_load",
    "expert_parallel_shards",
    "fully_shard_replicated",
    "get_state_dict",
    "has_expert_bias",
    "has_fused_experts",
    "hf_module_names_per_stage",
    "load_checkpoint",
    "load_stage_weights",
    "meta_causal_lm",
    "num_routed_experts",
    "pipeline_hf_causal_lm",
    "reduce_expert_parallel_gradients",
    "run_local_experts",
    "save_checkpoint",
    "save_pretrained",
    "self_check",
    "set_expert_parallel_transport",
    "set_state_dict",
    "sync_tied_gradients",
    "update_expert_bias",
]


# ---------------------------------------------------------------------------
# Building on the meta device and stage lists
# ---------------------------------------------------------------------------


def meta_causal_lm(config: Any, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Build ``AutoModelForCausalLM.from_config(config)`` with every
    parameter on the meta device (nothing allocated for weights).

    Non-persistent buffers (rotary frequencies, embedding scales), which no
    checkpoint holds, are real after :func:`pipeline_hf_causal_lm` has
    materialised a stage: on transformers 5.x the model is built entirely on
    meta and the stage's buffers are restored with the model's own
    ``_init_weights``; on 4.57 they are built for real (see
    ``[Note: meta build]`` in ``_compat.py``).

    Args:
        config: a transformers ``PretrainedConfig``.
        dtype: dtype of the floating-point parameters (default: as built,
            i.e. ``torch.get_default_dtype()``; loading a checkpoint into
            meta parameters keeps the checkpoint's dtype anyway).
    """
    return _build.build_on_meta(config, dtype)


def estimate_layer_costs(model: nn.Module) -> list[float]:
    """Per-layer cost estimates for :func:`hf_module_names_per_stage`: the
    parameters a token goes through (for MoE layers only ``top_k`` of the
    routed experts), relative to the cheapest layer.

    Works on meta models.  Experts are the submodules named ``experts``:
    an ``nn.ModuleList`` of per-expert modules (transformers 4.57) or one
    module whose parameters hold every expert along their first dimension
    (fused, 5.x); ``top_k`` is ``config.num_experts_per_tok``.
    """
    return _costs.layer_costs(model, detect_layout(model))


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
    return _costs.module_names_per_stage(
        model,
        detect_layout(model),
        num_stages,
        layer_costs,
        input_weight,
        output_weight,
    )


# ---------------------------------------------------------------------------
# This rank's stages
# ---------------------------------------------------------------------------


def pipeline_hf_causal_lm(
    model: Any,
    pp_mesh_or_group: MeshOrGroup,
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
    ep_group: DeviceMesh | dist.ProcessGroup | None = None,
    router_aux_loss: str | None = None,
    router_aux_loss_coef: float | None = None,
    **stage_kwargs: Any,
) -> tuple[list[PipelineStage], list[HFCausalLMStage]]:
    """Build this rank's pipeline stages of a Hugging Face causal LM.

    Args:
        model: a transformers causal LM (with real weights, or on the meta
            device, e.g. from :func:`meta_causal_lm`), or its config (then it
            is built with :func:`meta_causal_lm`).  It is not modified.
        pp_mesh_or_group: the job's layout or mesh (:mod:`~torch_pipelining_ext.launcher`'s
            ``parallel_layout`` and its ``mesh``; a ``("pp", "ep")`` mesh too: expert parallelism
            where ``ep`` > 1), or the pipeline dimension alone (1-D ``DeviceMesh`` or ``ProcessGroup``).
        schedule: schedule class or name (decides loop- or V-style placement).
        device: device of the stages.
        module_names_per_stage: FQN lists per stage; default
            :func:`hf_module_names_per_stage` with ``num_stages`` and ``layer_costs``.
        num_stages: number of stages when the lists are generated (default:
            the pipeline size for single-stage schedules, twice it otherwise).
        layer_costs: see :func:`hf_module_names_per_stage`.
        checkpoint: a safetensors checkpoint to read this rank's tensors from (:func:`load_stage_weights`).
        init_weights: initialise a meta model's stage weights (no checkpoint) by its ``_init_weights``.
        dtype: cast floating-point weights to this dtype.
        activation_checkpointing: recompute each decoder layer in backward
            (non-reentrant): ``"full"`` or selective (see
            :meth:`HFCausalLMStage.set_activation_checkpointing`); Hugging
            Face's reentrant ``gradient_checkpointing_enable()`` is refused.
        verify: compare the stages of this model type with its unsplit
            forward on a tiny config first (:func:`self_check`); default:
            only for unverified model types, refused if the check fails.
        ep_group: with the pipeline dimension alone, the expert-parallel one
            (``ProcessGroup`` or 1-D ``DeviceMesh``): every MoE layer keeps ``E / ep`` of
            its fused experts (``[Note: HF expert parallelism]``); its ranks feed different
            data (:func:`reduce_expert_parallel_gradients`, :func:`fully_shard_replicated`).
        router_aux_loss: a MoE's router auxiliary loss: ``"pooled"`` (Hugging
            Face's, the default where ``config.output_router_logits``),
            ``"per_layer"`` or ``"sequence"`` (DeepSeek-V3's); see :class:`CausalLMLoss`.
        router_aux_loss_coef: its coefficient (default
            ``config.router_aux_loss_coef``; required for ``"sequence"``).
        **stage_kwargs: further ``PipelineStage`` arguments.

    Returns:
        ``(stages, model_parts)``: ``PipelineStage`` s and their modules, by stage id.

    Raises:
        ValueError: a model layout this cannot run (the message names what
            is missing), a bad split, a meta model with neither
            ``checkpoint`` nor ``init_weights``, checkpoint problems, or an
            auxiliary loss the model cannot have.

    Tensors tied across stages are reported with a warning (call
    :func:`sync_tied_gradients` after each backward).  Run the schedule with
    ``scale_grads=False`` and :class:`CausalLMLoss`.
    """
    options = _config.StageOptions(
        num_stages=num_stages, layer_costs=layer_costs, checkpoint=checkpoint,
        init_weights=init_weights, dtype=dtype, verify=verify, ep_group=ep_group,
        activation_checkpointing=activation_checkpointing,
        router_aux_loss=router_aux_loss, router_aux_loss_coef=router_aux_loss_coef,
        stage_kwargs=stage_kwargs,
    )  # fmt: skip
    return _build.build_stages(
        model, pp_mesh_or_group, schedule, device, module_names_per_stage, options
    )


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
    _checkpoint.load_stage_weights(parts, checkpoint, _build.as_device(device), dtype)


def self_check(config: Any) -> float:
    """Compare the pipeline stages of ``config``'s model type with its
    unsplit Hugging Face forward on a tiny config of the same type (see
    ``[Note: HF self-check]``); returns the max abs logit difference, raises
    ``ValueError`` when the stages are wrong or cannot be checked."""
    return _selfcheck.check_stages_match(config)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def sync_tied_gradients(
    parts: Sequence[HFCausalLMStage], group: dist.ProcessGroup | None = None
) -> None:
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
    _training.sync_tied_gradients(parts, group)


def reduce_expert_parallel_gradients(
    parts: Sequence[HFCausalLMStage], ep_group: MeshOrGroup
) -> None:
    """Reduce the gradients over the ranks that train on different data,
    after the step, before clipping and the optimizer; every rank of those
    groups calls it (see ``[Note: HF expert gradient state]``).

    With ``CausalLMLoss.set_labels(labels, group=<the dp x ep group>)`` each
    rank's loss is the loss of its tokens as a share of the global batch,
    times the number of data-parallel ranks (the losses average to the global
    loss).  So the gradient of a parameter every data rank holds is averaged
    over them, and a sharded expert's gradient (which already sums its
    expert-parallel group's tokens: the all-to-all's backward brings them
    back) is summed over its ``dp`` replicas and divided by ``dp x ep``.
    Parameters FSDP2 manages (:func:`fully_shard_replicated`) are left to it;
    after ``fully_shard_replicated(parts, mesh)`` with a ``"dp"`` dimension
    of more than one rank this still sums the experts over ``dp``, and
    without one it has nothing left to do.

    Args:
        parts: this rank's stage modules.
        ep_group: the job's layout or mesh (``("pp", "dp", "ep")`` of
            :func:`torch_pipelining_ext.launcher.device_mesh`, or
            ``("pp", "ep")``), or the expert-parallel group alone (a
            ``ProcessGroup`` or 1-D mesh: no ``dp``).
    """
    _training.reduce_expert_parallel_gradients(parts, ep_group)


def fully_shard_replicated(
    parts: Sequence[HFCausalLMStage],
    mesh: ParallelLayout | DeviceMesh,
    **fsdp_kwargs: Any,
) -> None:
    """FSDP2 (``fully_shard``) over the data-parallel ranks for the
    parameters they all hold, the sharded experts left out.

    The FSDP way to do what :func:`reduce_expert_parallel_gradients` does:
    ``mesh`` is the job's layout or mesh (``("pp", "dp", "ep")``: sharded over the
    ``dp x ep`` ranks, the layout's ``data_mesh``)
    or its 1-D expert-parallel dimension.  The replicated parameters are
    sharded and their gradients averaged by FSDP's reduce-scatter; the
    experts stay local and every gradient they receive is divided by the
    number of data-parallel ranks (a tensor hook), matching
    ``CausalLMLoss.set_labels(labels, group=...)``.  The experts are
    replicated over ``dp``: with a ``"dp"`` dimension of more than one rank,
    call :func:`reduce_expert_parallel_gradients` after each step for their
    sum over ``dp`` (:func:`clip_grad_norm_` refuses gradients left
    unreduced).  Call it on this rank's stages once, before the first step
    and before building the optimizers.
    """
    _training.fully_shard_replicated(parts, mesh, **fsdp_kwargs)


def clip_grad_norm_(
    parts: Sequence[HFCausalLMStage],
    max_norm: float,
    norm_type: float | str = 2.0,
    *,
    mesh: MeshOrGroup = None,
    pp_group: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of the whole model by its total norm; returns that
    norm, the same on every rank.

    :func:`torch.nn.utils.clip_grad_norm_` for a model split over pipeline,
    data-parallel and expert-parallel ranks: the norm is that of the whole
    model's gradient (every stage, every expert, each counted once: replicas
    over the data-parallel ranks and weights tied across stages too), equal
    to the unsplit model's on the global batch, and every rank scales every
    gradient it holds (plain, FSDP2 shards, expert shards) by the same
    factor, ``max_norm / (total + 1e-6)`` if that is below 1.  A collective
    over every rank of ``mesh`` (one all-reduce of one number per pipeline,
    ``dp`` and ``ep`` dimension of more than one rank); call it after
    :func:`reduce_expert_parallel_gradients` (and
    :func:`sync_tied_gradients`), before the optimizer step.  See
    ``[Note: HF global gradient norm]``.

    Args:
        parts: this rank's stage modules.
        max_norm: the maximum norm of the whole gradient.
        norm_type: the p of the p-norm (``inf`` or ``"inf"``: the max norm).
        mesh: the job's layout or mesh (``("pp", "dp", "ep")`` or
            ``("pp", "ep")``, as given to :func:`pipeline_hf_causal_lm`).
        pp_group: without ``mesh``, the pipeline group (the experts' group is
            read from the stages; no data-parallel replicas).  Neither is
            needed when this rank holds every stage.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the
            total norm is ``nan`` or ``inf``; otherwise the gradients are
            scaled by it, as torch does.
        foreach: use the foreach kernels (``None``: where torch has them).

    Raises:
        RuntimeError: the expert gradients were not reduced after the step,
            or a non-finite norm with ``error_if_nonfinite``.
        ValueError: ``pp_group``/``mesh`` missing while other ranks hold
            stages, or a mesh the stages were not built with.
    """
    return _clip.clip_grad_norm_(
        parts, max_norm, norm_type, mesh, pp_group, error_if_nonfinite, foreach
    )


# ---------------------------------------------------------------------------
# Checkpoints and export
# ---------------------------------------------------------------------------


def get_state_dict(
    parts: Sequence[HFCausalLMStage],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts of this rank's stages, for
    ``torch.distributed.checkpoint`` (see ``[Note: HF expert checkpoints]``).

    :func:`torch.distributed.checkpoint.state_dict.get_state_dict` per stage
    module, merged: the model state dict has the model's own keys (FSDP2
    parameters as DTensors, each rank's experts as a ``Shard(0)`` DTensor of
    the whole ``[E, ...]`` tensor, every other tensor plain), the optimizer
    state dict is flattened (``flatten_optimizer_state_dict=True``) into
    ``state.<fqn>.<name>`` (e.g. ``state.model.layers.1.mlp.experts.down_proj.exp_avg``,
    experts' moments as shards too) and ``param_groups.<fqn>.<name>`` (``lr``,
    ``betas``, ...).  Every key names one parameter, so a checkpoint of one
    pipeline x expert-parallel layout loads into any other and into the
    unsplit model.

    Args:
        parts: this rank's stage modules.
        optimizers: one optimizer per stage module, ``optimizers[i]`` over
            ``parts[i].parameters()`` (a single optimizer for a single module);
            ``None``: the model only.  An optimizer without state yet gets
            it from a step with zero gradients and learning rate 0 (torch's
            way).
    """
    return _state_dict.get_state_dict(parts, optimizers)


def set_state_dict(
    parts: Sequence[HFCausalLMStage],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any] | None = None,
) -> None:
    """Load state dicts of the form :func:`get_state_dict` returns into
    this rank's stages and optimizers (each module takes its own keys; the
    experts their rows, from a shard or from a whole ``[E, ...]`` tensor)."""
    _state_dict.set_state_dict(parts, optimizers, model_state_dict, optim_state_dict)


def save_checkpoint(
    checkpoint_id: str | os.PathLike | None,
    parts: Sequence[HFCausalLMStage],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    state: dict[str, Any] | None = None,
    storage_writer: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save this rank's stages (and optimizers) with
    ``torch.distributed.checkpoint``; every rank of ``process_group`` calls it.

    The checkpoint holds ``{"model": ..., "optim": ...}`` of
    :func:`get_state_dict` (keys ``model.<fqn>``, ``optim.state.<fqn>.<name>``,
    ``optim.param_groups.<fqn>.<name>``) and the entries of ``state`` under
    their own keys (tensors, or ``Stateful`` objects such as a learning-rate
    scheduler's wrapper: per-rank values need per-rank keys, as DCP keeps one
    copy of a key).  It loads into any pipeline x data-parallel x
    expert-parallel layout (:func:`load_checkpoint`) and into the unsplit
    model (``dcp.load({"model": model.state_dict()}, ...)``).
    """
    _dcp.save_checkpoint(
        checkpoint_id,
        parts,
        optimizers,
        state,
        storage_writer=storage_writer,
        process_group=process_group,
    )


def load_checkpoint(
    checkpoint_id: str | os.PathLike | None,
    parts: Sequence[HFCausalLMStage],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    state: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_reader: Any = None,
) -> None:
    """Load a checkpoint of :func:`save_checkpoint` (of any layout) into this
    rank's stages and optimizers, and ``state``'s entries in place; every
    rank of ``process_group`` calls it.

    The checkpoint is checked against the model first (``[Note: HF checkpoint
    check]``): keys of the model it lacks, keys the model does not have, saved
    shapes that differ (experts: the whole ``[E, ...]`` tensor, so a
    checkpoint with another number of experts), optimizer state it lacks, and
    expert keys of the other transformers major are reported together, by
    name, in one ``ValueError`` raised on every rank before anything is read.
    """
    _dcp.load_checkpoint(
        checkpoint_id, parts, optimizers, state, storage_reader, process_group
    )


def check_checkpoint(model: Any, checkpoint_id: str | os.PathLike) -> None:
    """Check a checkpoint of :func:`save_checkpoint` against a model, in one
    process, before any process group exists (e.g. before a job resumes it).

    The checks of :func:`load_checkpoint` for the model's state (``[Note: HF
    checkpoint check]``): keys of the model the checkpoint lacks, keys the
    model does not have, saved shapes that differ (experts: the whole
    ``[E, ...]`` tensor) and expert keys of the other transformers major, in
    one ``ValueError`` naming them.  Nothing is read but the checkpoint's
    metadata.

    Args:
        model: the whole model (on any device; the meta device allocates
            nothing) or its config (then it is built with :func:`meta_causal_lm`).
        checkpoint_id: the checkpoint's directory.

    Raises:
        ValueError: the checkpoint does not fit the model.
        FileNotFoundError: ``checkpoint_id`` is not a directory.
    """
    if not isinstance(model, nn.Module):
        model = meta_causal_lm(model)
    _dcp.check_checkpoint(model, checkpoint_id)


def save_pretrained(
    parts: Sequence[HFCausalLMStage],
    save_directory: str | os.PathLike,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Write the model of the stages as a Hugging Face checkpoint:
    ``config.json`` and safetensors files with their index, in the key layout
    transformers itself writes (per-expert keys for MoE on 5.x, through its
    own conversion table), which ``AutoModelForCausalLM.from_pretrained`` and
    ``pipeline_hf_causal_lm(..., checkpoint=...)`` read.

    Every rank of ``process_group`` (default: all) calls it with its stages;
    each writes the tensors it owns to a file of its own (replicas are
    written once, FSDP2 parameters gathered one at a time), so no rank holds
    the whole model; the directory must be shared by the ranks.  See
    ``[Note: HF export]``.

    Args:
        parts: this rank's stage modules.
        save_directory: the directory (created if missing).
        overwrite: replace the model files of a non-empty directory
            (default: refuse it).
        dtype: cast floating-point tensors to it (default: as they are);
            also written to ``config.json``.

    Raises:
        ValueError: a non-empty directory without ``overwrite``, or experts
            that transformers' conversion table cannot write per expert
            (raised on every rank, before anything is written).
    """
    _export.save_pretrained(parts, save_directory, overwrite, dtype, process_group)


# ---------------------------------------------------------------------------
# Expert load and balancing
# ---------------------------------------------------------------------------


def expert_load(
    parts: Sequence[HFCausalLMStage], group: dist.ProcessGroup | None = None
) -> ExpertLoad:
    """The expert load of the step: per MoE layer, the (token, expert) slots
    routed to each expert, summed over every microbatch and over ``group``.

    Call it after ``schedule.step()``: it returns the counts of every forward
    since the last call and starts the next step's from zero (a second call
    without a step in between raises ``RuntimeError``).  The counts
    accumulate on the stages' device; this call adds one all-reduce (of
    ``num_hidden_layers x (2 E + 3)`` integers) and one host
    synchronisation.  See ``[Note: HF expert load]``.

    Args:
        parts: this rank's stage modules (a MoE model's).
        group: the ranks to sum over: the expert-parallel group (with the
            data-parallel ranks, if any) for the global batch's counts of
            this rank's layers; the whole world (``dist.group.WORLD``) to
            get every layer on every rank; ``None``: this rank's counts only.
            A collective: every rank of ``group`` calls it.

    Returns:
        :class:`ExpertLoad` (tokens per expert, max/mean load, padding and
        dropped slots per layer; ``summary()`` is one line).
    """
    return _expert_load.expert_load(parts, group)


def update_expert_bias(
    parts: Sequence[HFCausalLMStage], load: ExpertLoad, rate: float
) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: after
    ``optimizer.step()``, add ``rate * sign(mean load - load_i)`` to every
    MoE layer's ``e_score_correction_bias`` (per layer, expert ``i``), from
    ``load = expert_load(parts, group)`` of the same step.

    With ``group`` covering every rank that trains on other data (the
    expert-parallel and data-parallel ranks), every replica of a layer gets
    the same load and the same update, bitwise; each pipeline rank updates
    its own layers.  No communication.

    Raises:
        ValueError: the stages' routers have no ``e_score_correction_bias``,
            ``load`` lacks one of their layers, or ``rate`` is not > 0.
    """
    _expert_load.update_expert_bias(parts, load, rate)


# ---------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------


def has_fused_experts() -> bool:
    """Whether the installed transformers holds MoE experts as fused 3-D
    parameters (5.x), which expert parallelism (``ep_group=``) shards."""
    return _compat.has_fused_experts()


def set_expert_parallel_transport(
    transport: ExpertParallelTransport | None,
) -> ExpertParallelTransport:
    """Install ``transport`` for every expert-parallel all-to-all of this
    process (``None``: the default, :func:`torch.distributed.all_to_all_single`);
    returns the transport it replaces, to restore it.

    Every rank of an expert-parallel group must install a transport that
    keeps the collective's semantics; see
    ``[Note: HF expert-parallel transport]``.

    Example::

        class Counting(hf.ExpertParallelTransport):
            def tokens(
                self, output, input, output_split_sizes, input_split_sizes, group
            ):
                self.calls += 1
                super().tokens(
                    output, input, output_split_sizes, input_split_sizes, group
                )


        previous = hf.set_expert_parallel_transport(Counting())
        try:
            schedule.step(...)
        finally:
            hf.set_expert_parallel_transport(previous)
    """
    return _expert_parallel.set_transport(transport)


def expert_parallel_shards(
    parts: Sequence[nn.Module],
) -> list[tuple[nn.Module, ExpertShard]]:
    """Every experts module of ``parts`` that expert parallelism sharded, with
    its :class:`ExpertShard` (this rank's experts ``[start, stop)`` of
    ``num_experts``, ``local`` of them, over a group of ``size`` ranks)."""
    return _expert_parallel.sharded_experts(parts)


def run_local_experts(
    module: nn.Module, tokens: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """What a sharded experts ``module`` computes between dispatch and
    combine: its local experts on the ``tokens`` it received, grouped by
    source rank, then local expert (``counts``: rows per [source rank, local
    expert]); returns their outputs in the same order."""
    return _expert_parallel.local_experts(module, tokens, counts)
