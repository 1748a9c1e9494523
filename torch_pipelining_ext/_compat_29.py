"""torch 2.9: the custom-function runtime that upstream added in the 2.10 cycle.

The pieces of the PR that introduced ``register_custom_function`` and
``_PipelineContext`` in ``schedules.py``, which the patch table installs only
where a feature probe finds them missing:

* ``register_custom_function`` with upstream's semantics (the context,
  ``_pipeline_context.PipelineContext``, is installed on every torch);
* the per-schedule state upstream keeps on the schedule (``fwd_recv_ops``,
  ``bwd_recv_ops``, ``unshard_ops``, ``unsharded_stages``,
  ``_comp_type_to_function_map``) and ``_assert_unsharded``; the function
  map is made when the schedule is prepared (:func:`_make_prepare_with_map`),
  as 2.10+ makes it in ``__init__``;
* a step loop that dispatches custom functions and otherwise calls the
  schedule's ``perform_action`` -- the loop of upstream patch 0011 is the
  ``for`` statement in :func:`_runtime_step_microbatches`;
* OVERLAP_F_B kept through lowering (2.9's ``_add_send_recv`` flattens it).
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

from torch.distributed.pipelining import schedules as _schedules
from torch.profiler import record_function

from torch_pipelining_ext import _fsdp_stage
from torch_pipelining_ext._pipeline_context import (
    _CustomFunctionProtocol,
    _customizable_types,
    PipelineContext,
)
from torch_pipelining_ext._schedule_runtime import (
    perform_action,
    sequential_overlap_f_b,
)
from torch_pipelining_ext._schedule_state import rank_label, schedule_state


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase


__all__: list[str] = []

logger = logging.getLogger(__name__)


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
            action and the step's ``PipelineContext``.

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


def _assert_unsharded(
    self: _PipelineScheduleRuntime, stage: _PipelineStageBase
) -> None:
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


def _lazy_runtime_state(name: str) -> _LazyScheduleAttribute:
    """The class attribute that gives every schedule its own ``name`` state."""
    return _LazyScheduleAttribute(name, _RUNTIME_STATE[name])


def _make_prepare_with_map(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (2.9).

    Torch 2.10+ assigns ``_comp_type_to_function_map`` in ``__init__``, so
    what a new schedule's map holds -- the OVERLAP_F_B function chosen from
    ``$TORCH_PIPELINING_EXT_OVERLAP`` included -- is fixed when the schedule
    is built.  2.9's ``__init__`` has no map (the lazy attribute makes it on
    first use, the first step); it ends by preparing the schedule
    (``ScheduleDualPipeV``; a loaded CSV is prepared too), so the map is made
    here, before a step can run, and the switch means the same on 2.9.
    """

    @functools.wraps(original)
    def _prepare_schedule_with_comms(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._comp_type_to_function_map  # made now, not at the first step
        return original(self, *args, **kwargs)

    return _prepare_schedule_with_comms


def _runtime_step_microbatches(
    self: _PipelineScheduleRuntime,
    arg_mbs: list | None = None,
    kwarg_mbs: list | None = None,
    target_mbs: list | None = None,
    losses: list | None = None,
) -> None:
    """Torch 2.9's ``_PipelineScheduleRuntime._step_microbatches``, with custom functions.

    The loop of upstream patch 0011: one ``PipelineContext`` for the step;
    a registered custom function runs instead of the built-in action;
    OVERLAP_F_B without one runs its sub-actions in order; every other
    action is the schedule's ``perform_action`` (the map answers for them
    all, see [Note: the step loop through the custom-function map]).  Grads
    are scaled after a stage's last backward whether that is a FULL_BACKWARD
    or a BACKWARD_WEIGHT (2.9's own loop missed the latter).
    """
    arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
    if not self._stages_initialized:  # type: ignore[attr-defined]  # torch 2.9 only
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0])
    if getattr(self, "pipeline_order_with_comms", None) is None:
        raise AssertionError(
            "Must call _prepare_schedule_with_comms() before calling _step_microbatches()"
        )

    # torch 2.9 kept the counter and the unshard state per step.
    self.backward_counter.clear()
    self.unshard_ops.clear()
    self.unsharded_stages.clear()
    ctx = PipelineContext(self, arg_mbs, kwarg_mbs, target_mbs, losses)
    state = schedule_state(self)

    for time_step, action in enumerate(self.pipeline_order_with_comms[self.rank]):
        state.record_action(time_step, action)
        logger.debug(
            "_PipelineScheduleRuntime running time_step %d, action %s",
            time_step,
            action,
        )
        try:
            with record_function(_schedules._get_profiler_function_name(action)):
                if action.computation_type in self._comp_type_to_function_map:
                    self._comp_type_to_function_map[action.computation_type](
                        action, ctx
                    )
                elif action.computation_type == _schedules.OVERLAP_F_B:
                    sequential_overlap_f_b(action, ctx)
                else:
                    perform_action(action, ctx)
        except Exception:
            logger.error(
                "[%s] _PipelineScheduleRuntime caught exception at time step %s when running "
                "action %s.  Full schedule:\n%s",
                rank_label(self),
                time_step,
                action,
                _schedules._format_pipeline_order(
                    # torch annotates a list of _Action | None; it only reads it
                    self.pipeline_order_with_comms,  # type: ignore[arg-type]
                    error_step_number=time_step,
                ),
            )
            raise

    state.wait_sends()
    if len(self.unshard_ops) != 0:
        raise AssertionError("Unused unshard operations")
    self._update_losses(self._stages, losses)


