"""State dicts of Hugging Face stages that keep every expert.

Private helper of :mod:`torch_pipelining_ext.hf`: each rank's slice of the
fused experts seen by ``state_dict()`` as a shard of the whole tensor, the
optimizer state likewise, and the model and optimizer state dicts of a rank's
stages together (see ``[Note: HF expert checkpoints]``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard

from torch_pipelining_ext.hf._expert_parallel import (
    expert_parameters,
    ExpertShard,
    sharded_experts,
)
from torch_pipelining_ext.hf._tensors import state_keys


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF expert checkpoints]
# With expert parallelism each rank holds experts [start, stop) of a fused
# experts tensor as a plain tensor under the model's own key
# (``...mlp.experts.down_proj``).  torch.distributed.checkpoint takes plain
# tensors with the same key on several ranks for replicas and writes one of
# them: a checkpoint would keep one rank's experts under the key of all, and
# a load would hand every rank that rank's experts, silently.  So the state
# dict presents each rank's slice as what it is, a shard of the whole
# [E, ...] tensor: a DTensor with Shard(0) over the expert-parallel group
# (DTensor.from_local over DeviceMesh.from_group of the group; no copy, no
# collective), which DCP saves as chunks of one tensor and reshards into any
# other expert-parallel size, the unsplit model included, as it does FSDP's
# shards.  The parameters stay plain tensors (the expert computation meets
# plain activations); a state-dict post-hook of the experts module makes the
# DTensors and a load pre-hook takes them back (also a whole [E, ...] tensor,
# e.g. the unsplit model's state dict: this rank's rows).  Expert replicas
# over a data-parallel dimension are the same chunk, which DCP writes once.
#
# The optimizer state has the same defect (AdamW's moments of the experts are
# plain tensors under one key on every EP rank): get_state_dict presents its
# expert entries the same way.  Optimizer state dicts come from torch's
# get_state_dict with flatten_optimizer_state_dict=True, one optimizer per
# stage module, so that every key names its parameter
# ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") and the state of any
# pipeline layout loads into any other.


def register_expert_hooks(part: nn.Module) -> None:
    """Present the sharded experts of ``part`` as DTensor shards in its
    ``state_dict()`` and take them back in ``load_state_dict()``."""
    for module, _ in sharded_experts([part]):
        module.register_state_dict_post_hook(_experts_as_shards)
        module.register_load_state_dict_pre_hook(_experts_from_shards)


def as_shard(local: torch.Tensor, shard: ExpertShard) -> DTensor:
    """``local`` (this rank's experts, along dim 0) as a DTensor shard of the
    whole tensor over the expert-parallel mesh; no copy."""
    shape = torch.Size((shard.num_experts, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    with torch.no_grad():
        return DTensor.from_local(
            local.detach(),
            shard.mesh,
            [Shard(0)],
            run_check=False,
            shape=shape,
            stride=stride,
        )


def _experts_as_shards(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
) -> None:
    shard = cast(ExpertShard, module._expert_shard)
    for name in shard.param_names:
        key = prefix + name
        if key in state_dict and not isinstance(state_dict[key], DTensor):
            state_dict[key] = as_shard(state_dict[key], shard)


def _experts_from_shards(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    shard = cast(ExpertShard, module._expert_shard)
    for name in shard.param_names:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = local_rows(state_dict[key], shard, key)


def local_rows(value: Any, shard: ExpertShard, key: str) -> Any:
    """This rank's experts of ``value``: a DTensor shard over the expert-parallel
    mesh (its local tensor), a whole ``[E, ...]`` tensor (rows ``start:stop``),
    or this rank's rows already (unchanged; a wrong shape is left to the load's
    size check)."""
    if isinstance(value, DTensor):
        ranks = value.device_mesh.mesh.flatten().tolist()
        if (
            tuple(value.placements) != (Shard(0),)
            or ranks != dist.get_process_group_ranks(shard.group)
            or value.shape[0] != shard.num_experts
        ):
            raise ValueError(
                f"{key}: expected this rank's experts as Shard(0) of a [{shard.num_experts}, ...] tensor over the "
                f"expert-parallel group of {shard.size} ranks, got a DTensor of shape {list(value.shape)} with "
                f"placements {tuple(value.placements)} over the ranks {ranks}"
            )
        return value.to_local()
    if (
        torch.is_tensor(value)
        and value.dim() > 0
        and value.shape[0] == shard.num_experts
    ):
        return value[shard.start : shard.stop]
    return value


# ---------------------------------------------------------------------------
# The model and optimizer state dicts of a rank's stages
# ---------------------------------------------------------------------------


def _options() -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=True)


def pair_optimizers(
    parts: Sequence[nn.Module], optimizers: Any
) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
    """``[(part, its optimizer or None)]``; one optimizer per part, checked."""
    if not parts:
        raise ValueError("parts is empty: pass this rank's stage modules")
    if optimizers is None:
        return [(part, None) for part in parts]
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    if len(optimizers) != len(parts):
        raise ValueError(
            f"{len(optimizers)} optimizers for {len(parts)} stage modules: build one optimizer per stage module "
            "(optimizers[i] over parts[i].parameters()), as torch's get_state_dict takes one model per call"
        )
    for i, (part, optimizer) in enumerate(zip(parts, optimizers)):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizers[{i}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        own = {id(p) for p in part.parameters()}
        foreign = sum(
            id(p) not in own for g in optimizer.param_groups for p in g["params"]
        )
        if foreign:
            raise ValueError(
                f"optimizers[{i}] holds {foreign} parameters that parts[{i}] does not have: build one optimizer per "
                "stage module (optimizers[i] over parts[i].parameters())"
            )
    return list(zip(parts, optimizers))


def get_state_dict(
    parts: Sequence[nn.Module], optimizers: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """See :func:`torch_pipelining_ext.hf.get_state_dict`."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for part, optimizer in pair_optimizers(parts, optimizers):
        osd: dict[str, Any]
        if optimizer is None:
            msd, osd = dsd.get_model_state_dict(part, options=_options()), {}
        else:
            # flattened (flatten_optimizer_state_dict): one value per key, not
            # the nested dicts of torch's annotation
            msd, osd = cast(
                tuple[dict[str, Any], dict[str, Any]],
                dsd.get_state_dict(part, optimizer, options=_options()),
            )
        experts = expert_parameters(part)
        for key, value in osd.items():
            shard = _optimizer_expert(key, experts)
            if shard is not None and torch.is_tensor(value) and value.dim() > 0:
                osd[key] = as_shard(value, shard)
        for target, new in ((model_sd, msd), (optim_sd, osd)):
            twice = sorted(set(target) & set(new))
            if twice:
                raise ValueError(
                    f"stage modules share the state keys {twice[:5]}: pass each stage module once"
                )
            target.update(new)
    return model_sd, optim_sd


