"""Per-action bookkeeping of ``_PipelineScheduleRuntime``, shared by every code path.

Upstream file: ``torch/distributed/pipelining/schedules.py``.

Upstream's ``_PipelineScheduleRuntime._step_microbatches`` does each action's
bookkeeping -- waiting the action's receives, counting backwards to find the
last one, fetching the loss, the V-schedule local hand-off, FSDP unshard
state -- inside a nested ``_perform_action`` that custom functions
(``register_custom_function``) cannot call, so each custom implementation of
an action copies it.  This module writes it once:

* :func:`prepare_compute_action` -- the part of a compute action that must
  run in schedule order, on the calling thread; returns the compute itself as
  a closure that may run on another thread (how OVERLAP_F_B overlaps);
* :func:`run_action` -- any single action, sequentially, and
  :func:`perform_action`, the same as a custom function;
* :func:`stage_index_to_stage` -- the schedule's local stages by index.

On every supported torch every action custom functions may replace runs this
code: each schedule's custom-function map starts with :func:`perform_action`
for those types (:class:`_FunctionMapWithDefaults`), which torch's step loop
(2.10+) calls instead of its nested ``_perform_action``; this package's loop
(2.9) calls :func:`run_action` for the rest.  The OVERLAP_F_B handler and
users' custom functions call the same functions, so a FORWARD runs the same
bookkeeping whether or not it is inside an OVERLAP_F_B.  Only the
communication actions torch does not let custom functions replace (SEND/RECV,
and 2.15's send waits) stay torch's on 2.10+.

torch 2.9 has no custom-function runtime.  The pieces upstream added in the
2.10 cycle (the PR that introduced ``register_custom_function`` and
``_PipelineContext`` in ``schedules.py``) are provided here for it, and the
patch table installs them only where a feature probe finds them missing:

* ``_PipelineContext`` and ``register_custom_function`` with upstream's
  semantics;
* the per-schedule state upstream keeps on the schedule (``fwd_recv_ops``,
  ``bwd_recv_ops``, ``unshard_ops``, ``unsharded_stages``,
  ``_comp_type_to_function_map``) and ``_assert_unsharded``;
* a step loop that dispatches custom functions and otherwise calls
  :func:`run_action` -- the whole of 2.10's loop is the ``for`` statement in
  :func:`_runtime_step_microbatches`;
* OVERLAP_F_B kept through lowering (2.9's ``_add_send_recv`` flattens it).

On every torch, :func:`_make_step_context` wraps the step loop (torch's, or
ours on 2.9) once: each step begins and ends on the schedule's
``_schedule_state._ScheduleState``, which carries the step's
``return_outputs`` / ``loss_kwargs`` (which ``_PipelineContext`` does not
carry) to :func:`prepare_compute_action`, the sends to wait and the
OVERLAP_F_B worker to close when the step ends, and the time step and action
that any exception the step raises is noted with.  Where torch has a REDUCE_GRAD
action, :func:`_make_prepare_comms` adds the REDUCE_GRAD a
``compute_comms`` schedule lacks, so gradients are reduced whatever the CSV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules
from torch.profiler import record_function

from torch_pipelining_ext import _fsdp_stage
from torch_pipelining_ext._schedule_state import rank_label, schedule_state


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase


__all__ = ["perform_action", "prepare_compute_action", "run_action", "sequential_overlap_f_b", "stage_index_to_stage"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- #
# Context passed to custom functions (upstream: schedules._PipelineContext)    #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _PipelineContext:
    """Context passed to custom functions during pipeline execution.

    Same fields as upstream's ``schedules._PipelineContext`` (2.10 cycle);
    installed into ``torch.distributed.pipelining.schedules`` where missing.
    """

    schedule_ref: Any
    arg_mbs: list[tuple] | None = None
    kwarg_mbs: list[dict] | None = None
    target_mbs: list | None = None
    losses: list | None = None


class _CustomFunctionProtocol(Protocol):
    def __call__(self, action: _Action, ctx: _PipelineContext) -> None: ...


def _computation_type(name: str) -> Any:
    """``_ComputationType.<name>``, or ``None`` where this torch lacks it."""
    return getattr(_schedules._ComputationType, name, None)


def _reduce_grad_type() -> Any:
    return _computation_type("REDUCE_GRAD")


def _compute_types() -> tuple[Any, ...]:
    """The actions :func:`prepare_compute_action` handles."""
    return (_schedules.FORWARD, _schedules.FULL_BACKWARD, _schedules.BACKWARD_INPUT, _schedules.BACKWARD_WEIGHT)


# --------------------------------------------------------------------------- #
# The contract: stage lookup, compute actions, any action                      #
# --------------------------------------------------------------------------- #


def stage_index_to_stage(schedule: _PipelineScheduleRuntime) -> dict[int, _PipelineStageBase]:
    """The schedule's local stages, by stage index."""
    return {stage.stage_index: stage for stage in schedule._stages}


