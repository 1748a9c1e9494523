# Owner(s): ["oncall: distributed"]
"""Pipeline schedules with every stage on one rank (world size 1), on CPU and on one GPU.

The variants of the multi-process tests that fit on a single device, in this
process: a one-rank process group (gloo; ``cpu:gloo,cuda:nccl`` when a GPU
exists, so CUDA tensors go through NCCL with world size 1).
``tools/gpu_check.sh`` runs this module on a GPU machine.

* Every multi-stage schedule with all its stages on rank 0 (the V of
  ``ScheduleDualPipeV`` / ``ScheduleZBVZeroBubble``, the loop of the
  interleaved ones) and the single-stage ones: outputs, losses and every
  gradient equal to a single-process reference, over two steps that
  accumulate gradients.
* ``ScheduleDualPipeV`` with the package's OVERLAP_F_B: on an MLP, bitwise
  equal to a sequential OVERLAP_F_B (on CUDA when cuBLAS is deterministic,
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``); with the MoE model of ``model_registry`` and an
  expert-parallel group of size 1 (``all_to_all_single`` and the
  ``overlap`` marks in both threads), equal to the sequential run and the
  reference.  Every OVERLAP_F_B of the MoE model runs concurrently; a stage
  pair of the MLP (no marks) runs concurrently once per step and then, on
  CPU, sequentially (on CUDA it stays concurrent: the device may overlap it).
* FSDP2 on a one-rank mesh with the V schedules (split backward included):
  gradients equal to the reference, every parameter resharded after the step.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import unittest
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from common_pipelining import (
    mse_loss,
    nccl_decorators,
    random_batch,
    random_tokens,
    reference_step,
    token_cross_entropy,
)
from model_registry import (
    FSDPMLPStage,
    fully_shard_stage,
    MLPStage,
    MoEModelArgs,
    MoETransformer,
)
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext.overlap import _handler as _overlap
from torch_pipelining_ext.overlap._install import default_overlap_f_b
from torch_pipelining_ext._schedule_runtime import sequential_overlap_f_b
from torch_pipelining_ext.stage_split import build_stage_module


DIM = 16
N_MICROBATCHES = 4
MB_SIZE = 2
HAS_CUDA = torch.cuda.is_available() and dist.is_nccl_available()
DEVICES = ["cpu", subtest("cuda", decorators=nccl_decorators(1))]
MULTI_STAGE = (
    sched.ScheduleDualPipeV,
    sched.ScheduleZBVZeroBubble,
    sched.ScheduleInterleaved1F1B,
    sched.ScheduleInterleavedZeroBubble,
    sched.ScheduleLoopedBFS,
)
SINGLE_STAGE = (sched.ScheduleGPipe, sched.Schedule1F1B)
CUBLAS_DETERMINISTIC = os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
_NEEDS_FINALIZE = unittest.skipUnless(
    "finalize_gradients"
    in inspect.signature(sched.PipelineScheduleSingle.step).parameters,
    "step(finalize_gradients=...) needs torch 2.15+",
)

MOE_ARGS = MoEModelArgs(
    vocab_size=32,
    dim=16,
    n_heads=2,
    n_dense_layers=1,
    n_moe_layers=3,
    n_experts=4,
    top_k=2,
    moe_hidden=16,
    dense_hidden=32,
)
MOE_STAGES = [
    ["tok_embeddings", "layers.0", "layers.1"],
    ["layers.2", "layers.3", "norm", "output"],
]
SEQ_LEN = 8


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = random_batch(100 + step, N_MICROBATCHES * MB_SIZE, DIM)
    return x.to(device), y.to(device)


def _tokens(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = random_tokens(
        300 + step, N_MICROBATCHES * MB_SIZE, SEQ_LEN, MOE_ARGS.vocab_size
    )
    return tokens.to(device), labels.to(device)


def _build(
    schedule_class: type, parts: list[nn.Module], device: torch.device, loss_fn
) -> sched._PipelineSchedule:
    n = len(parts)
    stages = [PipelineStage(part, i, n, device) for i, part in enumerate(parts)]
    if issubclass(schedule_class, sched.PipelineScheduleSingle):
        return schedule_class(stages[0], N_MICROBATCHES, loss_fn=loss_fn)
    return schedule_class(stages, N_MICROBATCHES, loss_fn=loss_fn)


@contextlib.contextmanager
def _counting_concurrent_runs() -> Iterator[list[int]]:
    """Counts the OVERLAP_F_B actions run concurrently (by ``_overlap._run_overlapped``) while open."""
    count = [0]
    original = _overlap._run_overlapped

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    with mock.patch.object(_overlap, "_run_overlapped", counted):
        yield count


def _overlap_pairs(schedule: sched._PipelineSchedule) -> list[tuple[int, int]]:
    """(forward stage, backward stage) of every OVERLAP_F_B action of rank 0, in order."""
    pairs = []
    for action in schedule.pipeline_order_with_comms[0]:
        if action is not None and action.computation_type == sched.OVERLAP_F_B:
            fwd = next(
                a for a in action.sub_actions if a.computation_type == sched.FORWARD
            )
            bwd = next(
                a for a in action.sub_actions if a.computation_type != sched.FORWARD
            )
            pairs.append((fwd.stage_index, bwd.stage_index))
    return pairs


class _OneRankTestCase(TestCase):
    """Owns a one-rank default process group for the class (unless one exists already)."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._owns_pg = not dist.is_initialized()
        if cls._owns_pg:
            backend = "cpu:gloo,cuda:nccl" if HAS_CUDA else "gloo"
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1
            )
        elif dist.get_world_size() != 1:
            raise unittest.SkipTest(
                f"a process group of {dist.get_world_size()} ranks exists in this process"
            )

    @classmethod
    def tearDownClass(cls) -> None:
        if cls._owns_pg:
            dist.destroy_process_group()
        super().tearDownClass()

    def _device(self, device: str) -> torch.device:
        if device == "cuda":
            if not HAS_CUDA:
                self.skipTest("needs a CUDA device and NCCL")
            torch.cuda.set_device(0)
            return torch.device("cuda", 0)
        torch.set_num_threads(1)
        return torch.device("cpu")

    def _exact(self, device: torch.device) -> dict[str, float]:
        """Overlapped vs sequential tolerances: bitwise where the kernels are deterministic."""
        if device.type == "cpu" or CUBLAS_DETERMINISTIC:
            return {"rtol": 0.0, "atol": 0.0}
        return {}


