# Owner(s): ["oncall: distributed"]
"""Multi-process tests of ``torch_pipelining_ext.hf`` on gloo/CPU (four ranks):

* training: tiny Llama and Qwen3-MoE split with ``pipeline_hf_causal_lm`` on a
  PP=2 group, ``Schedule1F1B`` and ``ScheduleDualPipeV`` (4 stages), two steps
  with an SGD step between: every step's loss and every parameter gradient
  equal the unsplit Hugging Face model's own forward + loss;
* distributed checkpoints across pipeline layouts: ``torch.distributed.checkpoint``
  saves from PP=2 stages (two ranks) and from FSDP2-sharded PP=2 x DP=2
  stages, and loads into PP=4 stages and into the unsplit model; every tensor
  equals the original (tied weights and replicated rotary modules included);
  the FSDP2 case with ``PYTORCH_TEST_WITH_SLOW=1``.

The class runs with ``PYTORCH_TEST_WITH_SLOW=1`` only (it starts four ranks;
CI runs it in its slow steps, under both transformers majors).
"""

from __future__ import annotations

import unittest
import warnings

import torch
import torch.distributed as dist
from common_hf import HAS_TRANSFORMERS, HFMultiProcTest
from common_pipelining import slow_only
from hf_model_registry import tiny_hf_model
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)


if HAS_TRANSFORMERS:
    from torch_pipelining_ext import hf

VOCAB = 64
_SCHEDULES = {"1f1b": Schedule1F1B, "dualpipev": ScheduleDualPipeV}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100  # microbatches with different numbers of labelled tokens
    return ids, labels


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers (pip install .[hf])")
@slow_only("slow (four ranks started for the class): PYTORCH_TEST_WITH_SLOW=1 runs it")
@instantiate_parametrized_tests
class HFPipelineGlooTest(HFMultiProcTest):
    # ------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------

    @parametrize("schedule", list(_SCHEDULES))
    @parametrize("family", ["llama", "qwen3_moe"])
    def test_training_matches_unsplit_model(self, family, schedule):
        torch.set_num_threads(1)
        group = self.group([0, 1])
        if self.rank >= 2:
            return  # the PP=2 pipeline runs on ranks 0 and 1
        schedule_cls = _SCHEDULES[schedule]
        ref = tiny_hf_model(family, num_layers=4)
        stages, parts = hf.pipeline_hf_causal_lm(ref, group, schedule_cls, "cpu")
        self.assertEqual(len(stages), 1 if schedule == "1f1b" else 2)
        loss_fn = hf.CausalLMLoss()
        sched = schedule_cls(
            stages[0] if len(stages) == 1 else stages,
            n_microbatches=4,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.05)
        ref_params = dict(ref.named_parameters())
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        for step in range(2):
            ids, labels = _batch(step)
            ref_opt.zero_grad()
            opt.zero_grad()
            ref_loss = ref(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            loss_fn.set_labels(labels)
            losses: list[torch.Tensor] = []
            sched.step(*((ids,) if has_first else ()), target=labels, losses=losses)
            hf.sync_tied_gradients(parts, group)
            if has_last:
                self.assertEqual(len(losses), 4)
                torch.testing.assert_close(
                    torch.stack(losses).sum(),
                    ref_loss.detach(),
                    msg=f"loss of step {step}",
                )
            checked = []
            for part in parts:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    if want is None:  # an expert no token was routed to
                        self.assertIsNone(p.grad, name)
                    else:
                        torch.testing.assert_close(
                            p.grad, want, msg=f"step {step}: grad of {name}"
                        )
                    checked.append(name)
            gathered: list = [None, None]
            dist.all_gather_object(gathered, checked, group=group)
            self.assertEqual(
                sorted(n for names in gathered for n in names), sorted(ref_params)
            )
            ref_opt.step()
            opt.step()

    # ------------------------------------------------------------------
    # Distributed checkpoints across pipeline layouts
    # ------------------------------------------------------------------

    def _check_loaded(self, family: str, ckpt: str) -> None:
        """Load ``ckpt`` into PP=4 stages and into the unsplit model; compare with the seed-0 model."""
        import torch.distributed.checkpoint as dcp

        want = tiny_hf_model(family, num_layers=4, seed=0).state_dict()
        other = tiny_hf_model(
            family, num_layers=4, seed=1
        )  # different values everywhere
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's embedding/head tie across stages
            _, (part,) = hf.pipeline_hf_causal_lm(
                other, dist.group.WORLD, Schedule1F1B, "cpu"
            )
        sd = part.state_dict()
        self.assertTrue(sd)
        self.assertFalse(
            any(
                torch.equal(t, want[k])
                for k, t in sd.items()
                if t.numel() > 1
                and k.endswith("weight")
                and "norm" not in k
                and "ln_" not in k
            )
        )
        dcp.load(sd, checkpoint_id=ckpt)
        for key, t in part.state_dict().items():
            self.assertTrue(torch.equal(t, want[key]), f"PP=4 stage {self.rank}: {key}")
        whole = tiny_hf_model(family, num_layers=4, seed=2)
        sd = whole.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        self.assertEqual(set(whole.state_dict()), set(want))
        for key, t in whole.state_dict().items():
            self.assertTrue(torch.equal(t, want[key]), f"unsplit model: {key}")
        if family == "gpt2":  # the tie survived the load
            self.assertIs(whole.lm_head.weight, whole.transformer.wte.weight)

    @parametrize("family", ["llama", "gpt2"])
    def test_dcp_pp2_to_pp4_and_unsplit(self, family):
        import torch.distributed.checkpoint as dcp

        torch.set_num_threads(1)
        group = self.group([0, 1])
        ckpt = self.shared_dir("hf_dcp_")

        def save() -> None:
            if self.rank >= 2:
                return  # the PP=2 pipeline runs on ranks 0 and 1
            ref = tiny_hf_model(family, num_layers=4, seed=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, (part,) = hf.pipeline_hf_causal_lm(ref, group, Schedule1F1B, "cpu")
            if (
                family == "llama"
            ):  # every stage replicates the parameter-free rotary module
                self.assertIsNotNone(part.model.rotary_emb)
            dcp.save(part.state_dict(), checkpoint_id=ckpt, process_group=group)

        self.check_all(save)
        self._check_loaded(family, ckpt)

    @slow_only(
        "test_hf_training_state_multiproc covers FSDP2 checkpoints of PP=2 x DP=2 "
        "by default: PYTORCH_TEST_WITH_SLOW=1",
    )
    def test_dcp_fsdp_pp2xdp2_to_pp4_and_unsplit(self):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        torch.set_num_threads(1)
        mesh = self.layout(pp=2, dp=2)
        ckpt = self.shared_dir("hf_dcp_")
        ref = tiny_hf_model("llama", num_layers=4, seed=0)
        _, (part,) = hf.pipeline_hf_causal_lm(ref, mesh["pp"], Schedule1F1B, "cpu")
        for layer in part.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        sd = part.state_dict()
        self.assertTrue(all(isinstance(t, DTensor) for t in sd.values()))
        dcp.save(sd, checkpoint_id=ckpt)
        self._check_loaded("llama", ckpt)


if __name__ == "__main__":
    run_tests()