def _wait_recv(
    schedule: _PipelineScheduleRuntime,
    recv_ops: dict[tuple[int, int], list[dist.Work]],
    action: _Action,
    what: str,
) -> None:
    key = (action.stage_index, action.microbatch_index)
    works = recv_ops.pop(key, None)
    if works is None:
        raise AssertionError(f"[{rank_label(schedule)}] computing {action} before receiving its {what}")
    try:
        _schedules._wait_batch_p2p(works)
    except Exception as e:
        raise RuntimeError(
            f"[{rank_label(schedule)}] {action}: waiting for the {what} of stage "
            f"{action.stage_index} microbatch {action.microbatch_index} failed"
        ) from e


def _forward_one_chunk(stage: _PipelineStageBase, mb_index: int, args: Any, kwargs: Any, save_output: bool) -> Any:
    if save_output:  # torch 2.9's forward_one_chunk has no save_forward_output
        return stage.forward_one_chunk(mb_index, args, kwargs)
    return stage.forward_one_chunk(mb_index, args, kwargs, save_forward_output=False)


def _maybe_compute_loss(
    schedule: _PipelineScheduleRuntime,
    stage: _PipelineStageBase,
    output: Any,
    target_mbs: list | None,
    mb_index: int,
    loss_kwargs: dict[str, Any] | None,
) -> None:
    if loss_kwargs is None:  # torch 2.9's _maybe_compute_loss has no loss_kwargs
        schedule._maybe_compute_loss(stage, output, target_mbs, mb_index)
    else:
        schedule._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)


def _finish_last_backward(schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase) -> None:
    """Work after a stage's last backward of the step, on torches without REDUCE_GRAD.

    The stage's backward already ran FSDP's post-backward (torch 2.9's
    ``backward_maybe_with_nosync`` does so when ``last_backward``); what is
    left is scaling the gradients -- after FULL_BACKWARD and, unlike torch
    2.9's runtime loop, after BACKWARD_WEIGHT too.  Where torch has
    REDUCE_GRAD, that action does both and this is not called.
    """
    stage.scale_grads(schedule._n_microbatches if schedule.scale_grads else 1)


