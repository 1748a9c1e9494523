# Owner(s): ["oncall: distributed"]
"""Expert parallelism for Hugging Face MoE stages (``pipeline_hf_causal_lm(...,
ep_group=...)``), four gloo ranks as PP=2 x EP=2, transformers 5.x:

* training: tiny Qwen3-MoE, Mixtral and DeepSeek-V3, Schedule1F1B,
  Interleaved1F1B and ScheduleDualPipeV, two steps with an SGD step between,
  the two EP ranks on different halves of the global batch: the step's loss
  and every gradient (experts: this rank's slice) equal the unsplit model's on
  the whole global batch;
* the concurrent OVERLAP_F_B (DualPipeV) is bitwise the sequential handler,
  with no, full and selective activation checkpointing, and the all-to-alls
  each rank issues are the same sequence on each communicator in repeated runs;
* uneven loads (an expert without tokens, a rank that receives none), the
  error for ``E`` not divisible by ``ep``, and the refusal of per-expert
  modules (4.57).

The family x schedule and family x checkpointing matrices run a covering
subset by default (each value once) and whole with
``PYTORCH_TEST_WITH_SLOW=1``.
"""

from __future__ import annotations

import types
import unittest
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from common_hf import HAS_FUSED, HFMultiProcTest
from common_pipelining import load_csv, nccl_variant, parametrize_covering
from hf_model_registry import tiny_hf_model
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining import schedules as sched
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)
from torch_pipelining_ext.runtime import sequential_overlap_f_b


if HAS_FUSED:
    from torch_pipelining_ext import hf

VOCAB = 64
FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]
_SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "dualpipev": ScheduleDualPipeV,
}
# Interleaved1F1B's order (rank 0: stages 0 and 2, rank 1: stages 1 and 3) with adjacent forward/backward
# pairs merged into OVERLAP_F_B and full backwards only: torch allows one backward per selectively
# checkpointed region, which DualPipeV's split (input, weight) backwards would take twice.
CSV_SCHEDULE = """\
0F0,0F1,2F0,2F1,,,(0F2;2B0)OVERLAP_F_B,(0F3;2B1)OVERLAP_F_B,(2F2;0B0)OVERLAP_F_B,(2F3;0B1)OVERLAP_F_B,,2B2,,2B3,,0B2,,0B3
,1F0,1F1,,3F0,3B0,3F1,3B1,(1F2;1B0)OVERLAP_F_B,(1F3;1B1)OVERLAP_F_B,3F2,3B2,3F3,3B3,,1B2,,1B3
"""


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (8, 8), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    labels[6, 2:] = -100  # the two EP ranks predict different numbers of tokens
    return ids, labels


