"""Per-action bookkeeping of ``_PipelineScheduleRuntime``, shared by every code path.

Upstream's ``_PipelineScheduleRuntime._step_microbatches`` does each action's
bookkeeping -- waiting the action's receives, counting backwards to find the
last one, fetching the loss, the V-schedule local hand-off, FSDP unshard
state -- inside a nested ``_perform_action`` that custom functions
(``register_custom_function``) cannot call, so each custom implementation of
an action copies it.  This module writes it once:

* :func:`prepare_compute_action` -- the part of a compute action that must
  run in schedule order, on the calling thread; returns the compute itself as
  a closure that may run on another thread (how OVERLAP_F_B overlaps);
* :func:`run_action` -- any single action, sequentially: the body of the
  schedule's ``perform_action`` method, which :func:`perform_action` calls;
* :func:`stage_index_to_stage` -- the schedule's local stages by index.

The patch table also installs them as the schedule methods upstream's
patches 0010-0011 add (``_local_stages``, ``perform_action``,
``prepare_compute_action``), which the OVERLAP_F_B handler calls.

On every supported torch the step loop runs as 0011 describes it: one
``PipelineContext`` per step, passed to every custom function of the step,
and every action without a custom function -- OVERLAP_F_B's sub-actions and
the communication actions included -- run by the schedule's
``perform_action`` method, so that a subclass overriding it sees every one.
See [Note: the step loop through the custom-function map].
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast, Protocol, TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules

from torch_pipelining_ext import _fsdp_stage
from torch_pipelining_ext._grad_scaling import scaled_loss
from torch_pipelining_ext._pipeline_context import (
    _communication_types,
    _compute_types,
    _computation_type,
    _CustomFunctionProtocol,
    _customizable_types,
    _reduce_grad_type,
    PipelineAction,
    PipelineContext,
)
from torch_pipelining_ext._schedule_state import (
    _ScheduleState,
    rank_label,
    schedule_state,
)


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase


__all__ = [
    "CustomFunctionRuntime",
    "CustomFunctionStage",
    "perform_action",
    "PreparedComputeAction",
    "prepare_compute_action",
    "run_action",
    "sequential_overlap_f_b",
    "stage_index_to_stage",
]


# --------------------------------------------------------------------------- #
# The seam: what custom functions may call on the schedule and its stages      #
# --------------------------------------------------------------------------- #


class CustomFunctionRuntime(Protocol):
    """The methods of ``ctx.schedule_ref`` a custom function may call.

    ``_PipelineScheduleRuntime`` gets them from upstream's patches 0010-0011
    (on every supported torch, the patch table installs them: each is a
    target of ``runtime_action_functions`` or ``runtime_custom_functions``
    in ``_patching/patches.json``, which a test checks).  The concurrent
    OVERLAP_F_B handler uses nothing else of the schedule.
    """

    def _local_stages(self) -> dict[int, _PipelineStageBase]:
        """The schedule's stages on this rank, by stage index."""
        ...

    def perform_action(self, action: PipelineAction, ctx: PipelineContext) -> None:
        """Run one action the built-in way (:func:`run_action`).

        The step loop calls it for every action without a custom function
        and for the sub-actions of OVERLAP_F_B run sequentially, so a
        subclass may override it to wrap every action.
        """
        ...

    def prepare_compute_action(
        self, action: PipelineAction, ctx: PipelineContext, *, wait_inputs: bool = True
    ) -> PreparedComputeAction:
        """A compute action's in-order bookkeeping; its compute, as a closure."""
        ...

    def register_custom_function(
        self, computation_type: Any, custom_function: _CustomFunctionProtocol
    ) -> None:
        """Run ``custom_function`` for every action of ``computation_type``."""
        ...


class CustomFunctionStage(Protocol):
    """The stage method an OVERLAP_F_B custom function calls (upstream patch 0001).

    Installed on ``_PipelineStageBase`` by the ``overlap_f_b`` patch.
    """

    def _unshard_fsdp_modules(self) -> None:
        """Unshard every ``fully_shard`` module of the stage (waits)."""
        ...


class _CountsBackwards(Protocol):
    """``schedule.backward_counter``: the ``_backward_counter.BackwardCounter`` the
    patch table installs, or torch's own where it has ``record_backward``."""

    def record_backward(self, stage_idx: int) -> bool: ...


class _ScheduleSince215(Protocol):
    """What torch 2.15+ keeps on ``_PipelineScheduleRuntime`` for steps that do
    not finalize their gradients (the torch mypy checks against may be older)."""

    _finalize_gradients: bool
    _deferred_stages: set[int]
    _finalized_stages: set[int]