def prepare_compute_action(action: _Action, ctx: _PipelineContext) -> Callable[[], None]:
    """Do ``action``'s in-order bookkeeping now; return its compute as a closure.

    For FORWARD, FULL_BACKWARD, BACKWARD_INPUT and BACKWARD_WEIGHT.  On the
    calling thread, in schedule order:

    * FSDP: ``schedule._assert_unsharded(stage)`` (waits pending UNSHARD
      ops), as torch does; nested ``fully_shard`` modules are left to FSDP's
      hooks (the concurrent OVERLAP_F_B handler unshards them all first);
    * waiting the receives of (stage, microbatch), unless the neighbouring
      stage is local (V-schedule hand-off, no send/recv);
    * FULL_BACKWARD / BACKWARD_WEIGHT: counting the backward in
      ``schedule.backward_counter`` to decide ``last_backward``;
    * fetching the loss for a backward of the last stage.

    The returned ``compute()`` runs the stage (forward and loss, or backward),
    hands outputs or gradients to a local neighbouring stage and, on torches
    without REDUCE_GRAD, does the last-backward work.  Of the schedule's
    state it only appends a forward's loss to ``_internal_losses``, so it may
    run on another thread while another action's closure runs.

    Args:
        action: a compute action (not OVERLAP_F_B: prepare its sub-actions).
        ctx: the step's context, as passed to custom functions.
    """
    schedule = ctx.schedule_ref
    stages = stage_index_to_stage(schedule)
    ctype = action.computation_type
    stage_idx, mb_index = action.stage_index, action.microbatch_index
    if ctype not in _compute_types():
        raise ValueError(f"prepare_compute_action: {action} is not a FORWARD or backward action")
    if mb_index is None:
        raise AssertionError(f"{action=} missing mb_index")
    stage = stages[stage_idx]

    schedule._assert_unsharded(stage)

    if ctype == _schedules.FORWARD:
        if not stage.is_first and stage_idx - 1 not in stages:
            _wait_recv(schedule, schedule.fwd_recv_ops, action, "activations")
        state = schedule_state(schedule)
        return_outputs, loss_kwargs = state.return_outputs, state.loss_kwargs
        next_stage = stages.get(stage_idx + 1)
        arg_mbs = ctx.arg_mbs if ctx.arg_mbs is not None else [()] * schedule._n_microbatches
        kwarg_mbs = ctx.kwarg_mbs if ctx.kwarg_mbs is not None else [{}] * schedule._n_microbatches

        def forward() -> None:
            output = _forward_one_chunk(stage, mb_index, arg_mbs[mb_index], kwarg_mbs[mb_index], return_outputs)
            _maybe_compute_loss(schedule, stage, output, ctx.target_mbs, mb_index, loss_kwargs)
            if next_stage is not None:
                next_stage.set_local_fwd_input(output, mb_index)

        return forward

    loss = None
    if ctype != _schedules.BACKWARD_WEIGHT:
        if not stage.is_last and stage_idx + 1 not in stages:
            _wait_recv(schedule, schedule.bwd_recv_ops, action, "gradients")
        loss = schedule._maybe_get_loss(stage, mb_index)
    last_backward = False
    if ctype != _schedules.BACKWARD_INPUT:
        last_backward = schedule.backward_counter.record_backward(stage_idx)
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
            if prev_stage is not None:
                prev_stage.set_local_bwd_input(stage.get_local_bwd_output(mb_index), mb_index)
        if finish_in_backward:
            _finish_last_backward(schedule, stage)

    return backward


def _append_send(schedule: _PipelineScheduleRuntime, send_ops: list | None, works: list[dist.Work]) -> None:
    if send_ops is None:
        send_ops = schedule_state(schedule).pending_sends
    send_ops.append(works)


