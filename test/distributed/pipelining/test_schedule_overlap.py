# Owner(s): ["oncall: distributed"]
"""Multi-process tests of the concurrent OVERLAP_F_B handler (``torch_pipelining_ext/_overlap.py``).

Four ranks.  With expert parallelism they form PP=2 x EP=2 (pipeline groups
{0, 2} and {1, 3}, expert groups {0, 1} and {2, 3}); without it, two independent
PP=2 pipelines.  The model is the demo's DeepSeek-style MoE transformer
(``torch_pipelining_ext.demo.model``) split into four stages by module name:
stage 0 holds the embeddings and the dense layer (no MoE layer), stages 1-3 one
MoE layer each -- so the overlapped pairs of pipeline rank 0 have 0 and 1 MoE
layers on their two sides.

Every test runs two steps of the overlapped schedule
and checks outputs, losses and every gradient against

* the same schedule with a sequential OVERLAP_F_B function registered (the
  per-schedule opt-out): bitwise equal, since only the timing differs;
* a single-process reference of the same model (all experts local), fed every
  expert-parallel rank's data: equal up to floating-point reassociation.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import unittest

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, ScheduleDualPipeV
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests
from torch.utils.checkpoint import checkpoint

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import _overlap
from torch_pipelining_ext._schedule_runtime import run_action
from torch_pipelining_ext.demo.model import is_expert_param, MoEModelArgs, MoETransformer
from torch_pipelining_ext.stage_split import split_module


PP, EP = 2, 2
N_STAGES = 4
N_MICROBATCHES = 4
MB_SIZE, SEQ_LEN = 2, 8
MODEL_ARGS = MoEModelArgs(
    vocab_size=32, dim=16, n_heads=2, n_dense_layers=1, n_moe_layers=3, n_experts=4, top_k=2, moe_hidden=16, dense_hidden=32
)
STAGE_MODULES = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]

# A compute-only schedule for loop placement (rank 0: stages 0 and 2, rank 1:
# stages 1 and 3): torch's Interleaved1F1B order with each adjacent pair of a
# forward and a backward of different microbatches merged into OVERLAP_F_B --
# on different stages (rank 0) and on one stage (rank 1).
CSV_SCHEDULE = """\
0F0,0F1,2F0,2F1,,,(0F2;2B0)OVERLAP_F_B,(0F3;2B1)OVERLAP_F_B,(2F2;0B0)OVERLAP_F_B,(2F3;0B1)OVERLAP_F_B,,2B2,,2B3,,0B2,,0B3
,1F0,1F1,,3F0,3B0,3F1,3B1,(1F2;1B0)OVERLAP_F_B,(1F3;1B1)OVERLAP_F_B,3F2,3B2,3F3,3B3,,1B2,,1B3
"""


def _loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(step: int, data_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + data_rank)
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (N_MICROBATCHES * MB_SIZE, SEQ_LEN), generator=gen)
    labels = torch.randint(0, MODEL_ARGS.vocab_size, (N_MICROBATCHES * MB_SIZE, SEQ_LEN), generator=gen)
    return tokens.to(device), labels.to(device)


def _build_model(ep_group: dist.ProcessGroup | None, device: torch.device) -> MoETransformer:
    torch.manual_seed(0)
    with torch.device(device):
        return MoETransformer(MODEL_ARGS, ep_group=ep_group)


def _sequential_overlap_f_b(action: sched._Action, ctx: sched._PipelineContext) -> None:
    """OVERLAP_F_B as upstream runs it: one sub-action after the other."""
    for sub in action.sub_actions:
        run_action(ctx, sub)


def _selective_ac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _apply_ac(part: torch.nn.Module, mode: str) -> None:
    """Checkpoint every transformer block of a stage (non-reentrant; selective with ``mode="selective"``)."""
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_ac_context
    for block in part.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, **kwargs)


class _Pipeline:
    """This rank's stages of the 4-stage pipeline and their schedule."""

    def __init__(
        self,
        schedule: str,
        pp_group: dist.ProcessGroup,
        ep_group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        overlap: bool,
        ac: str = "",
        csv_path: str | None = None,
    ) -> None:
        pp_rank = dist.get_rank(pp_group)
        if schedule == "dualpipev":
            self.stage_ids = [pp_rank, N_STAGES - 1 - pp_rank]
        else:
            self.stage_ids = [pp_rank, pp_rank + PP]
        model = _build_model(ep_group, device)
        self.parts = [split_module(model, STAGE_MODULES[i]) for i in self.stage_ids]
        if ac:
            for part in self.parts:
                _apply_ac(part, ac)
        stages = [PipelineStage(part, i, N_STAGES, device, group=pp_group) for part, i in zip(self.parts, self.stage_ids)]
        if schedule == "dualpipev":
            self.schedule = ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=_loss_fn)
        else:
            self.schedule = _PipelineScheduleRuntime(stages, N_MICROBATCHES, loss_fn=_loss_fn)
            self.schedule._load_csv(csv_path)
        if not overlap:
            self.schedule.register_custom_function(sched.OVERLAP_F_B, _sequential_overlap_f_b)
        self.n_overlap = sum(
            a.computation_type == sched.OVERLAP_F_B for a in self.schedule.pipeline_order_with_comms[pp_rank]
        )
        # Which threads ran the backward sub-actions.
        self.backward_threads: list[str] = []
        for stage in stages:
            original = stage.backward_one_chunk

            def spy(*args, _original=original, **kwargs):
                self.backward_threads.append(threading.current_thread().name)
                return _original(*args, **kwargs)

            stage.backward_one_chunk = spy

    def step(self, step: int, data_rank: int, device: torch.device) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        tokens, labels = _batch(step, data_rank, device)
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses}
        out = self.schedule.step(tokens, **kwargs) if 0 in self.stage_ids else self.schedule.step(**kwargs)
        return (out if N_STAGES - 1 in self.stage_ids else None), losses

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for part in self.parts for n, p in part.named_parameters()}

    def worker_backwards(self) -> int:
        return sum(name.startswith("OVERLAP_F_B backward") for name in self.backward_threads)