class _StageSince215(Protocol):
    """The ``_PipelineStageBase`` methods torch 2.15+ added that the runtime calls."""

    def release_fwd_send_outputs(self, mb_index: int) -> None: ...

    def wait_for_gradient_reduction(self, grad_scale_factor: int) -> None: ...


# --------------------------------------------------------------------------- #
# The contract: stage lookup, compute actions, any action                      #
# --------------------------------------------------------------------------- #


def stage_index_to_stage(
    schedule: _PipelineScheduleRuntime,
) -> dict[int, _PipelineStageBase]:
    """The schedule's local stages, by stage index."""
    return {stage.stage_index: stage for stage in schedule._stages}


class _PendingRecv:
    """The receives of one compute action, taken from the schedule in schedule order.

    :func:`prepare_compute_action` takes them (RECV_F / RECV_B started them);
    :meth:`wait` waits for them, on whichever thread computes the action.
    """

    def __init__(
        self,
        schedule: _PipelineScheduleRuntime,
        recv_ops: dict[tuple[int, int], list[dist.Work]],
        action: PipelineAction,
        what: str,
    ) -> None:
        mb_index = action.microbatch_index
        assert mb_index is not None  # checked by prepare_compute_action
        works = recv_ops.pop((action.stage_index, mb_index), None)
        if works is None:
            raise AssertionError(
                f"[{rank_label(schedule)}] computing {action} before receiving its {what}"
            )
        self._schedule, self._action, self._works = schedule, action, works
        self.description = (
            f"the {what} of stage {action.stage_index} "
            f"microbatch {action.microbatch_index}"
        )

    def wait(self) -> None:
        """Wait for the receives; the error names the rank, the action and what it awaited."""
        try:
            _schedules._wait_batch_p2p(self._works)
        except Exception as e:
            raise RuntimeError(
                f"[{rank_label(self._schedule)}] {self._action}: waiting for "
                f"{self.description} failed"
            ) from e


class PreparedComputeAction:
    """A compute action whose in-order bookkeeping is done: returned by :func:`prepare_compute_action`.

    Calling it waits for the action's receives, if they are still pending,
    and computes.  :meth:`wait_inputs` waits for them alone, so that a caller
    (the concurrent OVERLAP_F_B handler) can tell waiting from computing.
    A class rather than a bare closure so that it can grow without breaking
    its callers (upstream patch 0011 returns it without ``wait_inputs``).
    """

    def __init__(
        self,
        action: PipelineAction,
        compute: Callable[[], None],
        recv: _PendingRecv | None,
    ) -> None:
        self.action = action
        self._compute, self._recv = compute, recv

    @property
    def inputs(self) -> str | None:
        """What the action still waits for (its activations or gradients), or None."""
        return None if self._recv is None else self._recv.description

    def wait_inputs(self) -> None:
        """Wait for the action's receives, once; nothing if there are none left."""
        recv, self._recv = self._recv, None
        if recv is not None:
            recv.wait()

    def __call__(self) -> None:
        self.wait_inputs()
        self._compute()


def _wait_now_or_defer(
    recv: _PendingRecv | None, wait_inputs: bool
) -> _PendingRecv | None:
    """``recv`` waited now (``wait_inputs``: returns None), or left pending for the compute."""
    if recv is not None and wait_inputs:
        recv.wait()
        return None
    return recv


def _forward_one_chunk(
    stage: _PipelineStageBase, mb_index: int, args: Any, kwargs: Any, save_output: bool
) -> Any:
    if save_output:  # torch 2.9's forward_one_chunk has no save_forward_output
        return stage.forward_one_chunk(mb_index, args, kwargs)
    return stage.forward_one_chunk(mb_index, args, kwargs, save_forward_output=False)


# [Note: losses keyed by microbatch]
# Torch's schedules append each last-stage loss to _internal_losses and read
# it back as _internal_losses[mb_index], which holds only while the forwards
# of the last stage finish in microbatch order.  With prepare_compute_action
# a custom function may finish them in any order (an OVERLAP_F_B computing
# its sub-actions concurrently, a FORWARD that defers its compute), and a
# backward would silently take another microbatch's loss.  The runtime keeps
# them keyed by microbatch (_LossesByMicrobatch, in _internal_losses' place,
# so that torch's own code reads them in microbatch order); upstream patch
# 0011 makes _internal_losses a dict.