class ScheduleSingleRankTest(_OneRankTestCase):
    @parametrize("device", DEVICES)
    @parametrize("schedule_class", MULTI_STAGE + SINGLE_STAGE)
    def test_schedule_matches_reference(
        self, schedule_class: type, device: str
    ) -> None:
        dev = self._device(device)
        n_stages = 1 if issubclass(schedule_class, sched.PipelineScheduleSingle) else 2
        torch.manual_seed(0)
        reference = nn.Sequential(*(MLPStage(DIM) for _ in range(n_stages))).to(dev)
        parts = [copy.deepcopy(m) for m in reference]
        schedule = _build(schedule_class, parts, dev, mse_loss)
        for step in range(2):  # no zero_grad: the second step accumulates
            x, y = _batch(step, dev)
            losses: list[torch.Tensor] = []
            out = schedule.step(x, target=y, losses=losses)
            ref_out, ref_losses = reference_step(
                reference, mse_loss, x, y, N_MICROBATCHES
            )
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(losses, ref_losses)
            for i, (part, ref) in enumerate(zip(parts, reference)):
                for (name, p), ref_p in zip(part.named_parameters(), ref.parameters()):
                    self.assertIsNotNone(
                        p.grad, f"step {step} stage {i} {name}: no gradient"
                    )
                    torch.testing.assert_close(
                        p.grad,
                        ref_p.grad,
                        msg=lambda m: f"step {step} stage {i} {name}: {m}",
                    )

    def test_overlap_switch_read_when_the_schedule_is_built(self) -> None:
        # TORCH_PIPELINING_EXT_OVERLAP=0 while a schedule is built makes that
        # schedule's OVERLAP_F_B sequential for its whole life, whatever the
        # variable says at its steps (torch 2.9 made the map at the first step)
        from torch_pipelining_ext import _schedule_runtime
        from torch_pipelining_ext.overlap import _install

        dev = self._device("cpu")
        torch.manual_seed(0)
        reference = nn.Sequential(MLPStage(DIM), MLPStage(DIM))
        with mock.patch.dict(os.environ, {_install.OVERLAP_ENV: "0"}):
            sequential = _build(
                sched.ScheduleDualPipeV,
                [copy.deepcopy(m) for m in reference],
                dev,
                mse_loss,
            )
        overlapped = _build(
            sched.ScheduleDualPipeV,
            [copy.deepcopy(m) for m in reference],
            dev,
            mse_loss,
        )
        for step in range(2):
            x, y = _batch(step, dev)
            outputs = [s.step(x, target=y) for s in (sequential, overlapped)]
            torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
        functions = [
            s._comp_type_to_function_map[sched.OVERLAP_F_B]
            for s in (sequential, overlapped)
        ]
        self.assertIs(functions[0], _schedule_runtime.sequential_overlap_f_b)
        self.assertIs(functions[1], _install.default_overlap_f_b)

    @parametrize("device", DEVICES)
    @parametrize("schedule_class", MULTI_STAGE + SINGLE_STAGE)
    def test_eval_between_steps(self, schedule_class: type, device: str) -> None:
        # eval() runs step() without backward: the model's outputs and losses,
        # the gradients left as they are.  Stock single-stage schedules still
        # divide the gradients by the microbatch count at its end; stock
        # multi-stage schedules with two adjacent stages on one rank (here,
        # every one; in a multi-rank job, the V schedules' last rank) raise
        # "can't steal_bwd_input if this stage doesn't have backward".
        dev = self._device(device)
        n_stages = 1 if issubclass(schedule_class, sched.PipelineScheduleSingle) else 2
        torch.manual_seed(0)
        reference = nn.Sequential(*(MLPStage(DIM) for _ in range(n_stages))).to(dev)
        parts = [copy.deepcopy(m) for m in reference]
        schedule = _build(schedule_class, parts, dev, mse_loss)
        for step in range(2):  # no zero_grad: the second step accumulates
            x, y = _batch(step, dev)
            schedule.step(x, target=y)
            losses: list[torch.Tensor] = []
            output = schedule.eval(x, target=y, losses=losses)
            reference_step(reference, mse_loss, x, y, N_MICROBATCHES)
            with torch.no_grad():
                expected = reference(x)
                expected_losses = [
                    mse_loss(out, target)
                    for out, target in zip(
                        expected.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)
                    )
                ]
            torch.testing.assert_close(output, expected)
            self.assertEqual(len(losses), N_MICROBATCHES)
            for got, want in zip(losses, expected_losses):
                torch.testing.assert_close(got, want)
            for i, (part, ref) in enumerate(zip(parts, reference)):
                for (name, p), ref_p in zip(part.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(
                        p.grad,
                        ref_p.grad,
                        msg=lambda m: f"step {step} stage {i} {name}: {m}",
                    )

    @parametrize("dtype", [torch.float32, torch.float16])
    @parametrize("schedule_class", [sched.ScheduleGPipe, sched.ScheduleInterleaved1F1B])
    def test_carried_gradients_are_added_to(
        self, schedule_class: type, dtype: torch.dtype
    ) -> None:
        # A step adds its gradients -- what it computes after zero_grad() -- to
        # the carried ones, without rescaling them (stock torch divides them by
        # the 3 microbatches again; multiplying them by 3 first would overflow
        # float16 at 6e4).  Up to rounding: autograd adds each microbatch's
        # gradient to the carried one in turn (see [Note: scale_grads scales
        # the loss]).
        dev = self._device("cpu")
        n_stages = 1 if issubclass(schedule_class, sched.PipelineScheduleSingle) else 2
        torch.manual_seed(0)
        model = nn.Sequential(*(MLPStage(DIM) for _ in range(n_stages))).to(dtype)
        runs = {}
        for name in ("carried", "fresh"):
            parts = [copy.deepcopy(m) for m in model]
            stages = [PipelineStage(p, i, n_stages, dev) for i, p in enumerate(parts)]
            first = stages[0] if n_stages == 1 else stages
            runs[name] = (schedule_class(first, 3, loss_fn=mse_loss), parts)
        gen = torch.Generator().manual_seed(1)
        carried = {}
        for part in runs["carried"][1]:
            for p in part.parameters():
                p.grad = (torch.rand(p.shape, generator=gen) * 6e4).to(dtype)
                carried[p] = p.grad.clone()
        x, y = (t.to(dtype) for t in _batch(0, dev))
        x, y = x[:6], y[:6]
        for schedule, _ in runs.values():
            schedule.step(x, target=y)
        for a, b in zip(runs["carried"][1], runs["fresh"][1]):
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                self.assertTrue(torch.isfinite(p.grad).all(), name)
                torch.testing.assert_close(
                    p.grad, carried[p] + q.grad, msg=lambda m: f"{name}: {m}"
                )

    @parametrize("device", DEVICES)
    def test_dualpipev_overlap_bitwise_equal_to_sequential(self, device: str) -> None:
        dev = self._device(device)
        torch.manual_seed(0)
        parts = [MLPStage(DIM, n_layers=3).to(dev) for _ in range(2)]
        runs = {}
        for mode in ("overlap", "sequential"):
            mode_parts = [copy.deepcopy(p) for p in parts]
            schedule = _build(sched.ScheduleDualPipeV, mode_parts, dev, mse_loss)
            if mode == "sequential":
                schedule.register_custom_function(
                    sched.OVERLAP_F_B, sequential_overlap_f_b
                )
            else:
                self.assertIs(
                    schedule._comp_type_to_function_map[sched.OVERLAP_F_B],
                    default_overlap_f_b,
                )
            runs[mode] = (schedule, mode_parts)
        pairs = _overlap_pairs(runs["overlap"][0])
        self.assertGreater(
            len(pairs), len(set(pairs))
        )  # some pair comes back within a step
        # No marks: on CPU each stage pair runs concurrently once per step, then sequentially.
        expected_concurrent = len(set(pairs)) if dev.type == "cpu" else len(pairs)
        for step in range(2):
            x, y = _batch(step, dev)
            results = {}
            for mode, (schedule, _) in runs.items():
                losses: list[torch.Tensor] = []
                with _counting_concurrent_runs() as concurrent:
                    out = schedule.step(x, target=y, losses=losses)
                self.assertEqual(
                    concurrent[0],
                    expected_concurrent if mode == "overlap" else 0,
                    f"{mode}, step {step}",
                )
                results[mode] = (out, losses)
            exact = self._exact(dev)
            torch.testing.assert_close(
                results["overlap"], results["sequential"], **exact
            )
            for a, b in zip(runs["overlap"][1], runs["sequential"][1]):
                for (name, p), q in zip(a.named_parameters(), b.parameters()):
                    torch.testing.assert_close(
                        p.grad,
                        q.grad,
                        **exact,
                        msg=lambda m: f"step {step} {name}: {m}",
                    )

    @parametrize("device", DEVICES)
    def test_dualpipev_moe_with_one_rank_expert_group(self, device: str) -> None:
        dev = self._device(device)
        ep_group = dist.group.WORLD  # one rank: the all-to-alls run, sending to itself
        torch.manual_seed(0)
        model = MoETransformer(MOE_ARGS, ep_group=ep_group)
        torch.manual_seed(0)
        reference = MoETransformer(MOE_ARGS).to(dev)
        runs = {}
        for mode in ("overlap", "sequential"):
            parts = [build_stage_module(model, names).to(dev) for names in MOE_STAGES]
            schedule = _build(sched.ScheduleDualPipeV, parts, dev, token_cross_entropy)
            if mode == "sequential":
                schedule.register_custom_function(
                    sched.OVERLAP_F_B, sequential_overlap_f_b
                )
            runs[mode] = (schedule, parts)
        for step in range(2):
            tokens, labels = _tokens(step, dev)
            results = {}
            for mode, (schedule, parts) in runs.items():
                for part in parts:
                    part.zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                with _counting_concurrent_runs() as concurrent:
                    out = schedule.step(tokens, target=labels, losses=losses)
                # marks in both stages: every OVERLAP_F_B runs concurrently
                expected = len(_overlap_pairs(schedule)) if mode == "overlap" else 0
                self.assertEqual(concurrent[0], expected, f"{mode}, step {step}")
                results[mode] = (out, losses)
            reference.zero_grad(set_to_none=True)
            ref_out, ref_losses = reference_step(
                reference, token_cross_entropy, tokens, labels, N_MICROBATCHES
            )
            # CUDA's index_add accumulates duplicate indices in no fixed order
            exact = {"rtol": 0.0, "atol": 0.0} if dev.type == "cpu" else {}
            torch.testing.assert_close(
                results["overlap"], results["sequential"], **exact
            )
            torch.testing.assert_close(results["overlap"], (ref_out, ref_losses))
            ref_params = dict(reference.named_parameters())
            seq_params = {
                n: p
                for part in runs["sequential"][1]
                for n, p in part.named_parameters()
            }
            for part in runs["overlap"][1]:
                for name, p in part.named_parameters():
                    self.assertIsNotNone(p.grad, f"{name}: no gradient")
                    torch.testing.assert_close(
                        p.grad,
                        seq_params[name].grad,
                        **exact,
                        msg=lambda m: f"{name}: {m}",
                    )
                    torch.testing.assert_close(
                        p.grad,
                        ref_params[name].grad,
                        msg=lambda m: f"{name} vs reference: {m}",
                    )


class ScheduleFSDPSingleRankTest(_OneRankTestCase):
    @parametrize("device", DEVICES)
    @parametrize(
        "schedule_class", [sched.ScheduleDualPipeV, sched.ScheduleZBVZeroBubble]
    )
    def test_fsdp_one_rank_mesh(self, schedule_class: type, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        dev = self._device(device)
        mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        reference = nn.Sequential(*(FSDPMLPStage(DIM) for _ in range(2))).to(dev)
        parts = [fully_shard_stage(copy.deepcopy(m), mesh) for m in reference]
        schedule = _build(schedule_class, parts, dev, mse_loss)
        for step in range(2):  # no zero_grad: the second step accumulates
            x, y = _batch(step, dev)
            losses: list[torch.Tensor] = []
            out = schedule.step(x, target=y, losses=losses)
            ref_out, ref_losses = reference_step(
                reference, mse_loss, x, y, N_MICROBATCHES
            )
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(losses, ref_losses)
            for i, (part, ref) in enumerate(zip(parts, reference)):
                for (name, p), ref_p in zip(part.named_parameters(), ref.parameters()):
                    self.assertIsInstance(
                        p, DTensor, f"stage {i} {name}: not resharded after the step"
                    )
                    self.assertIsInstance(
                        p.grad,
                        DTensor,
                        f"step {step} stage {i} {name}: no reduced gradient",
                    )
                    torch.testing.assert_close(
                        p.grad.full_tensor(),
                        ref_p.grad,
                        msg=lambda m: f"step {step} stage {i} {name}: {m}",
                    )
                self.assertTrue(
                    all(isinstance(m, FSDPModule) for m in (part, *part.layers))
                )

    @parametrize(
        "sequence",
        [
            ("step", "eval", "step"),
            subtest(("defer", "step"), decorators=[_NEEDS_FINALIZE]),
            subtest(("defer", "eval", "step"), decorators=[_NEEDS_FINALIZE]),
            subtest(("step", "defer", "eval", "step"), decorators=[_NEEDS_FINALIZE]),
        ],
    )
    @parametrize("schedule_class", [sched.Schedule1F1B, sched.ScheduleInterleaved1F1B])
    def test_fsdp_gradients_across_steps_and_eval(
        self, schedule_class: type, sequence: tuple[str, ...]
    ) -> None:
        # Steps without zero_grad() add up; eval() leaves the gradients alone;
        # step(finalize_gradients=False) ("defer") defers FSDP's reduction to the
        # next finalizing step, which adds what every deferred step computed.
        # eval() between a deferring and a finalizing step neither ends nor
        # restarts the deferral: the finalizing step adds each gradient once.
        from torch.distributed.device_mesh import init_device_mesh

        dev = self._device("cpu")
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        n_stages = 1 if issubclass(schedule_class, sched.PipelineScheduleSingle) else 2
        torch.manual_seed(0)
        reference = nn.Sequential(*(FSDPMLPStage(DIM) for _ in range(n_stages)))
        parts = [fully_shard_stage(copy.deepcopy(m), mesh) for m in reference]
        schedule = _build(schedule_class, parts, dev, mse_loss)
        for step, op in enumerate(sequence):
            x, y = _batch(step, dev)
            if op == "eval":
                schedule.eval(x, target=y)
                continue
            schedule.step(
                x, target=y, **({"finalize_gradients": False} if op == "defer" else {})
            )
            reference_step(reference, mse_loss, x, y, N_MICROBATCHES)
            if op == "defer":
                continue  # .grad is final once a step finalizes the reduction
            for i, (part, ref) in enumerate(zip(parts, reference)):
                for (name, p), ref_p in zip(part.named_parameters(), ref.parameters()):
                    self.assertIsNotNone(p.grad, f"step {step} stage {i} {name}")
                    torch.testing.assert_close(
                        p.grad.full_tensor(),
                        ref_p.grad,
                        msg=lambda m: f"step {step} ({op}) stage {i} {name}: {m}",
                    )


instantiate_parametrized_tests(ScheduleSingleRankTest)
instantiate_parametrized_tests(ScheduleFSDPSingleRankTest)


if __name__ == "__main__":
    run_tests()
