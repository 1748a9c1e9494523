# Owner(s): ["oncall: distributed"]
"""MoE balancing through the pipeline schedules, four gloo ranks as PP=2 x
EP=2, transformers 5.x, against the unsplit model on the global batch (right
padding in every batch):

* Hugging Face's router auxiliary loss (``config.output_router_logits``):
  Qwen3-MoE, Mixtral and OLMoE x Schedule1F1B, ScheduleInterleaved1F1B,
  ScheduleZBVZeroBubble and ScheduleDualPipeV (split backward) -- the step's
  loss and every gradient equal the global-batch LM loss plus
  ``router_aux_loss_coef`` times the mean, over every microbatch of every EP
  rank, of ``load_balancing_loss_func``; and with full activation
  checkpointing;
* the per-layer and DeepSeek-V3's sequence-wise forms against their hand
  computation;
* the expert-load statistics (over the EP group: this rank's layers; over
  the world: every layer) against the unsplit model's routing counts, and
  DeepSeek-V3's bias update against its rule, the EP replicas bitwise equal;
* the overlapped OVERLAP_F_B bitwise the sequential one.

The class runs with ``PYTORCH_TEST_WITH_SLOW=1`` only (it starts four ranks;
CI runs it once, in its slow step), the whole families x schedules cross
product.
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from common_hf import HAS_FUSED, HFMultiProcTest
from common_pipelining import check_on_all_ranks, parametrize_covering, slow_only
from hf_model_registry import (
    balanced_loss_by_hand,
    padded_batch,
    routing_counts,
    tiny_hf_model,
)
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import schedules as sched
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)
from torch_pipelining_ext.runtime import sequential_overlap_f_b


if HAS_FUSED:
    from torch_pipelining_ext import hf

VOCAB = 64
COEF = 0.5
RATE = 0.01
N_MICROBATCHES = 4
_SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return padded_batch(300 + step, VOCAB)


def _model(family: str, mode: str | None):
    """A tiny 4-layer model; Hugging Face's own loss is asked for with the config flag."""
    kwargs: dict[str, Any] = {"num_layers": 4}
    if family != "deepseek_v3":
        kwargs.update(router_aux_loss_coef=COEF)
    if mode == "pooled":
        kwargs.update(output_router_logits=True)
    return tiny_hf_model(family, **kwargs)


def _reference_loss(ref, batch, mode: str) -> torch.Tensor:
    """Global-batch LM loss + COEF * the mean of the microbatches' auxiliary
    terms (each EP rank's 4 rows in 4 microbatches: one row each)."""
    return balanced_loss_by_hand(ref, batch, mode, COEF)


@dataclass
class _Pipeline:
    stages: list
    parts: list
    loss_fn: Any
    schedule: Any


