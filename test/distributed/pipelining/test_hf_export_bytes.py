# Owner(s): ["oncall: distributed"]
"""``hf.save_pretrained`` is byte-reproducible: the same weights give the same
files, byte for byte, two gloo ranks (PP=1 x EP=2, each rank writing its own
safetensors file).

* The same parts exported several times: every file (safetensors, index,
  config) equal in bytes.  A safetensors header's ``__metadata__`` is a
  hash map in the ``safetensors`` library, written in an order that changes
  from one map to the next when it has more than one key (as the three keys
  torch's ``HuggingFaceStorageWriter`` writes had): several exports make such
  an order show (see ``[Note: HF export bytes]``).
* The tensors handed to the writer, and the keys of the file index, in
  another order (reversed): the same bytes.
* Every safetensors file's metadata is what transformers' own
  ``save_pretrained`` writes, ``{"format": "pt"}``.
"""

from __future__ import annotations

import json
import os
import unittest
from typing import Any
from unittest import mock

import torch
from common_hf import HAS_FUSED, HAS_TRANSFORMERS, HFMultiProcTest
from hf_model_registry import tiny_hf_model
from torch.distributed.pipelining import Schedule1F1B
from torch.testing._internal.common_utils import run_tests

import torch_pipelining_ext  # noqa: F401  (patches torch)


if HAS_TRANSFORMERS:
    from torch_pipelining_ext import hf
    from torch_pipelining_ext.hf import _export

EXPORTS = 4  # a header order that varies shows in one of them almost surely


def _files(path: str) -> dict[str, bytes]:
    """Name -> bytes of every file of an export directory."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _header_metadata(data: bytes) -> Any:
    """The ``__metadata__`` of a safetensors file's header."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__")


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x (fused experts)")
class HFExportBytesTest(HFMultiProcTest):
    world_size = 2

    def parts(self) -> list[Any]:
        model = tiny_hf_model("qwen3_moe", seed=3, num_layers=2, num_experts=4)
        _, parts = hf.pipeline_hf_causal_lm(
            model, self.layout(ep=2), Schedule1F1B, "cpu"
        )
        return parts

    def assert_same_files(self, paths: list[str]) -> None:
        def check() -> None:
            first = _files(paths[0])
            safetensors = [n for n in first if n.endswith(".safetensors")]
            self.assertEqual(len(safetensors), 2, sorted(first))  # one per rank
            self.assertIn("model.safetensors.index.json", first)
            self.assertIn("config.json", first)
            for path in paths[1:]:
                files = _files(path)
                self.assertEqual(sorted(files), sorted(first))
                for name, data in first.items():
                    self.assertTrue(files[name] == data, f"{name} differs in {path}")
            for name in safetensors:
                self.assertEqual(_header_metadata(first[name]), {"format": "pt"})

        if self.rank == 0:
            self.check_all(check)
        else:
            self.check_all(lambda: None)

    def test_exports_of_the_same_parts_are_equal_bytes(self) -> None:
        parts = self.parts()
        paths = [self.shared_dir() for _ in range(EXPORTS)]
        for path in paths:
            hf.save_pretrained(parts, path, overwrite=True)
        self.assert_same_files(paths)

    def test_order_of_the_tensors_and_of_the_keys_does_not_matter(self) -> None:
        parts = self.parts()
        plain, reordered = self.shared_dir(), self.shared_dir()
        hf.save_pretrained(parts, plain, overwrite=True)
        owned, assign = _export._owned_tensors, _export._assign

        def reversed_tensors(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
            return dict(reversed(list(owned(*args, **kwargs).items())))

        def reversed_mapping(everyone: list[Any]) -> Any:
            owners, mapping, problems = assign(everyone)
            return owners, dict(reversed(list(mapping.items()))), problems

        with (
            mock.patch.object(_export, "_owned_tensors", reversed_tensors),
            mock.patch.object(_export, "_assign", reversed_mapping),
        ):
            hf.save_pretrained(parts, reordered, overwrite=True)
        self.assert_same_files([plain, reordered])


if __name__ == "__main__":
    run_tests()
