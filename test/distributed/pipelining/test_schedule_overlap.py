# Owner(s): ["oncall: distributed"]
"""Multi-process tests of the concurrent OVERLAP_F_B handler (``torch_pipelining_ext/_overlap.py``).

Four ranks.  With expert parallelism they form PP=2 x EP=2 (pipeline groups
{0, 2} and {1, 3}, expert groups {0, 1} and {2, 3}); without it, two independent
PP=2 pipelines.  The model is a small DeepSeek-style MoE transformer
(``model_registry.MoETransformer``) split into four stages by module name:
stage 0 holds the embeddings and the dense layer (no MoE layer), stages 1-3 one
MoE layer each -- so the overlapped pairs of pipeline rank 0 have 0 and 1 MoE
layers on their two sides.

Every test runs two steps of the overlapped schedule, with an optimizer step
between them, and checks outputs, losses and every gradient against

* the same schedule with a sequential OVERLAP_F_B function registered (the
  per-schedule opt-out): bitwise equal, since only the timing differs;
* a single-process reference of the same model (all experts local), fed every
  expert-parallel rank's data: equal up to floating-point reassociation.  Not
  with random ops: the reference runs the microbatches in another order, so it
  draws other random numbers.

The compositions: dropout and random noise on/off x activation checkpointing
none/full/selective x expert parallelism (marks) on/off x ScheduleDualPipeV and
a CSV schedule with a same-stage pair; and FSDP2 (PP=2 x DP=2, nested
``fully_shard``) with random delays, where the data-parallel collectives each
rank issues are recorded and must not depend on timing; and a delayed gradient
receive (each overlapped backward's gradients arrive only once its forward has
started), still bitwise the sequential handler's.  The suite runs a
covering subset; ``TORCH_PIPELINING_EXT_FULL_MATRIX=1`` runs every composition
(``tools/overlap_compositions.py``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import threading
import time
import unittest
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime,
    ScheduleDualPipeV,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils.checkpoint import checkpoint

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext.overlap._install import default_overlap_f_b
from torch_pipelining_ext._schedule_runtime import sequential_overlap_f_b
from torch_pipelining_ext.stage_split import build_stage_module

from common_pipelining import (
    check_on_all_ranks,
    load_csv,
    mse_loss,
    nccl_variant,
    PipelineMultiProcTest,
    random_batch,
    random_tokens,
    token_cross_entropy,
)
from model_registry import (
    FSDPMLPStage,
    fully_shard_stage,
    is_expert_param,
    MoEModelArgs,
    MoETransformer,
)


PP, EP = 2, 2
N_STAGES = 4
N_MICROBATCHES = 4
MB_SIZE, SEQ_LEN = 2, 8
MODEL_ARGS = MoEModelArgs(
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
STAGE_MODULES = [
    ["tok_embeddings", "layers.0"],
    ["layers.1"],
    ["layers.2"],
    ["layers.3", "norm", "output"],
]

# A compute-only schedule for loop placement (rank 0: stages 0 and 2, rank 1:
# stages 1 and 3): torch's Interleaved1F1B order with each adjacent pair of a
# forward and a backward of different microbatches merged into OVERLAP_F_B --
# on different stages (rank 0) and on one stage (rank 1).
CSV_SCHEDULE = """\
0F0,0F1,2F0,2F1,,,(0F2;2B0)OVERLAP_F_B,(0F3;2B1)OVERLAP_F_B,(2F2;0B0)OVERLAP_F_B,(2F3;0B1)OVERLAP_F_B,,2B2,,2B3,,0B2,,0B3
,1F0,1F1,,3F0,3B0,3F1,3B1,(1F2;1B0)OVERLAP_F_B,(1F3;1B1)OVERLAP_F_B,3F2,3B2,3F3,3B3,,1B2,,1B3
"""


def _batch(
    step: int, data_rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = random_tokens(
        1000 * step + data_rank,
        N_MICROBATCHES * MB_SIZE,
        SEQ_LEN,
        MODEL_ARGS.vocab_size,
    )
    return tokens.to(device), labels.to(device)


def _build_model(
    ep_group: dist.ProcessGroup | None, device: torch.device
) -> MoETransformer:
    torch.manual_seed(0)
    with torch.device(device):
        return MoETransformer(MODEL_ARGS, ep_group=ep_group)


def _with_random_ops(forward):
    """``forward`` with the random ops of a training model around it: input noise, dropout."""

    def random_forward(x: torch.Tensor) -> torch.Tensor:
        x = x + 1e-3 * torch.randn_like(x)
        return F.dropout(forward(x), p=0.2, training=True)

    return random_forward


def _random_delay(*args) -> None:
    time.sleep(random.uniform(0, 0.002))


class _Delay(torch.autograd.Function):
    """Identity that sleeps a random 0-2 ms in forward and in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        _random_delay()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _random_delay()
        return grad


