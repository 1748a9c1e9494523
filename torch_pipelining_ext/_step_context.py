"""The step of every ``_PipelineScheduleRuntime``, begun and ended on the schedule's state.

:func:`_make_step_context` wraps the step loop (torch's, or ours on 2.9,
``_compat_29``) once: each step begins and ends on the schedule's
``_schedule_state._ScheduleState``, which carries the step's
``return_outputs`` / ``loss_kwargs`` (which torch's ``_PipelineContext`` does
not carry) to the step's one ``PipelineContext``, the sends to wait when the
step ends, and the time step and action that any exception the step raises is
noted with.  The OVERLAP_F_B handler's state on the schedule (``_overlap_state``)
ends its step here too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TYPE_CHECKING

from torch_pipelining_ext._schedule_state import rank_label, schedule_state


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        _Action,
        _PipelineScheduleRuntime,
    )

    from torch_pipelining_ext._schedule_state import _ScheduleState


__all__: list[str] = []

logger = logging.getLogger(__name__)


class _StepScoped(Protocol):
    """State that lives for one step (the OVERLAP_F_B handler's ``_OverlapState``)."""

    def end_step(self, owner: str) -> None: ...


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
def _recording_actions(
    schedule: _PipelineScheduleRuntime, state: _ScheduleState
) -> Iterator[None]:
    """For torch's loop: the rank's actions, while it runs, record the loop's position in the state.

    See ``_schedule_state._RecordedActions``.  The actions are put back when
    the loop returns, unless something replaced them meanwhile.
    """
    order: dict[int, list[_Action | None]] | None = getattr(
        schedule, "pipeline_order_with_comms", None
    )
    actions = order.get(schedule.rank) if order is not None else None
    if order is None or actions is None:
        yield
        return
    recorded = order[schedule.rank] = state.recording(actions)
    try:
        yield
    finally:
        if order.get(schedule.rank) is recorded:
            order[schedule.rank] = actions


def _make_step_context(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineScheduleRuntime._step_microbatches`` (torch's loop or ours) once.

    The step begins and ends on the schedule's ``_ScheduleState``: before the
    loop it holds the step's ``return_outputs`` and ``loss_kwargs``, which the
    step's one ``PipelineContext`` carries (``_ScheduleState.step_context``);
    after it, the sends the step's SEND actions started are waited (torch
    2.15+: each was retired by its wait action, and one left is an error);
    when the step ends, however it ends, the OVERLAP_F_B backward thread is
    closed.  On an exception the pending sends are drained, as torch's loop
    does, and a note names the rank, the time step and the action
    (upstream logs the time step and action, but neither the rank nor the
    exception says where the step failed) and the exception is re-raised.
    Our loop (torch 2.9, marked ``records_actions``) records its time step
    and action itself; torch's is followed through :func:`_recording_actions`.
    """
    signature = inspect.signature(original)
    loop_records_actions = getattr(original, "records_actions", False)

    @functools.wraps(original)
    def _step_microbatches(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        state = schedule_state(self)
        state.begin_step(
            bound.arguments.get("return_outputs", True),
            bound.arguments.get("loss_kwargs"),
        )
        try:
            with (
                contextlib.nullcontext()
                if loop_records_actions
                else _recording_actions(self, state)
            ):
                result = original(self, *args, **kwargs)
            state.wait_sends()
            return result
        except Exception as e:
            state.drain_sends()
            note = f"[{rank_label(self)}] {type(self).__name__} step failed"
            if state.time_step is not None:
                note += f" at time step {state.time_step} running action {state.action}"
            _add_note(e, note)
            raise
        finally:
            state.end_step()
            overlap: _StepScoped | None = self.__dict__.get("_overlap_state")
            if overlap is not None:
                overlap.end_step(type(self).__name__)

    return _step_microbatches
