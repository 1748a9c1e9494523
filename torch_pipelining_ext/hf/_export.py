"""Writing the model of a rank's Hugging Face stages back as a Hugging Face
checkpoint, every rank its own tensors.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF export]``.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist

from torch_pipelining_ext.hf._expert_parallel import expert_parameters
from torch_pipelining_ext.hf._loading import INDEX_FILE, SINGLE_FILE


if TYPE_CHECKING:
    from torch_pipelining_ext.hf._stage import HFCausalLMStage


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF export]
# save_pretrained writes config.json and sharded safetensors with an index,
# in the key layout transformers itself writes for the model, without
# gathering the model anywhere:
#   1. every rank lists its tensors in *units* that a key conversion never
#      crosses: per decoder layer, the layer's experts slice (experts
#      [start, stop) of an expert-parallel rank) apart from the rest, and the
#      tensors outside the layers;
#   2. the keys each unit becomes are worked out on the meta device with
#      transformers' own conversion table reversed (revert_weight_conversion,
#      as PreTrainedModel.save_pretrained does: per-expert keys for fused
#      experts on 5.x, legacy names where transformers writes them), an
#      experts slice numbered from its first global expert; whatever cannot
#      be written that way (experts of a model type the table does not split
#      per expert: one rank would write its slice under the key of all) is
#      refused, as is a non-empty directory without overwrite=True;
#   3. one all_gather_object of every rank's units, keys and problems: each
#      unit gets one owner among the ranks that hold it (data-parallel and
#      expert replicas hold the same unit), spread round-robin, and every
#      rank raises the same error when any rank found a problem;
#   4. FSDP2 parameters are gathered one at a time (DTensor.full_tensor, a
#      collective over their mesh) and kept by their owner only;
#   5. each owner converts its units and writes them to a safetensors file
#      of its own (one file per writing rank, as transformers names shards),
#      rank 0 the index and config.json; the files' bytes depend on the
#      weights alone (see [Note: HF export bytes]).
# Tied weights are written once, under their first name (transformers drops
# the others and ties them again on load), and keys the model class ignores
# on save are left out.

# [Note: HF export bytes]
# The same weights give the same files, byte for byte (a run and its resumed
# twin, two exports of one model), so that an export can be compared or
# deduplicated by its checksum:
#   * a safetensors header's "__metadata__" is a hash map in the safetensors
#     library (Rust's HashMap, seeded at random per map): with more than one
#     key its order differs from one file to the next.  torch's
#     HuggingFaceStorageWriter, which wrote the files before, writes three
#     keys ("DCP_SHARDING_INFO", "DCP_VERSION", "format"), and the caller
#     cannot change them; so the files are written here with
#     safetensors.torch.save_file and the one key transformers' own
#     save_pretrained writes, {"format": "pt"} (the DCP keys serve only DCP's
#     reader of sharded tensors: an export holds whole tensors);
#   * safetensors orders the tensors of a file by dtype and name, whatever
#     order they are handed over in;
#   * which file a key goes to (_assign) depends on the units every rank
#     holds, sorted, and on their holders in rank order: the same for the
#     same layout;
#   * the index lists the keys sorted, config.json is written by
#     transformers with sorted keys.
# Exports of the same weights in different layouts hold the same tensors
# under the same keys but in other files (one per writing rank).

_LAYER = re.compile(r"^(.*?\.\d+)\.")


@dataclass
class _Unit:
    """Tensors of one unit on this rank: ``(model key, tensor)`` in state-dict
    order, and the checkpoint keys they become."""

    items: list[tuple[str, Any]] = field(default_factory=list)
    out_keys: list[str] = field(default_factory=list)
    start: int | None = None  # first global expert of an experts slice


def save_pretrained(
    parts: Sequence[HFCausalLMStage],
    save_directory: str | os.PathLike,
    overwrite: bool,
    dtype: torch.dtype | None,
    process_group: Any,
) -> None:
    """See :func:`torch_pipelining_ext.hf.save_pretrained`."""
    from torch_pipelining_ext.hf._stage import HFCausalLMStage

    if not parts or not all(isinstance(p, HFCausalLMStage) for p in parts):
        raise TypeError("parts must be a non-empty sequence of HFCausalLMStage modules")
    path = Path(save_directory)
    rank = dist.get_rank(process_group)
    units, problems = _local_units(parts)
    if rank == 0:
        problems += _directory_problems(path, overwrite)
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(
        everyone,
        ({u: x.out_keys for u, x in units.items()}, problems),
        group=process_group,
    )
    owners, mapping, problems = _assign(everyone)
    if problems:
        raise ValueError(
            f"cannot write {path}: " + "; ".join(problems) + ". Nothing was written"
        )
    if rank == 0:
        _prepare_directory(path)
    dist.barrier(group=process_group)
    tensors = _owned_tensors(parts, units, owners, rank, dtype)
    _write(path, tensors, mapping, process_group)
    if rank == 0:
        _write_config(parts[0], path, dtype or _float_dtype(parts))
    dist.barrier(group=process_group)
    logger.info("rank %d wrote %d tensors to %s", rank, len(tensors), path)


def _layer_of(key: str, layers_prefix: str) -> str:
    m = _LAYER.match(key)
    return m.group(1) if m and m.group(1).startswith(layers_prefix + ".") else ""


def _local_units(
    parts: Sequence[HFCausalLMStage],
) -> tuple[dict[tuple, _Unit], list[str]]:
    """This rank's units (see ``[Note: HF export]``) with their checkpoint
    keys, worked out on the meta device, and what cannot be written."""
    units: dict[tuple, _Unit] = {}
    for part in parts:
        experts = expert_parameters(part)
        skip = {n for names, _, _ in part.tied_groups for n in names[1:]}
        ignored = [re.compile(p) for p in part._keys_to_ignore_on_save]
        for key, value in part.state_dict().items():
            if key in skip or any(p.search(key) for p in ignored):
                continue
            shard = experts.get(key)
            if shard is not None:  # its slice, not the DTensor a checkpoint sees
                value = value.to_local()
            # outside the layers: the embedding or the norm and head, one unit per stage
            layer = (
                _layer_of(key, part._layout.layers_prefix)
                or f"stage {part.stage_index}"
            )
            unit_key = (layer, None if shard is None else shard.start)
            unit = units.setdefault(
                unit_key, _Unit(start=None if shard is None else shard.start)
            )
            unit.items.append((key, value))
    problems: list[str] = []
    first = parts[0]
    for unit in units.values():
        meta = {
            k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            for k, v in unit.items
        }
        converted, problem = convert_unit(first, meta, unit.start)
        unit.out_keys = list(converted)
        if problem:
            problems.append(problem)
    return units, problems


def convert_unit(
    part: HFCausalLMStage, tensors: dict[str, torch.Tensor], start: int | None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """``tensors`` (model keys) in transformers' saved layout; an experts
    slice numbered from global expert ``start``.  Returns the converted
    tensors and what went wrong (``None``: nothing)."""
    conversions = part._weight_conversions
    if conversions:
        from transformers.core_model_loading import revert_weight_conversion

        converted = revert_weight_conversion(part, dict(tensors))
    else:
        converted = dict(tensors)
    if start is None:
        return converted, None
    return _renumber(converted, tensors, start, part.config.model_type)


def _renumber(
    converted: dict[str, torch.Tensor],
    source: dict[str, torch.Tensor],
    start: int,
    model_type: str,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Number the per-expert keys of an experts slice from ``start``: the
    expert index is the one numeric key component the model key lacks."""
    local = next(iter(source.values())).shape[0]
    layer_numbers = [c for c in next(iter(source)).split(".") if c.isdigit()]
    out: dict[str, torch.Tensor] = {}
    for key, tensor in converted.items():
        parts = key.split(".")
        numeric = [i for i, c in enumerate(parts) if c.isdigit()]
        at = [
            i for i in numeric if [parts[j] for j in numeric if j != i] == layer_numbers
        ]
        if (
            len(numeric) != len(layer_numbers) + 1
            or not at
            or int(parts[at[-1]]) >= local
        ):
            return {}, (
                f"the experts {sorted(source)} of this expert-parallel rank (experts {start}..{start + local - 1}) "
                f"would be written as {key!r}: transformers' conversion table has no per-expert layout for model "
                f"type {model_type!r}, and a rank's slice of the fused experts cannot be written under the key of "
                "the whole tensor"
            )
        parts[at[-1]] = str(int(parts[at[-1]]) + start)
        out[".".join(parts)] = tensor
    return out, None


