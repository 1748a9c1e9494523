"""Text and a tokenizer for trying the trainer out, from this machine alone.

    python tools/prepare_text.py DIR [--vocab-size 4096] [--max-docs N]

Writes ``DIR/docs.jsonl`` (one JSON object per line, its ``text`` field a
documentation string of Python's standard library: every module, class and
function docstring of at least ``--min-chars`` characters, files in sorted
order) and ``DIR/tokenizer/`` (a byte-level BPE tokenizer trained on them
with ``tokenizers``, saved as a transformers ``PreTrainedTokenizerFast`` with
``<|endoftext|>`` as its EOS token).  Nothing is downloaded; the same Python
gives the same files.  ``python -m torch_pipelining_ext.train --tokenizer
DIR/tokenizer --data DIR/docs.jsonl ...`` trains on them.

The last line is machine-readable::

    prepare_text docs=<n> chars=<n> vocab=<n> dir=<DIR>
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
from collections.abc import Iterator


EOS = "<|endoftext|>"
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "__pycache__",
}


def stdlib_docstrings(min_chars: int = 200) -> Iterator[str]:
    """Docstrings of the standard library's modules, classes and functions,
    in a fixed order (sorted paths, then the order of the source)."""
    root = sysconfig.get_paths()["stdlib"]
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(
                    node,
                    (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef),
                ):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        yield doc


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> int:
    """Train a byte-level BPE tokenizer on ``texts`` and save it with
    transformers into ``out_dir``; returns its vocabulary size."""
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    fast.save_pretrained(out_dir)
    return len(fast)


def prepare(
    out_dir: str,
    vocab_size: int = 4096,
    max_docs: int | None = None,
    min_chars: int = 200,
) -> dict:
    """Write ``docs.jsonl`` and ``tokenizer/`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    docs = []
    for doc in stdlib_docstrings(min_chars):
        docs.append(doc)
        if max_docs is not None and len(docs) == max_docs:
            break
    if not docs:
        raise SystemExit(
            f"no docstring of at least {min_chars} characters found in {sysconfig.get_paths()['stdlib']}"
        )
    with open(os.path.join(out_dir, "docs.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    vocab = train_tokenizer(docs, vocab_size, os.path.join(out_dir, "tokenizer"))
    return {
        "docs": len(docs),
        "chars": sum(map(len, docs)),
        "vocab": vocab,
        "dir": out_dir,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", help="where docs.jsonl and tokenizer/ go")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-docs", type=int, help="at most this many documents")
    p.add_argument(
        "--min-chars", type=int, default=200, help="shorter docstrings are left out"
    )
    args = p.parse_args(argv)
    if args.vocab_size < 260:
        p.error("--vocab-size must be at least 260 (the 256 bytes and the EOS token)")
    info = prepare(args.dir, args.vocab_size, args.max_docs, args.min_chars)
    print(
        " ".join(
            f"{k}={v}"
            for k, v in [
                ("prepare_text docs", info["docs"]),
                ("chars", info["chars"]),
                ("vocab", info["vocab"]),
                ("dir", info["dir"]),
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
