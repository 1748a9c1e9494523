# Owner(s): ["oncall: distributed"]
"""Hugging Face's router auxiliary loss through chained stage forwards in one
process (padding, full activation checkpointing), and its errors; the
schedules under PP x EP are in ``test_hf_moe_balance_multiproc.py``."""

from __future__ import annotations

import unittest

import torch
from hf_model_registry import tiny_hf_model
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_pipelining_ext import stage_split as ss


try:
    import transformers  # noqa: F401

    from torch_pipelining_ext import hf
    from torch_pipelining_ext.hf import _router_aux

    HAS_TRANSFORMERS = True
    HAS_FUSED = hf.has_fused_experts()
except ImportError:
    HAS_TRANSFORMERS = HAS_FUSED = False

COEF = 0.25


def _stages(model, num_stages: int, ac=None) -> list:
    names = hf.hf_module_names_per_stage(model, num_stages)
    layout = hf.detect_layout(model)
    aux = _router_aux.router_aux_loss(model)
    stages = []
    for i, part in enumerate(ss.build_stage_modules(model, names, range(num_stages))):
        stage = hf.HFCausalLMStage(part, layout, i, num_stages, router_aux=aux)
        stage.set_activation_checkpointing(ac)
        stages.append(stage)
    return stages


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    mask[3, 2:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x")
@instantiate_parametrized_tests
class RouterAuxLossTest(TestCase):
    @parametrize("ac", [None, "full"])
    @parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
    def test_chained_stages_match_the_unsplit_model(self, family, ac):
        model = tiny_hf_model(
            family, num_layers=3, output_router_logits=True, router_aux_loss_coef=COEF
        )
        ids, mask, labels = _batch()
        lm = model(
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            output_router_logits=False,
        ).loss
        aux = [
            model(input_ids=i, attention_mask=m).aux_loss
            for i, m in zip(ids.split(2), mask.split(2))
        ]
        want = lm + COEF * torch.stack(aux).mean()
        want.backward()
        stages = _stages(model, 3, ac)
        loss_fn = hf.CausalLMLoss(n_microbatches=2)
        loss_fn.set_labels(labels)
        losses = []
        for mb_ids, mb_mask, mb_labels in zip(
            ids.split(2), mask.split(2), labels.split(2)
        ):
            out = (mb_ids, mb_mask)
            for stage in stages:
                out = stage(*out)
            losses.append(loss_fn(out, mb_labels))
        total = torch.stack(losses).sum()
        torch.testing.assert_close(total, want)
        total.backward()
        params = dict(model.named_parameters())
        for stage in stages:
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, params[name].grad, msg=name)

    def test_no_mask_is_an_unpadded_batch(self):
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        ids = _batch()[0]
        (stage,) = _stages(model, 1)
        _, aux = stage(ids)
        torch.testing.assert_close(
            aux, (model.router_aux_loss_coef * model(input_ids=ids).aux_loss).reshape(1)
        )

    def test_errors(self):
        model = tiny_hf_model("deepseek_v3", num_layers=2)
        model.config.output_router_logits = True
        with self.assertRaisesRegex(
            ValueError, "deepseek_v3 has no router auxiliary loss"
        ):
            _router_aux.router_aux_loss(model)
        model = tiny_hf_model(
            "mixtral", num_layers=2, output_router_logits=True, router_jitter_noise=0.1
        )
        with self.assertRaisesRegex(ValueError, "router_jitter_noise=0.1"):
            _router_aux.router_aux_loss(model)
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        (stage,) = _stages(model, 1)
        ids, mask, labels = _batch()
        with self.assertRaisesRegex(ValueError, "padding on the right"):
            stage(ids, mask.flip(-1))
        with self.assertRaisesRegex(ValueError, "integer or bool tensor"):
            stage(ids, mask.float())
        with self.assertRaisesRegex(
            ValueError, "takes \\(input_ids\\[, attention_mask\\]\\)"
        ):
            stage(ids, mask, mask)
        loss_fn = hf.CausalLMLoss()
        loss_fn.set_labels(labels)
        with self.assertRaisesRegex(
            RuntimeError, "CausalLMLoss\\(n_microbatches=...\\)"
        ):
            loss_fn(stage(ids, mask), labels)
        with self.assertRaisesRegex(ValueError, "n_microbatches must be >= 1"):
            hf.CausalLMLoss(n_microbatches=0)
        (plain,) = _stages(tiny_hf_model("qwen3_moe", num_layers=2), 1)
        with self.assertRaisesRegex(TypeError, "takes one tensor, got 2"):
            plain(ids, mask)


@unittest.skipIf(
    not HAS_FUSED, "needs transformers 5.x (routers apart from fused experts)"
)
class RouterAuxLossRuntimeTest(TestCase):
    def test_refused_on_the_backport(self):
        """Refused exactly where torch runs the package's backported step loop (torch 2.9)."""
        import torch_pipelining_ext
        from torch_pipelining_ext.hf import _build

        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        status = {r.name: r.status for r in torch_pipelining_ext.patch_report()}
        if status["runtime_step_loop"] is torch_pipelining_ext.PatchStatus.APPLIED:
            with self.assertRaisesRegex(
                ValueError, "verified only under torch's own step loop"
            ):
                _build._check_router_aux_runtime(model)
        else:
            _build._check_router_aux_runtime(model)  # torch 2.10+: accepted
        model.config.output_router_logits = False
        _build._check_router_aux_runtime(model)  # nothing to refuse


@unittest.skipIf(not HAS_TRANSFORMERS or HAS_FUSED, "transformers 4.x only")
class RouterAuxLoss4xTest(TestCase):
    def test_refused_without_fused_experts(self):
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        with self.assertRaisesRegex(ValueError, "needs transformers 5.x"):
            _router_aux.router_aux_loss(model)


if __name__ == "__main__":
    run_tests()