_runtime_step_microbatches.records_actions = True  # type: ignore[attr-defined]  # see _step_context


# --------------------------------------------------------------------------- #
# torch 2.9: keep OVERLAP_F_B through lowering (upstream 2.10+ _add_send_recv) #
# --------------------------------------------------------------------------- #


def _send_recv_pair(a: _Action) -> tuple[_Action, _Action]:
    """The SEND of ``a``'s output on its stage and the matching RECV on the peer stage."""
    forward = a.computation_type == _schedules.FORWARD
    send_type = _schedules.SEND_F if forward else _schedules.SEND_B
    recv_type = _schedules.RECV_F if forward else _schedules.RECV_B
    recv_stage = a.stage_index + 1 if forward else a.stage_index - 1
    return (
        _schedules._Action(a.stage_index, send_type, a.microbatch_index),
        _schedules._Action(recv_stage, recv_type, a.microbatch_index),
    )


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
            return peer < num_stages and stage_to_rank(peer) != stage_to_rank(
                a.stage_index
            )
        if a.computation_type in (I, B):
            peer = a.stage_index - 1
            return peer >= 0 and stage_to_rank(peer) != stage_to_rank(a.stage_index)
        return False

    def inputs_available(a: _Action | None, done: set[_Action]) -> bool:
        if a is None:
            return True
        s, mb = a.stage_index, a.microbatch_index
        if a.computation_type == F and s != 0:
            return (
                Action(s, _schedules.RECV_F, mb) in done or Action(s - 1, F, mb) in done
            )
        if a.computation_type in (I, B) and s != num_stages - 1:
            return (
                Action(s, _schedules.RECV_B, mb) in done
                or Action(s + 1, I, mb) in done
                or Action(s + 1, B, mb) in done
            )
        return True

    lowered: dict[int, list[_Action]] = {rank: [] for rank in compute_actions}
    done: dict[int, set[_Action]] = {rank: set() for rank in compute_actions}
    pending = {
        rank: list(actions) for rank, actions in compute_actions.items() if actions
    }
    while pending:
        progress = False
        for rank in sorted(pending):
            action = pending[rank][0]
            parts = (
                action.sub_actions
                if action is not None and action.sub_actions is not None
                else (action,)
            )
            if not all(inputs_available(a, done[rank]) for a in parts):
                continue
            if action is not None:
                lowered[rank].append(action)
                for a in parts:
                    assert a is not None  # the parts of an action are actions
                    done[rank].add(a)
                    if sends_to_other_rank(a):
                        send, recv = _send_recv_pair(a)
                        lowered[rank].append(send)
                        done[rank].add(send)
                        peer = stage_to_rank(recv.stage_index)
                        lowered[peer].append(recv)
                        done[peer].add(recv)
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            raise AssertionError(
                "Malformed compute schedule, can't schedule sends/recvs"
            )
    return lowered
