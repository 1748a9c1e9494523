# Owner(s): ["oncall: distributed"]
"""FSDP2 x pipeline parallelism (``torch_pipelining_ext/_fsdp_stage.py`` and the runtime).

4 ranks as a (pp=2, dp=2) ``DeviceMesh``; 4 stages (2 per pipeline rank), each
an :class:`FSDPMLPStage` with ``fully_shard`` on every layer and on the stage
root; both data-parallel replicas get the same batch, so every gradient must
equal the single-process reference.  For every multi-stage schedule, for
DualPipeV with the package's OVERLAP_F_B, torch's sequential OVERLAP_F_B and
users' custom backward functions, and for a ``compute_comms`` CSV schedule
with OVERLAP_F_B: two steps without ``zero_grad``; after each, outputs, losses
and every gradient (``DTensor.full_tensor()``) match the reference, every
parameter is resharded (no unsharded storage left) and every gradient is
reduce-scattered (a sharded DTensor; nothing left on the unsharded parameters).
"""

from __future__ import annotations

import copy
import inspect
import unittest
from collections import Counter

import torch
import torch.nn as nn
from common_pipelining import (
    check_on_all_ranks,
    load_csv,
    mse_loss,
    nccl_variant,
    PipelineMultiProcTest,
    random_batch,
    reference_step,
)
from model_registry import FSDPMLPStage, fully_shard_stage
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard, FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import (
    _Action,
    _PipelineScheduleRuntime,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext._schedule_runtime import run_action


REDUCE_GRAD = getattr(sched._ComputationType, "REDUCE_GRAD", None)
WAIT_REDUCE_GRAD = getattr(
    sched._ComputationType, "WAIT_REDUCE_GRAD", None
)  # torch 2.15+

DIM = 8
N_MICROBATCHES = 4
MB_SIZE = 2
PP = 2
DP = 2
N_STAGES = 2 * PP
V_SCHEDULES = (ScheduleDualPipeV, ScheduleZBVZeroBubble)
SCHEDULES = (
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    ScheduleInterleavedZeroBubble,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)


def _reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(FSDPMLPStage(DIM) for _ in range(N_STAGES)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(200 + step, N_MICROBATCHES * MB_SIZE, DIM)


def _stage_indices(v_placement: bool, pp_rank: int) -> list[int]:
    return [pp_rank, N_STAGES - 1 - pp_rank] if v_placement else [pp_rank, pp_rank + PP]


def _fsdp_params(module: nn.Module) -> list:
    """The FSDPParams of one ``fully_shard`` module (torch 2.9: one group; 2.10+: a list)."""
    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = (
            [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        )
    return [p for group in groups for p in group.fsdp_params]


class _FSDPPipeline:
    """This rank's FSDP-sharded stages, their schedule and the single-process reference."""

    def __init__(
        self, mesh: DeviceMesh, schedule_class: type, device: torch.device
    ) -> None:
        self.ref = _reference_model().to(device)
        pp_rank = self.mesh_pp_rank = mesh["pp"].get_local_rank()
        # The CSV schedules (a bare _PipelineScheduleRuntime) place stages like DualPipeV.
        v_placement = (
            schedule_class in V_SCHEDULES or schedule_class is _PipelineScheduleRuntime
        )
        self.stage_indices = _stage_indices(v_placement, pp_rank)
        self.modules = [
            fully_shard_stage(copy.deepcopy(self.ref[i]), mesh["dp"])
            for i in self.stage_indices
        ]
        self.stages = [
            PipelineStage(m, i, N_STAGES, device, group=mesh["pp"].get_group())
            for m, i in zip(self.modules, self.stage_indices)
        ]
        self.device = device
        self.schedule: _PipelineScheduleRuntime | None = None

    def step(self, test: PipelineMultiProcTest, step: int) -> None:
        assert self.schedule is not None
        x, y = (t.to(self.device) for t in _batch(step))
        losses: list[torch.Tensor] = []
        out = self.schedule.step(x, target=y, losses=losses)
        ref_out, ref_losses = reference_step(self.ref, mse_loss, x, y, N_MICROBATCHES)
        # Collectives first (same on every rank), then the checks; all ranks
        # fail together, so no rank waits for one that stopped at an assert.
        full_grads = [
            [
                p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                for p in module.parameters()
            ]
            for module in self.modules
        ]

        def check() -> None:
            if N_STAGES - 1 in self.stage_indices:
                torch.testing.assert_close(out, ref_out)
                torch.testing.assert_close(losses, ref_losses)
            self.check_resharded_and_reduced(test)
            self.check_gradients(test, step, full_grads)

        check_on_all_ranks(check, self.device)

    def check_resharded_and_reduced(self, test: PipelineMultiProcTest) -> None:
        for module, i in zip(self.modules, self.stage_indices):
            for fsdp_module in (
                m for m in module.modules() if isinstance(m, FSDPModule)
            ):
                for fsdp_param in _fsdp_params(fsdp_module):
                    name = f"stage {i} {fsdp_param._param_fqn}"
                    registered = getattr(
                        fsdp_param._module_info.module,
                        fsdp_param._module_info.param_name,
                    )
                    test.assertIs(
                        registered, fsdp_param.sharded_param, f"{name}: not resharded"
                    )
                    for buffer in fsdp_param.all_gather_outputs:
                        test.assertEqual(
                            buffer.untyped_storage().size(),
                            0,
                            f"{name}: unsharded storage left",
                        )
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    test.assertTrue(
                        unsharded is None or unsharded.grad is None,
                        f"{name}: unreduced gradient",
                    )
                    test.assertIsNone(
                        fsdp_param.unsharded_accumulated_grad,
                        f"{name}: unreduced gradient",
                    )
                    grad = fsdp_param.sharded_param.grad
                    test.assertIsInstance(
                        grad, DTensor, f"{name}: no reduce-scattered gradient"
                    )
                    test.assertEqual(grad.placements, (Shard(0),), name)

    def check_gradients(
        self, test: PipelineMultiProcTest, step: int, full_grads: list[list]
    ) -> None:
        for module, i, grads in zip(self.modules, self.stage_indices, full_grads):
            for (name, _), grad, ref_p in zip(
                module.named_parameters(), grads, self.ref[i].parameters()
            ):
                test.assertIsNotNone(grad, f"step {step} stage {i} {name}: no gradient")
                torch.testing.assert_close(
                    grad, ref_p.grad, msg=lambda m: f"step {step} stage {i} {name}: {m}"
                )


class _UserBackwardFunctions:
    """FULL_BACKWARD / BACKWARD_WEIGHT written against the stage API, as a user would.

    They keep the books with the schedule's own state -- ``backward_counter``
    updated upstream-style with ``+=`` --, so the schedule sees their
    backwards, and on torch without REDUCE_GRAD scale gradients after the
    last one like torch 2.9's loop.  OVERLAP_F_B runs its sub-actions through
    the registered functions.
    """

    def __init__(self) -> None:
        self.calls = 0

    def backward(self, action: _Action, ctx: sched._PipelineContext) -> None:
        self.calls += 1
        schedule = ctx.schedule_ref
        stages = {s.stage_index: s for s in schedule._stages}
        stage, mb = stages[action.stage_index], action.microbatch_index
        schedule._assert_unsharded(stage)
        if action.computation_type == sched.FULL_BACKWARD:
            if not stage.is_last and stage.stage_index + 1 not in stages:
                for work in schedule.bwd_recv_ops.pop((stage.stage_index, mb)):
                    work.wait()
            loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[stage.stage_index] += 1
        last_backward = (
            schedule.backward_counter[stage.stage_index] == schedule._n_microbatches
        )
        if action.computation_type == sched.FULL_BACKWARD:
            stage.backward_one_chunk(
                mb, loss=loss, full_backward=True, last_backward=last_backward
            )
            if stage.stage_index - 1 in stages:
                stages[stage.stage_index - 1].set_local_bwd_input(
                    stage.get_local_bwd_output(mb), mb
                )
        else:
            stage.backward_weight_one_chunk(mb, last_backward=last_backward)
        if last_backward and REDUCE_GRAD is None:
            stage.scale_grads(schedule._n_microbatches)

    def overlap_f_b(self, action: _Action, ctx: sched._PipelineContext) -> None:
        function_map = ctx.schedule_ref._comp_type_to_function_map
        for sub_action in action.sub_actions:
            function = function_map.get(sub_action.computation_type)
            if function is not None:
                function(sub_action, ctx)
            else:
                run_action(sub_action, ctx)


# A compute-only V schedule (rank 0: stages 0 and 3, rank 1: stages 1 and 2)
# with OVERLAP_F_B on both ranks, in which stage 3 runs a forward between a
# microbatch's input and weight passes (3I0 3F1 3W0, 3I1 3F2 3W1): the forward
# reshards stage 3's layers, so the weight pass must unshard them again.
_COMPUTE_ONLY_CSV = """\
0F0,0F1,0F2,0F3,3F0,3I0,3F1,3W0,3I1,3F2,3W1,(3F3;3B2)OVERLAP_F_B,3B3,0B0,0B1,0B2,0B3
1F0,2F0,1F1,2F1,1F2,2F2,(1F3;2B0)OVERLAP_F_B,2F3,1B0,2B1,1B1,2B2,1B2,2B3,1B3
"""


_MESH: DeviceMesh | None = None


class ScheduleFSDPTest(PipelineMultiProcTest):
    world_size = PP * DP

    def _pipeline(self, schedule_class: type) -> _FSDPPipeline:
        global _MESH
        if _MESH is None:
            _MESH = init_device_mesh(
                self.device_type(), (PP, DP), mesh_dim_names=("pp", "dp")
            )
        return _FSDPPipeline(_MESH, schedule_class, self.device)

    def _run_two_steps(self, pipeline: _FSDPPipeline) -> None:
        for step in range(2):  # no zero_grad: the second step accumulates
            pipeline.step(self, step)

    @parametrize("schedule_class", SCHEDULES)
    def test_fsdp_schedule(self, schedule_class: type) -> None:
        pipeline = self._pipeline(schedule_class)
        pipeline.schedule = schedule_class(
            pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss
        )
        self._run_two_steps(pipeline)

    @unittest.skipIf(
        "finalize_gradients"
        not in inspect.signature(ScheduleInterleaved1F1B.step).parameters,
        "step(finalize_gradients=...) needs torch 2.15+",
    )
    def test_fsdp_deferred_gradient_finalization(self) -> None:
        # Steps that defer FSDP's reduction (finalize_gradients=False) between finalized
        # ones, no zero_grad: the finalizing step must scale only what the deferred steps added.
        pipeline = self._pipeline(ScheduleInterleaved1F1B)
        pipeline.schedule = ScheduleInterleaved1F1B(
            pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss
        )
        for step, finalize in enumerate([True, False, True]):
            x, y = (t.to(self.device) for t in _batch(step))
            pipeline.schedule.step(x, target=y, finalize_gradients=finalize)
            reference_step(pipeline.ref, mse_loss, x, y, N_MICROBATCHES)
            if not finalize:
                continue
            full_grads = [
                [
                    p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    for p in module.parameters()
                ]
                for module in pipeline.modules
            ]
            check_on_all_ranks(
                lambda: pipeline.check_gradients(self, step, full_grads), self.device
            )

    def test_fsdp_dual_pipe_v_sequential_overlap_f_b(self) -> None:
        pipeline = self._pipeline(ScheduleDualPipeV)
        schedule = ScheduleDualPipeV(pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss)
        # Without a registered OVERLAP_F_B function torch runs the sub-actions in turn.
        schedule._comp_type_to_function_map.pop(sched.OVERLAP_F_B, None)
        pipeline.schedule = schedule
        self._run_two_steps(pipeline)

    def test_fsdp_dual_pipe_v_user_backward_functions(self) -> None:
        pipeline = self._pipeline(ScheduleDualPipeV)
        schedule = ScheduleDualPipeV(pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss)
        functions = _UserBackwardFunctions()
        schedule.register_custom_function(sched.FULL_BACKWARD, functions.backward)
        schedule.register_custom_function(sched.BACKWARD_WEIGHT, functions.backward)
        schedule.register_custom_function(sched.OVERLAP_F_B, functions.overlap_f_b)
        # The FSDP actions through the package's run_action (REDUCE_GRAD and, on
        # torch 2.15+, WAIT_REDUCE_GRAD as torch runs them).
        fsdp_types = [
            t
            for t in (sched.UNSHARD, sched.RESHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD)
            if t is not None
        ]
        ran: Counter = Counter()

        def fsdp_action(action: _Action, ctx: sched._PipelineContext) -> None:
            ran[action.computation_type] += 1
            run_action(action, ctx)

        for ctype in fsdp_types:
            schedule.register_custom_function(ctype, fsdp_action)
        lowered = Counter(
            a.computation_type
            for a in schedule.pipeline_order_with_comms[pipeline.mesh_pp_rank]
        )
        pipeline.schedule = schedule
        self._run_two_steps(pipeline)
        self.assertEqual(
            functions.calls, 2 * len(pipeline.stage_indices) * N_MICROBATCHES
        )
        self.assertEqual(ran, Counter({t: 2 * lowered[t] for t in fsdp_types}))
        if REDUCE_GRAD is not None:
            self.assertEqual(ran[REDUCE_GRAD], 2 * len(pipeline.stage_indices))

    def test_fsdp_compute_only_csv_with_forward_between_input_and_weight(self) -> None:
        pipeline = self._pipeline(_PipelineScheduleRuntime)
        schedule = _PipelineScheduleRuntime(
            pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss
        )
        load_csv(schedule, _COMPUTE_ONLY_CSV, "compute_only")
        lowered = schedule.pipeline_order_with_comms[pipeline.mesh_pp_rank]
        self.assertTrue(any(a.computation_type == sched.OVERLAP_F_B for a in lowered))
        pipeline.schedule = schedule
        self._run_two_steps(pipeline)

    @parametrize("written_without", ["REDUCE_GRAD", "WAIT_REDUCE_GRAD"])
    def test_fsdp_compute_comms_csv_with_overlap_f_b(
        self, written_without: str
    ) -> None:
        pipeline = self._pipeline(_PipelineScheduleRuntime)
        # The lowered DualPipeV schedule, written as a compute_comms CSV by hand
        # or for an older torch: without REDUCE_GRAD (and so without its
        # WAIT_REDUCE_GRAD; before torch 2.10), or with REDUCE_GRAD but without
        # WAIT_REDUCE_GRAD (torch 2.10 - 2.14).
        lowered = ScheduleDualPipeV(
            pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss
        ).pipeline_order_with_comms
        dropped = (
            {WAIT_REDUCE_GRAD}
            if written_without == "WAIT_REDUCE_GRAD"
            else {REDUCE_GRAD, WAIT_REDUCE_GRAD}
        )
        rows = [
            [a for a in lowered[rank] if a.computation_type not in dropped]
            for rank in sorted(lowered)
        ]
        self.assertTrue(
            any(a.computation_type == sched.OVERLAP_F_B for row in rows for a in row)
        )
        if REDUCE_GRAD is not None:
            self.assertEqual(
                any(a.computation_type == REDUCE_GRAD for row in rows for a in row),
                written_without != "REDUCE_GRAD",
            )
        schedule = _PipelineScheduleRuntime(
            pipeline.stages, N_MICROBATCHES, loss_fn=mse_loss
        )
        load_csv(
            schedule,
            "".join(",".join(map(str, row)) + "\n" for row in rows),
            "compute_comms",
        )
        self.assertEqual(
            _reduce_grad_actions(
                schedule.pipeline_order_with_comms[pipeline.mesh_pp_rank]
            ),
            _reduce_grad_actions(lowered[pipeline.mesh_pp_rank]),
        )
        pipeline.schedule = schedule
        self._run_two_steps(pipeline)


def _reduce_grad_actions(actions: list[_Action]) -> list[_Action]:
    """The REDUCE_GRAD and WAIT_REDUCE_GRAD actions, in order."""
    types = {t for t in (REDUCE_GRAD, WAIT_REDUCE_GRAD) if t is not None}
    return [a for a in actions if a.computation_type in types]


instantiate_parametrized_tests(ScheduleFSDPTest)
ScheduleFSDPTestNCCL = nccl_variant(ScheduleFSDPTest)


if __name__ == "__main__":
    run_tests()