def _optimizer_expert(key: str, experts: dict[str, ExpertShard]) -> ExpertShard | None:
    """The shard of the expert parameter whose state ``key`` is
    (``state.<fqn>.<name>``), if any."""
    fqn = param_of(key, experts) if key.startswith("state.") else None
    return None if fqn is None else experts[fqn]


def param_of(key: str, fqns: Any) -> str | None:
    """The parameter FQN (one of ``fqns``) of a flattened optimizer key
    (``state.<fqn>.<name...>`` or ``param_groups.<fqn>.<name>``), if any."""
    head, _, rest = key.partition(".")
    if head not in ("state", "param_groups"):
        return None
    dot = rest.find(".")
    while dot != -1:
        if rest[:dot] in fqns:
            return rest[:dot]
        dot = rest.find(".", dot + 1)
    return None


def set_state_dict(
    parts: Sequence[nn.Module],
    optimizers: Any,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any] | None,
) -> None:
    """See :func:`torch_pipelining_ext.hf.set_state_dict`."""
    for part, optimizer in pair_optimizers(parts, optimizers):
        keys = state_keys(part)
        msd = {k: v for k, v in model_state_dict.items() if k in keys}
        missing = sorted(keys - set(msd))
        if missing:
            raise ValueError(
                f"model_state_dict lacks the keys {missing[:5]} of stage {part.stage_index}"
            )
        if optimizer is None:
            dsd.set_model_state_dict(part, msd, options=_options())
            continue
        if optim_state_dict is None:
            raise ValueError("optimizers given without optim_state_dict")
        names = {n for n, _ in part.named_parameters()}
        experts = expert_parameters(part)
        osd = {}
        for key, value in optim_state_dict.items():
            if param_of(key, names) is None:
                continue
            shard = _optimizer_expert(key, experts)
            osd[key] = local_rows(value, shard, key) if shard is not None else value
        dsd.set_state_dict(
            part,
            optimizer,
            model_state_dict=msd,
            optim_state_dict=osd,
            options=_options(),
        )
