"""Distributed checkpoints of a rank's Hugging Face stages and optimizers.

Private helper of :mod:`torch_pipelining_ext.hf`: ``torch.distributed.checkpoint``
save and load of the state dicts of ``_state_dict.py``, and the check of a
checkpoint against the model before anything is loaded (see ``[Note: HF
checkpoint check]``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from torch_pipelining_ext.hf import _state_dict
from torch_pipelining_ext.hf._loading import summarize_keys


__all__: list[str] = []

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"

# [Note: HF checkpoint check]
# torch.distributed.checkpoint loads straight into the tensors of the state
# dict it is given (here: the parameters and the optimizer state), ignores
# what the checkpoint holds beyond them, and reports a missing key or a size
# mismatch on the rank that meets it.  A checkpoint of another model whose
# keys include ours (more layers), one of the other transformers major
# (per-expert modules on 4.x, fused experts on 5.x) or of another optimizer
# would then load partly, or fail on some ranks while the others wait in the
# load's collectives.  So before dcp.load every rank compares the
# checkpoint's metadata with the model: keys of the whole model missing from
# the checkpoint, checkpoint keys the model does not have, this rank's
# tensors whose saved shape differs (experts: the whole [E, ...] tensor), and
# this rank's optimizer state; the findings of all ranks are gathered (one
# small collective), and if there are any every rank raises the same error,
# naming the keys, before anything was read.

_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)$")


def save_checkpoint(
    checkpoint_id: Any,
    parts: Sequence[nn.Module],
    optimizers: Any,
    state: Any,
    **dcp_kwargs: Any,
) -> None:
    """See :func:`torch_pipelining_ext.hf.save_checkpoint` (``dcp_kwargs``:
    ``storage_writer``, ``process_group``)."""
    combined = _combined(parts, optimizers, state)
    dcp.save(combined, checkpoint_id=checkpoint_id, **dcp_kwargs)
    logger.info(
        "saved stages %s (%d model tensors) to %s",
        [getattr(p, "stage_index", None) for p in parts],
        len(combined[MODEL_KEY]),
        checkpoint_id,
    )


def load_checkpoint(
    checkpoint_id: Any,
    parts: Sequence[nn.Module],
    optimizers: Any,
    state: Any,
    storage_reader: Any,
    process_group: Any,
) -> None:
    """See :func:`torch_pipelining_ext.hf.load_checkpoint`."""
    combined = _combined(parts, optimizers, state)
    reader = _reader(checkpoint_id, storage_reader)
    problems = checkpoint_problems(
        parts, combined[MODEL_KEY], combined.get(OPTIM_KEY), reader.read_metadata()
    )
    _raise_on_every_rank(problems, checkpoint_id, process_group)
    dcp.load(
        combined,
        checkpoint_id=checkpoint_id,
        storage_reader=reader,
        process_group=process_group,
    )
    _state_dict.set_state_dict(
        parts, optimizers, combined[MODEL_KEY], combined.get(OPTIM_KEY)
    )


def _combined(
    parts: Sequence[nn.Module], optimizers: Any, state: Any
) -> dict[str, Any]:
    """``{"model": ..., "optim": ... (with optimizers), **state}``."""
    model_sd, optim_sd = _state_dict.get_state_dict(parts, optimizers)
    combined: dict[str, Any] = {MODEL_KEY: model_sd}
    if optimizers is not None:
        combined[OPTIM_KEY] = optim_sd
    for key, value in (state or {}).items():
        if key in (MODEL_KEY, OPTIM_KEY):
            raise ValueError(
                f"state may not use the key {key!r}: it holds the stages' {key} state"
            )
        combined[key] = value
    return combined


def _reader(checkpoint_id: Any, storage_reader: Any) -> Any:
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("pass checkpoint_id (a directory) or storage_reader")
        if not os.path.isdir(checkpoint_id):
            raise FileNotFoundError(f"checkpoint {checkpoint_id} is not a directory")
        return dcp.FileSystemReader(checkpoint_id)
    if checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    return storage_reader


def checkpoint_problems(
    parts: Sequence[nn.Module],
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any] | None,
    metadata: Any,
) -> list[str]:
    """What in the checkpoint (its ``metadata``) does not fit this rank's
    stages and optimizers (see ``[Note: HF checkpoint check]``)."""
    saved = metadata.state_dict_metadata
    prefix = MODEL_KEY + "."
    saved_model = {k[len(prefix) :] for k in saved if k.startswith(prefix)}
    if not saved_model:
        return [
            f"it holds no model state (no key starts with {prefix!r}; its keys: {summarize_keys(list(saved))})"
        ]
    whole = set().union(
        *(getattr(p, "_full_state_keys", frozenset()) for p in parts)
    ) or set(model_sd)
    problems = []
    missing = sorted(whole - saved_model)
    unexpected = sorted(saved_model - whole)
    if missing:
        problems.append(
            f"keys of the model missing from the checkpoint {summarize_keys(missing)}"
        )
    if unexpected:
        problems.append(
            f"checkpoint keys the model does not have {summarize_keys(unexpected)}"
        )
    hint = _major_hint(missing, unexpected)
    if hint:
        problems.append(hint)
    problems += _shape_problems(model_sd, saved, prefix, "")
    if optim_sd is not None:
        absent = sorted(k for k in optim_sd if OPTIM_KEY + "." + k not in saved)
        if absent:
            problems.append(
                "optimizer state missing from the checkpoint (saved without optimizers, or with another "
                f"optimizer) {summarize_keys(absent)}"
            )
        problems += _shape_problems(
            optim_sd, saved, OPTIM_KEY + ".", "optimizer state "
        )
    return problems


def _shape_problems(
    sd: dict[str, Any], saved: dict[str, Any], prefix: str, what: str
) -> list[str]:
    out = []
    for key, value in sd.items():
        md = saved.get(prefix + key)
        if md is None or not torch.is_tensor(value):
            continue
        size = getattr(md, "size", None)
        if size is None:
            out.append(f"{what}{key!r}: saved as an object, the model holds a tensor")
        elif tuple(size) != tuple(value.shape):
            out.append(f"{what}{key!r}: saved {list(size)}, here {list(value.shape)}")
    if len(out) > 5:
        out = out[:5] + [f"... {len(out) - 5} more shape mismatches"]
    return out


_MAJORS = {
    "per_expert": "experts as separate modules ('...experts.<e>.<proj>.weight', transformers 4.x)",
    "fused": "fused experts ('...experts.gate_up_proj', transformers 5.x)",
}


def _major_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """Name the transformers major a checkpoint's expert keys come from when
    they are the other major's."""
    kinds = {"per_expert": _PER_EXPERT, "fused": _FUSED}
    for saved, here in (("per_expert", "fused"), ("fused", "per_expert")):
        if any(kinds[here].search(k) for k in missing) and any(
            kinds[saved].search(k) for k in unexpected
        ):
            return (
                f"the checkpoint holds {_MAJORS[saved]} while this model has {_MAJORS[here]}: a DCP checkpoint "
                "loads under the transformers major it was saved with; convert it through a Hugging Face "
                "checkpoint (hf.save_pretrained under that major, then pipeline_hf_causal_lm(..., checkpoint=...) "
                "under this one)"
            )
    return None


def check_checkpoint(model: nn.Module, checkpoint_id: Any) -> None:
    """See :func:`torch_pipelining_ext.hf.check_checkpoint` (``model``: the
    whole model, on any device)."""
    reader = _reader(checkpoint_id, None)
    problems = checkpoint_problems(
        [model], model.state_dict(), None, reader.read_metadata()
    )
    _raise_problems(problems, checkpoint_id)


def _raise_on_every_rank(problems: list[str], checkpoint_id: Any, group: Any) -> None:
    """Raise the problems of every rank on every rank of ``group`` (nobody is
    left waiting in the load's collectives)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems, group=group)
    found: list[str] = []
    for rank_problems in everyone:
        found += [p for p in rank_problems if p not in found]
    _raise_problems(found, checkpoint_id)


def _raise_problems(problems: list[str], checkpoint_id: Any) -> None:
    if problems:
        raise ValueError(
            f"cannot load checkpoint {checkpoint_id}: "
            + "; ".join(problems)
            + ". Nothing was loaded"
        )
