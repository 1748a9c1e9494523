"""The trainer's data: documents tokenized and packed into one stream of
token ids, cut into sequences, read in a deterministic order and sharded
over the ranks that train on different data.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: training
data]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: training data]
# Every source becomes one flat file of token ids (the "stream"): plain text
# (each file one document), JSON lines (each line's text field one document)
# or a datasets dataset are tokenized, every document followed by the EOS
# token, and written once to the run directory, named by a fingerprint of
# the sources and the tokenizer (written under a temporary name and renamed:
# ranks started by torchrun may all write it, and a crash leaves no half
# file under the real name); a flat binary file of uint16/uint32 ids is used
# as it is, memory-mapped.  The stream is cut into sequences of --seq-len
# tokens (the tail that does not fill one is left out).  Epoch e reads them
# in the order of a permutation drawn from (seed, e) (or in file order, with
# --no-shuffle).  The data position is global: the number of sequences the
# run has consumed, over all ranks.  Step s reads the --batch-size sequences
# from the position on, and data rank d of D takes the d-th of D equal
# blocks of them.  So a checkpoint's position means the same in any layout,
# and a resumed run reads exactly what the uninterrupted one would have.
#
# [Note: held-out data]
# --eval-batches K holds out the stream's last K x --batch-size sequences
# (in file order, never shuffled): training reads the sequences before them
# only, so the training data depends on K and --batch-size, never on
# --eval-every -- a run that evaluates trains on exactly the sequences, in
# exactly the order, of one that holds the same part out and does not.
# Without --eval-batches nothing is held out and the data is what it always
# was.  Evaluation batch j (0-based) is the j-th block of --batch-size
# held-out sequences, shared over the data ranks as a training batch is, so
# an evaluation means the same in every layout.  A checkpoint's trainer.json
# records the held-out count and a resume with another is refused
# (_plan.make_plan): the split of a run directory never changes.

HELD_OUT_KEY = "held_out_sequences"  # in a checkpoint's trainer.json
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
BINARY_SUFFIXES = (".bin",)
_TOKENIZE_BATCH = 512


class DataError(ValueError):
    """The data cannot be read or is empty (the trainer exits with status 2)."""


@dataclass(frozen=True)
class TokenStream:
    """A flat file of token ids: ``num_tokens`` of ``dtype`` at ``path``."""

    path: str
    dtype: str
    num_tokens: int

    def open(self) -> np.ndarray:
        """The ids, memory-mapped read-only."""
        return np.memmap(
            self.path,
            dtype=TOKEN_DTYPES[self.dtype],
            mode="r",
            shape=(self.num_tokens,),
        )

    def max_id(self) -> int:
        """The largest id (reads the whole file, in blocks)."""
        ids = self.open()
        block = 1 << 24
        return max(
            int(ids[i : i + block].max()) for i in range(0, self.num_tokens, block)
        )


def source_kind(path: str) -> str:
    """``"text"``, ``"jsonl"`` or ``"binary"``, from the file's suffix."""
    lower = path.lower()
    if lower.endswith(BINARY_SUFFIXES):
        return "binary"
    if lower.endswith(JSON_SUFFIXES):
        return "jsonl"
    if lower.endswith(TEXT_SUFFIXES):
        return "text"
    raise DataError(
        f"--data {path}: unknown file type; use plain text ({', '.join(TEXT_SUFFIXES)}), JSON lines "
        f"({', '.join(JSON_SUFFIXES)}) or token ids ({', '.join(BINARY_SUFFIXES)})"
    )


