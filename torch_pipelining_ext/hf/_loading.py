"""Read selected tensors of a safetensors checkpoint into their destination.

Private helper of :mod:`torch_pipelining_ext.hf`: the tensors a checkpoint
holds (the headers, through ``safetensors.safe_open``), and the reads, each
with the file open for that read only (see [Note: one open per read]).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from transformers.core_model_loading import WeightConverter, WeightRenaming


__all__: list[str] = []

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# [Note: one open per read]
# ``safe_open(file, framework="pt")`` maps the file, and a slice of it is a
# view of that map: copying the slice into the stage's storage makes the
# pages it covers resident in this process (file-backed RSS) until the file
# is closed.  A reader that keeps each file open while it reads all of its
# tensors (``HuggingFaceStorageReader`` of torch.distributed.checkpoint
# does) holds every page read from that file on top of the stage's own
# storage, up to twice the stage's bytes.  Here the file is opened for each
# read of at most ``_READ_BYTES`` (whole rows of one tensor), so the extra
# peak RSS of loading a stage is its bytes plus one read.  Extra peak RSS
# over the stage's bytes, ``tools/bench_load.py`` on torch 2.13.0, CPU,
# safetensors 0.8.0 (stage 1 of 4, bf16, one run; on torch 2.15.0 and
# 2.9.1 the first two rows are the same within 0.003):
#
#   reader                                  Llama 1.1B  MoE 3.5B  MoE, EP 1/4
#   safe_open per read (here)               1.043       1.010     1.048
#   byte offsets and readinto (the former)  1.022       1.008     1.040
#   safe_open per file                      1.848       1.263     1.290
#   HuggingFaceStorageReader.read_data      1.853       1.265     1.298
#   from_pretrained, then split             2.124
#
# Reading through the mapping costs time (page faults on top of the copy,
# an open per read): the three stage loads (meta build, split and reads)
# took 1.5 / 2.9 / 1.2 s of CPU against 0.8 / 1.9 / 1.1 s with
# ``readinto`` (torch 2.15.0, one thread, the files in the page cache), and
# 2.3 / 10.0 / 1.8 s of wall time against 1.0 / 2.9 / 1.3 s (torch 2.9.1,
# a quieter machine).
_READ_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor of a safetensors file, or its rows ``start:`` (the
    first ``shape[0]`` of them)."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = 0  # first row read (first dimension)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (the header only is read)."""
    from safetensors import safe_open, SafetensorError
    from safetensors.torch import _getdtype  # as HuggingFaceStorageReader reads dtypes

    out: dict[str, TensorEntry] = {}
    try:
        opened = safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a safetensors file ({e})") from None
    with opened as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            stored = f.get_slice(key)
            try:
                dtype = _getdtype(stored.get_dtype())
            except KeyError:
                raise ValueError(
                    f"{file}: tensor {key!r} has dtype {stored.get_dtype()}, which this torch cannot hold"
                ) from None
            out[key] = TensorEntry(file, key, dtype, tuple(stored.get_shape()))
    return out


def checkpoint_entries(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of a Hugging Face safetensors checkpoint: a directory
    (``model.safetensors`` or ``model.safetensors.index.json``), a single
    ``.safetensors`` file, or an ``*.index.json`` file.

    Only the headers of the files the index names are read.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            found = sorted(p.name for p in path.iterdir())[:10]
            raise FileNotFoundError(
                f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it has {found})"
            )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.name.endswith(".json"):
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path} has no 'weight_map'")
        entries: dict[str, TensorEntry] = {}
        for file in sorted(set(weight_map.values())):
            header = read_header(path.parent / file)
            entries.update(
                (key, entry)
                for key, entry in header.items()
                if weight_map.get(key) == file
            )
        listed_only = sorted(set(weight_map) - set(entries))
        if listed_only:
            raise ValueError(
                f"{path} lists tensors its files do not hold: {listed_only[:10]}"
            )
        return entries
    return read_header(path)