class _LossesByMicrobatch(list):
    """``schedule._internal_losses`` keyed by microbatch; the list holds them in microbatch order.

    See [Note: losses keyed by microbatch].  Torch's own code paths (which
    compute in order) append and read by position; the runtime's
    :meth:`put` and :meth:`loss` go by microbatch index.
    """

    def __init__(self, losses: list[torch.Tensor]) -> None:
        super().__init__(losses)
        self._by_microbatch = dict(enumerate(losses))

    def put(self, mb_index: int, loss: torch.Tensor) -> None:
        """The loss of microbatch ``mb_index``; the list view stays in microbatch order."""
        self._by_microbatch[mb_index] = loss
        super().clear()
        super().extend(self._by_microbatch[k] for k in sorted(self._by_microbatch))

    def append(self, loss: torch.Tensor) -> None:
        self.put(len(self._by_microbatch), loss)

    def clear(self) -> None:
        self._by_microbatch.clear()
        super().clear()

    def loss(self, mb_index: int) -> torch.Tensor | None:
        """The loss of microbatch ``mb_index``; None (no losses yet) or an error naming the ones there."""
        loss = self._by_microbatch.get(mb_index)
        if loss is None and self._by_microbatch:
            raise RuntimeError(
                f"Loss for microbatch {mb_index} is not available. Available "
                f"losses for microbatches: {sorted(self._by_microbatch)}"
            )
        return loss


def _losses_by_microbatch(schedule: _PipelineScheduleRuntime) -> _LossesByMicrobatch:
    """The schedule's ``_internal_losses`` as :class:`_LossesByMicrobatch` (in schedule order, on the step's thread)."""
    losses = schedule._internal_losses
    if not isinstance(losses, _LossesByMicrobatch):
        # torch's list: what its own code appended, in microbatch order
        losses = schedule._internal_losses = _LossesByMicrobatch(losses)
    return losses


def _compute_loss(
    schedule: _PipelineScheduleRuntime,
    output: Any,
    target: Any,
    loss_kwargs: dict[str, Any] | None,
) -> torch.Tensor:
    if loss_kwargs is None:  # torch 2.9's _compute_loss has no loss_kwargs
        return schedule._compute_loss(output, target)
    return schedule._compute_loss(output, target, loss_kwargs)


def _finish_last_backward(
    schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase
) -> None:
    """Work after a stage's last backward of the step, on torches without REDUCE_GRAD.

    The stage's backward already ran FSDP's post-backward (torch 2.9's
    ``backward_maybe_with_nosync`` does so when ``last_backward``); what is
    left is scaling the gradients -- after FULL_BACKWARD and, unlike torch
    2.9's runtime loop, after BACKWARD_WEIGHT too.  Where torch has
    REDUCE_GRAD, that action does both and this is not called.
    """
    stage.scale_grads(schedule._n_microbatches if schedule.scale_grads else 1)


def prepare_compute_action(
    action: PipelineAction, ctx: PipelineContext, *, wait_inputs: bool = True
) -> PreparedComputeAction:
    """Do ``action``'s in-order bookkeeping now; return its compute as a closure.

    For FORWARD, FULL_BACKWARD, BACKWARD_INPUT and BACKWARD_WEIGHT.  On the
    calling thread, in schedule order:

    * FSDP: ``schedule._assert_unsharded(stage)`` (waits pending UNSHARD
      ops), as torch does; nested ``fully_shard`` modules are left to FSDP's
      hooks (the concurrent OVERLAP_F_B handler unshards them all first);
    * taking the receives of (stage, microbatch) from the schedule and
      waiting for them, unless the neighbouring stage is local (V-schedule
      hand-off, no send/recv); with ``wait_inputs=False`` they are only
      taken, and the returned compute waits for them when called;
    * FULL_BACKWARD / BACKWARD_WEIGHT: counting the backward in
      ``schedule.backward_counter`` to decide ``last_backward``;
    * fetching the loss for a backward of the last stage.

    The returned ``compute()`` waits for receives still pending, runs the
    stage (forward and loss, or backward), hands outputs or gradients to a
    local neighbouring stage and, on torches without REDUCE_GRAD, does the
    last-backward work.  Of the schedule's state it only stores a forward's
    loss under its microbatch (see [Note: losses keyed by microbatch]), so
    it may run on another thread while another action's compute runs, and
    the computes of a stage's forwards may finish in any order.  Not thread
    safe otherwise: see ``PipelineContext``.

    Args:
        action: a compute action (not OVERLAP_F_B: prepare its sub-actions).
        ctx: the step's context, as passed to custom functions.
        wait_inputs: wait for the receives now (default), or leave them to
            the compute, on whichever thread runs it, so that it can start
            when its own input is there (``wait_inputs()`` of the result
            waits for them alone).
    """
    schedule = ctx.schedule_ref
    stages = stage_index_to_stage(schedule)
    if action.computation_type not in _compute_types():
        raise ValueError(
            f"prepare_compute_action: {action} is not a FORWARD or backward action"
        )
    if action.microbatch_index is None:
        raise AssertionError(f"{action=} missing mb_index")
    schedule._assert_unsharded(stages[action.stage_index])
    if action.computation_type == _schedules.FORWARD:
        return _prepare_forward(action, ctx, stages, wait_inputs)
    return _prepare_backward(action, schedule, stages, wait_inputs)