def binary_stream(path: str, dtype: str) -> TokenStream:
    """A flat binary file of token ids of ``dtype``, checked."""
    size = _readable_size(path)
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % itemsize:
        raise DataError(
            f"--data {path}: {size} bytes is not a whole number of {dtype} token ids "
            "(--token-dtype?)"
        )
    if size == 0:
        raise DataError(f"--data {path} is empty")
    return TokenStream(os.path.abspath(path), dtype, size // itemsize)


def _readable_size(path: str) -> int:
    if not os.path.isfile(path):
        raise DataError(f"--data {path}: no such file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise DataError(f"--data {path} cannot be read: {e}") from e
    return os.path.getsize(path)


def documents(paths: Sequence[str], text_field: str) -> Iterator[str]:
    """The documents of text and JSON-lines files, in order."""
    for path in paths:
        _readable_size(path)
        try:
            if source_kind(path) == "text":
                with open(path, encoding="utf-8") as f:
                    yield f.read()
                continue
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield _json_text(path, number, line, text_field)
        except UnicodeDecodeError as e:
            raise DataError(f"--data {path} is not UTF-8 text: {e}") from e


def _json_text(path: str, number: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"--data {path}:{number}: not a JSON object: {e}") from e
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f"--data {path}:{number}: no string field {field!r} (--text-field)"
        )
    return text


def dataset_documents(
    name_or_path: str, split: str, text_field: str
) -> tuple[Iterator[str], str]:
    """The documents of a local ``datasets`` dataset (a ``save_to_disk``
    directory, or a name already in the local cache: nothing is downloaded),
    and its fingerprint."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            "--dataset needs the datasets package (pip install datasets); it is optional"
        ) from e
    try:
        if os.path.isdir(name_or_path):
            data = datasets.load_from_disk(name_or_path)
            if isinstance(data, datasets.DatasetDict):
                data = data[split]
        else:
            data = datasets.load_dataset(name_or_path, split=split)
    except Exception as e:  # datasets raises many kinds; all mean "cannot use it"
        raise DataError(f"--dataset {name_or_path}: cannot load it locally: {e}") from e
    if text_field not in data.column_names:
        raise DataError(
            f"--dataset {name_or_path}: no column {text_field!r} (--text-field); it has {data.column_names}"
        )
    fingerprint = getattr(data, "_fingerprint", None) or name_or_path
    return (str(row[text_field]) for row in data), fingerprint


def tokenized_stream(
    docs: Iterator[str],
    tokenizer: Any,
    fingerprint: str,
    cache_dir: str,
) -> TokenStream:
    """Tokenize ``docs`` (each followed by the tokenizer's EOS) into a token
    file of ``cache_dir`` named by ``fingerprint``; an existing one is reused."""
    eos = tokenizer.eos_token_id
    dtype = "uint16" if len(tokenizer) <= 1 << 16 else "uint32"
    key = hashlib.sha256(f"{fingerprint}|{eos}|{dtype}".encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"tokens-{key}.{dtype}.bin")
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        return binary_stream(path, dtype)
    os.makedirs(cache_dir, exist_ok=True)
    partial = f"{path}.partial-{os.getpid()}"
    count = 0
    try:
        with open(partial, "wb") as out:
            for batch in _batches(docs):
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                flat = [t for doc in ids for t in (*doc, eos)]
                np.asarray(flat, dtype=TOKEN_DTYPES[dtype]).tofile(out)
                count += len(flat)
        if count == 0:
            raise DataError("the data holds no document")
        os.replace(partial, path)  # [Note: training data]: never a half file
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    logger.info("tokenized %d tokens into %s", count, path)
    return binary_stream(path, dtype)


def synthetic_stream(
    vocab_size: int, seq_len: int, num_sequences: int, seed: int, cache_dir: str
) -> TokenStream:
    """``num_sequences`` sequences of ``seq_len`` ids that follow one random
    permutation of the vocabulary from a random first id (a rule the model
    learns in a few steps), written to a token file of ``cache_dir``: data
    for trying the trainer out, and for ``--compare-sequential``, without
    text or a tokenizer."""
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=gen)
    ids = torch.empty(num_sequences, seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab_size, (num_sequences,), generator=gen)
    for t in range(1, seq_len):
        ids[:, t] = perm[ids[:, t - 1]]
    os.makedirs(cache_dir, exist_ok=True)
    name = f"synthetic-v{vocab_size}-s{seed}-{num_sequences}x{seq_len}.{dtype}.bin"
    path = os.path.join(cache_dir, name)
    partial = f"{path}.partial-{os.getpid()}"
    ids.numpy().astype(TOKEN_DTYPES[dtype]).tofile(partial)
    os.replace(partial, path)
    return binary_stream(path, dtype)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        if doc:
            batch.append(doc)
        if len(batch) == _TOKENIZE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def files_fingerprint(paths: Sequence[str], tokenizer_dir: str, text_field: str) -> str:
    """What identifies tokenized files: their paths, sizes and modification
    times, the tokenizer's files and the text field."""
    parts = [text_field]
    for path in paths:
        _readable_size(path)
        st = os.stat(path)
        parts.append(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}")
    parts.append(_directory_digest(tokenizer_dir))
    return "|".join(parts)


def _directory_digest(directory: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            digest.update(name.encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


@dataclass
class Sequences:
    """The sequences of a token stream in the run's order (``[Note: training
    data]``): :meth:`batch` returns a data rank's rows of a step's batch."""

    stream: TokenStream
    seq_len: int
    seed: int
    shuffle: bool
    held_out: int = 0  # the last sequences, for evaluation ([Note: held-out data])

    def __post_init__(self) -> None:
        self.num_sequences = self.stream.num_tokens // self.seq_len - self.held_out
        if self.num_sequences <= 0:
            raise DataError(
                f"the data holds {self.stream.num_tokens} tokens, fewer than one sequence of "
                f"--seq-len {self.seq_len}"
                + (f" besides the {self.held_out} held out" if self.held_out else "")
            )
        self._ids = self.stream.open()
        self._order: tuple[int, torch.Tensor] | None = None

    def sequence_index(self, position: int) -> int:
        """The index in the stream of the sequence at global ``position``."""
        epoch, within = divmod(position, self.num_sequences)
        if not self.shuffle:
            return within
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.num_sequences, generator=gen))
        return int(self._order[1][within])

    def batch(
        self, position: int, batch_size: int, rank: int, ranks: int
    ) -> torch.Tensor:
        """Data rank ``rank`` of ``ranks``: its block of the ``batch_size``
        sequences from global ``position`` on, ``[batch_size / ranks, seq_len]``."""
        rows = batch_size // ranks
        first = position + rank * rows
        out = np.empty((rows, self.seq_len), dtype=np.int64)
        for i in range(rows):
            start = self.sequence_index(first + i) * self.seq_len
            out[i] = self._ids[start : start + self.seq_len]
        return torch.from_numpy(out)

    def held_out_batch(
        self, index: int, batch_size: int, rank: int, ranks: int
    ) -> torch.Tensor:
        """Data rank ``rank`` of ``ranks``: its block of held-out batch
        ``index`` (``[Note: held-out data]``), ``[batch_size / ranks, seq_len]``."""
        if (index + 1) * batch_size > self.held_out:
            raise IndexError(
                f"held-out batch {index} of {batch_size} sequences: only {self.held_out} are held out"
            )
        rows = batch_size // ranks
        first = self.num_sequences + index * batch_size + rank * rows
        start, stop = first * self.seq_len, (first + rows) * self.seq_len
        out = np.asarray(self._ids[start:stop], dtype=np.int64)
        return torch.from_numpy(out.reshape(rows, self.seq_len))


def held_out_sequences(args: argparse.Namespace) -> int:
    """The sequences held out for evaluation (``[Note: held-out data]``)."""
    return (args.eval_batches or 0) * args.batch_size


def recorded_held_out(checkpoint_path: str) -> int:
    """The held-out count a checkpoint was trained with (0: none recorded)."""
    path = os.path.join(checkpoint_path, "trainer.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError):
        return 0
    return int(info.get(HELD_OUT_KEY, 0))


def checkpoint_info(args: argparse.Namespace) -> dict[str, Any]:
    """What a checkpoint's trainer.json records of the split."""
    return {HELD_OUT_KEY: held_out_sequences(args)}
