# Owner(s): ["oncall: distributed"]
"""MoE balancing through chained stage forwards in one process: the router
auxiliary losses (Hugging Face's pooled form, the per-layer form, DeepSeek-V3's
sequence-wise form) against hand computations on the unsplit model, with
padding and full activation checkpointing; the expert-load statistics and
DeepSeek-V3's bias update against the unsplit model's routing; in a group of
one rank, what pipeline_hf_causal_lm adds for the statistics; the errors.
The schedules under PP x EP are in ``test_hf_moe_balance_multiproc.py``."""

from __future__ import annotations

import unittest

import torch
from hf_model_registry import (
    per_layer_loss_by_hand,
    routing_counts,
    sequence_loss_by_hand,
    tiny_hf_model,
)
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
    from torch_pipelining_ext.hf import _router_aux, _routing

    HAS_TRANSFORMERS = True
    HAS_FUSED = hf.has_fused_experts()
except ImportError:
    HAS_TRANSFORMERS = HAS_FUSED = False

COEF = 0.25


def _stages(model, num_stages: int, ac=None, mode=None, coef=None) -> list:
    """The chained stages of ``model`` (what pipeline_hf_causal_lm builds per rank)."""
    names = hf.hf_module_names_per_stage(model, num_stages)
    layout = hf.detect_layout(model)
    routing = _routing.model_routing(model, layout.layers_prefix)
    aux = _router_aux.router_aux_loss(model, routing, mode, coef)
    stages = []
    for i, part in enumerate(ss.build_stage_modules(model, names, range(num_stages))):
        stage = hf.HFCausalLMStage(
            part, layout, i, num_stages, router_aux=aux, routing=routing
        )
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