def _prepare_forward(
    action: PipelineAction,
    ctx: PipelineContext,
    stages: dict[int, _PipelineStageBase],
    wait_inputs: bool,
) -> PreparedComputeAction:
    schedule = ctx.schedule_ref
    stage_idx, mb_index = action.stage_index, action.microbatch_index
    assert mb_index is not None  # checked by prepare_compute_action
    stage = stages[stage_idx]
    recv = None
    if not stage.is_first and stage_idx - 1 not in stages:
        recv = _PendingRecv(schedule, schedule.fwd_recv_ops, action, "activations")
    recv = _wait_now_or_defer(recv, wait_inputs)
    # torch's own _PipelineContext (where the package's is not installed) has
    # no step options: the step's are on the schedule's state
    state = schedule_state(schedule)
    return_outputs = getattr(ctx, "return_outputs", state.return_outputs)
    loss_kwargs = getattr(ctx, "loss_kwargs", state.loss_kwargs)
    next_stage = stages.get(stage_idx + 1)
    losses = (
        _losses_by_microbatch(schedule)
        if stage.is_last and schedule._loss_fn is not None
        else None
    )
    arg_mbs = (
        ctx.arg_mbs if ctx.arg_mbs is not None else [()] * schedule._n_microbatches
    )
    kwarg_mbs = (
        ctx.kwarg_mbs if ctx.kwarg_mbs is not None else [{}] * schedule._n_microbatches
    )

    def forward() -> None:
        output = _forward_one_chunk(
            stage, mb_index, arg_mbs[mb_index], kwarg_mbs[mb_index], return_outputs
        )
        if losses is not None:
            target = ctx.target_mbs[mb_index]  # type: ignore[index]
            losses.put(mb_index, _compute_loss(schedule, output, target, loss_kwargs))
        if next_stage is not None:
            next_stage.set_local_fwd_input(output, mb_index)

    return PreparedComputeAction(action, forward, recv)


def _prepare_backward(
    action: PipelineAction,
    schedule: _PipelineScheduleRuntime,
    stages: dict[int, _PipelineStageBase],
    wait_inputs: bool,
) -> PreparedComputeAction:
    stage_idx, mb_index = action.stage_index, action.microbatch_index
    assert mb_index is not None  # checked by prepare_compute_action
    stage, ctype = stages[stage_idx], action.computation_type
    loss, recv = None, None
    if ctype != _schedules.BACKWARD_WEIGHT:
        if not stage.is_last and stage_idx + 1 not in stages:
            recv = _PendingRecv(schedule, schedule.bwd_recv_ops, action, "gradients")
        recv = _wait_now_or_defer(recv, wait_inputs)
        if stage.is_last and schedule._loss_fn is not None:
            loss = scaled_loss(schedule, _losses_by_microbatch(schedule).loss(mb_index))
    last_backward = False
    if ctype != _schedules.BACKWARD_INPUT:
        counter = cast(_CountsBackwards, schedule.backward_counter)
        last_backward = counter.record_backward(stage_idx)
    finish_in_backward = last_backward and _reduce_grad_type() is None
    prev_stage = stages.get(stage_idx - 1)

    def backward() -> None:
        if ctype == _schedules.BACKWARD_WEIGHT:
            stage.backward_weight_one_chunk(mb_index, last_backward=last_backward)
        else:
            stage.backward_one_chunk(
                mb_index,
                loss=loss,
                full_backward=ctype == _schedules.FULL_BACKWARD,
                last_backward=last_backward,
            )
            # eval() runs the backward actions as no-ops: no gradient to hand on
            if prev_stage is not None and stage.has_backward:
                prev_stage.set_local_bwd_input(
                    stage.get_local_bwd_output(mb_index), mb_index
                )
        if finish_in_backward:
            _finish_last_backward(schedule, stage)

    return PreparedComputeAction(action, backward, recv)