class _Reference:
    """The unsplit model with all experts, trained on the data of ``data_ranks`` like the pipeline."""

    def __init__(self, device: torch.device, data_ranks: list[int]) -> None:
        self.model = _build_model(None, device)
        self.data_ranks = data_ranks

    def step(self, step: int, device: torch.device) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
        results = {}
        for r in self.data_ranks:
            tokens, labels = _batch(step, r, device)
            outs, losses = [], []
            for x, y in zip(tokens.chunk(N_MICROBATCHES), labels.chunk(N_MICROBATCHES)):
                out = self.model(x)
                loss = _loss_fn(out, y)
                (loss / N_MICROBATCHES).backward()  # the schedules scale gradients by the microbatch count
                outs.append(out.detach())
                losses.append(loss.detach())
            results[r] = (torch.cat(outs), losses)
        return results


class ScheduleOverlapTest(MultiProcContinuousTest):
    world_size = PP * EP

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @classmethod
    def device_type(cls) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def _exact(self) -> dict[str, float]:
        """Overlapped vs sequential: bitwise on CPU (only the timing differs); CUDA's
        index_add accumulates duplicate indices in no fixed order."""
        return {"rtol": 0.0, "atol": 0.0} if self.device.type == "cpu" else {}

    def _groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(this rank's PP group, this rank's EP group); every rank creates all four, in one order."""
        cls = type(self)
        if not hasattr(cls, "_pp_ep_groups"):
            pp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            cls._pp_ep_groups = (pp, ep)
        pp, ep = cls._pp_ep_groups
        return pp[self.rank % EP], ep[self.rank // EP]

    def _csv_path(self) -> str:
        path = os.path.join(tempfile.gettempdir(), f"overlap_csv_{os.getpid()}.csv")
        with open(path, "w") as f:
            f.write(CSV_SCHEDULE)
        return path

    def _check(self, schedule: str, use_ep: bool, ac: str = "") -> None:
        # (in the rank's process: MultiProcContinuousTest does not run setUp there)
        torch.set_num_threads(1)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.rank)
        pp_group, ep_group = self._groups()
        ep_group = ep_group if use_ep else None
        ep_rank = self.rank % EP  # this rank's data; with EP also its expert shard
        csv_path = self._csv_path() if schedule == "csv" else None
        overlapped = _Pipeline(schedule, pp_group, ep_group, self.device, overlap=True, ac=ac, csv_path=csv_path)
        with self.assertNoLogs(level="WARNING"):  # replacing the package's OVERLAP_F_B function is quiet
            sequential = _Pipeline(schedule, pp_group, ep_group, self.device, overlap=False, ac=ac, csv_path=csv_path)
        self.assertIs(overlapped.schedule._comp_type_to_function_map[sched.OVERLAP_F_B], _overlap.overlap_f_b)
        self.assertGreater(overlapped.n_overlap, 0)
        reference = _Reference(self.device, data_ranks=list(range(EP)) if use_ep else [ep_rank])

        for step in range(2):
            for model in (*overlapped.parts, *sequential.parts, reference.model):
                model.zero_grad(set_to_none=True)
            out, losses = overlapped.step(step, ep_rank, self.device)
            seq_out, seq_losses = sequential.step(step, ep_rank, self.device)
            ref_out, ref_losses = reference.step(step, self.device)[ep_rank]
            # the backward sub-actions of OVERLAP_F_B ran on the worker thread
            self.assertEqual(overlapped.worker_backwards(), (step + 1) * overlapped.n_overlap)
            self.assertEqual(sequential.worker_backwards(), 0)
            # the backward thread does not outlive the step
            self.assertEqual([t.name for t in threading.enumerate() if t.name.startswith("OVERLAP_F_B")], [])
            if out is not None:
                torch.testing.assert_close(out, seq_out, **self._exact)
                torch.testing.assert_close(losses, seq_losses, **self._exact)
                torch.testing.assert_close(out, ref_out)
                torch.testing.assert_close(losses, ref_losses)
            self._check_gradients(overlapped, sequential, reference, ep_group)

    def _check_gradients(
        self, overlapped: _Pipeline, sequential: _Pipeline, reference: _Reference, ep_group: dist.ProcessGroup | None
    ) -> None:
        ref_params = dict(reference.model.named_parameters())
        seq_params = sequential.named_parameters()
        params = overlapped.named_parameters()
        self.assertEqual(params.keys(), seq_params.keys())
        for name, p in params.items():
            self.assertIsNotNone(p.grad, f"{name}: no gradient")
            torch.testing.assert_close(p.grad, seq_params[name].grad, **self._exact, msg=lambda m: f"{name}: {m}")
            grad, ref_grad = p.grad, ref_params[name].grad
            if ep_group is not None:
                if is_expert_param(name):
                    # this rank's experts; their gradient already sums every EP rank's tokens
                    n_local = MODEL_ARGS.n_experts // EP
                    ep_rank = dist.get_rank(ep_group)
                    ref_grad = ref_grad[ep_rank * n_local : (ep_rank + 1) * n_local]
                else:
                    # replicated over the EP group, each rank saw its own data
                    grad = grad.clone()
                    dist.all_reduce(grad, group=ep_group)
            torch.testing.assert_close(grad, ref_grad, msg=lambda m: f"{name} vs reference: {m}")

    def test_dualpipev_pp2_ep2(self) -> None:
        self._check("dualpipev", use_ep=True)

    @parametrize("schedule", ["dualpipev", "csv"])
    def test_pp2_without_ep(self, schedule: str) -> None:
        self._check(schedule, use_ep=False)

    def test_dualpipev_pp2_ep2_activation_checkpointing(self) -> None:
        self._check("dualpipev", use_ep=True, ac="full")

    @unittest.skipIf(
        not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"),
        "selective activation checkpointing needs a newer torch",
    )
    def test_csv_pp2_ep2_selective_activation_checkpointing(self) -> None:
        # torch allows one backward per selectively checkpointed region, so not
        # with DualPipeV's split (input, then weight) backward: the CSV schedule
        # has full backwards only.
        self._check("csv", use_ep=True, ac="selective")


@unittest.skipIf(
    not (dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= PP * EP),
    f"NCCL variants need {PP * EP} GPUs",
)
class ScheduleOverlapNCCLTest(ScheduleOverlapTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @classmethod
    def device_type(cls) -> str:
        return "cuda"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank)


instantiate_parametrized_tests(ScheduleOverlapTest)


if __name__ == "__main__":
    run_tests()