def _run_chain(stages, loss_fn, ids, mask, labels, n_microbatches=2) -> torch.Tensor:
    """The step's loss of the chained stages (microbatches of the batch's rows)."""
    losses = []
    for mb_ids, mb_mask, mb_labels in zip(
        ids.chunk(n_microbatches),
        mask.chunk(n_microbatches),
        labels.chunk(n_microbatches),
    ):
        out = (mb_ids, mb_mask)
        for stage in stages:
            out = stage(*out)
        losses.append(loss_fn(out, mb_labels))
    return torch.stack(losses).sum()


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x")
@instantiate_parametrized_tests
class RouterAuxLossTest(TestCase):
    @parametrize("ac", [None, "full"])
    @parametrize(
        "family",
        ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "qwen3_next"],
    )
    def test_pooled_matches_the_unsplit_model(self, family, ac):
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
            for i, m in zip(ids.chunk(2), mask.chunk(2))
        ]
        want = lm + COEF * torch.stack(aux).mean()
        self._check_chain(model, _stages(model, 3, ac), want, ids, mask, labels)

    def _check_chain(self, model, stages, want, ids, mask, labels):
        want.backward()
        loss_fn = hf.CausalLMLoss(n_microbatches=2)
        loss_fn.set_labels(labels)
        total = _run_chain(stages, loss_fn, ids, mask, labels)
        torch.testing.assert_close(total, want)
        total.backward()
        params = dict(model.named_parameters())
        checked = 0
        for stage in stages:
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p.grad, params[name].grad, msg=name)
                checked += 1
        self.assertEqual(checked, len(params))

    @parametrize("ac", [None, "full"])
    @parametrize("family", ["qwen3_moe", "mixtral"])
    def test_per_layer_matches_hand_computation(self, family, ac):
        model = tiny_hf_model(family, num_layers=3, router_aux_loss_coef=COEF)
        ids, mask, labels = _batch()
        lm = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        aux = [
            per_layer_loss_by_hand(model, i, m)
            for i, m in zip(ids.chunk(2), mask.chunk(2))
        ]
        want = lm + COEF * torch.stack(aux).mean()
        stages = _stages(model, 3, ac, mode="per_layer")
        self._check_chain(model, stages, want, ids, mask, labels)

    def test_per_layer_of_one_moe_layer_is_pooled(self):
        """With one MoE layer the two forms agree."""
        model = tiny_hf_model("qwen3_moe", num_layers=1, router_aux_loss_coef=COEF)
        ids, mask, _ = _batch()
        (pooled,) = _stages(model, 1, mode="pooled")
        (per_layer,) = _stages(model, 1, mode="per_layer")
        torch.testing.assert_close(pooled(ids, mask)[1], per_layer(ids, mask)[1])

    @parametrize("ac", [None, "full"])
    @parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_moe"])
    def test_sequence_matches_hand_computation(self, family, ac):
        model = tiny_hf_model(family, num_layers=3)
        with torch.no_grad():  # a bias that changes the routing
            for m in model.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.copy_(
                        torch.tensor([0.05, -0.05, 0.0, 0.1])
                    )
        ids, mask, labels = _batch()
        lm = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        sigmoid = family != "qwen3_moe"  # DeepSeek-V3-style routers score by sigmoid
        aux = [
            sequence_loss_by_hand(model, i, m, sigmoid)
            for i, m in zip(ids.chunk(2), mask.chunk(2))
        ]
        want = lm + COEF * torch.stack(aux).mean()
        stages = _stages(model, 3, ac, mode="sequence", coef=COEF)
        self._check_chain(model, stages, want, ids, mask, labels)

    def test_no_mask_is_an_unpadded_batch(self):
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        ids = _batch()[0]
        (stage,) = _stages(model, 1)
        _, aux = stage(ids)
        torch.testing.assert_close(
            aux, (model.router_aux_loss_coef * model(input_ids=ids).aux_loss).reshape(1)
        )

    def test_carried_tensors(self):
        """Floating point, never a received tensor itself (what torch 2.9's stages need)."""
        for mode, coef in (("pooled", None), ("per_layer", None), ("sequence", 0.1)):
            model = tiny_hf_model("qwen3_moe", num_layers=2)
            first, second = _stages(model, 2, mode=mode, coef=coef)
            ids, mask, _ = _batch()
            out = first(ids, mask)
            self.assertTrue(all(t.is_floating_point() for t in out), mode)
            middle = _stages(
                tiny_hf_model("qwen3_moe", num_layers=3), 3, mode=mode, coef=coef
            )
            carried = middle[0](ids, mask)
            passed = middle[1](*carried)
            for received, sent in zip(carried[1:], passed[1:]):
                self.assertNotEqual(received.data_ptr(), sent.data_ptr(), mode)
            _, loss = second(*out)
            self.assertEqual(loss.shape, (1,))

    def test_errors(self):
        ids, mask, labels = _batch()
        model = tiny_hf_model("deepseek_v3", num_layers=2)
        model.config.output_router_logits = True
        with self.assertRaisesRegex(
            ValueError, "deepseek_v3 has no router auxiliary loss"
        ):
            _stages(model, 1)
        model.config.output_router_logits = False
        for mode in ("pooled", "per_layer"):
            with self.assertRaisesRegex(ValueError, "router_aux_loss='sequence'"):
                _stages(model, 1, mode=mode, coef=0.1)
        with self.assertRaisesRegex(ValueError, "needs router_aux_loss_coef"):
            _stages(model, 1, mode="sequence")
        with self.assertRaisesRegex(ValueError, "no auxiliary loss is asked for"):
            _stages(model, 1, coef=0.1)
        with self.assertRaisesRegex(ValueError, "llama has no router"):
            _stages(tiny_hf_model("llama", num_layers=2), 1, mode="per_layer")
        model = tiny_hf_model("qwen3_moe", num_layers=2)
        with self.assertRaisesRegex(ValueError, "must be one of"):
            _stages(model, 1, mode="switch")
        with self.assertRaisesRegex(ValueError, "finite and >= 0"):
            _stages(model, 1, mode="per_layer", coef=-1.0)
        model = tiny_hf_model(
            "mixtral", num_layers=2, output_router_logits=True, router_jitter_noise=0.1
        )
        with self.assertRaisesRegex(ValueError, "router_jitter_noise=0.1"):
            _stages(model, 1)
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        (stage,) = _stages(model, 1)
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


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x")
@instantiate_parametrized_tests
class ExpertLoadTest(TestCase):
    @parametrize("mode", [None, "pooled"])
    @parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
    def test_statistics_equal_the_unsplit_routing(self, family, mode):
        """Tokens per expert of every MoE layer equal the unsplit model's routing
        counts; padding is told apart when the mask travels (an auxiliary loss)."""
        if mode is not None and family == "deepseek_v3":
            mode = "sequence"
        model = tiny_hf_model(family, num_layers=3)
        ids, mask, labels = _batch()
        coef = None if mode is None else COEF
        stages = _stages(model, 3, ac="full", mode=mode, coef=coef)
        loss_fn = hf.CausalLMLoss(n_microbatches=2)
        loss_fn.set_labels(labels)
        if mode is None:  # no mask travels: every token counts
            out_mask = torch.ones_like(mask)
            loss = sum(
                loss_fn(stages[2](stages[1](stages[0](i))), y)
                for i, y in zip(ids.chunk(2), labels.chunk(2))
            )
        else:
            out_mask = mask
            loss = _run_chain(stages, loss_fn, ids, mask, labels)
        loss.backward()  # recomputations in backward count nothing
        load = hf.expert_load(stages)
        want = routing_counts(model, ids, out_mask)
        self.assertEqual(load.layers, tuple(want))
        torch.testing.assert_close(
            load.tokens_per_expert, torch.stack(list(want.values()))
        )
        k = model.config.num_experts_per_tok
        padding = (out_mask == 0).sum() * k * len(want)  # per MoE layer
        self.assertEqual(int(load.padding_slots.sum()), int(padding))
        self.assertEqual(int(load.dropped_slots.sum()), 0)
        self.assertEqual(load.replicas.tolist(), [1] * len(want))
        tokens = load.tokens_per_expert.double()
        torch.testing.assert_close(
            load.imbalance(), tokens.max(-1).values / tokens.mean(-1)
        )
        self.assertIn("expert load max/mean per MoE layer", load.summary())
        with self.assertRaisesRegex(RuntimeError, "statistics requested before a step"):
            hf.expert_load(stages)

    @parametrize("family", ["deepseek_v3", "glm4_moe"])
    def test_bias_update_follows_the_rule(self, family):
        model = tiny_hf_model(family, num_layers=3)
        ids, mask, _ = _batch()
        stages = _stages(model, 2)
        for i in ids.chunk(2):
            stages[1](stages[0](i))
        load = hf.expert_load(stages)
        rate = 0.01
        hf.update_expert_bias(stages, load, rate)
        want = routing_counts(model, ids, torch.ones_like(mask))
        routers = {
            int(n.split(".")[2]): m
            for stage in stages
            for n, m in stage.named_modules()
            if hasattr(m, "e_score_correction_bias")
        }
        self.assertEqual(set(routers), set(want))
        for layer, tokens in want.items():
            mean = tokens.double().mean()
            expected = torch.tensor(
                [
                    rate * (1.0 if mean > t else -1.0 if mean < t else 0.0)
                    for t in tokens.tolist()
                ]
            )
            torch.testing.assert_close(
                routers[layer].e_score_correction_bias, expected, msg=str(layer)
            )

    def test_errors(self):
        ids = _batch()[0]
        stages = _stages(tiny_hf_model("qwen3_moe", num_layers=2), 1)
        with self.assertRaisesRegex(RuntimeError, "statistics requested before a step"):
            hf.expert_load(stages)
        stages[0](ids)
        load = hf.expert_load(stages)
        with self.assertRaisesRegex(ValueError, "have no e_score_correction_bias"):
            hf.update_expert_bias(stages, load, 0.01)
        dense = _stages(tiny_hf_model("llama", num_layers=2), 1)
        with self.assertRaisesRegex(ValueError, "none of these stages holds a MoE"):
            hf.expert_load(dense)
        deepseek = _stages(tiny_hf_model("deepseek_v3", num_layers=3), 1)
        deepseek[0](ids)
        load = hf.expert_load(deepseek)
        for bad in (0, -1.0, float("nan")):
            with self.assertRaisesRegex(ValueError, "rate must be finite and > 0"):
                hf.update_expert_bias(deepseek, load, bad)
        with self.assertRaisesRegex(TypeError, "load must be the ExpertLoad"):
            hf.update_expert_bias(deepseek, {}, 0.01)
        other = hf.ExpertLoad((), *(torch.zeros(0, dtype=torch.int64),) * 4)
        with self.assertRaisesRegex(ValueError, "the load has no layer 1"):
            hf.update_expert_bias(deepseek, other, 0.01)


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x")
class SchedulePipelineTest(TestCase):
    """What pipeline_hf_causal_lm adds for the statistics, in one process (a group of one rank)."""

    def setUp(self) -> None:
        super().setUp()
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.addCleanup(dist.destroy_process_group)

    def test_stage_freed_without_garbage_collection(self):
        """No reference cycle keeps a PipelineStage (and its process group)
        alive: a cycle freed by a later collection, in a forked child, would
        run the group's destructor there, which hangs."""
        import gc
        import weakref

        from torch.distributed.pipelining import Schedule1F1B

        model = tiny_hf_model("qwen3_moe", num_layers=2)
        gc.disable()
        self.addCleanup(gc.enable)
        stages, parts = hf.pipeline_hf_causal_lm(
            model, torch.distributed.group.WORLD, Schedule1F1B, "cpu"
        )
        refs = [weakref.ref(x) for x in (*stages, *parts)]
        del stages, parts
        self.assertTrue(all(r() is None for r in refs))

    def test_counts_the_schedule_forwards_only(self):
        """The metadata inference of torch 2.13+ runs the stage outside the
        schedule's forward: not counted; one step counts each microbatch once."""
        from torch.distributed.pipelining import Schedule1F1B

        model = tiny_hf_model("qwen3_moe", num_layers=2)
        ids, _, labels = _batch()
        (stage,), parts = hf.pipeline_hf_causal_lm(
            model, torch.distributed.group.WORLD, Schedule1F1B, "cpu"
        )
        loss_fn = hf.CausalLMLoss()
        schedule = Schedule1F1B(stage, 2, loss_fn=loss_fn, scale_grads=False)
        loss_fn.set_labels(labels)
        schedule.step(ids, target=labels)
        load = hf.expert_load(parts)
        want = routing_counts(model, ids, torch.ones_like(ids))
        torch.testing.assert_close(
            load.tokens_per_expert, torch.stack(list(want.values()))
        )
        parts[0](ids)  # a stage used outside its schedule counts nothing
        with self.assertRaisesRegex(RuntimeError, "statistics requested before a step"):
            hf.expert_load(parts)


@unittest.skipIf(not HAS_TRANSFORMERS or HAS_FUSED, "transformers 4.x only")
class RouterAuxLoss4xTest(TestCase):
    def test_refused_without_fused_experts(self):
        model = tiny_hf_model("qwen3_moe", num_layers=2, output_router_logits=True)
        with self.assertRaisesRegex(ValueError, "needs transformers 5.x"):
            _router_aux.router_aux_loss(model, None)
        with self.assertRaisesRegex(ValueError, "needs transformers 5.x"):
            _router_aux.router_aux_loss(model, None, "sequence", 0.1)
        layout = hf.detect_layout(model)
        self.assertIsNone(_routing.model_routing(model, layout.layers_prefix))
        stages = _stages(tiny_hf_model("deepseek_v3", num_layers=2), 1)
        with self.assertRaisesRegex(ValueError, "fused experts of transformers 5.x"):
            hf.expert_load(stages)
        with self.assertRaisesRegex(ValueError, "fused experts of transformers 5.x"):
            hf.update_expert_bias(stages, None, 0.01)


if __name__ == "__main__":
    run_tests()
