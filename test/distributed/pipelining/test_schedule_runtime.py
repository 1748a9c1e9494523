# Owner(s): ["oncall: distributed"]
"""Tests of the shared schedule runtime (``torch_pipelining_ext/_schedule_runtime.py``).

Single-process: lowering that keeps OVERLAP_F_B, REDUCE_GRAD added to
compute_comms schedules.  Multi-process (2 ranks, 4 stages): custom FORWARD and
OVERLAP_F_B functions built on ``prepare_compute_action`` / ``run_action``,
registration semantics, gradient accumulation across steps for every
multi-stage schedule, eval() after a step (two adjacent stages on one rank
included), and errors raised inside custom functions -- every
numerical test compares outputs, losses and every gradient with a
single-process reference.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import logging
import unittest
import unittest.mock
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from common_pipelining import (
    check_on_all_ranks,
    mse_loss,
    nccl_variant,
    PipelineMultiProcTest,
    random_batch,
    reference_step,
)
from model_registry import MLPStage
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import (
    _Action,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import _compat_29, _compute_comms, _schedule_runtime as rt
from torch_pipelining_ext._backward_counter import BackwardCounter
from torch_pipelining_ext._schedule_state import _ScheduleState
from torch_pipelining_ext import overlap
from torch_pipelining_ext.overlap import (
    _handler as overlap_handler,
    _install as overlap_install,
)
from torch_pipelining_ext.overlap._handler import _OverlapState


F, B, I, W = (
    sched.FORWARD,
    sched.FULL_BACKWARD,
    sched.BACKWARD_INPUT,
    sched.BACKWARD_WEIGHT,
)
OVERLAP_F_B = sched.OVERLAP_F_B
REDUCE_GRAD = getattr(sched._ComputationType, "REDUCE_GRAD", None)
WAIT_REDUCE_GRAD = getattr(
    sched._ComputationType, "WAIT_REDUCE_GRAD", None
)  # torch 2.15+

D_HID = 8
N_MICROBATCHES = 4
MB_SIZE = 2
PP = 2
N_STAGES = 4
V_SCHEDULES = (ScheduleDualPipeV, ScheduleZBVZeroBubble)
MULTI_STAGE_SCHEDULES = (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    ScheduleInterleavedZeroBubble,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)


def _overlap(f: _Action, b: _Action) -> _Action:
    return _Action(-1, OVERLAP_F_B, None, (f, b))


# --------------------------------------------------------------------------- #
# Single process: lowering                                                     #
# --------------------------------------------------------------------------- #


def _v_schedule_with_overlap() -> dict[int, list[_Action | None]]:
    """Two ranks, V placement (rank 0: stages 0, 3; rank 1: stages 1, 2), 3 microbatches."""
    a = _Action
    return {
        0: [
            a(0, F, 0), a(0, F, 1), a(0, F, 2), a(3, F, 0), _overlap(a(3, F, 1), a(3, B, 0)),
            _overlap(a(3, F, 2), a(3, B, 1)), a(3, B, 2), a(0, B, 0), a(0, B, 1), a(0, B, 2),
        ],
        1: [
            a(1, F, 0), a(2, F, 0), a(1, F, 1), a(2, F, 1), a(1, F, 2), _overlap(a(2, F, 2), a(2, B, 0)),
            a(1, B, 0), None, a(2, B, 1), a(1, B, 1), a(2, B, 2), a(1, B, 2),
        ],
    }  # fmt: skip


def _v_stage_to_rank(stage: int) -> int:
    return {0: 0, 1: 1, 2: 1, 3: 0}[stage]


class LoweringTest(TestCase):
    def test_overlap_f_b_survives_lowering(self) -> None:
        lowered = sched._add_send_recv(
            _v_schedule_with_overlap(), _v_stage_to_rank, N_STAGES
        )
        self.assertEqual(sorted(lowered), [0, 1])
        for rank, actions in lowered.items():
            overlaps = [
                i for i, a in enumerate(actions) if a.computation_type == OVERLAP_F_B
            ]
            self.assertEqual(
                len(overlaps), 2 if rank == 0 else 1, f"rank {rank}: {actions}"
            )
            for i in overlaps:
                # The sends of both sub-actions follow the OVERLAP_F_B.
                f, b = actions[i].sub_actions
                expected_sends = []
                if (
                    f.stage_index + 1 < N_STAGES
                    and _v_stage_to_rank(f.stage_index + 1) != rank
                ):
                    expected_sends.append(
                        _Action(f.stage_index, sched.SEND_F, f.microbatch_index)
                    )
                if b.stage_index > 0 and _v_stage_to_rank(b.stage_index - 1) != rank:
                    expected_sends.append(
                        _Action(b.stage_index, sched.SEND_B, b.microbatch_index)
                    )
                self.assertEqual(
                    actions[i + 1 : i + 1 + len(expected_sends)], expected_sends
                )
                # No sub-action appears on its own.
                self.assertNotIn(f, actions)
                self.assertNotIn(b, actions)

    @unittest.skipIf(
        sched._add_send_recv is _compat_29._add_send_recv,
        "this torch's own _add_send_recv flattens OVERLAP_F_B; nothing to compare with",
    )
    def test_lowering_matches_upstream(self) -> None:
        ours = _compat_29._add_send_recv(
            _v_schedule_with_overlap(), _v_stage_to_rank, N_STAGES
        )
        theirs = sched._add_send_recv(
            _v_schedule_with_overlap(), _v_stage_to_rank, N_STAGES
        )
        self.assertEqual(ours, theirs)

    def test_malformed_schedule_raises(self) -> None:
        a = _Action
        # Stage 1 backward before anything sends it gradients, on both ranks.
        bad = {0: [a(0, B, 0)], 1: [a(1, F, 0)]}
        with self.assertRaisesRegex(AssertionError, "Malformed compute schedule"):
            _compat_29._add_send_recv(bad, lambda s: s, 2)

    @unittest.skipIf(REDUCE_GRAD is None, "this torch has no REDUCE_GRAD action")
    def test_add_missing_reduce_grad(self) -> None:
        a = _Action
        actions = [
            a(1, F, 0), a(1, F, 1), a(1, I, 0), a(1, sched.SEND_B, 0), a(1, W, 0),
            _overlap(a(0, F, 0), a(1, B, 1)), a(1, sched.SEND_B, 1), a(0, B, 0), a(0, sched.SEND_B, 0),
            a(0, F, 1), a(0, B, 1),
        ]  # fmt: skip
        out = _compute_comms._add_missing_reduce_grad(actions, n_microbatches=2)

        def reduction(stage: int) -> list[_Action]:
            pair = [a(stage, REDUCE_GRAD, None)]
            return (
                pair + [a(stage, WAIT_REDUCE_GRAD, None)]
                if WAIT_REDUCE_GRAD is not None
                else pair
            )

        # stage 1's last backward is inside the OVERLAP_F_B: its REDUCE_GRAD follows the trailing send.
        self.assertEqual(out, actions[:7] + reduction(1) + actions[7:] + reduction(0))
        # A schedule that has its REDUCE_GRADs (and their waits) is left alone.
        self.assertEqual(
            _compute_comms._add_missing_reduce_grad(out, n_microbatches=2), out
        )

    @unittest.skipIf(
        WAIT_REDUCE_GRAD is None, "this torch has no WAIT_REDUCE_GRAD action"
    )
    def test_add_missing_wait_reduce_grad(self) -> None:
        a = _Action
        complete = [
            a(0, F, 0), a(0, B, 0), a(0, REDUCE_GRAD, None), a(0, WAIT_REDUCE_GRAD, None),
            a(1, F, 0), a(1, B, 0), a(1, REDUCE_GRAD, None), a(1, WAIT_REDUCE_GRAD, None),
        ]  # fmt: skip
        # REDUCE_GRAD written without its wait (a schedule for torch 2.10 - 2.14): the wait follows it.
        no_waits = [x for x in complete if x.computation_type != WAIT_REDUCE_GRAD]
        self.assertEqual(
            _compute_comms._add_missing_reduce_grad(no_waits, n_microbatches=1),
            complete,
        )
        # A wait without its REDUCE_GRAD: the pair is added after the last backward instead.
        no_reduce_0 = [x for x in complete if x != a(0, REDUCE_GRAD, None)]
        self.assertEqual(
            _compute_comms._add_missing_reduce_grad(no_reduce_0, n_microbatches=1),
            complete,
        )


# --------------------------------------------------------------------------- #
# Multi-process helpers                                                        #
# --------------------------------------------------------------------------- #


def _runtime_looped_bfs() -> type:
    """ScheduleLoopedBFS run by ``_PipelineScheduleRuntime``, on every release.

    From torch 2.10 ScheduleLoopedBFS is a runtime subclass; on 2.9 it is a
    ``PipelineScheduleMulti``, so custom functions need its order lowered
    onto the runtime (the same actions, the runtime's dispatch).
    """
    if issubclass(ScheduleLoopedBFS, sched._PipelineScheduleRuntime):
        return ScheduleLoopedBFS

    class _LoopedBFSRuntime(sched._PipelineScheduleRuntime):
        def __init__(self, stages: list, n_microbatches: int, **kwargs: Any) -> None:
            super().__init__(stages, n_microbatches, **kwargs)
            order = ScheduleLoopedBFS(stages, n_microbatches, **kwargs).pipeline_order
            self.pipeline_order = order
            self._prepare_schedule_with_comms(order)

    return _LoopedBFSRuntime


def _local_stage_indices(schedule_class: type, rank: int) -> list[int]:
    if issubclass(schedule_class, V_SCHEDULES):
        return [rank, 2 * PP - 1 - rank]
    return [rank, rank + PP]


def _reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MLPStage(D_HID) for _ in range(N_STAGES)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(100 + step, N_MICROBATCHES * MB_SIZE, D_HID)


class ScheduleStateTest(TestCase):
    def test_recorded_actions(self) -> None:
        state = _ScheduleState()
        actions = [_Action(0, F, 0), None, _Action(0, B, 0)]
        recorded = state.recording(actions)
        copied = copy.deepcopy(
            recorded
        )  # torch copies the schedule to format it: a plain list, not iterated
        self.assertIs(type(copied), list)
        seen = []
        for time_step, action in enumerate(recorded):
            seen.append((state.time_step, state.action))
            self.assertEqual((time_step, action), seen[-1])
        self.assertEqual(len(seen), 3)
        self.assertEqual(list(recorded), actions)  # a later iteration records nothing
        self.assertEqual((state.time_step, state.action), (2, actions[2]))
        self.assertEqual(copied, actions)

    def test_end_step_forgets_the_step(self) -> None:
        state = _ScheduleState()
        state.begin_step(False, {"scale": 2})
        state.pending_sends.append([])
        state.step_context(sched._PipelineContext(None))
        state.end_step()
        self.assertEqual(
            (
                state.in_step,
                state.return_outputs,
                state.loss_kwargs,
                state.context,
                state.pending_sends,
                state.send_tracker,
            ),
            (False, True, None, None, [], None),
        )

    def test_step_context_is_the_first_of_the_step(self) -> None:
        state = _ScheduleState()
        outside = sched.PipelineContext("schedule")
        self.assertIs(state.step_context(outside), outside)  # no step: as given
        self.assertIsNone(state.context)
        state.begin_step(False, {"scale": 2})
        first = sched.PipelineContext("schedule", losses=[])
        self.assertIs(state.step_context(first), first)
        self.assertIs(state.step_context(sched.PipelineContext("schedule")), first)
        self.assertEqual(
            (first.return_outputs, first.loss_kwargs), (False, {"scale": 2})
        )
        state.end_step()
        state.begin_step(True, None)
        self.assertIsNot(state.step_context(sched.PipelineContext("schedule")), first)


class PublicNamesTest(TestCase):
    def test_pipeline_context_and_action_are_public(self) -> None:
        # Upstream patch 0011's names, the former ones aliases of the same classes
        self.assertIs(sched.PipelineContext, sched._PipelineContext)
        self.assertIs(sched.PipelineAction, sched._Action)
        self.assertIn("PipelineContext", sched.__all__)
        self.assertIn("PipelineAction", sched.__all__)
        fields = [f.name for f in dataclasses.fields(sched.PipelineContext)]
        self.assertEqual(
            fields,
            [
                "schedule_ref",
                "arg_mbs",
                "kwarg_mbs",
                "target_mbs",
                "losses",
                "return_outputs",
                "loss_kwargs",
                "state",
            ],
        )
        self.assertIsNotNone(sched.PipelineContext.__doc__)

    def test_overlap_state_end_step_closes_the_worker(self) -> None:
        class Worker:
            closed_for = None

            def close_after_step(self, owner: str) -> None:
                self.closed_for = owner

        state, worker = _OverlapState(), Worker()
        state.backward_worker = worker
        state.unmarked_pairs.add((0, 3))
        state.end_step("Sched")
        self.assertIsNone(state.backward_worker)
        self.assertEqual(state.unmarked_pairs, set())
        self.assertEqual(worker.closed_for, "Sched")


class CustomFunctionApiTest(TestCase):
    """The custom-function API on one rank holding two adjacent stages (fake backend).

    Every test compares the losses and every gradient with the unpartitioned
    module's.
    """

    def setUp(self) -> None:
        super().setUp()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(backend="fake", rank=0, world_size=1, store=FakeStore())

    def tearDown(self) -> None:
        dist.destroy_process_group()
        super().tearDown()

    def _train(
        self, schedule_class: type, register: Any = None
    ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Two steps over stages 0 and 1 of a 2-stage model: schedule, losses, grads, reference."""
        torch.manual_seed(0)
        ref = nn.Sequential(MLPStage(D_HID), MLPStage(D_HID))
        modules = [copy.deepcopy(ref[i]) for i in range(2)]
        stages = [
            PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)
        ]
        schedule = schedule_class(stages, N_MICROBATCHES, loss_fn=mse_loss)
        if register is not None:
            register(schedule)
        losses: list[torch.Tensor] = []
        ref_losses: list[torch.Tensor] = []
        for step in range(2):
            x, y = _batch(step)
            step_losses: list[torch.Tensor] = []
            schedule.step(x, target=y, losses=step_losses)
            losses += step_losses
            ref_losses += reference_step(ref, mse_loss, x, y, N_MICROBATCHES)[1]
        torch.testing.assert_close(losses, ref_losses)
        for module, ref_module in zip(modules, ref):
            for (name, p), ref_p in zip(
                module.named_parameters(), ref_module.parameters()
            ):
                torch.testing.assert_close(
                    p.grad, ref_p.grad, msg=lambda m: f"{name}: {m}"
                )
        grads = [p.grad for m in modules for p in m.parameters()]
        return schedule, losses, grads, ref_losses

    def test_forwards_finishing_out_of_order(self) -> None:
        """A backward takes its own microbatch's loss when the last stage's forwards finish out of order.

        A custom FORWARD prepares the last stage's forwards in schedule order
        and computes them in reverse once all are prepared (ScheduleLoopedBFS
        runs every forward of a stage before its backwards).
        """
        finished: list[int] = []

        def reversed_last_forwards(action: _Action, ctx: Any) -> None:
            compute = ctx.schedule_ref.prepare_compute_action(action, ctx)
            if action.stage_index == 0:
                compute()
                return
            pending = ctx.state.setdefault("pending", [])
            pending.append(compute)
            if len(pending) == N_MICROBATCHES:
                for compute in reversed(pending):
                    finished.append(compute.action.microbatch_index)
                    compute()

        def register(schedule: Any) -> None:
            schedule.register_custom_function(F, reversed_last_forwards)

        self._train(_runtime_looped_bfs(), register)
        self.assertEqual(finished, list(reversed(range(N_MICROBATCHES))) * 2)

    def test_prepare_compute_action_returns_a_handle(self) -> None:
        """``prepare_compute_action`` returns a ``PreparedComputeAction`` naming its action; ``ctx.state`` is the step's."""
        handles: list[Any] = []
        states: list[dict] = []

        def forward(action: _Action, ctx: Any) -> None:
            self.assertEqual(
                ctx.state.get("step_forwards", 0), len(states) % (2 * N_MICROBATCHES)
            )
            ctx.state["step_forwards"] = ctx.state.get("step_forwards", 0) + 1
            states.append(ctx.state)
            handle = ctx.schedule_ref.prepare_compute_action(action, ctx)
            handles.append(handle)
            handle.wait_inputs()
            handle()

        def register(schedule: Any) -> None:
            schedule.register_custom_function(F, forward)

        self._train(_runtime_looped_bfs(), register)
        self.assertEqual(len(handles), 2 * 2 * N_MICROBATCHES)
        for handle in handles:
            self.assertIsInstance(handle, rt.PreparedComputeAction)
            self.assertEqual(handle.action.computation_type, F)
        n = 2 * N_MICROBATCHES
        self.assertEqual({id(s) for s in states[:n]}, {id(states[0])})
        self.assertEqual({id(s) for s in states[n:]}, {id(states[n])})
        self.assertIsNot(states[0], states[n])

    @parametrize("custom_overlap", [False, True])
    def test_custom_compute_function_and_overlap_f_b(
        self, custom_overlap: bool
    ) -> None:
        """Which runs OVERLAP_F_B's sub-actions: see [Note: custom functions and the sub-actions of OVERLAP_F_B].

        Without a custom OVERLAP_F_B the custom FORWARD and FULL_BACKWARD
        run every forward and backward, sub-actions included (the package's
        concurrent handler steps aside); a custom OVERLAP_F_B owns its
        sub-actions.
        """
        seen: Counter[Any] = Counter()
        overlaps: list[_Action] = []

        def counting(action: _Action, ctx: Any) -> None:
            seen[action.computation_type] += 1
            ctx.schedule_ref.perform_action(action, ctx)

        def overlap_f_b(action: _Action, ctx: Any) -> None:
            overlaps.append(action)
            for sub_action in action.sub_actions:
                ctx.schedule_ref.perform_action(sub_action, ctx)

        def register(schedule: Any) -> None:
            schedule.register_custom_function(F, counting)
            schedule.register_custom_function(B, counting)
            if custom_overlap:
                schedule.register_custom_function(OVERLAP_F_B, overlap_f_b)

        schedule, *_ = self._train(ScheduleDualPipeV, register)
        lowered = schedule.pipeline_order_with_comms[0]
        top_level = Counter(a.computation_type for a in lowered)
        in_overlap = Counter(
            sub.computation_type
            for a in lowered
            if a.computation_type == OVERLAP_F_B
            for sub in a.sub_actions
        )
        self.assertGreater(top_level[OVERLAP_F_B], 0)
        self.assertGreater(in_overlap[F], 0)
        expected = top_level if custom_overlap else top_level + in_overlap
        self.assertEqual(seen[F], 2 * expected[F])
        self.assertEqual(seen[B], 2 * expected[B])
        self.assertEqual(
            len(overlaps), 2 * top_level[OVERLAP_F_B] if custom_overlap else 0
        )