def run_action(action: PipelineAction, ctx: PipelineContext) -> None:
    """Run one action of the lowered schedule, sequentially: the built-in ``perform_action``.

    Compute actions go through :func:`prepare_compute_action`; SEND_F/SEND_B
    start their sends, which the step waits before it returns (torch 2.15+:
    which WAIT_SEND_F/WAIT_SEND_B wait); RECV_F/RECV_B start their receives
    and store them in ``schedule.fwd_recv_ops`` / ``bwd_recv_ops`` for the
    compute action to wait; UNSHARD/RESHARD act on every FSDP module of the
    stage; REDUCE_GRAD and WAIT_REDUCE_GRAD (where torch has them) reduce
    and scale the gradients as the installed torch does (see
    :func:`_reduce_grad`).

    Raises:
        ValueError: OVERLAP_F_B (run its ``sub_actions``) or an unknown type.
    """
    schedule = ctx.schedule_ref
    ctype = action.computation_type
    if ctype in _compute_types():
        prepare_compute_action(action, ctx)()
        return
    if ctype == _schedules.OVERLAP_F_B:
        raise ValueError(
            f"run_action runs single actions; run the sub_actions of {action}"
        )

    stage = stage_index_to_stage(schedule)[action.stage_index]
    if ctype in (_schedules.SEND_F, _schedules.SEND_B):
        _run_send(action, schedule, stage)
    elif ctype is not None and ctype in (
        _computation_type("WAIT_SEND_F"),
        _computation_type("WAIT_SEND_B"),
    ):
        _wait_send(action, schedule)
    elif ctype in (_schedules.RECV_F, _schedules.RECV_B):
        _run_recv(action, schedule, stage)
    elif ctype in (_schedules.UNSHARD, _schedules.RESHARD):
        _run_unshard_or_reshard(action, schedule, stage)
    elif ctype is not None and ctype == _reduce_grad_type():
        _reduce_grad(schedule, stage)
    elif ctype is not None and ctype == _computation_type("WAIT_REDUCE_GRAD"):
        _wait_reduce_grad(schedule, stage)
    else:
        raise ValueError(f"{action=} is unknown or unsupported")


def _run_send(
    action: PipelineAction,
    schedule: _PipelineScheduleRuntime,
    stage: _PipelineStageBase,
) -> None:
    """SEND_F / SEND_B: start the sends, kept in the step's pending sends.

    Torch 2.15+ (the state has a send tracker): registered under (type,
    stage, microbatch) for the WAIT_SEND action that retires them (a forward
    send's outputs are released then), as torch's loop does.
    """
    mb_index = action.microbatch_index
    if mb_index is None:
        raise AssertionError(f"{action=} missing mb_index")
    forward = action.computation_type == _schedules.SEND_F
    state = schedule_state(schedule)
    tracker = state.send_tracker
    key = (action.computation_type, action.stage_index, mb_index)
    if tracker is not None:
        tracker.check_can_register(key)
    ops = (
        stage.get_fwd_send_ops(mb_index)
        if forward
        else stage.get_bwd_send_ops(mb_index)
    )
    works = _schedules._batch_p2p(ops)
    if tracker is None:
        state.pending_sends.append(works)
        return
    release = functools.partial(
        cast(_StageSince215, stage).release_fwd_send_outputs, mb_index
    )
    tracker.register(key, ops, works, release if forward else None)


def _wait_send(action: PipelineAction, schedule: _PipelineScheduleRuntime) -> None:
    """WAIT_SEND_F / WAIT_SEND_B (torch 2.15+): wait and retire the matching send."""
    tracker = schedule_state(schedule).send_tracker
    if tracker is None:
        raise AssertionError(f"{action}: no step in progress tracks its send")
    wait_f = action.computation_type == _computation_type("WAIT_SEND_F")
    send_type = _schedules.SEND_F if wait_f else _schedules.SEND_B
    tracker.wait((send_type, action.stage_index, action.microbatch_index))


def _run_recv(
    action: PipelineAction,
    schedule: _PipelineScheduleRuntime,
    stage: _PipelineStageBase,
) -> None:
    """RECV_F / RECV_B: start the receives, for the compute action to wait."""
    stage_idx, mb_index = action.stage_index, action.microbatch_index
    if mb_index is None:
        raise AssertionError(f"{action=} missing mb_index")
    forward = action.computation_type == _schedules.RECV_F
    recv_ops = schedule.fwd_recv_ops if forward else schedule.bwd_recv_ops
    get_ops = stage.get_fwd_recv_ops if forward else stage.get_bwd_recv_ops
    if (stage_idx, mb_index) in recv_ops:
        raise AssertionError(
            f"Recv twice for {stage_idx=} {mb_index=} without executing "
            f"{'forward' if forward else 'backward'}"
        )
    recv_ops[(stage_idx, mb_index)] = _schedules._batch_p2p(get_ops(mb_index))