def run_action(action: _Action, ctx: _PipelineContext, send_ops: list[list[dist.Work]] | None = None) -> None:
    """Run one action of the lowered schedule, sequentially.

    Compute actions go through :func:`prepare_compute_action`; SEND_F/SEND_B
    start their sends (appended to ``send_ops``, or waited before the step
    returns when ``send_ops`` is None); RECV_F/RECV_B start their receives
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
        raise ValueError(f"run_action runs single actions; run the sub_actions of {action}")

    stage_idx, mb_index = action.stage_index, action.microbatch_index
    stage = stage_index_to_stage(schedule)[stage_idx]
    if ctype in (_schedules.SEND_F, _schedules.SEND_B, _schedules.RECV_F, _schedules.RECV_B) and mb_index is None:
        raise AssertionError(f"{action=} missing mb_index")

    if ctype == _schedules.SEND_F:
        _append_send(schedule, send_ops, _schedules._batch_p2p(stage.get_fwd_send_ops(mb_index)))
    elif ctype == _schedules.SEND_B:
        _append_send(schedule, send_ops, _schedules._batch_p2p(stage.get_bwd_send_ops(mb_index)))
    elif ctype == _schedules.RECV_F:
        if (stage_idx, mb_index) in schedule.fwd_recv_ops:
            raise AssertionError(f"Recv twice for {stage_idx=} {mb_index=} without executing forward")
        schedule.fwd_recv_ops[(stage_idx, mb_index)] = _schedules._batch_p2p(stage.get_fwd_recv_ops(mb_index))
    elif ctype == _schedules.RECV_B:
        if (stage_idx, mb_index) in schedule.bwd_recv_ops:
            raise AssertionError(f"Recv twice for {stage_idx=} {mb_index=} without executing backward")
        schedule.bwd_recv_ops[(stage_idx, mb_index)] = _schedules._batch_p2p(stage.get_bwd_recv_ops(mb_index))
    elif ctype == _schedules.UNSHARD:
        if _fsdp_stage.stage_uses_fsdp(stage):
            if _take_marker(schedule, "_deferred_stages", stage_idx):
                return  # kept unsharded from a step that did not finalize its gradients
            if stage_idx in schedule.unsharded_stages or stage_idx in schedule.unshard_ops:
                raise AssertionError(f"Unsharding the same {stage_idx=} twice")
            schedule.unshard_ops[stage_idx] = _fsdp_stage.unshard_async(stage)
    elif ctype == _schedules.RESHARD:
        if _fsdp_stage.stage_uses_fsdp(stage):
            if _take_marker(schedule, "_finalized_stages", stage_idx):
                return  # the gradient reduction resharded it
            finalize = getattr(schedule, "_finalize_gradients", True)
            if not finalize and schedule.backward_counter[stage_idx] == schedule._n_microbatches:
                schedule._deferred_stages.add(stage_idx)  # keep the accumulated gradients unsharded
                return
            if stage_idx not in schedule.unsharded_stages:
                raise AssertionError(f"Resharding {stage_idx=} without unsharding")
            if stage_idx in schedule.unshard_ops:
                raise AssertionError(f"Resharding {stage_idx=} before finishing unshard")
            _fsdp_stage.reshard_stage(stage)
            schedule.unsharded_stages.remove(stage_idx)
    elif ctype is not None and ctype == _reduce_grad_type():
        _reduce_grad(schedule, stage)
    elif ctype is not None and ctype == _computation_type("WAIT_REDUCE_GRAD"):
        _wait_reduce_grad(schedule, stage)
    else:
        raise ValueError(f"{action=} is unknown or unsupported")


def sequential_overlap_f_b(action: _Action, ctx: _PipelineContext) -> None:
    """Run an OVERLAP_F_B action as torch does: its sub-actions one after the other.

    Custom-function protocol.  Registered for OVERLAP_F_B, it opts one
    schedule out of the concurrent handler (``_overlap.overlap_f_b``)::

        schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b)
    """
    for sub_action in action.sub_actions or ():
        run_action(sub_action, ctx)


def perform_action(action: _Action, ctx: _PipelineContext) -> None:
    """Run one action with this module's implementation: :func:`run_action` as a custom function.

    Custom-function protocol.  Every schedule's custom-function map holds it
    for each computation type ``register_custom_function`` accepts (except
    OVERLAP_F_B, see :class:`_FunctionMapWithDefaults`), so every compute,
    UNSHARD, RESHARD and gradient-reduction action runs the same bookkeeping
    whether it is a plain action or a sub-action of OVERLAP_F_B, on every
    supported torch.  A custom function that only adds to an action calls it::

        def forward_with_timing(action, ctx):
            start = time.perf_counter()
            perform_action(action, ctx)
            times.append(time.perf_counter() - start)

        schedule.register_custom_function(FORWARD, forward_with_timing)
    """
    run_action(action, ctx)


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
    if not _fsdp_stage.stage_uses_fsdp(stage):
        stage.perform_reduce_grad(_grad_scale_factor(schedule))
    elif not schedule._finalize_gradients:
        schedule._deferred_stages.add(stage_idx)
    else:
        stage.start_gradient_reduction()
        schedule.unsharded_stages.discard(stage_idx)
        schedule._deferred_stages.discard(stage_idx)
        schedule._finalized_stages.add(stage_idx)


def _wait_reduce_grad(schedule: _PipelineScheduleRuntime, stage: _PipelineStageBase) -> None:
    """WAIT_REDUCE_GRAD (torch 2.15+): wait for the FSDP reduce-scatter REDUCE_GRAD started, then scale."""
    if schedule._has_backward and schedule._finalize_gradients and _fsdp_stage.stage_uses_fsdp(stage):
        stage.wait_for_gradient_reduction(_grad_scale_factor(schedule))


# --------------------------------------------------------------------------- #
# torch 2.9: the custom-function runtime (upstream: 2.10 cycle, schedules.py)  #
# --------------------------------------------------------------------------- #

_CUSTOMIZABLE_TYPES = (
    "FORWARD",
    "FULL_BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "OVERLAP_F_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
    "WAIT_REDUCE_GRAD",
)


def _customizable_types() -> list[Any]:
    """The computation types custom functions may replace, as far as this torch has them."""
    return [t for t in map(_computation_type, _CUSTOMIZABLE_TYPES) if t is not None]


def register_custom_function(
    self: _PipelineScheduleRuntime,
    computation_type: Any,
    custom_function: _CustomFunctionProtocol,
) -> None:
    """Register a function to run instead of the built-in one for ``computation_type``.

    Upstream semantics (``_PipelineScheduleRuntime.register_custom_function``):
    FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B,
    UNSHARD, RESHARD (and REDUCE_GRAD where torch has it) may be overridden;
    registering a type again replaces the function with a warning.

    Args:
        computation_type: a ``_ComputationType``.
        custom_function: called as ``custom_function(action, ctx)`` with the
            action and a ``_PipelineContext``.

    Raises:
        ValueError: ``computation_type`` cannot be overridden.
    """
    allowed = _customizable_types()
    if computation_type not in allowed:
        raise ValueError(
            f"Invalid computation type {computation_type}. Only "
            f"{', '.join(t.name for t in allowed)} are supported."
        )
    if computation_type in self._comp_type_to_function_map:
        logger.warning(
            "Computation type %s is already registered. Overwriting the existing custom function.",
            computation_type,
        )
    self._comp_type_to_function_map[computation_type] = custom_function


def _assert_unsharded(self: _PipelineScheduleRuntime, stage: _PipelineStageBase) -> None:
    """If an unshard of ``stage`` is pending, wait for it and mark the stage unsharded.

    Upstream: ``_PipelineScheduleRuntime._assert_unsharded`` (2.10 cycle).
    """
    if not _fsdp_stage.stage_uses_fsdp(stage):
        return
    stage_idx = stage.stage_index
    handles = self.unshard_ops.pop(stage_idx, None)
    if handles is not None:
        for handle in handles:
            handle.wait()
        self.unsharded_stages.add(stage_idx)
    if stage_idx not in self.unsharded_stages:
        raise AssertionError(f"Attempted to compute on sharded {stage_idx=}")


class _LazyScheduleAttribute:
    """Class-level data descriptor giving every schedule its own ``factory()`` value.

    Used for the state upstream creates in ``_PipelineScheduleRuntime.__init__``
    (2.10 cycle) so that torch 2.9's ``__init__`` need not be replaced, and
    schedules built before the patch get the state too.  The value lives in the
    instance ``__dict__`` under the same name.
    """

    def __init__(self, name: str, factory: Callable[[], Any]) -> None:
        self._name = name
        self._factory = factory

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self._name]
        except KeyError:
            return obj.__dict__.setdefault(self._name, self._factory())

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._name] = value

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self._name, None)


# Schedule state upstream keeps on the schedule (name -> factory).
_RUNTIME_STATE: dict[str, Callable[[], Any]] = {
    "_comp_type_to_function_map": dict,
    "fwd_recv_ops": dict,
    "bwd_recv_ops": dict,
    "unshard_ops": functools.partial(defaultdict, list),
    "unsharded_stages": set,
}


def _runtime_step_microbatches(
    self: _PipelineScheduleRuntime,
    arg_mbs: list | None = None,
    kwarg_mbs: list | None = None,
    target_mbs: list | None = None,
    losses: list | None = None,
) -> None:
    """Torch 2.9's ``_PipelineScheduleRuntime._step_microbatches``, with custom functions.

    Mirrors the loop of torch 2.10+: a registered custom function runs
    instead of the built-in action; OVERLAP_F_B without one runs its
    sub-actions in order; every other action is :func:`run_action`.  Grads
    are scaled after a stage's last backward whether that is a FULL_BACKWARD
    or a BACKWARD_WEIGHT (2.9's own loop missed the latter).
    """
    arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
    if not self._stages_initialized:
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0])
    if getattr(self, "pipeline_order_with_comms", None) is None:
        raise AssertionError("Must call _prepare_schedule_with_comms() before calling _step_microbatches()")

    # torch 2.9 kept the counter and the unshard state per step.
    self.backward_counter.clear()
    self.unshard_ops.clear()
    self.unsharded_stages.clear()
    ctx = _PipelineContext(self, arg_mbs, kwarg_mbs, target_mbs, losses)
    state = schedule_state(self)
    send_ops = state.pending_sends

    for time_step, action in enumerate(self.pipeline_order_with_comms[self.rank]):
        state.record_action(time_step, action)
        logger.debug("_PipelineScheduleRuntime running time_step %d, action %s", time_step, action)
        try:
            with record_function(_schedules._get_profiler_function_name(action)):
                custom_function = self._comp_type_to_function_map.get(action.computation_type)
                if custom_function is not None:
                    custom_function(action, ctx)
                elif action.computation_type == _schedules.OVERLAP_F_B:
                    sequential_overlap_f_b(action, ctx)
                else:
                    run_action(action, ctx, send_ops)
        except Exception:
            logger.error(
                "[%s] _PipelineScheduleRuntime caught exception at time step %s when running "
                "action %s.  Full schedule:\n%s",
                rank_label(self),
                time_step,
                action,
                _schedules._format_pipeline_order(self.pipeline_order_with_comms, error_step_number=time_step),
            )
            raise

    state.wait_sends()
    if len(self.unshard_ops) != 0:
        raise AssertionError("Unused unshard operations")
    self._update_losses(self._stages, losses)


# --------------------------------------------------------------------------- #
# torch 2.9: keep OVERLAP_F_B through lowering (upstream 2.10+ _add_send_recv) #
# --------------------------------------------------------------------------- #


def _add_send_recv(
    compute_actions: dict[int, list[_Action | None]],
    stage_to_rank: Callable[[int], int],
    num_stages: int,
) -> dict[int, list[_Action]]:
    """Add SEND/RECV actions to a compute-only schedule, keeping OVERLAP_F_B whole.

    Same lowering as torch 2.10+'s ``schedules._add_send_recv``: each rank's
    next action is placed once every input it consumes is available (its
    RECV placed by the sending rank, or the producing stage ran locally); an
    OVERLAP_F_B waits for the inputs of all its sub-actions and is followed by
    their sends.  torch 2.9 replaced OVERLAP_F_B by its sub-actions here.
    """
    F, I, B = _schedules.FORWARD, _schedules.BACKWARD_INPUT, _schedules.FULL_BACKWARD
    Action = _schedules._Action

    def sends_to_other_rank(a: _Action) -> bool:
        if a.computation_type == F:
            peer = a.stage_index + 1
            return peer < num_stages and stage_to_rank(peer) != stage_to_rank(a.stage_index)
        if a.computation_type in (I, B):
            peer = a.stage_index - 1
            return peer >= 0 and stage_to_rank(peer) != stage_to_rank(a.stage_index)
        return False

    def inputs_available(a: _Action | None, done: set[_Action]) -> bool:
        if a is None:
            return True
        s, mb = a.stage_index, a.microbatch_index
        if a.computation_type == F and s != 0:
            return Action(s, _schedules.RECV_F, mb) in done or Action(s - 1, F, mb) in done
        if a.computation_type in (I, B) and s != num_stages - 1:
            return (
                Action(s, _schedules.RECV_B, mb) in done
                or Action(s + 1, I, mb) in done
                or Action(s + 1, B, mb) in done
            )
        return True

    lowered: dict[int, list[_Action]] = {rank: [] for rank in compute_actions}
    done: dict[int, set[_Action]] = {rank: set() for rank in compute_actions}
    pending = {rank: list(actions) for rank, actions in compute_actions.items() if actions}
    while pending:
        progress = False
        for rank in sorted(pending):
            action = pending[rank][0]
            parts = action.sub_actions if action is not None and action.sub_actions is not None else (action,)
            if not all(inputs_available(a, done[rank]) for a in parts):
                continue
            if action is not None:
                lowered[rank].append(action)
                for a in parts:
                    done[rank].add(a)
                    if sends_to_other_rank(a):
                        forward = a.computation_type == F
                        send_type = _schedules.SEND_F if forward else _schedules.SEND_B
                        recv_type = _schedules.RECV_F if forward else _schedules.RECV_B
                        send = Action(a.stage_index, send_type, a.microbatch_index)
                        recv_stage = a.stage_index + 1 if forward else a.stage_index - 1
                        recv = Action(recv_stage, recv_type, a.microbatch_index)
                        lowered[rank].append(send)
                        done[rank].add(send)
                        peer = stage_to_rank(recv_stage)
                        lowered[peer].append(recv)
                        done[peer].add(recv)
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            raise AssertionError("Malformed compute schedule, can't schedule sends/recvs")
    return lowered


# --------------------------------------------------------------------------- #
# Every torch: the step, begun and ended on the schedule's state               #
# --------------------------------------------------------------------------- #


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10 the same ``__notes__`` (PEP 678),
    which its tracebacks do not print, so the note is logged too."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    try:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    logger.error("%s: %s: %s", note, type(error).__name__, error)


@contextlib.contextmanager
def _recording_actions(schedule: _PipelineScheduleRuntime) -> Iterator[None]:
    """For torch's loop: the rank's actions, while it runs, record the loop's position in the state.

    See ``_schedule_state._RecordedActions``.  The actions are put back when
    the loop returns, unless something replaced them meanwhile.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None)
    actions = order.get(schedule.rank) if order is not None else None
    if actions is None:
        yield
        return
    recorded = order[schedule.rank] = schedule_state(schedule).recording(actions)
    try:
        yield
    finally:
        if order.get(schedule.rank) is recorded:
            order[schedule.rank] = actions