instantiate_parametrized_tests(CustomFunctionApiTest)


class _PipelineRun:
    """The local stages of a 4-stage pipeline on 2 ranks, and their reference."""

    def __init__(
        self,
        schedule_class: type,
        rank: int,
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> None:
        self.ref = _reference_model().to(device)
        self.stage_indices = _local_stage_indices(schedule_class, rank)
        self.modules = [copy.deepcopy(self.ref[i]) for i in self.stage_indices]
        self.stages = [
            PipelineStage(module, i, N_STAGES, device, group=group)
            for module, i in zip(self.modules, self.stage_indices)
        ]
        self.schedule = schedule_class(self.stages, N_MICROBATCHES, loss_fn=mse_loss)
        self.device = device

    def step(self, test: TestCase, step: int) -> None:
        """Run one step on both, check output, losses and every gradient."""
        x, y = (t.to(self.device) for t in _batch(step))
        losses: list[torch.Tensor] = []
        out = self.schedule.step(x, target=y, losses=losses)
        ref_out, ref_losses = reference_step(self.ref, mse_loss, x, y, N_MICROBATCHES)

        def check() -> None:
            if N_STAGES - 1 in self.stage_indices:
                test.assertEqual(out, ref_out)
                test.assertEqual(losses, ref_losses)
            self.check_gradients(test)

        check_on_all_ranks(check, self.device)

    def check_gradients(self, test: TestCase) -> None:
        for module, i in zip(self.modules, self.stage_indices):
            for (name, p), ref_p in zip(
                module.named_parameters(), self.ref[i].parameters()
            ):
                test.assertIsNotNone(p.grad, f"stage {i} {name}: no gradient")
                torch.testing.assert_close(
                    p.grad, ref_p.grad, msg=lambda m: f"stage {i} {name}: {m}"
                )


class _RecordingFunctions:
    """Custom FORWARD and OVERLAP_F_B functions written on the shared bookkeeping."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.last_backwards: list[int] = []

    def forward(self, action: _Action, ctx: sched._PipelineContext) -> None:
        self.calls["F"] += 1
        rt.prepare_compute_action(action, ctx)()

    def overlap_f_b(self, action: _Action, ctx: sched._PipelineContext) -> None:
        self.calls["OVERLAP_F_B"] += 1
        schedule = ctx.schedule_ref
        f, b = action.sub_actions
        counted_before = schedule.backward_counter[b.stage_index]
        # Bookkeeping in schedule order (forward first), then the two computes.
        computes = [rt.prepare_compute_action(a, ctx) for a in (f, b)]
        self.calls["backwards_counted"] += (
            schedule.backward_counter[b.stage_index] - counted_before
        )
        if schedule.backward_counter.is_last_backward(b.stage_index):
            self.last_backwards.append(b.stage_index)
        for compute in computes:
            compute()


# stage -> rank of the custom schedules of test_adjacent_stages_on_one_rank
_ADJACENT_LAYOUTS = {
    "v_shaped": {0: 0, 1: 1, 2: 1, 3: 0},  # stages 1 and 2 on rank 1
    "unbalanced": {0: 0, 1: 0, 2: 0, 3: 1},  # stages 0, 1 and 2 on rank 0
}


class _OneMicrobatchInStageOrder(sched.PipelineScheduleMulti):
    """One microbatch through the stages in order and back, one action per time step,
    on the generic ``PipelineScheduleMulti`` loop with any stage-to-rank layout."""

    def __init__(
        self, stages: list[PipelineStage], stage_to_rank: dict[int, int], loss_fn: Any
    ) -> None:
        super().__init__(stages, 1, loss_fn=loss_fn)
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = dict(stage_to_rank)
        order = [_Action(i, F, 0) for i in range(N_STAGES)] + [
            _Action(i, B, 0) for i in reversed(range(N_STAGES))
        ]
        self.pipeline_order = {
            rank: [a if stage_to_rank[a.stage_index] == rank else None for a in order]
            for rank in range(PP)
        }


# --------------------------------------------------------------------------- #
# Multi-process tests                                                          #
# --------------------------------------------------------------------------- #


class ScheduleRuntimeTest(PipelineMultiProcTest):
    world_size = PP

    def _run(self, schedule_class: type) -> _PipelineRun:
        return _PipelineRun(schedule_class, self.rank, self.device, dist.group.WORLD)

    def test_register_custom_function_semantics(self) -> None:
        run = self._run(ScheduleDualPipeV)
        schedule = run.schedule
        with self.assertRaisesRegex(
            ValueError,
            r"Invalid computation type .*SEND_F.*FORWARD.*OVERLAP_F_B.*RESHARD",
        ):
            schedule.register_custom_function(sched.SEND_F, lambda action, ctx: None)
        with self.assertRaisesRegex(ValueError, "Invalid computation type"):
            schedule.register_custom_function(sched.RECV_B, lambda action, ctx: None)
        first, second = (lambda action, ctx: None), (lambda action, ctx: None)
        # Upstream's and this package's register_custom_function warn on their module's logger.
        logger_name = inspect.unwrap(type(schedule).register_custom_function).__module__
        self.assertIs(schedule._comp_type_to_function_map[F], rt.perform_action)
        with self.assertNoLogs(
            logger_name, level=logging.WARNING
        ):  # replaces the package's default
            schedule.register_custom_function(F, first)
        with self.assertLogs(logger_name, level=logging.WARNING) as logs:
            schedule.register_custom_function(F, second)
        self.assertIn("already registered", "\n".join(logs.output))
        self.assertIs(schedule._comp_type_to_function_map[F], second)
        # The state custom functions share lives on the schedule.
        self.assertIsInstance(schedule.backward_counter, BackwardCounter)
        self.assertIsInstance(schedule.backward_counter, Counter)
        for name in ("fwd_recv_ops", "bwd_recv_ops", "unshard_ops", "unsharded_stages"):
            self.assertEqual(len(getattr(schedule, name)), 0, name)
        self.assertTrue(callable(schedule._assert_unsharded))
        self.assertEqual(
            rt.stage_index_to_stage(schedule), dict(zip(run.stage_indices, run.stages))
        )

    def test_custom_forward_and_overlap_f_b(self) -> None:
        run = self._run(ScheduleDualPipeV)
        functions = _RecordingFunctions()
        run.schedule.register_custom_function(F, functions.forward)
        run.schedule.register_custom_function(OVERLAP_F_B, functions.overlap_f_b)
        lowered = run.schedule.pipeline_order_with_comms[self.rank]
        n_forward = sum(a.computation_type == F for a in lowered)
        n_overlap = sum(a.computation_type == OVERLAP_F_B for a in lowered)
        self.assertGreater(
            n_overlap, 0, "DualPipeV's lowered schedule lost its OVERLAP_F_B actions"
        )
        for step in range(2):  # no zero_grad: the second step accumulates
            run.step(self, step)
            self.assertEqual(functions.calls["F"], (step + 1) * n_forward)
            self.assertEqual(functions.calls["OVERLAP_F_B"], (step + 1) * n_overlap)
            self.assertEqual(
                functions.calls["backwards_counted"], (step + 1) * n_overlap
            )
            # Every local stage had all its backwards counted, built-in and custom together.
            for i in run.stage_indices:
                self.assertEqual(run.schedule.backward_counter[i], N_MICROBATCHES)

    def test_every_compute_action_runs_the_shared_bookkeeping(self) -> None:
        """Plain actions and OVERLAP_F_B's sub-actions run one implementation, on every torch."""
        run = self._run(ScheduleDualPipeV)
        schedule = run.schedule
        for ctype in (
            F,
            B,
            sched.BACKWARD_INPUT,
            sched.BACKWARD_WEIGHT,
            sched.UNSHARD,
            sched.RESHARD,
        ):
            self.assertIs(
                schedule._comp_type_to_function_map[ctype], rt.perform_action, ctype
            )
        # A custom function that adds to an action reuses perform_action.
        forwards: list[_Action] = []

        def counting_forward(action: _Action, ctx: sched._PipelineContext) -> None:
            forwards.append(action)
            rt.perform_action(action, ctx)

        schedule.register_custom_function(F, counting_forward)
        lowered = schedule.pipeline_order_with_comms[self.rank]
        compute_actions = Counter(
            a.computation_type
            for action in lowered
            for a in (
                action.sub_actions
                if action.computation_type == OVERLAP_F_B
                else (action,)
            )
            if a.computation_type in (F, B, sched.BACKWARD_INPUT, sched.BACKWARD_WEIGHT)
        )
        prepared: Counter[Any] = Counter()
        original = rt.prepare_compute_action

        def spy(action: _Action, ctx: sched._PipelineContext, **kwargs):  # type: ignore[no-untyped-def]
            prepared[action.computation_type] += 1
            return original(action, ctx, **kwargs)

        with unittest.mock.patch.object(rt, "prepare_compute_action", spy):
            run.step(self, 0)
        self.assertEqual(prepared, compute_actions)
        # the custom FORWARD runs OVERLAP_F_B's forwards too (no custom OVERLAP_F_B)
        self.assertEqual(len(forwards), compute_actions[F])

    def _performed(self, schedule: Any) -> list[_Action]:
        """The rank's lowered actions as the step loop performs them, OVERLAP_F_B's in turn."""
        return [
            sub
            for action in schedule.pipeline_order_with_comms[self.rank]
            for sub in (
                action.sub_actions
                if action.computation_type == OVERLAP_F_B
                else (action,)
            )
        ]

    def test_perform_action_override_sees_every_action(self) -> None:
        """Every action without a custom function reaches the schedule's perform_action.

        Upstream patch 0011's step loop: plain actions, the sub-actions of an
        OVERLAP_F_B without a custom function and the communication actions,
        in schedule order, on every torch; results bitwise the built-in ones.
        """

        class Recording(ScheduleDualPipeV):
            performed: list[_Action]

            def perform_action(self, action: _Action, ctx: Any) -> None:
                self.performed.append(action)
                super().perform_action(action, ctx)

        # OVERLAP_F_B without a custom function: the schedules are built
        # without the concurrent handler
        with unittest.mock.patch.dict(
            os.environ, {"TORCH_PIPELINING_EXT_OVERLAP": "0"}
        ):
            run = self._run(Recording)
            builtin = self._run(ScheduleDualPipeV)
        run.schedule.performed = []
        expected = self._performed(run.schedule)
        for step in range(2):
            run.step(self, step)
            builtin.step(self, step)

        def check() -> None:
            kinds = {a.computation_type for a in expected}
            # torch 2.15+ retires each send with a wait action
            waits = {getattr(sched, "WAIT_SEND_F", F), getattr(sched, "WAIT_SEND_B", F)}
            self.assertTrue({F, sched.SEND_F, sched.RECV_B, *waits} <= kinds, kinds)
            self.assertIn(
                OVERLAP_F_B,
                {
                    a.computation_type
                    for a in run.schedule.pipeline_order_with_comms[self.rank]
                },
            )
            self.assertEqual(run.schedule.performed, expected * 2)
            for module, builtin_module in zip(run.modules, builtin.modules):
                for p, builtin_p in zip(
                    module.parameters(), builtin_module.parameters()
                ):
                    torch.testing.assert_close(p.grad, builtin_p.grad, rtol=0, atol=0)

        check_on_all_ranks(check, self.device)

    def test_one_context_per_step(self) -> None:
        """Every custom function of a step, and every built-in action, get the step's one PipelineContext.

        The same object (a function may keep state on it), a new one for the
        next step, carrying the step's options; the concurrent OVERLAP_F_B
        handler gets it too.
        """

        class Recording(ScheduleDualPipeV):
            contexts: list[Any]

            def perform_action(self, action: _Action, ctx: Any) -> None:
                self.contexts.append(ctx)
                super().perform_action(action, ctx)

        run = self._run(Recording)
        schedule = run.schedule
        schedule.contexts = []
        concurrent = schedule._comp_type_to_function_map.get(OVERLAP_F_B)
        forwards: list[int] = []

        def counting_forward(action: _Action, ctx: Any) -> None:
            ctx.state["forwards"] = ctx.state.get("forwards", 0) + 1
            forwards.append(ctx.state["forwards"])
            schedule.contexts.append(ctx)
            ctx.schedule_ref.perform_action(action, ctx)

        def recording_overlap_f_b(action: _Action, ctx: Any) -> None:
            schedule.contexts.append(ctx)
            concurrent(action, ctx)

        schedule.register_custom_function(F, counting_forward)
        schedule.register_custom_function(OVERLAP_F_B, recording_overlap_f_b)
        lowered = schedule.pipeline_order_with_comms[self.rank]
        n_forward = sum(a.computation_type == F for a in lowered)
        per_step: list[list[Any]] = []
        for step in range(2):
            schedule.contexts = []
            run.step(self, step)
            per_step.append(schedule.contexts)
        options = {}
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            schedule.contexts = []
            x, y = (t.to(self.device) for t in _batch(2))
            schedule.step(x, target=y, return_outputs=False)
            options = {"return_outputs": schedule.contexts[0].return_outputs}

        def check() -> None:
            self.assertIs(concurrent, overlap_install.default_overlap_f_b)
            self.assertGreater(n_forward, 0)
            self.assertEqual(
                forwards[: 2 * n_forward], list(range(1, n_forward + 1)) * 2
            )
            first, second = per_step
            self.assertGreaterEqual(len(first), len(lowered))
            for contexts in per_step:
                self.assertEqual({id(c) for c in contexts}, {id(contexts[0])})
                self.assertIsInstance(contexts[0], sched.PipelineContext)
                self.assertIs(contexts[0].schedule_ref, schedule)
                self.assertTrue(contexts[0].return_outputs)
                self.assertIsNone(contexts[0].loss_kwargs)
            self.assertIsNot(first[0], second[0])
            if options:
                self.assertEqual(options, {"return_outputs": False})

        check_on_all_ranks(check, self.device)

    def test_overlap_engine_registered_through_the_public_entry_point(self) -> None:
        """The concurrent OVERLAP_F_B engine plugs into a schedule as any custom function.

        A schedule built without the package's default handler (as on a torch
        with upstream patch 0011 alone) gets the engine through
        ``register_custom_function(OVERLAP_F_B, overlap.overlap_f_b)``; its
        actions run concurrently and the results are the sequential ones,
        bitwise.
        """
        with unittest.mock.patch.dict(
            os.environ, {"TORCH_PIPELINING_EXT_OVERLAP": "0"}
        ):
            engine = self._run(ScheduleDualPipeV)
            sequential = self._run(ScheduleDualPipeV)
        function_map = engine.schedule._comp_type_to_function_map
        self.assertIs(function_map.get(OVERLAP_F_B), rt.sequential_overlap_f_b)
        engine.schedule.register_custom_function(OVERLAP_F_B, overlap.overlap_f_b)
        with unittest.mock.patch.object(
            overlap_handler, "_run_overlapped", wraps=overlap_handler._run_overlapped
        ) as concurrent:
            for step in range(2):
                engine.step(self, step)
                sequential.step(self, step)

        def check() -> None:
            self.assertGreater(concurrent.call_count, 0)
            for module, sequential_module in zip(engine.modules, sequential.modules):
                for p, sequential_p in zip(
                    module.parameters(), sequential_module.parameters()
                ):
                    torch.testing.assert_close(
                        p.grad, sequential_p.grad, rtol=0, atol=0
                    )

        check_on_all_ranks(check, self.device)

    @parametrize("schedule_class", MULTI_STAGE_SCHEDULES)
    def test_gradient_accumulation(self, schedule_class: type) -> None:
        run = self._run(schedule_class)
        last_backward_calls: Counter[int] = Counter()
        for stage in run.stages:
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                original = getattr(stage, name)

                def spy(*args, _original=original, _stage=stage, **kwargs):  # type: ignore[no-untyped-def]
                    if kwargs.get("last_backward"):
                        last_backward_calls[_stage.stage_index] += 1
                    return _original(*args, **kwargs)

                setattr(stage, name, spy)
        for step in range(
            2
        ):  # same batch, no zero_grad: the second step doubles the gradients
            run.step(self, 0)
            self.assertEqual(
                dict(last_backward_calls), dict.fromkeys(run.stage_indices, step + 1)
            )
        once = _reference_model().to(self.device)
        x, y = (t.to(self.device) for t in _batch(0))
        reference_step(once, mse_loss, x, y, N_MICROBATCHES)
        for module, i in zip(run.modules, run.stage_indices):
            for p, p_once in zip(module.parameters(), once[i].parameters()):
                torch.testing.assert_close(p.grad, 2 * p_once.grad)

    def test_custom_function_error_names_rank_time_step_and_action(self) -> None:
        run = self._run(ScheduleDualPipeV)

        def broken_unshard(action: _Action, ctx: sched._PipelineContext) -> None:
            raise ValueError(f"custom UNSHARD failed for {action}")

        # Lowering puts UNSHARD first on every rank, before any receive: no rank waits.
        first = run.schedule.pipeline_order_with_comms[self.rank][0]
        self.assertEqual(first.computation_type, sched.UNSHARD)
        run.schedule.register_custom_function(sched.UNSHARD, broken_unshard)
        x, y = (t.to(self.device) for t in _batch(0))
        with self.assertRaises(ValueError) as cm:
            run.schedule.step(x, target=y)
        notes = "\n".join(getattr(cm.exception, "__notes__", []))
        self.assertIn("custom UNSHARD failed", str(cm.exception))
        self.assertIn(f"[rank {self.rank}]", notes)
        self.assertIn(f"time step 0 running action {first}", notes)

    @parametrize("schedule_class", MULTI_STAGE_SCHEDULES)
    def test_eval_after_step(self, schedule_class: type) -> None:
        # The V schedules put stages 1 and 2 on rank 1: stock torch's eval()
        # raises there ("can't steal_bwd_input") and rank 0 waits for it.
        run = self._run(schedule_class)
        run.step(self, 0)
        x, y = (t.to(self.device) for t in _batch(1))
        losses: list[torch.Tensor] = []
        out = run.schedule.eval(x, target=y, losses=losses)
        with torch.no_grad():
            ref_out = run.ref(x)
            ref_losses = [
                mse_loss(o, t)
                for o, t in zip(ref_out.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES))
            ]

        def check() -> None:
            if N_STAGES - 1 in run.stage_indices:
                torch.testing.assert_close(out, ref_out)
                self.assertEqual(len(losses), N_MICROBATCHES)
                for got, want in zip(losses, ref_losses):
                    torch.testing.assert_close(got, want)
            run.check_gradients(self)  # the step's, untouched by eval()

        check_on_all_ranks(check, self.device)

    @parametrize("layout", ["v_shaped", "unbalanced"])
    def test_adjacent_stages_on_one_rank(self, layout: str) -> None:
        # Upstream's CustomSchedulesTest.test_non_symmetric_stage_ids on gloo: a
        # PipelineScheduleMulti schedule with two adjacent stages on one rank, so
        # the generic loop sends from a rank to itself (p2p_to_own_rank).
        stage_to_rank = _ADJACENT_LAYOUTS[layout]
        ref = _reference_model().to(self.device)
        indices = [i for i in range(N_STAGES) if stage_to_rank[i] == self.rank]
        modules = [copy.deepcopy(ref[i]) for i in indices]
        stages = [
            PipelineStage(m, i, N_STAGES, self.device) for m, i in zip(modules, indices)
        ]
        schedule = _OneMicrobatchInStageOrder(stages, stage_to_rank, mse_loss)
        for step in range(2):
            x, y = (t[:MB_SIZE].to(self.device) for t in _batch(step))
            ref.zero_grad()
            for module in modules:
                module.zero_grad()
            losses: list[torch.Tensor] = []
            schedule.step(x, target=y, losses=losses)
            _, ref_losses = reference_step(ref, mse_loss, x, y, 1)

            def check() -> None:
                if N_STAGES - 1 in indices:
                    self.assertEqual(losses, ref_losses)
                for module, i in zip(modules, indices):
                    for (name, p), ref_p in zip(
                        module.named_parameters(), ref[i].parameters()
                    ):
                        torch.testing.assert_close(
                            p.grad, ref_p.grad, msg=lambda m: f"stage {i} {name}: {m}"
                        )

            check_on_all_ranks(check, self.device)

    def test_run_action_rejects_overlap_and_unknown_types(self) -> None:
        run = self._run(ScheduleDualPipeV)
        ctx = sched._PipelineContext(run.schedule)
        with self.assertRaisesRegex(ValueError, "sub_actions"):
            rt.run_action(_overlap(_Action(0, F, 0), _Action(3, B, 0)), ctx)
        with self.assertRaisesRegex(ValueError, "not a FORWARD or backward action"):
            rt.prepare_compute_action(_Action(0, sched.SEND_F, 0), ctx)


instantiate_parametrized_tests(ScheduleRuntimeTest)
ScheduleRuntimeTestNCCL = nccl_variant(ScheduleRuntimeTest)


if __name__ == "__main__":
    run_tests()
