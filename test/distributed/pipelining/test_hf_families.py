# Owner(s): ["oncall: distributed"]
"""What ``hf/_families.py`` knows of each model family (experts, dense
layers, the expert bias) agrees with the models transformers builds, reads a
``config.json`` mapping as it reads a config object, refuses nonsense, and
needs no transformers (the planner imports it without the ``hf`` extra)."""

from __future__ import annotations

import subprocess
import sys
import unittest

import torch
import torch.nn as nn
from hf_model_registry import HF_FAMILIES, MOE_FAMILIES, tiny_hf_config
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_pipelining_ext.hf import _families
from torch_pipelining_ext.sim import ModelShape


try:
    import transformers

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

# the families whose routers balance with a bias instead of an auxiliary loss
BIASED_FAMILIES = ("deepseek_v3", "glm4_moe")


def _has_routed_experts(layer: nn.Module) -> bool:
    return any(
        name.rpartition(".")[2] == "experts" for name, _ in layer.named_modules()
    )


@unittest.skipUnless(HAS_TRANSFORMERS, "needs transformers")
class FamiliesAgreeWithTheModelsTest(TestCase):
    @parametrize("family", HF_FAMILIES)
    def test_experts_dense_layers_and_bias(self, family: str) -> None:
        config = tiny_hf_config(family, num_layers=4)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        layers = model.model.layers if hasattr(model, "model") else model.transformer.h
        dense = [i for i, layer in enumerate(layers) if not _has_routed_experts(layer)]
        experts = _families.num_routed_experts(config)
        self.assertEqual(experts > 0, family in MOE_FAMILIES)
        self.assertEqual(
            _families.first_dense_layers(config), len(dense) if experts else 0
        )
        self.assertEqual(_families.moe_layer_step(config), 1)
        self.assertEqual(_families.has_expert_bias(model), family in BIASED_FAMILIES)
        # a config.json mapping reads as the config object does
        fields = config.to_dict()
        self.assertEqual(_families.num_routed_experts(fields), experts)
        self.assertEqual(
            _families.first_dense_layers(fields), _families.first_dense_layers(config)
        )
        self.assertEqual(
            ModelShape.from_hf_config(fields), ModelShape.from_hf_config(config)
        )

    def test_self_check_keeps_a_layer_past_each_pattern(self) -> None:
        """The self-check's tiny config keeps the dense first layers and one MoE layer."""
        from torch_pipelining_ext.hf import _selfcheck

        config = tiny_hf_config("deepseek_v3", num_layers=8, first_k_dense_replace=3)
        tiny = _selfcheck.tiny_config(config)
        self.assertEqual(tiny.num_hidden_layers, 4)
        self.assertEqual(_families.first_dense_layers(tiny), 3)
        config = tiny_hf_config("qwen3_moe", num_layers=8, decoder_sparse_step=3)
        self.assertEqual(_selfcheck.tiny_config(config).num_hidden_layers, 4)

    def test_dense_layers_past_the_first(self) -> None:
        config = tiny_hf_config("qwen3_moe", num_layers=6, mlp_only_layers=[0, 4])
        self.assertEqual(_families.first_dense_layers(config), 2)
        config = tiny_hf_config("deepseek_v3", num_layers=6, first_k_dense_replace=3)
        self.assertEqual(_families.first_dense_layers(config), 3)


class FamiliesOfMappingsTest(TestCase):
    def test_mappings(self) -> None:
        moe = {"n_routed_experts": 8, "first_k_dense_replace": 3, "moe_layer_freq": 2}
        self.assertEqual(_families.num_routed_experts(moe), 8)
        self.assertEqual(_families.first_dense_layers(moe), 3)
        self.assertEqual(_families.moe_layer_step(moe), 2)
        self.assertEqual(_families.moe_layer_step({"decoder_sparse_step": 3}), 3)
        # a dense model has no dense first layers to tell apart
        dense = {"first_k_dense_replace": 3, "num_experts": 0}
        self.assertEqual(_families.num_routed_experts(dense), 0)
        self.assertEqual(_families.first_dense_layers(dense), 0)
        self.assertEqual(_families.moe_layer_step({}), 1)

    def test_bad_expert_counts(self) -> None:
        for bad in (-8, 8.0, "8", True):
            with (
                self.subTest(bad=bad),
                self.assertRaisesRegex(
                    ValueError,
                    f"num_local_experts must be a positive integer, got {bad!r}",
                ),
            ):
                _families.num_routed_experts({"num_local_experts": bad})

    def test_expert_bias_as_buffer_or_frozen_parameter(self) -> None:
        router = nn.Module()
        self.assertFalse(_families.has_expert_bias(router))
        router.register_buffer(_families.EXPERT_BIAS_BUFFER, torch.zeros(4))
        self.assertTrue(_families.has_expert_bias(nn.Sequential(router)))
        frozen = nn.Module()
        frozen.e_score_correction_bias = nn.Parameter(
            torch.zeros(4), requires_grad=False
        )
        self.assertTrue(_families.has_expert_bias(frozen))
        other = nn.Module()
        other.register_buffer("expert_bias", torch.zeros(4))
        self.assertFalse(_families.has_expert_bias(other))

    def test_the_planner_needs_no_transformers(self) -> None:
        code = (
            "import sys; import torch_pipelining_ext.sim.plan; "
            "from torch_pipelining_ext.hf import _families; "
            "sys.exit('transformers' in sys.modules)"
        )
        subprocess.run([sys.executable, "-c", code], check=True)


instantiate_parametrized_tests(FamiliesAgreeWithTheModelsTest)

if __name__ == "__main__":
    run_tests()