def _directory_problems(path: Path, overwrite: bool) -> list[str]:
    if path.exists() and not path.is_dir():
        return [f"{path} exists and is not a directory"]
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        found = sorted(p.name for p in path.iterdir())[:5]
        return [
            f"{path} is not empty (it holds {found}): pass overwrite=True to replace its model files"
        ]
    return []


def _assign(everyone: list[Any]) -> tuple[dict[tuple, int], dict[str, int], list[str]]:
    """Owner rank of every unit, the file index of every checkpoint key, and
    every rank's problems (see ``[Note: HF export]``)."""
    problems: list[str] = []
    holders: dict[tuple, list[int]] = {}
    keys: dict[tuple, list[str]] = {}
    for rank, (units, rank_problems) in enumerate(everyone):
        problems += [p for p in rank_problems if p not in problems]
        for unit, out_keys in units.items():
            holders.setdefault(unit, []).append(rank)
            keys.setdefault(unit, out_keys)
    ordered = sorted(holders, key=lambda u: (u[0], -1 if u[1] is None else u[1]))
    owners = {u: holders[u][i % len(holders[u])] for i, u in enumerate(ordered)}
    writers = sorted(set(owners.values()))
    mapping: dict[str, int] = {}
    for unit in ordered:
        for key in keys[unit]:
            if key in mapping:
                problems.append(
                    f"two units of the model would both be written as {key!r}"
                )
            mapping[key] = writers.index(owners[unit]) + 1
    return owners, mapping, problems


