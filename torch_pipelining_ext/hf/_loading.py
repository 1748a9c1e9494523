# mypy: allow-untyped-defs
"""Read selected tensors of a safetensors checkpoint straight into their
destination.

Private helper of :mod:`torch_pipelining_ext.hf`.  The safetensors format is
an 8-byte little-endian header length, a JSON header mapping each tensor name
to its dtype, shape and byte range, then the raw bytes.  Reading a tensor with
``readinto`` into the stage's own storage touches no other memory (no mmap of
the file, no staging copy on CPU), so loading a stage costs about the stage's
bytes of RSS.
"""

from __future__ import annotations

import ctypes
import re
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch


__all__: list[str] = []

logger = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file (the header only is read)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(
                f"{file} is not a safetensors file (shorter than its 8-byte header length)"
            )
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise ValueError(f"{file} is not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    data_start = 8 + n
    out: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(
                f"{file}: tensor {key!r} has dtype {info['dtype']}, which this torch cannot hold"
            )
        start, end = info["data_offsets"]
        out[key] = TensorEntry(
            file, dtype, tuple(info["shape"]), data_start + start, end - start
        )
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


def _byte_view(t: torch.Tensor):
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def read_tensor(f, entry: TensorEntry, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` (same dtype, shape) from ``f``."""
    f.seek(entry.offset)
    view = memoryview(_byte_view(out)).cast("B")
    done = 0
    while done < entry.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise OSError(
                f"{entry.file}: file ends inside a tensor (read {done} of {entry.nbytes} bytes)"
            )
        done += n


def read_tensors(requests: list[tuple[TensorEntry, torch.Tensor]]) -> None:
    """Fill each destination from its entry, one open file at a time, in
    file order."""
    by_file: dict[Path, list[tuple[TensorEntry, torch.Tensor]]] = {}
    for entry, out in requests:
        by_file.setdefault(entry.file, []).append((entry, out))
    for file, items in by_file.items():
        items.sort(key=lambda it: it[0].offset)
        with open(file, "rb", buffering=0) as f:
            for entry, out in items:
                if (
                    out.dtype != entry.dtype
                    or out.device.type != "cpu"
                    or not out.is_contiguous()
                ):
                    raise AssertionError(
                        "internal error: read destination must be a contiguous CPU tensor"
                    )
                read_tensor(f, entry, out)
        logger.debug(
            "read %d tensors (%d bytes) from %s",
            len(items),
            sum(e.nbytes for e, _ in items),
            file,
        )


def rows(entry: TensorEntry, start: int, stop: int) -> TensorEntry:
    """The rows ``start:stop`` (first dimension) of a stored tensor: a
    contiguous byte range of the same file."""
    per_row = entry.nbytes // entry.shape[0]
    return TensorEntry(
        entry.file,
        entry.dtype,
        (stop - start, *entry.shape[1:]),
        entry.offset + start * per_row,
        (stop - start) * per_row,
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
        conversions,
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