def _run_unshard_or_reshard(
    action: PipelineAction,
    schedule: _PipelineScheduleRuntime,
    stage: _PipelineStageBase,
) -> None:
    """UNSHARD / RESHARD of the stage's FSDP modules (nothing for a stage without).

    An UNSHARD is skipped for a stage kept unsharded from a step that did not
    finalize its gradients, a RESHARD for one the gradient reduction resharded.
    """
    if not _fsdp_stage.stage_uses_fsdp(stage):
        return
    unshard = action.computation_type == _schedules.UNSHARD
    marker = "_deferred_stages" if unshard else "_finalized_stages"
    if _take_marker(schedule, marker, action.stage_index):
        return
    if unshard:
        _unshard(schedule, stage, action.stage_index)
    else:
        _reshard(schedule, stage, action.stage_index)


def _unshard(
    schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase, stage_idx: int
) -> None:
    if stage_idx in schedule.unsharded_stages or stage_idx in schedule.unshard_ops:
        raise AssertionError(f"Unsharding the same {stage_idx=} twice")
    schedule.unshard_ops[stage_idx] = _fsdp_stage.unshard_async(stage)


def _reshard(
    schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase, stage_idx: int
) -> None:
    finalize = getattr(schedule, "_finalize_gradients", True)
    if (
        not finalize
        and schedule.backward_counter[stage_idx] == schedule._n_microbatches
    ):
        # keep the accumulated gradients unsharded
        cast(_ScheduleSince215, schedule)._deferred_stages.add(stage_idx)
        return
    if stage_idx not in schedule.unsharded_stages:
        raise AssertionError(f"Resharding {stage_idx=} without unsharding")
    if stage_idx in schedule.unshard_ops:
        raise AssertionError(f"Resharding {stage_idx=} before finishing unshard")
    _fsdp_stage.reshard_stage(stage)
    schedule.unsharded_stages.remove(stage_idx)


# [Note: custom functions and the sub-actions of OVERLAP_F_B]
# Which runs a FORWARD or backward that is a sub-action of an OVERLAP_F_B: a
# custom function registered for its type, or the built-in action?  The rule
# (upstream patch 0011's step loop, and the package's on every torch):
#
# * without a custom OVERLAP_F_B function, each sub-action runs as a plain
#   action of its type would: the custom function registered for its type,
#   else perform_action.  A custom FORWARD sees every forward of the step.
#   The package's default concurrent handler is not a custom function: while
#   a custom function is registered for a compute type, the schedule runs
#   its OVERLAP_F_B sequentially (sequential_overlap_f_b), so that rule holds;
# * a custom OVERLAP_F_B function owns its sub-actions: it decides how each
#   runs, and perform_action / prepare_compute_action are the built-in
#   behaviour, not a dispatch to the custom functions.


def sequential_overlap_f_b(action: PipelineAction, ctx: PipelineContext) -> None:
    """Run an OVERLAP_F_B action as torch does: its sub-actions one after the other.

    Custom-function protocol.  Each sub-action goes through the custom
    function registered for its type, or :func:`perform_action` (the
    schedule's ``perform_action`` method), as 0011's step loop runs an
    OVERLAP_F_B without a custom function (see [Note: custom functions and
    the sub-actions of OVERLAP_F_B]).  Registered for OVERLAP_F_B, it opts
    one schedule out of the concurrent handler (``overlap.overlap_f_b``)::

        schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b)
    """
    functions = ctx.schedule_ref._comp_type_to_function_map
    for sub_action in action.sub_actions or ():
        function = functions.get(sub_action.computation_type) or perform_action
        function(sub_action, ctx)


def perform_action(action: PipelineAction, ctx: PipelineContext) -> None:
    """Run one action as ``ctx.schedule_ref`` runs it: its ``perform_action`` method.

    Custom-function protocol.  Every schedule's custom-function map holds it
    for each computation type ``register_custom_function`` accepts (except
    OVERLAP_F_B, see :class:`_FunctionMapWithDefaults`), so every action
    without a custom function, plain or a sub-action of OVERLAP_F_B, reaches
    the schedule's method -- :func:`run_action`, unless a subclass overrides
    it (an override calls ``super().perform_action``, not this function).  A
    custom function that only adds to an action calls it, or the method::

        def forward_with_timing(action, ctx):
            start = time.perf_counter()
            ctx.schedule_ref.perform_action(action, ctx)
            times.append(time.perf_counter() - start)


        schedule.register_custom_function(FORWARD, forward_with_timing)
    """
    method = getattr(ctx.schedule_ref, "perform_action", None)
    if method is None:  # a schedule built before unpatch() removed the method
        run_action(action, ctx)
    else:
        method(action, ctx)


# The schedule methods upstream's patches 0010-0011 add, installed by the patch
# table (the OVERLAP_F_B handler calls them).