def _prepare_directory(path: Path) -> None:
    """Make the directory; remove the model files a previous export left."""
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (INDEX_FILE, SINGLE_FILE, "config.json") or re.fullmatch(
            r"model-\d{5}-of-\d{5}\.safetensors", old.name
        ):
            old.unlink()


def _owned_tensors(
    parts: Sequence[HFCausalLMStage],
    units: dict[tuple, _Unit],
    owners: dict[tuple, int],
    rank: int,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """This rank's tensors, converted, on the CPU; every FSDP2 parameter is
    gathered on every rank of its mesh, in the same order, and kept by its
    owner only."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for unit_key, unit in units.items():
        mine = owners[unit_key] == rank
        tensors = {}
        for key, value in unit.items:
            if isinstance(
                value, DTensor
            ):  # FSDP2's shards (the experts are plain here)
                value = value.full_tensor()
            if mine:
                tensors[key] = value
        if not mine:
            continue
        converted, _ = convert_unit(parts[0], tensors, unit.start)
        for key, t in converted.items():
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[key] = t.detach().to("cpu").contiguous()
    return out


def _write(
    path: Path, tensors: dict[str, torch.Tensor], mapping: dict[str, int], group: Any
) -> None:
    """Every rank's tensors to its own file, rank 0 the index (see
    ``[Note: HF export bytes]``)."""
    import json

    from safetensors.torch import save_file

    count = max(mapping.values(), default=1)
    if tensors:
        (index,) = {mapping[key] for key in tensors}  # one file per owner (_assign)
        name = path / _file_name(index, count)
        save_file(tensors, str(name), metadata={"format": "pt"})
        _fsync(name)
    sizes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, sum(t.nbytes for t in tensors.values()), group=group)
    if dist.get_rank(group) == 0:
        index_json = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": {k: _file_name(i, count) for k, i in sorted(mapping.items())},
        }
        (path / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
        _fsync(path / INDEX_FILE)


def _file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _fsync(path: Path) -> None:
    """``path`` on disk before the export is reported written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _float_dtype(parts: Sequence[HFCausalLMStage]) -> torch.dtype:
    for part in parts:
        for p in part.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.get_default_dtype()


def _write_config(part: HFCausalLMStage, path: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(part.config)
    if hasattr(config, "dtype"):
        config.dtype = dtype
    else:  # transformers 4.x
        config.torch_dtype = dtype
    config.save_pretrained(str(path))
