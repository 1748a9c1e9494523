# Owner(s): ["oncall: distributed"]
"""Hugging Face's router auxiliary loss (``config.output_router_logits``)
through pipeline stages, four gloo ranks as PP=2 x EP=2, transformers 5.x:
the step's loss and every gradient equal the unsplit model's global-batch
LM loss plus ``router_aux_loss_coef`` times the mean, over every microbatch
of every EP rank, of its ``load_balancing_loss_func`` (right padding
masked), and the overlapped OVERLAP_F_B is bitwise the sequential one.
"""

from __future__ import annotations

import unittest

import torch
import torch.distributed as dist
from hf_model_registry import tiny_hf_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV
from torch.distributed.pipelining import schedules as sched
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # patches torch
from torch_pipelining_ext.runtime import sequential_overlap_f_b


try:
    import transformers  # noqa: F401  (is transformers installed?)

    from torch_pipelining_ext import hf

    HAS_FUSED = hf.has_fused_experts()
except ImportError:
    HAS_FUSED = False

VOCAB = 64
COEF = 0.5
N_MICROBATCHES = 4
_SCHEDULES = {"1f1b": Schedule1F1B, "dualpipev": ScheduleDualPipeV}


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of 8 sequences, some right-padded."""
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (8, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[6, 3:] = 0
    mask[7, 7:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _reference_loss(ref, batch) -> torch.Tensor:
    """Global-batch token-mean LM loss + COEF * the mean of the microbatches'
    ``load_balancing_loss_func`` (each EP rank's 4 rows in 4 microbatches)."""
    ids, mask, labels = batch
    lm = ref(
        input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False
    ).loss
    aux = [
        ref(
            input_ids=ids[i : i + 1],
            attention_mask=mask[i : i + 1],
            output_router_logits=True,
        ).aux_loss
        for i in range(ids.shape[0])
    ]
    return lm + COEF * torch.stack(aux).mean()


def _backport_step_loop() -> bool:
    """torch without its own step loop (2.9): the package refuses the router auxiliary loss there."""
    status = {r.name: r.status for r in torch_pipelining_ext.patch_report()}
    return status.get("runtime_step_loop") is torch_pipelining_ext.PatchStatus.APPLIED


@unittest.skipIf(
    not HAS_FUSED, "needs transformers 5.x (routers apart from fused experts)"
)
@unittest.skipIf(
    _backport_step_loop(),
    "refused on the package's backported step loop (test_refused_on_the_backport)",
)
@instantiate_parametrized_tests
class HFMoEBalanceGlooTest(MultiProcContinuousTest):
    world_size = 4
    _meshes: dict = {}

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    def _mesh(self):
        if not self._meshes:
            self._meshes["pp_ep"] = init_device_mesh(
                "cpu", (2, 2), mesh_dim_names=("pp", "ep")
            )
        mesh = self._meshes["pp_ep"]
        return mesh, mesh["ep"].get_group(), mesh["ep"].get_local_rank()

    def _pipeline(self, ref, mesh, schedule, overlap=True):
        cls = _SCHEDULES[schedule]
        stages, parts = hf.pipeline_hf_causal_lm(ref, mesh, cls, "cpu")
        loss_fn = hf.CausalLMLoss(n_microbatches=N_MICROBATCHES)
        sch = cls(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=N_MICROBATCHES,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        if not overlap:
            sch.register_custom_function(sched.OVERLAP_F_B, sequential_overlap_f_b)
        return stages, parts, loss_fn, sch

    def _step(self, pipeline, batch, ep_group, ep_rank) -> list[torch.Tensor]:
        stages, parts, loss_fn, sch = pipeline
        ids, mask, labels = (t[4 * ep_rank : 4 * ep_rank + 4] for t in batch)
        for part in parts:
            part.zero_grad()
        loss_fn.set_labels(labels, group=ep_group)
        losses: list[torch.Tensor] = []
        has_first = any(s.is_first for s in stages)
        sch.step(*((ids, mask) if has_first else ()), target=labels, losses=losses)
        hf.reduce_expert_parallel_gradients(parts, ep_group)
        return losses

    @parametrize("schedule", list(_SCHEDULES))
    @parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
    def test_aux_loss_matches_unsplit_model(self, family, schedule):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model(
            family, num_layers=4, output_router_logits=True, router_aux_loss_coef=COEF
        )
        pipeline = self._pipeline(ref, mesh, schedule)
        ref_params = dict(ref.named_parameters())
        for step in range(2):
            batch = _global_batch(step)
            ref.zero_grad()
            want_loss = _reference_loss(ref, batch)
            want_loss.backward()
            losses = self._step(pipeline, batch, ep_group, ep_rank)
            if any(s.is_last for s in pipeline[0]):
                total = torch.stack(losses).sum().detach()
                dist.all_reduce(total, group=ep_group)
                torch.testing.assert_close(total / 2, want_loss.detach())
            for part in pipeline[1]:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    if name in part.expert_ranges:
                        want = want[slice(*part.expert_ranges[name])]
                    torch.testing.assert_close(p.grad, want, msg=f"{step}: {name}")
            with torch.no_grad():  # the same update on both sides
                for part in pipeline[1]:
                    for name, p in part.named_parameters():
                        p -= 0.05 * p.grad
                for p in ref.parameters():
                    p -= 0.05 * p.grad

    def test_overlapped_equals_sequential_bitwise(self):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model(
            "qwen3_moe",
            num_layers=4,
            output_router_logits=True,
            router_aux_loss_coef=COEF,
        )
        runs = []
        for overlap in (True, False):
            pipeline = self._pipeline(ref, mesh, "dualpipev", overlap=overlap)
            out = []
            for step in range(2):
                losses = self._step(pipeline, _global_batch(step), ep_group, ep_rank)
                grads = {
                    n: p.grad.clone()
                    for part in pipeline[1]
                    for n, p in part.named_parameters()
                }
                out.append(([t.detach().clone() for t in losses], grads))
            runs.append(out)
        sch = pipeline[3]
        actions = sch.pipeline_order_with_comms[pipeline[0][0].group_rank]
        self.assertTrue(
            any(
                a is not None and a.computation_type == sched.OVERLAP_F_B
                for a in actions
            )
        )
        for (losses_a, grads_a), (losses_b, grads_b) in zip(*runs):
            for a, b in zip(losses_a, losses_b, strict=True):
                self.assertTrue(torch.equal(a, b))
            for key in grads_a:
                self.assertTrue(torch.equal(grads_a[key], grads_b[key]), key)


if __name__ == "__main__":
    run_tests()