class _Pipeline:
    """This rank's stages of ``ref`` (PP x EP), a schedule and an optimizer."""

    def __init__(
        self, ref, mesh, schedule: str, device, *, overlap: bool = True, ac=None
    ) -> None:
        cls = _SCHEDULES.get(schedule, ScheduleInterleaved1F1B)  # csv: loop placement
        self.device = device
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            ref, mesh, cls, device, activation_checkpointing=ac
        )
        self.loss_fn = hf.CausalLMLoss()
        if schedule == "csv":
            self.schedule = sched._PipelineScheduleRuntime(
                self.stages, n_microbatches=4, loss_fn=self.loss_fn, scale_grads=False
            )
            load_csv(self.schedule, CSV_SCHEDULE)
        else:
            self.schedule = cls(
                self.stages[0] if len(self.stages) == 1 else self.stages,
                n_microbatches=4,
                loss_fn=self.loss_fn,
                scale_grads=False,
            )
        if not overlap:
            self.schedule.register_custom_function(
                sched.OVERLAP_F_B, sequential_overlap_f_b
            )
        self.optimizer = torch.optim.SGD(
            [p for part in self.parts for p in part.parameters()], lr=0.05
        )

    def step(self, ids, labels, ep_group) -> list[torch.Tensor]:
        self.optimizer.zero_grad()
        self.loss_fn.set_labels(labels, group=ep_group)
        losses: list[torch.Tensor] = []
        has_first = any(s.is_first for s in self.stages)
        ids, labels = ids.to(self.device), labels.to(self.device)
        self.schedule.step(*((ids,) if has_first else ()), target=labels, losses=losses)
        hf.reduce_expert_parallel_gradients(self.parts, ep_group)
        return losses

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for part in self.parts for n, p in part.named_parameters()}


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x (fused experts)")
@instantiate_parametrized_tests
class HFExpertParallelGlooTest(HFMultiProcTest):
    def _mesh(self):
        mesh = self.layout(pp=2, ep=2)
        return mesh, mesh["ep"].get_group(), mesh["ep"].get_local_rank()

    def _local(
        self, batch: tuple[torch.Tensor, torch.Tensor], ep_rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t[4 * ep_rank : 4 * ep_rank + 4] for t in batch)

    @parametrize_covering(schedule=list(_SCHEDULES), family=FAMILIES)
    def test_training_matches_unsplit_model_on_the_global_batch(self, family, schedule):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model(family, num_layers=4)
        pipe = _Pipeline(ref, mesh, schedule, self.device)
        self.assertTrue(any(part.expert_ranges for part in pipe.parts))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        ref_params = dict(ref.named_parameters())
        for step in range(2):
            batch = _global_batch(step)
            ref_opt.zero_grad()
            ref_loss = ref(input_ids=batch[0], labels=batch[1]).loss
            ref_loss.backward()
            losses = pipe.step(*self._local(batch, ep_rank), ep_group)
            if any(s.is_last for s in pipe.stages):
                total = torch.stack(losses).sum().detach()
                dist.all_reduce(total, group=ep_group)
                total /= dist.get_world_size(
                    ep_group
                )  # the ranks' losses average to the global loss
                torch.testing.assert_close(
                    total.cpu(), ref_loss.detach(), msg=f"loss of step {step}"
                )
            for part in pipe.parts:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    want = torch.zeros_like(ref_params[name]) if want is None else want
                    if name in part.expert_ranges:
                        start, stop = part.expert_ranges[name]
                        want = want[start:stop]
                    got = p.grad if p.grad is not None else torch.zeros_like(p)
                    torch.testing.assert_close(
                        got.cpu(), want, msg=f"step {step}: grad of {name}"
                    )
            ref_opt.step()
            pipe.optimizer.step()

    @parametrize_covering(ac=["none", "full", "selective"], family=FAMILIES)
    def test_overlapped_equals_sequential_bitwise(self, family, ac):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        policy = {
            "none": None,
            "full": "full",
            "selective": [torch.ops.aten.mm.default],
        }[ac]
        ref = tiny_hf_model(family, num_layers=4)
        runs = {}
        schedule = "csv" if ac == "selective" else "dualpipev"
        for name, overlap in (
            ("overlapped", True),
            ("overlapped_again", True),
            ("sequential", False),
        ):
            pipe = _Pipeline(
                ref, mesh, schedule, self.device, overlap=overlap, ac=policy
            )
            # per communicator: with a twin group the two sides of an overlapped
            # action each keep their own program order, not a common one
            calls: dict[str, list[tuple]] = {}
            real = dist.all_to_all_single

            def recording(
                output,
                input,
                output_split_sizes=None,
                input_split_sizes=None,
                group=None,
                **kw,
            ):
                name = (group or dist.group.WORLD).group_name
                calls.setdefault(name, []).append(
                    (
                        input.dtype,
                        tuple(input.shape),
                        tuple(output_split_sizes or ()),
                        tuple(input_split_sizes or ()),
                    )
                )
                return real(
                    output,
                    input,
                    output_split_sizes,
                    input_split_sizes,
                    group=group,
                    **kw,
                )

            out = []
            for step in range(2):
                # recorded in the second step: the first one also runs torch's metadata inference, whose
                # stage forwards and backwards see uninitialised tensors (routing, hence sizes, vary)
                with mock.patch.object(
                    dist, "all_to_all_single", recording if step == 1 else real
                ):
                    losses = pipe.step(
                        *self._local(_global_batch(step), ep_rank), ep_group
                    )
                grads = {
                    n: p.grad.clone()
                    for n, p in pipe.named_parameters().items()
                    if p.grad is not None
                }
                out.append(([loss.detach().clone() for loss in losses], grads))
                pipe.optimizer.step()
            runs[name] = (out, calls)
        self.assertGreater(sum(map(len, runs["overlapped"][1].values())), 0)
        actions = pipe.schedule.pipeline_order_with_comms[pipe.stages[0].group_rank]
        n_overlap = sum(
            a is not None and a.computation_type == sched.OVERLAP_F_B for a in actions
        )
        self.assertGreater(n_overlap, 0)
        for name in ("overlapped_again", "sequential"):
            for (losses_a, grads_a), (losses_b, grads_b) in zip(
                runs["overlapped"][0], runs[name][0]
            ):
                self.assertEqual(len(losses_a), len(losses_b))
                for a, b in zip(losses_a, losses_b):
                    self.assertTrue(torch.equal(a, b), f"{name}: losses differ")
                self.assertEqual(grads_a.keys(), grads_b.keys())
                for key in grads_a:
                    self.assertTrue(
                        torch.equal(grads_a[key], grads_b[key]),
                        f"{name}: grad of {key}",
                    )
        # the all-to-alls of the overlapped run: on each communicator, the same
        # sequence (kinds and sizes) when run again
        self.assertEqual(runs["overlapped"][1], runs["overlapped_again"][1])
        # and the same kinds in the same order on the other EP rank (sizes follow the data)
        kinds = {
            name: [(c[0], len(c[2])) for c in seq]
            for name, seq in runs["overlapped"][1].items()
        }
        gathered = [None, None]
        dist.all_gather_object(gathered, kinds, group=ep_group)
        self.assertEqual(gathered[0], gathered[1])

    def test_fsdp2_over_the_ep_dimension(self):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=4)
        stages, parts = hf.pipeline_hf_causal_lm(ref, mesh, Schedule1F1B, self.device)
        hf.fully_shard_replicated(parts, mesh["ep"])
        loss_fn = hf.CausalLMLoss()
        schedule = Schedule1F1B(
            stages[0], n_microbatches=4, loss_fn=loss_fn, scale_grads=False
        )
        ref_params = dict(ref.named_parameters())
        for step in range(2):
            batch = _global_batch(step)
            ref.zero_grad()
            ref(input_ids=batch[0], labels=batch[1]).loss.backward()
            ids, labels = (t.to(self.device) for t in self._local(batch, ep_rank))
            loss_fn.set_labels(labels, group=ep_group)
            for part in parts:
                part.zero_grad()
            schedule.step(
                *((ids,) if stages[0].is_first else ()), target=labels, losses=[]
            )
            for part in parts:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    if name in part.expert_ranges:
                        start, stop = part.expert_ranges[name]
                        self.assertNotIsInstance(p, torch.distributed.tensor.DTensor)
                        torch.testing.assert_close(
                            p.grad.cpu(), want[start:stop], msg=f"step {step}: {name}"
                        )
                    else:
                        torch.testing.assert_close(
                            p.grad.full_tensor().cpu(), want, msg=f"step {step}: {name}"
                        )

    def test_uneven_loads(self):
        # every token routed to experts 0 and 1 (EP rank 0's): rank 1's experts get no token, rank 1 receives none
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=4)
        for layer in ref.model.layers:
            layer.mlp.gate.forward = types.MethodType(
                _first_two_experts, layer.mlp.gate
            )
        ids = _global_batch(0)[0]
        pipe = _Pipeline(ref, mesh, "1f1b", self.device)
        ref.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        losses = pipe.step(
            ids[4 * ep_rank : 4 * ep_rank + 4],
            ids[4 * ep_rank : 4 * ep_rank + 4],
            ep_group,
        )
        if any(s.is_last for s in pipe.stages):
            total = torch.stack(losses).sum().detach()
            dist.all_reduce(total, group=ep_group)
            total /= dist.get_world_size(ep_group)
            torch.testing.assert_close(total.cpu(), ref_loss.detach())
        ref_params = dict(ref.named_parameters())
        for part in pipe.parts:
            for name, p in part.named_parameters():
                want = ref_params[name].grad
                want = torch.zeros_like(ref_params[name]) if want is None else want
                if name in part.expert_ranges:
                    start, stop = part.expert_ranges[name]
                    want = want[start:stop]
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                torch.testing.assert_close(got.cpu(), want, msg=name)

    def test_transport_sees_every_all_to_all(self):
        torch.set_num_threads(1)
        mesh, ep_group, ep_rank = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=4)
        batches = [self._local(_global_batch(step), ep_rank) for step in range(2)]

        class Recording(hf.ExpertParallelTransport):
            def __init__(self):
                self.counts_calls, self.tokens_calls, self.well_formed = 0, [], []

            def counts(self, output, input, group):
                self.counts_calls += 1
                super().counts(output, input, group)

            def tokens(
                self, output, input, output_split_sizes, input_split_sizes, group
            ):
                self.well_formed.append(input.is_contiguous() and group is ep_group)
                self.tokens_calls.append(
                    (sum(input_split_sizes), sum(output_split_sizes))
                )
                super().tokens(
                    output, input, output_split_sizes, input_split_sizes, group
                )

        runs = {}
        for name in ("default", "recording"):
            pipe = _Pipeline(ref, mesh, "1f1b", self.device)
            recording = Recording()
            previous = hf.set_expert_parallel_transport(
                recording if name == "recording" else None
            )
            try:
                pipe.step(*batches[0], ep_group)  # also runs torch's metadata inference
                recording.counts_calls, recording.tokens_calls = 0, []
                runs[name] = pipe.step(*batches[1], ep_group)
            finally:
                installed = hf.set_expert_parallel_transport(previous)
            self.assertIs(
                type(installed),
                Recording if name == "recording" else hf.ExpertParallelTransport,
            )
        for a, b in zip(runs["default"], runs["recording"]):
            self.assertTrue(torch.equal(a, b))
        shards = hf.expert_parallel_shards(pipe.parts)
        self.assertEqual(len(shards), 2)  # 2 of the 4 MoE layers on each pipeline rank
        # per MoE layer and microbatch: the counts once, the tokens forward and backward, dispatch and combine
        self.assertEqual(recording.counts_calls, 4 * len(shards))
        self.assertEqual(len(recording.tokens_calls), 4 * 4 * len(shards))
        self.assertTrue(all(recording.well_formed))
        with self.assertRaisesRegex(TypeError, "must be an ExpertParallelTransport"):
            hf.set_expert_parallel_transport(dist.all_to_all_single)

    def test_set_labels_on_some_ep_ranks_only_fails_fast(self):
        _, ep_group, _ = self._mesh()
        labels = _global_batch(0)[1][:4]
        loss_fn = hf.CausalLMLoss()
        if self.rank == 0:  # its EP peer, rank 1, never calls set_labels
            with self.assertRaisesRegex(
                RuntimeError,
                r"rank 0: CausalLMLoss.set_labels is a collective .* ranks \[1\] did not call it",
            ):
                loss_fn.set_labels(labels, group=ep_group, timeout=timedelta(seconds=2))
            self.assertIsNone(loss_fn.num_items_in_batch)
        dist.barrier()
        # no collective was left behind: the group works, and the calls of the ranks still pair up
        loss_fn.set_labels(labels, group=ep_group)
        self.assertEqual(
            loss_fn.num_items_in_batch,
            (labels[:, 1:] != -100).sum().item(),  # the same labels on both EP ranks
        )

    def test_expert_parallel_shards_and_local_experts(self):
        torch.set_num_threads(1)
        mesh, _, ep_rank = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=4)
        _, parts = hf.pipeline_hf_causal_lm(ref, mesh, Schedule1F1B, self.device)
        shards = hf.expert_parallel_shards(parts)
        self.assertEqual(len(shards), 2)
        for module, shard in shards:
            self.assertEqual(
                (shard.size, shard.rank, shard.local),
                (2, ep_rank, shard.num_experts // 2),
            )
            self.assertEqual(
                parts[0].expert_ranges[f"{shard.fqn}.gate_up_proj"],
                (shard.start, shard.stop),
            )
            self.assertEqual(module.gate_up_proj.shape[0], shard.local)
        module, shard = shards[0]
        counts = torch.tensor(
            [[1, 0] + [2] * (shard.local - 2), [3, 1] + [0] * (shard.local - 2)]
        )
        tokens = torch.randn(
            int(counts.sum()), module.gate_up_proj.shape[-1], device=self.device
        )
        got = hf.run_local_experts(module, tokens, counts)
        # row by row: rows come grouped by source rank, then local expert
        experts = (
            torch.arange(shard.local).repeat(2).repeat_interleave(counts.flatten())
        )
        for row, e in enumerate(experts.tolist()):
            gate, up = torch.nn.functional.linear(
                tokens[row], module.gate_up_proj[e]
            ).chunk(2, dim=-1)
            want = torch.nn.functional.linear(
                module.act_fn(gate) * up, module.down_proj[e]
            )
            torch.testing.assert_close(got[row], want)

    def test_experts_not_divisible_by_the_group(self):
        mesh, _, _ = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=2, num_experts=3)
        with self.assertRaisesRegex(
            ValueError,
            r"experts cannot be split over an expert-parallel group of 2 ranks",
        ):
            hf.pipeline_hf_causal_lm(ref, mesh, Schedule1F1B, self.device)

    def test_experts_computing_otherwise_are_refused(self):
        from transformers.models.qwen3_moe import modeling_qwen3_moe as q

        class ScaledExperts(q.Qwen3MoeExperts):  # the same parameters, another output
            def forward(self, hidden_states, top_k_index, top_k_weights):
                return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

        mesh, _, _ = self._mesh()
        ref = tiny_hf_model("qwen3_moe", num_layers=2)
        for layer in ref.model.layers:
            experts = ScaledExperts(ref.config)
            experts.load_state_dict(layer.mlp.experts.state_dict())
            layer.mlp.experts = experts
        with self.assertRaisesRegex(
            ValueError,
            r"model.layers.\d.mlp.experts \(ScaledExperts\) cannot be expert-parallel: its forward computes something else",
        ):
            hf.pipeline_hf_causal_lm(ref, mesh, Schedule1F1B, self.device)
        with self.assertRaisesRegex(
            ValueError, "expected exactly gate_up_proj and down_proj"
        ):
            hf.pipeline_hf_causal_lm(
                tiny_hf_model("gpt_oss", num_layers=2), mesh, Schedule1F1B, self.device
            )


HFExpertParallelNCCLTest = unittest.skipIf(
    not HAS_FUSED, "needs transformers 5.x (fused experts)"
)(nccl_variant(HFExpertParallelGlooTest))


def _first_two_experts(router, hidden_states):
    """The router's own forward, with every token sent to experts 0 and 1 (its top-2 weights kept)."""
    logits, weights, indices = type(router).forward(router, hidden_states)
    return (
        logits,
        weights,
        torch.arange(indices.shape[-1], device=indices.device).expand_as(indices),
    )


if __name__ == "__main__":
    run_tests()