def read_tensor(entry: TensorEntry, out: torch.Tensor) -> None:
    """Copy the stored tensor into ``out`` (same dtype and shape), with the
    file open for each read of at most ``_READ_BYTES``."""
    from safetensors import safe_open

    if out.dtype != entry.dtype or tuple(out.shape) != entry.shape:
        raise AssertionError(
            f"internal error: reading {entry.key!r} ({entry.dtype}, {list(entry.shape)}) into "
            f"a {out.dtype} tensor of shape {list(out.shape)}"
        )
    if not entry.shape:  # a scalar: no rows to slice
        with safe_open(entry.file, framework="pt") as f:
            out.copy_(f.get_tensor(entry.key))
        return
    step = max(1, _READ_BYTES * entry.shape[0] // max(entry.nbytes, 1))
    for i, dest in zip(
        range(entry.start, entry.start + entry.shape[0], step), out.split(step)
    ):
        with safe_open(entry.file, framework="pt") as f:
            dest.copy_(f.get_slice(entry.key)[i : i + len(dest)])


def read_tensors(requests: list[tuple[TensorEntry, torch.Tensor]]) -> None:
    """Fill each destination from its entry, file by file."""
    by_file: dict[Path, list[tuple[TensorEntry, torch.Tensor]]] = {}
    for entry, out in requests:
        by_file.setdefault(entry.file, []).append((entry, out))
    for file, items in by_file.items():
        for entry, out in items:
            read_tensor(entry, out)
        logger.debug(
            "read %d tensors (%d bytes) from %s",
            len(items),
            sum(e.nbytes for e, _ in items),
            file,
        )


def rows(entry: TensorEntry, start: int, stop: int) -> TensorEntry:
    """The rows ``start:stop`` (first dimension) of a stored tensor."""
    return dataclasses.replace(
        entry, shape=(stop - start, *entry.shape[1:]), start=entry.start + start
    )


def summarize_keys(keys: list[str], first: int = 5, patterns: int = 5) -> str:
    """``count``, the first few keys and the most common patterns (numbers
    replaced by ``*``) of a long key list, for error messages."""
    keys = sorted(keys)
    if len(keys) <= first:
        return f"({len(keys)}): {', '.join(map(repr, keys))}"
    counts: dict[str, int] = {}
    for k in keys:
        p = re.sub(r"\.\d+(?=\.|$)", ".*", k)
        counts[p] = counts.get(p, 0) + 1
    common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:patterns]
    shown = ", ".join(map(repr, keys[:first]))
    pats = ", ".join(f"{p!r} x{n}" for p, n in common)
    more = (
        f" and {len(counts) - patterns} more patterns" if len(counts) > patterns else ""
    )
    return f"({len(keys)}): {shown}, ...; patterns: {pats}{more}"


@dataclass(frozen=True)
class Piece:
    """A stored tensor that fills part of a fused model tensor: one
    expert's (global index ``expert``) tensor of the converter's source
    pattern number ``part``."""

    key: str
    entry: TensorEntry
    expert: int
    part: int  # which source pattern of the converter (gate = 0, up = 1, ...)


class CheckpointKeys:
    """The keys of a checkpoint in the model's key space.

    A checkpoint key is the model's own key, the key without the base-model
    prefix (checkpoints of the bare base model), or, on transformers 5.x, a
    key that transformers' own conversion mapping renames (Mixtral's
    ``block_sparse_moe`` -> ``mlp``) and, for fused experts, merges: the
    per-expert keys ``...experts.{e}.gate_proj.weight`` and
    ``...experts.{e}.up_proj.weight`` are the rows of ``gate_up_proj[e]``,
    ``...experts.{e}.down_proj.weight`` is ``down_proj[e]``
    (``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``).  Each stored
    tensor then fills its slice of the fused parameter directly.
    """

    SUPPORTED_OPS = (
        ("MergeModulelist(dim=0)",),
        ("MergeModulelist(dim=0)", "Concatenate(dim=1)"),
    )

    def __init__(
        self,
        entries: dict[str, TensorEntry],
        model_keys: frozenset[str],
        prefix: str,
        conversions: tuple[list[WeightRenaming], list[WeightConverter]] | None,
    ) -> None:
        from torch_pipelining_ext.hf._compat import describe_ops

        self.entries = entries
        self.direct: dict[str, str] = {}  # model key -> checkpoint key
        self.pieces: dict[str, list[Piece]] = {}  # model key -> per-expert pieces
        self.ops: dict[str, tuple[str, ...]] = {}  # model key -> converter operations
        self.unmatched: list[str] = []
        renamings, converters = conversions if conversions is not None else ([], [])

        def in_model(key: str) -> str | None:
            for cand in (key, prefix + key):
                if cand in model_keys:
                    return cand
            return None

        for key, entry in entries.items():
            renamed = key
            found = in_model(key)
            if found is None:
                for r in renamings:
                    renamed = r.rename_source_key(renamed)[0]
                found = in_model(renamed)
            if found is not None:
                self.direct.setdefault(found, key)
                continue
            matched = False
            for conv in converters:
                target, pattern = conv.rename_source_key(renamed)
                if pattern is None:
                    continue
                found = in_model(target)
                index = conv.source_patterns.index(pattern)
                originals = getattr(
                    conv, "_original_source_patterns", conv.source_patterns
                )
                number = _expert_number(originals[index], renamed)
                if found is not None and number is not None:
                    self.pieces.setdefault(found, []).append(
                        Piece(key, entry, number, index)
                    )
                    self.ops[found] = describe_ops(conv)
                    matched = True
                break  # at most one converter applies to a key, as in transformers
            if not matched:
                self.unmatched.append(key)

    def has(self, model_key: str) -> bool:
        return model_key in self.direct or model_key in self.pieces


def _expert_number(pattern: str, key: str) -> int | None:
    """The expert index in ``key`` at the ``*`` of a converter's source
    pattern (``mlp.experts.*.gate_proj.weight``)."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(regex, key)
    return int(m.group(1)) if m else None