def _perform_action_method(
    self: _PipelineScheduleRuntime, action: PipelineAction, ctx: PipelineContext
) -> None:
    """Run one action (not OVERLAP_F_B) the built-in way: :func:`run_action`.

    The step loop calls it for every action without a custom function and
    for the sub-actions of OVERLAP_F_B; custom functions call it to run the
    actions, or the sub-actions of an OVERLAP_F_B, they do not implement
    themselves.  ``ctx`` is the step's context, as custom functions receive
    it.
    """
    run_action(action, ctx)


def _prepare_compute_action_method(
    self: _PipelineScheduleRuntime,
    action: PipelineAction,
    ctx: PipelineContext,
    *,
    wait_inputs: bool = True,
) -> PreparedComputeAction:
    """``_PipelineScheduleRuntime.prepare_compute_action``: :func:`prepare_compute_action`."""
    return prepare_compute_action(action, ctx, wait_inputs=wait_inputs)


def _take_marker(schedule: _PipelineScheduleRuntime, name: str, stage_idx: int) -> bool:
    """Remove ``stage_idx`` from the schedule's set ``name`` (torch 2.15+); whether it was there."""
    marked = getattr(schedule, name, None)
    if marked is None or stage_idx not in marked:
        return False
    marked.remove(stage_idx)
    return True


def _grad_scale_factor(schedule: _PipelineScheduleRuntime) -> int:
    return schedule._n_microbatches if schedule.scale_grads else 1


def _reduce_grad(schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase) -> None:
    """REDUCE_GRAD as the installed torch runs it.

    Before torch 2.15, ``perform_reduce_grad`` runs FSDP's post-backward and
    scales the gradients.  From 2.15 on, an FSDP stage only starts its
    reduce-scatter here (WAIT_REDUCE_GRAD waits and scales), and a step with
    ``finalize_gradients=False`` defers the reduction to a later step.
    """
    if not hasattr(stage, "start_gradient_reduction"):
        stage.perform_reduce_grad(_grad_scale_factor(schedule))
        return
    if not schedule._has_backward:
        return
    stage_idx = stage.stage_index
    deferral = cast(_ScheduleSince215, schedule)
    if not _fsdp_stage.stage_uses_fsdp(stage):
        stage.perform_reduce_grad(_grad_scale_factor(schedule))
    elif not deferral._finalize_gradients:
        deferral._deferred_stages.add(stage_idx)
    else:
        stage.start_gradient_reduction()
        schedule.unsharded_stages.discard(stage_idx)
        deferral._deferred_stages.discard(stage_idx)
        deferral._finalized_stages.add(stage_idx)


def _wait_reduce_grad(
    schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase
) -> None:
    """WAIT_REDUCE_GRAD (torch 2.15+): wait for the FSDP reduce-scatter REDUCE_GRAD started, then scale."""
    if (
        schedule._has_backward
        and cast(_ScheduleSince215, schedule)._finalize_gradients
        and _fsdp_stage.stage_uses_fsdp(stage)
    ):
        cast(_StageSince215, stage).wait_for_gradient_reduction(
            _grad_scale_factor(schedule)
        )


# --------------------------------------------------------------------------- #
# Every torch: the step loop as 0011 describes it                              #
# --------------------------------------------------------------------------- #

# [Note: the step loop through the custom-function map]
# Upstream patch 0011's step loop builds one PipelineContext per step, passes
# it to every custom function of the step, and runs every other action (and
# the sub-actions of an OVERLAP_F_B without a custom function) with
# self.perform_action(action, ctx).  The package gets that from torch's own
# loop (2.10+; ours on 2.9, _compat_29) without replacing it, through the one
# thing the loop consults for every action, the schedule's
# _comp_type_to_function_map (a _CustomFunctionMap):
#
# * it holds, besides what the user registers, perform_action for every
#   customizable type and an OVERLAP_F_B function that runs the sub-actions
#   with perform_action (or the concurrent handler, overlap/_install.py);
#   perform_action calls the schedule's method, so an override sees them;
# * during a step of the patched loop it also answers for the communication
#   actions custom functions may not replace (SEND/RECV, 2.15's send waits),
#   with perform_action, so torch's nested _perform_action runs nothing;
# * during such a step, a lookup (map[computation_type], what the loop does)
#   returns a call of the function with the step's one context
#   (_ScheduleState.step_context: the first context the loop built in the
#   step, with the step's options).
#
# Outside a step, and with get, iteration and len at any time, the map shows
# what it holds, as torch's does.

_FUNCTION_MAP = "_comp_type_to_function_map"


def _call_with_step_context(
    state: _ScheduleState,
    function: _CustomFunctionProtocol,
    action: PipelineAction,
    ctx: PipelineContext,
) -> None:
    function(action, state.step_context(ctx))