@unittest.skipIf(
    not HAS_FUSED, "needs transformers 5.x (routers apart from fused experts)"
)
@slow_only("slow (four ranks started for the class): PYTORCH_TEST_WITH_SLOW=1 runs it")
@instantiate_parametrized_tests
class HFMoEBalanceTest(HFMultiProcTest):
    def _mesh(self):
        mesh = self.layout(pp=2, ep=2)
        return mesh, mesh["ep"].get_group(), mesh["ep"].get_local_rank()

    def _pipeline(self, ref, schedule, mode, *, overlap=True, ac=None) -> _Pipeline:
        cls = _SCHEDULES[schedule]
        options = {} if mode in (None, "pooled") else {"router_aux_loss": mode}
        if mode == "sequence":
            options["router_aux_loss_coef"] = COEF
        stages, parts = hf.pipeline_hf_causal_lm(
            ref, self._mesh()[0], cls, "cpu", activation_checkpointing=ac, **options
        )
        loss_fn = hf.CausalLMLoss(n_microbatches=N_MICROBATCHES)
        schedule = cls(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=N_MICROBATCHES,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        if not overlap:
            schedule.register_custom_function(sched.OVERLAP_F_B, sequential_overlap_f_b)
        return _Pipeline(stages, parts, loss_fn, schedule)

    def _step(self, pipeline: _Pipeline, batch) -> list[torch.Tensor]:
        _, ep_group, ep_rank = self._mesh()
        ids, mask, labels = (t[4 * ep_rank : 4 * ep_rank + 4] for t in batch)
        for part in pipeline.parts:
            part.zero_grad()
        pipeline.loss_fn.set_labels(labels, group=ep_group)
        losses: list[torch.Tensor] = []
        has_first = any(s.is_first for s in pipeline.stages)
        pipeline.schedule.step(
            *((ids, mask) if has_first else ()), target=labels, losses=losses
        )
        hf.reduce_expert_parallel_gradients(pipeline.parts, ep_group)
        return losses

    def _check_step(self, pipeline: _Pipeline, ref, losses, want_loss, step) -> None:
        """The step's loss (summed over the EP ranks) and every gradient equal the unsplit model's."""
        _, ep_group, _ = self._mesh()
        has_last = any(s.is_last for s in pipeline.stages)
        total = torch.stack(losses).sum().detach() if has_last else torch.zeros(())
        dist.all_reduce(total, group=ep_group)
        ref_params = dict(ref.named_parameters())

        def check():
            if has_last:
                torch.testing.assert_close(total / 2, want_loss.detach())
            for part in pipeline.parts:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    if name in part.expert_ranges:
                        want = want[slice(*part.expert_ranges[name])]
                    torch.testing.assert_close(p.grad, want, msg=f"{step}: {name}")

        check_on_all_ranks(check, self.device)

    def _train(self, ref, pipeline: _Pipeline, mode: str, steps: int = 2, after=None):
        """``steps`` steps on both sides, compared; the same SGD update on both."""
        for step in range(steps):
            batch = _global_batch(step)
            ref.zero_grad()
            want_loss = _reference_loss(ref, batch, mode)
            want_loss.backward()
            losses = self._step(pipeline, batch)
            self._check_step(pipeline, ref, losses, want_loss, step)
            if after is not None:  # before the update: the step's routing
                after(step, batch)
            with torch.no_grad():
                for part in pipeline.parts:
                    for p in part.parameters():
                        p -= 0.05 * p.grad
                for p in ref.parameters():
                    p -= 0.05 * p.grad

    @parametrize_covering(
        schedule=list(_SCHEDULES), family=["qwen3_moe", "mixtral", "olmoe"]
    )
    def test_pooled_matches_unsplit_model(self, family, schedule):
        ref = _model(family, "pooled")
        self._train(ref, self._pipeline(ref, schedule, "pooled"), "pooled")

    @parametrize("schedule", ["interleaved1f1b", "dualpipev"])
    def test_pooled_with_full_activation_checkpointing(self, schedule):
        ref = _model("qwen3_moe", "pooled")
        pipeline = self._pipeline(ref, schedule, "pooled", ac="full")
        self._train(ref, pipeline, "pooled")

    @parametrize("mode", ["per_layer", "sequence"])
    def test_forms_match_hand_computation(self, mode):
        family = "deepseek_v3" if mode == "sequence" else "mixtral"
        ref = _model(family, mode)
        self._train(ref, self._pipeline(ref, "zbv", mode), mode)

    def test_statistics_and_bias_update(self):
        """DeepSeek-V3 with its sequence-wise loss (the mask travels): the load
        equals the unsplit model's routing counts of the global batch (real
        tokens), over the EP group (this rank's layers) and over the world
        (every layer); the bias update follows the rule on both sides."""
        ref = _model("deepseek_v3", "sequence")
        pipeline = self._pipeline(ref, "dualpipev", "sequence")
        _, ep_group, _ = self._mesh()
        local = sorted(layer for p in pipeline.parts for layer in p._routers)

        def after(step: int, batch) -> None:
            group = ep_group if step == 0 else dist.group.WORLD
            load = hf.expert_load(pipeline.parts, group)
            want = routing_counts(ref, batch[0], batch[1])
            _update_reference_bias(ref, want)
            hf.update_expert_bias(pipeline.parts, load, RATE)
            biases = _biases(pipeline.parts)
            gathered = [None] * 2
            dist.all_gather_object(gathered, biases, group=ep_group)

            def check():
                self.assertEqual(load.layers, tuple(local if step == 0 else want))
                for row, layer in enumerate(load.layers):
                    torch.testing.assert_close(load.tokens_per_expert[row], want[layer])
                self.assertEqual(load.replicas.tolist(), [2] * len(load.layers))
                padding = (batch[1] == 0).sum() * ref.config.num_experts_per_tok
                self.assertEqual(
                    load.padding_slots.tolist(), [int(padding)] * len(load.layers)
                )
                ref_biases = _biases([ref])
                for name, bias in biases.items():
                    torch.testing.assert_close(bias, ref_biases[name], msg=name)
                    self.assertTrue(torch.equal(bias, gathered[0][name]), name)
                    self.assertTrue(torch.equal(bias, gathered[1][name]), name)

            check_on_all_ranks(check, self.device)

        self._train(ref, pipeline, "sequence", after=after)

    @parametrize("mode", ["pooled", "sequence"])
    def test_overlapped_equals_sequential_bitwise(self, mode):
        ref = _model("qwen3_moe" if mode == "pooled" else "deepseek_v3", mode)
        runs = []
        for overlap in (True, False):
            pipeline = self._pipeline(ref, "dualpipev", mode, overlap=overlap)
            out = []
            for step in range(2):
                losses = self._step(pipeline, _global_batch(step))
                grads = {
                    n: p.grad.clone()
                    for part in pipeline.parts
                    for n, p in part.named_parameters()
                }
                load = hf.expert_load(pipeline.parts, self._mesh()[1])
                out.append(([t.detach().clone() for t in losses], grads, load))
            runs.append(out)
        actions = pipeline.schedule.pipeline_order_with_comms[
            pipeline.stages[0].group_rank
        ]

        def check():
            self.assertTrue(
                any(
                    a is not None and a.computation_type == sched.OVERLAP_F_B
                    for a in actions
                )
            )
            for (losses_a, grads_a, load_a), (losses_b, grads_b, load_b) in zip(*runs):
                for a, b in zip(losses_a, losses_b, strict=True):
                    self.assertTrue(torch.equal(a, b))
                for key in grads_a:
                    self.assertTrue(torch.equal(grads_a[key], grads_b[key]), key)
                self.assertTrue(
                    torch.equal(load_a.tokens_per_expert, load_b.tokens_per_expert),
                    f"{load_a} {load_b}",
                )

        check_on_all_ranks(check, self.device)


def _biases(modules) -> dict[str, torch.Tensor]:
    return {
        name: buf.detach().clone()
        for module in modules
        for name, buf in module.named_buffers()
        if name.endswith("e_score_correction_bias")
    }


def _update_reference_bias(ref, counts: dict[int, torch.Tensor]) -> None:
    """DeepSeek-V3's rule, written out: bias_i += RATE * sign(mean load - load_i)."""
    with torch.no_grad():
        for layer, tokens in counts.items():
            bias = ref.model.layers[layer].mlp.gate.e_score_correction_bias
            mean = tokens.double().mean()
            for i, t in enumerate(tokens.tolist()):
                bias[i] += RATE * (1.0 if mean > t else -1.0 if mean < t else 0.0)


if __name__ == "__main__":
    run_tests()