def _make_step_context(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineScheduleRuntime._step_microbatches`` (torch's loop or ours) once.

    The step begins and ends on the schedule's ``_ScheduleState``: before the
    loop it holds the step's ``return_outputs`` and ``loss_kwargs`` for
    :func:`prepare_compute_action`; after it, the sends that custom functions
    started through ``run_action(..., send_ops=None)`` are waited; when the
    step ends, however it ends, the OVERLAP_F_B backward thread is closed.  On
    an exception a note names the rank, the time step and the action
    (upstream logs the time step and action, but neither the rank nor the
    exception says where the step failed) and the exception is re-raised.
    Our loop (torch 2.9) records its time step and action itself; torch's is
    followed through :func:`_recording_actions`.
    """
    signature = inspect.signature(original)
    loop_records_actions = original is _runtime_step_microbatches

    @functools.wraps(original)
    def _step_microbatches(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        state = schedule_state(self)
        state.begin_step(bound.arguments.get("return_outputs", True), bound.arguments.get("loss_kwargs"))
        try:
            with contextlib.nullcontext() if loop_records_actions else _recording_actions(self):
                result = original(self, *args, **kwargs)
            state.wait_sends()
            return result
        except Exception as e:
            note = f"[{rank_label(self)}] {type(self).__name__} step failed"
            if state.time_step is not None:
                note += f" at time step {state.time_step} running action {state.action}"
            _add_note(e, note)
            raise
        finally:
            state.end_step(type(self).__name__)

    return _step_microbatches


# --------------------------------------------------------------------------- #
# Every torch: every customizable action runs this module's implementation     #
# --------------------------------------------------------------------------- #

_FUNCTION_MAP = "_comp_type_to_function_map"


class _FunctionMapWithDefaults:
    """Class-level data descriptor for ``_PipelineScheduleRuntime._comp_type_to_function_map``.

    Every schedule's custom-function map starts with this module's functions:
    :func:`perform_action` for each type ``register_custom_function`` accepts
    and :meth:`overlap_function` for OVERLAP_F_B.  Torch's step loop (2.10+)
    calls a mapped function instead of its nested ``_perform_action``, so a
    plain FORWARD and the FORWARD inside an OVERLAP_F_B share one
    implementation.  Communication actions (SEND/RECV and, on 2.15+, the
    send waits) cannot be customised and stay torch's.

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
            return obj.__dict__.setdefault(_FUNCTION_MAP, self._with_defaults({}))

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[_FUNCTION_MAP] = self._with_defaults(value)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(_FUNCTION_MAP, None)

    def overlap_function(self) -> _CustomFunctionProtocol:
        """The default OVERLAP_F_B function: its sub-actions one after the other."""
        return sequential_overlap_f_b

    def defaults(self) -> dict[Any, _CustomFunctionProtocol]:
        """Computation type -> the function a new schedule's map holds for it."""
        functions: dict[Any, _CustomFunctionProtocol] = dict.fromkeys(_customizable_types(), perform_action)
        functions[_schedules.OVERLAP_F_B] = self.overlap_function()
        return functions

    def is_default(self, computation_type: Any, function: Any) -> bool:
        """Whether ``function`` is what this descriptor puts in a new map for ``computation_type``."""
        return function is self.defaults().get(computation_type)

    def _with_defaults(self, function_map: dict) -> dict:
        for computation_type, function in self.defaults().items():
            function_map.setdefault(computation_type, function)
        return function_map


def _make_register_custom_function(original: Callable[..., None]) -> Callable[..., None]:
    """``register_custom_function`` that replaces one of the package's default functions quietly.

    Registering a function for a type whose entry is still the default
    (:class:`_FunctionMapWithDefaults`) is a first registration for the user:
    it should not log "already registered".  Replacing a function the user
    registered still warns, as torch does.
    """

    def register_custom_function(self: Any, computation_type: Any, custom_function: Callable[..., None]) -> None:
        descriptor = inspect.getattr_static(type(self), _FUNCTION_MAP, None)
        function_map = self._comp_type_to_function_map
        if isinstance(descriptor, _FunctionMapWithDefaults) and computation_type in function_map:
            if descriptor.is_default(computation_type, function_map[computation_type]):
                del function_map[computation_type]
        original(self, computation_type, custom_function)

    register_custom_function.__doc__ = original.__doc__
    register_custom_function.__wrapped__ = original  # type: ignore[attr-defined]
    return register_custom_function


# --------------------------------------------------------------------------- #
# torch with REDUCE_GRAD: compute_comms schedules without REDUCE_GRAD          #
# --------------------------------------------------------------------------- #


def _add_missing_reduce_grad(actions: list[_Action | None], n_microbatches: int) -> list[_Action | None]:
    """Complete the gradient reduction of one rank's compute_comms actions.

    Inserts REDUCE_GRAD after each stage's last backward where ``actions`` has
    none, counting FULL_BACKWARD and BACKWARD_WEIGHT (also inside OVERLAP_F_B)
    per stage like ``_add_reduce_grad``; it goes after the sends that follow
    the last backward, so they are not delayed by it.  Each REDUCE_GRAD
    without a WAIT_REDUCE_GRAD gets one right after it, and a wait whose
    REDUCE_GRAD is missing is replaced by the added pair.  Anything else is
    left as it is, for the loader to validate.
    """
    # [upstream-only]
    # reduce_grad, wait = REDUCE_GRAD, WAIT_REDUCE_GRAD
    # [/upstream-only]
    # (wait is None on a torch without WAIT_REDUCE_GRAD)  # [package-only]
    reduce_grad, wait = _reduce_grad_type(), _computation_type("WAIT_REDUCE_GRAD")  # [package-only]
    present = [a for a in actions if a is not None]
    reduced = {a.stage_index for a in present if a.computation_type == reduce_grad}
    waited = {a.stage_index for a in present if wait is not None and a.computation_type == wait}

    def reduction(stage_idx: int) -> list[_Action]:
        pair = [_schedules._Action(stage_idx, reduce_grad, None)]
        if wait is not None:
            pair.append(_schedules._Action(stage_idx, wait, None))
        return pair

    counts: dict[int, int] = defaultdict(int)
    out: list[_Action | None] = []
    due: list[int] = []  # stages whose REDUCE_GRAD waits for the trailing sends
    for action in actions:
        ctype = action.computation_type if action is not None else None
        if due and ctype not in (_schedules.SEND_F, _schedules.SEND_B):
            out.extend(a for s in due for a in reduction(s))
            due.clear()
        if action is None:
            out.append(action)
            continue
        if wait is not None and ctype == wait and action.stage_index not in reduced:
            continue  # replaced by the pair added after the stage's last backward
        out.append(action)
        if wait is not None and ctype == reduce_grad and action.stage_index not in waited:
            out.append(_schedules._Action(action.stage_index, wait, None))
        for a in action.sub_actions if action.sub_actions is not None else (action,):
            if a.computation_type in (_schedules.FULL_BACKWARD, _schedules.BACKWARD_WEIGHT):
                counts[a.stage_index] += 1
                if counts[a.stage_index] == n_microbatches and a.stage_index not in reduced:
                    due.append(a.stage_index)
    out.extend(a for s in due for a in reduction(s))
    return out


def _make_prepare_comms(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineScheduleRuntime._prepare_schedule_with_comms``.

    A ``compute_comms`` schedule is taken as given, so one written before
    REDUCE_GRAD existed (or by hand) has none, and on torch 2.10+ -- where only
    REDUCE_GRAD runs FSDP's post-backward and scales gradients -- its
    gradients would be neither reduced nor scaled; on torch 2.15+ one written
    before WAIT_REDUCE_GRAD existed is rejected.  The missing actions are
    added before torch reads the schedule (:func:`_add_missing_reduce_grad`).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _prepare_schedule_with_comms(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["format"] == "compute_comms":
            bound.arguments["actions"] = {
                rank: _add_missing_reduce_grad(list(rank_actions), self._n_microbatches)
                for rank, rank_actions in bound.arguments["actions"].items()
            }
        return original(*bound.args, **bound.kwargs)

    return _prepare_schedule_with_comms


# --------------------------------------------------------------------------- #
# Feature probes (used by _patches.py)                                         #
# --------------------------------------------------------------------------- #