class _CustomFunctionMap(dict):
    """A schedule's custom-function map: computation type -> function.

    See [Note: the step loop through the custom-function map].  ``state`` is
    the schedule's ``_ScheduleState``.
    """

    def __init__(
        self,
        functions: dict,
        state: _ScheduleState,
        defaults: _FunctionMapWithDefaults | None = None,
    ) -> None:
        super().__init__(functions)
        self._state = state
        self._defaults = defaults

    def _overlap_function(self, function: Callable[..., None]) -> Callable[..., None]:
        """The OVERLAP_F_B function to run: see [Note: custom functions and the sub-actions of OVERLAP_F_B].

        ``function``, the map's, unless it is the default and a compute type
        has a custom function: then the sub-actions one after the other.
        """
        overlap_is_default = self._defaults is not None and self._defaults.is_default(
            _schedules.OVERLAP_F_B, function
        )
        if overlap_is_default and any(
            self.get(t, perform_action) is not perform_action for t in _compute_types()
        ):
            return sequential_overlap_f_b
        return function

    def _runs_communication(self, computation_type: Any) -> bool:
        return self._state.in_step and computation_type in _communication_types()

    def __contains__(self, computation_type: object) -> bool:
        return super().__contains__(computation_type) or self._runs_communication(
            computation_type
        )

    def __getitem__(self, computation_type: Any) -> Callable[..., None]:
        function = self.get(computation_type)
        if not self._state.in_step:
            return super().__getitem__(computation_type)
        if function is None:
            if not self._runs_communication(computation_type):
                raise KeyError(computation_type)
            function = perform_action
        elif computation_type == _schedules.OVERLAP_F_B:
            function = self._overlap_function(function)
        return functools.partial(_call_with_step_context, self._state, function)


class _FunctionMapWithDefaults:
    """Class-level data descriptor for ``_PipelineScheduleRuntime._comp_type_to_function_map``.

    Every schedule's custom-function map is a :class:`_CustomFunctionMap`
    that starts with this module's functions: :func:`perform_action` for
    each type ``register_custom_function`` accepts and
    :meth:`overlap_function` for OVERLAP_F_B (see [Note: the step loop
    through the custom-function map]).

    The map is assigned in ``__init__`` (torch 2.10+) or created on first use
    (torch 2.9); either way it lives in the instance ``__dict__`` under the
    same name, so removing the descriptor (``unpatch()``) leaves every schedule
    with its map.  Registering a function replaces a default without the
    "already registered" warning (:func:`_make_register_custom_function`).
    """

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[_FUNCTION_MAP]
        except KeyError:
            return obj.__dict__.setdefault(_FUNCTION_MAP, self._with_defaults(obj, {}))

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[_FUNCTION_MAP] = self._with_defaults(obj, value)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(_FUNCTION_MAP, None)

    def overlap_function(self) -> _CustomFunctionProtocol:
        """The default OVERLAP_F_B function: its sub-actions one after the other."""
        return sequential_overlap_f_b

    def defaults(self) -> dict[Any, _CustomFunctionProtocol]:
        """Computation type -> the function a new schedule's map holds for it."""
        functions: dict[Any, _CustomFunctionProtocol] = dict.fromkeys(
            _customizable_types(), perform_action
        )
        functions[_schedules.OVERLAP_F_B] = self.overlap_function()
        return functions

    def is_default(self, computation_type: Any, function: Any) -> bool:
        """Whether ``function`` is what this descriptor puts in a new map for ``computation_type``."""
        return function is self.defaults().get(computation_type)

    def _with_defaults(self, obj: Any, functions: dict) -> _CustomFunctionMap:
        function_map = _CustomFunctionMap(functions, schedule_state(obj), self)
        for computation_type, function in self.defaults().items():
            function_map.setdefault(computation_type, function)
        return function_map


def _make_register_custom_function(
    original: Callable[..., None],
) -> Callable[..., None]:
    """``register_custom_function`` that replaces one of the package's default functions quietly.

    Registering a function for a type whose entry is still the default
    (:class:`_FunctionMapWithDefaults`) is a first registration for the user:
    it should not log "already registered".  Replacing a function the user
    registered still warns, as torch does.
    """

    def register_custom_function(
        self: Any, computation_type: Any, custom_function: Callable[..., None]
    ) -> None:
        descriptor = inspect.getattr_static(type(self), _FUNCTION_MAP, None)
        function_map = self._comp_type_to_function_map
        function = function_map.get(computation_type)
        if (
            isinstance(descriptor, _FunctionMapWithDefaults)
            and function is not None
            and descriptor.is_default(computation_type, function)
        ):
            del function_map[computation_type]
        original(self, computation_type, custom_function)

    register_custom_function.__doc__ = original.__doc__
    register_custom_function.__wrapped__ = original  # type: ignore[attr-defined]
    return register_custom_function
