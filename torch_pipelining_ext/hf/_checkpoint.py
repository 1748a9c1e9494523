"""Loading this rank's stage tensors from a Hugging Face checkpoint.

Private helper of :mod:`torch_pipelining_ext.hf`: what every tensor of the
stages is read from (:class:`_LoadPlan`), the checks made before anything is
read, then the reads (:mod:`torch_pipelining_ext.hf._loading`) and the swap.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_pipelining_ext.hf import _compat
from torch_pipelining_ext.hf._loading import (
    checkpoint_entries,
    CheckpointKeys,
    read_tensors,
    rows,
    summarize_keys,
)
from torch_pipelining_ext.hf._stage import HFCausalLMStage
from torch_pipelining_ext.hf._tensors import replace, state_keys, tensor_slots


__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class _LoadPlan:
    """Every tensor of the stages with what to read into it (``reads`` None:
    nothing, it is only moved), and what stands in the way."""

    tensors: list[tuple[torch.Tensor, list, list | None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    meta_left: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        if self.missing:
            out.append(f"missing from the checkpoint {summarize_keys(self.missing)}")
        if self.unexpected:
            out.append(f"not in the model {summarize_keys(self.unexpected)}")
        if self.mismatched:
            more = "; ..." if len(self.mismatched) > 5 else ""
            out.append(
                f"shape mismatches ({len(self.mismatched)}): {'; '.join(self.mismatched[:5])}{more}"
            )
        if self.unsupported:
            out.append(
                f"conversions per-stage loading cannot do ({len(self.unsupported)}): {'; '.join(self.unsupported[:3])}"
            )
        if self.meta_left:
            out.append(
                f"non-persistent buffers on the meta device, which no checkpoint holds: {self.meta_left}; build the "
                "model with meta_causal_lm(config) (parameters on meta, buffers real)"
            )
        return out


def load_stage_weights(
    parts: Sequence[HFCausalLMStage],
    checkpoint: str | os.PathLike,
    device: torch.device,
    dtype: torch.dtype | None,
) -> None:
    """See :func:`torch_pipelining_ext.hf.load_stage_weights`."""
    if not parts or not all(isinstance(p, HFCausalLMStage) for p in parts):
        raise TypeError("parts must be a non-empty sequence of HFCausalLMStage modules")
    first = parts[0]
    keys = CheckpointKeys(
        checkpoint_entries(checkpoint),
        first._full_state_keys,
        first._layout.base + ".",
        first._checkpoint_conversions,
    )
    for part in parts:
        if part._init_weights_fn is not None and any(b.is_meta for b in part.buffers()):
            _compat.restore_buffers(part._init_weights_fn, part, device)
    plan = _plan(parts, keys)
    problems = plan.problems()
    if problems:
        raise ValueError(
            f"cannot load {checkpoint}: " + "; ".join(problems) + ". Nothing was loaded"
        )
    requests = _read_and_swap(plan, device, dtype)
    logger.info(
        "loaded %d tensors (%.1f MiB) of stages %s from %s",
        len(requests),
        sum(e.nbytes for e, _ in requests) / 2**20,
        [p.stage_index for p in parts],
        checkpoint,
    )


def _plan(parts: Sequence[HFCausalLMStage], keys: CheckpointKeys) -> _LoadPlan:
    aliases = {n: names for names, _, _ in parts[0].tied_groups for n in names}
    ignore = [re.compile(p) for p in parts[0]._ignore_unexpected]
    plan = _LoadPlan(
        unexpected=[k for k in keys.unmatched if not any(p.search(k) for p in ignore)]
    )
    for part in parts:
        persistent = state_keys(part)
        for old, places in tensor_slots(part).values():
            fqns = [fqn for *_, fqn in places if fqn in persistent]
            if not fqns:
                if old.is_meta:
                    plan.meta_left.append(places[0][3])
                plan.tensors.append((old, places, None))
                continue
            key = next(
                (a for f in fqns for a in aliases.get(f, (f,)) if keys.has(a)), None
            )
            if key is None:
                plan.missing.extend(fqns)
                continue
            start, stop = part.expert_ranges.get(key, (0, None))
            reads, problem = _reads_for(keys, key, tuple(old.shape), start, stop)
            if problem is None:
                plan.tensors.append((old, places, reads))
            elif problem[0] == "missing":
                plan.missing.extend(problem[1])
            elif problem[0] == "unsupported":
                plan.unsupported.append(f"{key!r} needs {problem[1]}")
            else:
                plan.mismatched.append(f"{key!r}: {problem[1]}")
    return plan


def _read_and_swap(
    plan: _LoadPlan, device: torch.device, dtype: torch.dtype | None
) -> list:
    """Read every planned tensor into new storage, then swap them all in;
    returns the read requests."""
    loaded = []
    requests = []
    for old, places, reads in plan.tensors:
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
        replace(places, buf.to(device=device, dtype=target), old)
    for old, places, reads in plan.tensors:
        if reads is None and old.device != device:
            replace(places, old.to(device), old)
    return requests


def _reads_for(
    keys: CheckpointKeys, key: str, shape: tuple[int, ...], start: int, stop: int | None
) -> tuple[list[tuple[Any, Any]], tuple[str, Any] | None]:
    """What to read for model tensor ``key`` of ``shape`` (holding experts
    ``start:stop`` when it is a fused expert tensor sliced for expert
    parallelism): ``([(entry, index into the tensor or None)], None)``, or
    ``([], (kind, detail))`` with kind ``"missing"`` (detail: the absent
    pieces), ``"unsupported"`` or ``"shape"``."""
    if key in keys.direct:
        entry = keys.entries[keys.direct[key]]
        if stop is not None:  # sliced
            if entry.shape[1:] != shape[1:] or entry.shape[0] < stop:
                return [], (
                    "shape",
                    f"checkpoint {list(entry.shape)} vs model experts {start}:{stop} of shape {list(shape)}",
                )
            entry = rows(entry, start, stop)
        if entry.shape != shape:
            return [], (
                "shape",
                f"checkpoint {list(entry.shape)} vs model {list(shape)}",
            )
        return [(entry, None)], None
    ops = keys.ops[key]
    if ops not in CheckpointKeys.SUPPORTED_OPS:
        return [], ("unsupported", " then ".join(ops))
    pieces = {(p.expert, p.part): p for p in keys.pieces[key]}
    num_parts = 1 + max(p.part for p in pieces.values())
    first = start
    last = stop if stop is not None else shape[0] + start
    if last - first != shape[0]:
        return [], ("shape", f"model holds {shape[0]} experts, expected {last - first}")
    absent = [
        f"{key}[expert {e}, source {k}]"
        for e in range(first, last)
        for k in range(num_parts)
        if (e, k) not in pieces
    ]
    if absent:
        return [], ("missing", absent)
    reads = []
    offsets = [0]
    for k in range(num_parts):
        offsets.append(offsets[-1] + pieces[(first, k)].entry.shape[0])
    if num_parts > 1 and offsets[-1] != shape[1]:
        return [], (
            "shape",
            f"{num_parts} stored parts of {offsets[-1]} rows vs model {list(shape)}",
        )
    for e in range(first, last):
        for k in range(num_parts):
            entry = pieces[(e, k)].entry
            index = (
                (e - first,)
                if num_parts == 1
                else (e - first, slice(offsets[k], offsets[k + 1]))
            )
            want = (
                shape[1:]
                if num_parts == 1
                else (offsets[k + 1] - offsets[k], *shape[2:])
            )
            if entry.shape != tuple(want):
                return [], (
                    "shape",
                    f"expert {e}: checkpoint {list(entry.shape)} vs model slice {list(want)}",
                )
            reads.append((entry, index))
    return reads, None
