"""The package's state of one ``_PipelineScheduleRuntime``, kept on the schedule.

Upstream file: ``torch/distributed/pipelining/schedules.py`` (state that
``_PipelineScheduleRuntime`` would hold in attributes of its own).

What the runtime remembers about a schedule between the actions of a step is
one :class:`_ScheduleState`, found with :func:`schedule_state` (the
OVERLAP_F_B handler keeps its own, upstream-style, in ``_overlap_state``).
The step wrapper (``_step_context``) starts and ends each step on it
(:meth:`_ScheduleState.begin_step`, :meth:`_ScheduleState.end_step`); the
actions of the step read and add to it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any, TYPE_CHECKING

import torch.distributed as dist


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


__all__: list[str] = []

logger = logging.getLogger(__name__)

_STATE_ATTR = "_pipelining_ext_state"


@dataclasses.dataclass
class _ScheduleState:
    """Per-schedule state of the package, held by the schedule (see :func:`schedule_state`).

    Attributes:
        in_step: a step of the patched loop is in progress.
        return_outputs: ``return_outputs`` of the step in progress (True between steps).
        loss_kwargs: ``loss_kwargs`` of the step in progress.
        context: the step's one ``PipelineContext`` (see :meth:`step_context`).
        pending_sends: sends started during the step that it waits before
            returning (torch < 2.15, whose schedules have no send waits).
        send_tracker: torch 2.15+: the step's ``_PendingSendTracker``; each
            send is retired by its WAIT_SEND_F / WAIT_SEND_B action.
        time_step: position in the rank's lowered schedule of the action running now.
        action: the action running now (last started, when the step failed).
    """

    in_step: bool = False
    return_outputs: bool = True
    loss_kwargs: dict[str, Any] | None = None
    context: Any = None
    pending_sends: list[list[dist.Work]] = dataclasses.field(default_factory=list)
    send_tracker: Any = None
    time_step: int | None = None
    action: _Action | None = None

    def begin_step(
        self, return_outputs: bool, loss_kwargs: dict[str, Any] | None
    ) -> None:
        """Start a step with these ``step()`` arguments."""
        from torch.distributed.pipelining import schedules

        self.in_step = True
        self.return_outputs = return_outputs
        self.loss_kwargs = loss_kwargs
        self.context = None
        self.pending_sends.clear()
        # torch 2.15+ retires each send with a WAIT_SEND action
        tracker = getattr(schedules, "_PendingSendTracker", None)
        if tracker is None or not hasattr(schedules._ComputationType, "WAIT_SEND_F"):
            self.send_tracker = None
        else:
            self.send_tracker = tracker()
        self.time_step = self.action = None

    def step_context(self, ctx: Any) -> Any:
        """The step's one context: the first ``ctx`` the step loop passed, or ``ctx`` outside a step.

        Torch's step loop (2.10+) builds a context for every custom function
        it calls; the first one of the step, with the step's options, is the
        one every custom function of the step receives.
        """
        if not self.in_step:
            return ctx
        if self.context is None:
            from torch_pipelining_ext._pipeline_context import PipelineContext

            if not isinstance(ctx, PipelineContext):  # torch's own class
                ctx = PipelineContext(
                    ctx.schedule_ref,
                    ctx.arg_mbs,
                    ctx.kwarg_mbs,
                    ctx.target_mbs,
                    ctx.losses,
                )
            ctx.return_outputs, ctx.loss_kwargs = self.return_outputs, self.loss_kwargs
            self.context = ctx
        return self.context

    def record_action(self, time_step: int, action: _Action | None) -> None:
        """The step loop is at ``time_step``, running ``action``."""
        self.time_step, self.action = time_step, action

    def wait_sends(self) -> None:
        """The step's loop is done: wait the sends it left (torch 2.15+: raise if one has no wait)."""
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        while self.pending_sends:
            _wait_batch_p2p(self.pending_sends.pop())
        if self.send_tracker is not None:
            try:
                self.send_tracker.assert_empty()
            except Exception:
                self.drain_sends()
                raise

    def drain_sends(self) -> None:
        """The step failed: wait the sends still pending (as torch's loop does), logging failures."""
        if self.send_tracker is None:
            return
        try:
            self.send_tracker.drain()
        except Exception:
            logger.exception("Failed to drain pending pipeline sends")

    def end_step(self) -> None:
        """End the step, however it ended: forget its sends, options and context."""
        self.in_step = False
        self.pending_sends.clear()
        self.send_tracker = self.context = None
        self.return_outputs, self.loss_kwargs = True, None

    def recording(self, actions: list[_Action | None]) -> _RecordedActions:
        """``actions`` as a list whose first iteration records each position here."""
        return _RecordedActions(actions, self)


class _RecordedActions(list):
    """A rank's lowered actions whose first iteration records each action it yields.

    Torch's step loop (2.10+) iterates ``pipeline_order_with_comms[rank]``
    once per step; with this list in its place for the step, the state knows
    the time step and action the loop is at without reading its frame.
    Later iterations (torch formats the whole schedule when an action fails)
    and copies are plain.
    """

    def __init__(self, actions: list[_Action | None], state: _ScheduleState) -> None:
        super().__init__(actions)
        self._state: _ScheduleState | None = state

    def __iter__(self) -> Iterator[_Action | None]:
        state, self._state = self._state, None
        if state is None:
            return super().__iter__()
        return self._record(state)

    def _record(self, state: _ScheduleState) -> Iterator[_Action | None]:
        for time_step, action in enumerate(super().__iter__()):
            state.record_action(time_step, action)
            yield action

    def __deepcopy__(self, memo: dict[int, Any]) -> list[_Action | None]:
        return copy.deepcopy(self[:], memo)  # slicing does not iterate

    def __reduce_ex__(self, protocol: Any) -> Any:
        return list, (self[:],)


def schedule_state(schedule: Any) -> _ScheduleState:
    """The package's state of ``schedule``, created on first use.

    Kept in the instance ``__dict__``: nothing is installed on torch's class,
    and the state goes with the schedule.
    """
    state = schedule.__dict__.get(_STATE_ATTR)
    if state is None:
        state = schedule.__dict__.setdefault(_STATE_ATTR, _ScheduleState())
    return state


def global_rank(schedule: Any) -> int:
    """This process's rank in the default group (``schedule.rank``, the pipeline rank, without one)."""
    return dist.get_rank() if dist.is_initialized() else getattr(schedule, "rank", 0)


def rank_label(schedule: Any) -> str:
    """``"rank G"`` (global rank), with ``" (pipeline rank P)"`` where the two differ."""
    rank, pp_rank = global_rank(schedule), getattr(schedule, "rank", 0)
    return (
        f"rank {rank}" if rank == pp_rank else f"rank {rank} (pipeline rank {pp_rank})"
    )