def _marked_delay(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for expert-parallel communication: a random delay between dispatch marks."""
    from torch_pipelining_ext import overlap

    return overlap.dispatch_end(_Delay.apply(overlap.dispatch_begin(x)))


FULL_MATRIX = os.environ.get("TORCH_PIPELINING_EXT_FULL_MATRIX", "0") == "1"


def _compositions() -> list[tuple[str, bool, bool, str]]:
    """(schedule, expert parallelism, random ops, activation checkpointing) to test."""
    if FULL_MATRIX:
        every = itertools.product(
            ["dualpipev", "csv"],
            [True, False],
            [True, False],
            ["", "full", "selective"],
        )
        # torch allows one backward per selectively checkpointed region, so not
        # DualPipeV's split (input, then weight) backward.
        return [c for c in every if not (c[0] == "dualpipev" and c[3] == "selective")]
    return [
        ("dualpipev", True, False, ""),
        ("dualpipev", False, False, ""),  # no marks: the unmarked-pair rule
        # dropout + AC: the recomputation draws on the backward thread
        ("dualpipev", True, True, "full"),
        ("csv", True, True, "selective"),
        ("csv", False, True, ""),  # rank 1's same-stage pair
    ]


def _composition_name(c: tuple[str, bool, bool, str]) -> str:
    schedule, ep, random_ops, ac = c
    return f"{schedule}_{'ep' if ep else 'noep'}_{'random' if random_ops else 'norandom'}_{ac or 'noac'}"


def _selective_ac_context():
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op in save
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

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
        random_ops: bool = False,
    ) -> None:
        pp_rank = dist.get_rank(pp_group)
        if schedule == "dualpipev":
            self.stage_ids = [pp_rank, N_STAGES - 1 - pp_rank]
        else:
            self.stage_ids = [pp_rank, pp_rank + PP]
        model = _build_model(ep_group, device)
        self.parts = [
            build_stage_module(model, STAGE_MODULES[i]) for i in self.stage_ids
        ]
        for part in self.parts:
            if random_ops:
                for block in part.layers.values():
                    block.forward = _with_random_ops(block.forward)
            if ac:
                _apply_ac(part, ac)
        stages = [
            PipelineStage(part, i, N_STAGES, device, group=pp_group)
            for part, i in zip(self.parts, self.stage_ids)
        ]
        if schedule == "dualpipev":
            self.schedule = ScheduleDualPipeV(
                stages, N_MICROBATCHES, loss_fn=token_cross_entropy
            )
        else:
            self.schedule = _PipelineScheduleRuntime(
                stages, N_MICROBATCHES, loss_fn=token_cross_entropy
            )
            load_csv(self.schedule, CSV_SCHEDULE)
        if not overlap:
            self.schedule.register_custom_function(
                sched.OVERLAP_F_B, sequential_overlap_f_b
            )
        self.n_overlap = sum(
            a.computation_type == sched.OVERLAP_F_B
            for a in self.schedule.pipeline_order_with_comms[pp_rank]
        )
        # Which threads ran the backward sub-actions.
        self.backward_threads: list[str] = []
        for stage in stages:
            original = stage.backward_one_chunk

            def spy(*args, _original=original, **kwargs):
                self.backward_threads.append(threading.current_thread().name)
                return _original(*args, **kwargs)

            stage.backward_one_chunk = spy

    def step(
        self, step: int, data_rank: int, device: torch.device
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        tokens, labels = _batch(step, data_rank, device)
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses}
        out = (
            self.schedule.step(tokens, **kwargs)
            if 0 in self.stage_ids
            else self.schedule.step(**kwargs)
        )
        return (out if N_STAGES - 1 in self.stage_ids else None), losses

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for part in self.parts for n, p in part.named_parameters()}

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [p for part in self.parts for p in part.parameters()], lr=0.1
        )

    def worker_backwards(self) -> int:
        return sum(
            name.startswith("OVERLAP_F_B backward") for name in self.backward_threads
        )


class _Reference:
    """The unsplit model with all experts, trained on the data of ``data_ranks`` like the pipeline."""

    def __init__(self, device: torch.device, data_ranks: list[int]) -> None:
        self.model = _build_model(None, device)
        self.data_ranks = data_ranks

    def step(
        self, step: int, device: torch.device
    ) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
        results = {}
        for r in self.data_ranks:
            tokens, labels = _batch(step, r, device)
            outs, losses = [], []
            for x, y in zip(tokens.chunk(N_MICROBATCHES), labels.chunk(N_MICROBATCHES)):
                out = self.model(x)
                loss = token_cross_entropy(out, y)
                (
                    loss / N_MICROBATCHES
                ).backward()  # the schedules scale gradients by the microbatch count
                outs.append(out.detach())
                losses.append(loss.detach())
            results[r] = (torch.cat(outs), losses)
        return results


class _GatedWork:
    """A receive whose wait returns only once ``opened`` is set: gradients still in flight until then."""

    def __init__(self, works, opened: threading.Event, on_wait) -> None:
        self.works, self.opened, self.on_wait = works, opened, on_wait

    def wait(self) -> bool:
        # bounded: a handler that waits before the forward runs fails, not hangs
        if not self.opened.wait(60.0):
            raise TimeoutError("the gradients were awaited before the forward ran")
        for work in self.works:
            work.wait()
        self.on_wait()
        return True


class _GradientGate(dict):
    """``bwd_recv_ops`` of a schedule whose overlapped backwards get their gradients after their forward started.

    For each OVERLAP_F_B pair (forward F, backward B with a remote gradient)
    the receive of B completes only once F's ``forward_one_chunk`` has been
    entered.  ``log`` records, in order, ("forward", stage, microbatch) and
    ("gradients", stage, microbatch, thread name).
    """

    def __init__(self, pipeline: _Pipeline, pp_rank: int) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.started: dict[tuple[int, int], threading.Event] = {}
        self.pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for action in pipeline.schedule.pipeline_order_with_comms[pp_rank]:
            if action.computation_type == sched.OVERLAP_F_B:
                fwd, bwd = action.sub_actions
                f_key = (fwd.stage_index, fwd.microbatch_index)
                self.pairs[(bwd.stage_index, bwd.microbatch_index)] = f_key
                self.started[f_key] = threading.Event()
        for stage in pipeline.schedule._stages:
            original = stage.forward_one_chunk

            def spy(mb_index, *args, _original=original, _idx=stage.stage_index, **kw):
                self._record(("forward", _idx, mb_index))
                if (_idx, mb_index) in self.started:
                    self.started[(_idx, mb_index)].set()
                return _original(mb_index, *args, **kw)

            stage.forward_one_chunk = spy

    def _record(self, entry: tuple) -> None:
        with self.lock:
            self.log.append(entry)

    def __setitem__(self, key: tuple[int, int], works) -> None:
        if key in self.pairs:
            entry = ("gradients", *key)
            works = [
                _GatedWork(
                    works,
                    self.started[self.pairs[key]],
                    lambda: self._record((*entry, threading.current_thread().name)),
                )
            ]
        super().__setitem__(key, works)


def _update(
    pipelines: tuple[_Pipeline, ...],
    optimizers: list[torch.optim.Optimizer],
    ep_group: dist.ProcessGroup | None,
) -> None:
    """The optimizer step; with EP (data parallel over the EP group) after summing replicated gradients."""
    if ep_group is not None:
        for pipeline in pipelines:
            for name, p in pipeline.named_parameters().items():
                if not is_expert_param(name):
                    dist.all_reduce(p.grad, group=ep_group)
    for optimizer in optimizers:
        optimizer.step()


class _OverlapTests:
    """OVERLAP_F_B with expert parallelism (PP=2 x EP=2) or without (two PP=2 pipelines)."""

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

    def _check(
        self, schedule: str, use_ep: bool, random_ops: bool = False, ac: str = ""
    ) -> None:
        pp_group, ep_group = self._groups()
        ep_group = ep_group if use_ep else None
        ep_rank = self.rank % EP  # this rank's data; with EP also its expert shard
        kwargs = {"ac": ac, "random_ops": random_ops}
        overlapped = _Pipeline(
            schedule, pp_group, ep_group, self.device, overlap=True, **kwargs
        )
        with self.assertNoLogs(
            level="WARNING"
        ):  # replacing the package's OVERLAP_F_B function is quiet
            sequential = _Pipeline(
                schedule, pp_group, ep_group, self.device, overlap=False, **kwargs
            )
        self.assertIs(
            overlapped.schedule._comp_type_to_function_map[sched.OVERLAP_F_B],
            default_overlap_f_b,
        )
        self.assertGreater(overlapped.n_overlap, 0)
        reference = _Reference(
            self.device, data_ranks=list(range(EP)) if use_ep else [ep_rank]
        )
        optimizers = [p.optimizer() for p in (overlapped, sequential)]
        optimizers.append(torch.optim.SGD(reference.model.parameters(), lr=0.1))

        for step in range(2):
            for model in (*overlapped.parts, *sequential.parts, reference.model):
                model.zero_grad(set_to_none=True)
            torch.manual_seed(
                100 + step
            )  # both runs draw from the same generator state
            out, losses = overlapped.step(step, ep_rank, self.device)
            torch.manual_seed(100 + step)
            seq_out, seq_losses = sequential.step(step, ep_rank, self.device)
            ref_out, ref_losses = reference.step(step, self.device)[ep_rank]
            grads = self._gather_gradients(overlapped, sequential, reference, ep_group)

            def check() -> None:
                # the backward sub-actions of OVERLAP_F_B ran on the worker thread
                self.assertEqual(
                    overlapped.worker_backwards(), (step + 1) * overlapped.n_overlap
                )
                self.assertEqual(sequential.worker_backwards(), 0)
                # the backward thread does not outlive the step
                self.assertEqual(
                    [
                        t.name
                        for t in threading.enumerate()
                        if t.name.startswith("OVERLAP_F_B")
                    ],
                    [],
                )
                if out is not None:
                    torch.testing.assert_close(out, seq_out, **self._exact)
                    torch.testing.assert_close(losses, seq_losses, **self._exact)
                    if not random_ops:
                        torch.testing.assert_close(out, ref_out)
                        torch.testing.assert_close(losses, ref_losses)
                for name, (grad, seq_grad, comparable, ref_grad) in grads.items():
                    self.assertIsNotNone(grad, f"{name}: no gradient")
                    torch.testing.assert_close(
                        grad, seq_grad, **self._exact, msg=lambda m: f"{name}: {m}"
                    )
                    if not random_ops:
                        torch.testing.assert_close(
                            comparable,
                            ref_grad,
                            msg=lambda m: f"{name} vs reference: {m}",
                        )

            check_on_all_ranks(check, self.device)
            _update((overlapped, sequential), optimizers, ep_group)

    def _gather_gradients(
        self,
        overlapped: _Pipeline,
        sequential: _Pipeline,
        reference: _Reference,
        ep_group: dist.ProcessGroup | None,
    ) -> dict[
        str,
        tuple[
            torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor
        ],
    ]:
        """name -> (gradient, sequential gradient, gradient comparable with the reference, reference gradient).

        All collectives happen here, before any assertion.
        """
        ref_params = dict(reference.model.named_parameters())
        seq_params = sequential.named_parameters()
        self.assertEqual(overlapped.named_parameters().keys(), seq_params.keys())
        grads = {}
        for name, p in overlapped.named_parameters().items():
            grad, ref_grad = p.grad, ref_params[name].grad
            comparable = grad
            if ep_group is not None and grad is not None:
                if is_expert_param(name):
                    # this rank's experts; their gradient already sums every EP rank's tokens
                    n_local = MODEL_ARGS.n_experts // EP
                    ep_rank = dist.get_rank(ep_group)
                    ref_grad = ref_grad[ep_rank * n_local : (ep_rank + 1) * n_local]
                else:
                    # replicated over the EP group, each rank saw its own data
                    comparable = grad.clone()
                    dist.all_reduce(comparable, group=ep_group)
            grads[name] = (grad, seq_params[name].grad, comparable, ref_grad)
        return grads

    def test_forward_runs_while_the_gradients_are_in_flight(self) -> None:
        # Each overlapped backward's gradients arrive only once its forward
        # has started: the forward computes while they are in flight, and the
        # results are still bitwise the sequential handler's.
        pp_group, ep_group = self._groups()
        pp_rank, ep_rank = dist.get_rank(pp_group), self.rank % EP
        pipelines = [
            _Pipeline("dualpipev", pp_group, ep_group, self.device, overlap=overlap)
            for overlap in (True, False)
        ]
        gate = _GradientGate(pipelines[0], pp_rank)
        pipelines[0].schedule.bwd_recv_ops = gate
        results = []
        for pipeline in pipelines:
            torch.manual_seed(100)
            results.append(pipeline.step(0, ep_rank, self.device))
        grads = [p.named_parameters() for p in pipelines]

        def check() -> None:
            gradients = [e for e in gate.log if e[0] == "gradients"]
            self.assertGreater(len(gradients), 0)
            for _, stage_idx, mb, thread in gradients:
                forward = ("forward", *gate.pairs[(stage_idx, mb)])
                self.assertLess(
                    gate.log.index(forward),
                    gate.log.index(("gradients", stage_idx, mb, thread)),
                )
                self.assertTrue(thread.startswith("OVERLAP_F_B backward"), thread)
            (out, losses), (seq_out, seq_losses) = results
            if out is not None:
                torch.testing.assert_close(out, seq_out, **self._exact)
                torch.testing.assert_close(losses, seq_losses, **self._exact)
            self.assertEqual(grads[0].keys(), grads[1].keys())
            for name, p in grads[0].items():
                torch.testing.assert_close(
                    p.grad, grads[1][name].grad, **self._exact, msg=name
                )

        check_on_all_ranks(check, self.device)

    @parametrize("composition", _compositions(), name_fn=_composition_name)
    def test_overlapped_equals_sequential(
        self, composition: tuple[str, bool, bool, str]
    ) -> None:
        schedule, use_ep, random_ops, ac = composition
        if ac == "selective" and not hasattr(
            torch.utils.checkpoint, "create_selective_checkpoint_contexts"
        ):
            self.skipTest("selective activation checkpointing needs a newer torch")
        self._check(schedule, use_ep, random_ops=random_ops, ac=ac)


# --------------------------------------------------------------------------- #
# FSDP2 stages: PP=2 x DP=2                                                    #
# --------------------------------------------------------------------------- #

FSDP_DIM = 8
FSDP_MB_SIZE = 2
FSDP_REPEATS = 2  # overlapped runs with other random delays, per schedule
_MESH = None


def _fsdp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(step, N_MICROBATCHES * FSDP_MB_SIZE, FSDP_DIM)


def _fsdp_reference() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(FSDPMLPStage(FSDP_DIM) for _ in range(N_STAGES)))


def _fsdp_reference_steps(
    device: torch.device,
) -> tuple[list[list[torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Two steps of the unsplit FSDP test model (no update): each step's losses and gradients."""
    reference = _fsdp_reference().to(device)
    ref_losses, ref_grads = [], []
    for step in range(2):
        x, y = (t.to(device) for t in _fsdp_batch(step))
        losses = []
        for xb, yb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
            loss = mse_loss(reference(xb), yb)
            (loss / N_MICROBATCHES).backward()
            losses.append(loss.detach())
        ref_losses.append(losses)
        ref_grads.append(
            {
                f"{i}.{n}": p.grad.clone()
                for i, m in enumerate(reference)
                for n, p in m.named_parameters()
            }
        )
    return ref_losses, ref_grads


class _CollectiveLog:
    """Records the FSDP collectives a rank issues, in order: (kind, parameter names)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(sharded parameter) -> name
        self.entries: list[tuple[str, tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def _wrap(self, kind: str, fn):
        def recorded(fsdp_params, *args, **kwargs):
            names = tuple(
                self.names.get(id(fp.sharded_param), "?") for fp in fsdp_params
            )
            with self._lock:
                self.entries.append((kind, names))
            return fn(fsdp_params, *args, **kwargs)

        return recorded

    @contextlib.contextmanager
    def recording(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        with unittest.mock.patch.object(
            pg, "foreach_all_gather", self._wrap("all_gather", pg.foreach_all_gather)
        ):
            with unittest.mock.patch.object(
                pg, "foreach_reduce", self._wrap("reduce_scatter", pg.foreach_reduce)
            ):
                yield self


class _FSDPPipeline:
    """This rank's two FSDP stages (every layer and the root ``fully_shard``-ed) and their schedule."""

    def __init__(
        self,
        schedule: str,
        mesh,
        device: torch.device,
        *,
        overlap: bool,
        random_ops: bool,
        ac: str,
        marks: bool,
    ) -> None:
        pp_rank = mesh["pp"].get_local_rank()
        self.stage_ids = (
            [pp_rank, N_STAGES - 1 - pp_rank]
            if schedule == "dualpipev"
            else [pp_rank, pp_rank + PP]
        )
        reference = _fsdp_reference()
        self.modules = []
        for i in self.stage_ids:
            module = reference[i]
            for layer in module.layers:
                # random timing; with ``marks``, a marked communication region after every layer, so
                # that the two threads of an overlapped action take turns inside the stage
                delay = _marked_delay if marks else (lambda x: x)
                layer.register_forward_hook(
                    lambda m, args, out, _d=delay: _d(_Delay.apply(out))
                )
                if random_ops:
                    layer.forward = _with_random_ops(layer.forward)
                if ac:
                    layer.forward = functools.partial(
                        checkpoint, layer.forward, use_reentrant=False
                    )
            self.modules.append(fully_shard_stage(module.to(device), mesh["dp"]))
        stages = [
            PipelineStage(m, i, N_STAGES, device, group=mesh["pp"].get_group())
            for m, i in zip(self.modules, self.stage_ids)
        ]
        loss_fn = mse_loss
        if schedule == "dualpipev":
            self.schedule = ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=loss_fn)
        else:
            self.schedule = _PipelineScheduleRuntime(
                stages, N_MICROBATCHES, loss_fn=loss_fn
            )
            load_csv(self.schedule, CSV_SCHEDULE)
        if not overlap:
            self.schedule.register_custom_function(
                sched.OVERLAP_F_B, sequential_overlap_f_b
            )
        self.param_names = {
            id(p): f"{i}.{n}"
            for m, i in zip(self.modules, self.stage_ids)
            for n, p in m.named_parameters()
        }

    def step(
        self, step: int, device: torch.device
    ) -> tuple[list[tuple[str, tuple[str, ...]]], list[torch.Tensor]]:
        x, y = _fsdp_batch(step)
        losses: list[torch.Tensor] = []
        log = _CollectiveLog(self.param_names)
        with log.recording():
            if 0 in self.stage_ids:
                self.schedule.step(x.to(device), target=y.to(device), losses=losses)
            else:
                self.schedule.step(target=y.to(device), losses=losses)
        return log.entries, losses

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient (a collective over the DP group)."""
        return {
            f"{i}.{n}": p.grad.full_tensor()
            for m, i in zip(self.modules, self.stage_ids)
            for n, p in m.named_parameters()
        }


class _FSDPOverlapTests:
    """OVERLAP_F_B with FSDP2 stages: results and each rank's collectives do not depend on timing.

    Mixed into :class:`ScheduleOverlapTest` (the same four ranks, spawned once).
    """

    def _mesh(self):
        global _MESH
        if _MESH is None:
            from torch.distributed.device_mesh import init_device_mesh

            _MESH = init_device_mesh(
                self.device_type(), (PP, 2), mesh_dim_names=("pp", "dp")
            )
        return _MESH

    # The suite runs a covering subset: a same-stage FSDP pair without marks,
    # and marked communication with dropout + activation checkpointing;
    # TORCH_PIPELINING_EXT_FULL_MATRIX=1 runs all eight.
    @parametrize(
        "schedule,composition",
        [
            ("csv", "plain"),
            ("dualpipev", "random_ac_marks"),
        ]
        + (
            [
                ("dualpipev", "plain_marks"),
                ("csv", "random_ac_marks"),
                ("dualpipev", "plain"),
                ("csv", "random_ac"),
                ("dualpipev", "random_ac"),
                ("csv", "plain_marks"),
            ]
            if FULL_MATRIX
            else []
        ),
    )
    def test_collectives_do_not_depend_on_timing(
        self, schedule: str, composition: str
    ) -> None:
        # csv: rank 1's (1F2;1B0) is a same-stage pair of an FSDP stage.
        mesh = self._mesh()
        marks = composition.endswith("_marks")
        random_ops = ac = composition.startswith("random_ac")
        ac = "full" if ac else ""
        runs = []
        for repeat in range(FSDP_REPEATS + 1):
            overlap = repeat < FSDP_REPEATS  # the last run is the sequential handler
            random.seed(1000 * self.rank + repeat)  # other delays on every rank and run
            pipeline = _FSDPPipeline(
                schedule,
                mesh,
                self.device,
                overlap=overlap,
                random_ops=random_ops,
                ac=ac,
                marks=marks,
            )
            logs, all_losses, all_grads = [], [], []
            for step in range(2):
                torch.manual_seed(100 + step)
                log, losses = pipeline.step(step, self.device)
                logs.append(log)
                all_losses.append(losses)
                all_grads.append(pipeline.full_gradients())
            runs.append((logs, all_losses, all_grads))
        # (every rank issues the same collectives: gathered before any assertion)
        dp_logs: list = [None] * 2
        dist.all_gather_object(dp_logs, runs[0][0], group=mesh["dp"].get_group())

        ref_losses, ref_grads = (
            ([], []) if random_ops else _fsdp_reference_steps(self.device)
        )

        def check() -> None:
            seq_logs, seq_losses, seq_grads = runs[-1]
            for logs, losses, grads in runs[:-1]:
                self.assertEqual(
                    logs, runs[0][0]
                )  # the same collectives, in the same order, every run
                for step in range(2):
                    torch.testing.assert_close(
                        losses[step], seq_losses[step], rtol=0, atol=0
                    )
                    self.assertEqual(grads[step].keys(), seq_grads[step].keys())
                    for name, grad in grads[step].items():
                        torch.testing.assert_close(
                            grad,
                            seq_grads[step][name],
                            rtol=0,
                            atol=0,
                            msg=lambda m: f"{name}: {m}",
                        )
            self.assertEqual(
                dp_logs[0], dp_logs[1]
            )  # and as the other data-parallel rank
            self.assertGreater(
                sum(len(log) for log in runs[0][0]), 0
            )  # the recorder saw FSDP's collectives
            for step, ref in enumerate(
                ref_grads
            ):  # without random ops: equal to the reference too
                if seq_losses[step]:
                    torch.testing.assert_close(seq_losses[step], ref_losses[step])
                for name, grad in seq_grads[step].items():
                    torch.testing.assert_close(
                        grad, ref[name], msg=lambda m: f"{name} vs reference: {m}"
                    )

        check_on_all_ranks(check, self.device)


instantiate_parametrized_tests(_OverlapTests)
instantiate_parametrized_tests(_FSDPOverlapTests)


class ScheduleOverlapTest(_OverlapTests, _FSDPOverlapTests, PipelineMultiProcTest):
    """Both sets of tests on one set of four ranks (PP=2 x EP=2, and PP=2 x DP=2)."""

    world_size = PP * EP


ScheduleOverlapTestNCCL = nccl_variant(ScheduleOverlapTest)


if __name__ == "__main__":
    run_tests()
