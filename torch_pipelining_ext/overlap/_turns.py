"""Turn-taking of the two threads of an overlapped OVERLAP_F_B action.

One :class:`_CommCoordinator` per action decides when each side may
communicate and compute; ``_ep_marks`` calls it at the marks.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.profiler import record_function

from torch_pipelining_ext.overlap import _policy
from torch_pipelining_ext.overlap._rng import _RNGDevices, _RNGWindows


__all__ = ["CommWaitTimeoutError", "DEFAULT_WAIT_TIMEOUT_S", "TIMEOUT_ENV"]


TIMEOUT_ENV = "TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT"
DEFAULT_WAIT_TIMEOUT_S = 600.0
# see [Note: the hand-over policy]
_HAND_OVER_MIN_REGION_S = _policy.HAND_OVER_MIN_REGION_S
_timeout_s: float | None = None  # set_wait_timeout(); None: environment or default
_observer: Any = None  # observe_actions(); None: nothing is timed


class CommWaitTimeoutError(RuntimeError):
    """A thread of an overlapped action waited too long for its turn to communicate."""


def _check_timeout(value: object, source: str) -> float:
    """``value`` as a timeout in seconds: a positive number, ``math.inf`` for none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{source}: the timeout must be a number of seconds, got "
            f"{type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{source}: the timeout must be a positive number of seconds "
            f"(inf: no limit), got {value!r}"
        )
    return seconds


def _set_timeout(seconds: float | None) -> None:
    global _timeout_s
    _timeout_s = (
        None if seconds is None else _check_timeout(seconds, "set_wait_timeout")
    )


def _get_timeout() -> float:
    if _timeout_s is not None:
        return _timeout_s
    env = os.environ.get(TIMEOUT_ENV, "").strip()
    if not env:
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(
            f"${TIMEOUT_ENV}={env!r} is not a number of seconds (inf: no limit)"
        ) from None
    try:
        return _check_timeout(value, f"${TIMEOUT_ENV}={env!r}")
    except ValueError as e:
        raise ValueError(str(e)) from None


def _set_observer(observer: Any) -> Any:
    """Make ``observer`` the one later actions report to; returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def _wait_arg(seconds: float) -> float | None:
    """A timeout for ``threading`` waits and joins: ``None`` for no limit."""
    return None if math.isinf(seconds) else seconds


class _Side(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1

    @property
    def other(self) -> _Side:
        return _Side(1 - self)

    @property
    def thread_name(self) -> str:
        return "forward" if self is _Side.FORWARD else "backward"


class _TurnState(enum.Enum):
    """Where one side of an action is, as the turn-taking sees it."""

    NOT_STARTED = "not started"
    AWAITING_INPUT = "waiting for its input"  # its receives, before it starts
    COMPUTING = "computing"
    COMMUNICATING = "communicating"  # inside a (possibly nested) region
    DONE = "done"  # finished or failed: gives up its turns


class _CoordinatorState(enum.Enum):
    RUNNING = "running"
    STOPPED = "stopped"  # a side failed: nobody waits any more


@dataclasses.dataclass
class _SideTurns:
    """One side's part of a coordinator's state."""

    state: _TurnState = _TurnState.NOT_STARTED
    depth: int = 0  # nesting of the current region (> 0 exactly when COMMUNICATING)
    regions: int = 0  # regions opened so far
    waiting: int = 0  # blocked in the coordinator (parked)
    where: str | None = None  # last boundary passed
    opened_at: float = 0.0  # clock() when the current region was entered
    awaiting: str | None = None  # the input awaited (AWAITING_INPUT)
    awaiting_since: float = 0.0  # clock() when the input wait began
    awaited_long: bool = False  # the input wait was long enough to hand over
    profiler_range: Any = None


class _CommCoordinator:
    """Turn-taking of the two threads of one overlapped action.

    The policy (it depends only on the order of boundaries on each thread,
    never on timing):

    * **Communication turns alternate**, the backward side first: its first
      region, then the forward side's first, and so on; a side that is DONE
      gives up its turns.  Regions are exclusive.
    * **Compute is handed over at each boundary**, see [Note: the hand-over
      policy].
    * **Inputs**: a side may first wait for its receives
      (:meth:`await_inputs`); see [Note: a side waiting for its input].
    * **Random numbers** are drawn as the sequential handler draws them; see
      [Note: random numbers in an overlapped action].

    State, guarded by one ``threading.Condition``: the coordinator's
    :class:`_CoordinatorState`, ``turn`` (whose region is next), a
    :class:`_SideTurns` per side and the backward side's :class:`_RNGWindows`.
    A side woken because the other failed finds the coordinator STOPPED.

    Args:
        rank: the global rank, for messages.
        action: the action, for messages.
        timeout: seconds a side may wait for the other (``math.inf``: no limit).
        clock: measures region lengths (tests inject one).
        hand_over_min_region_s: shorter regions are not handed over (default:
            ``_HAND_OVER_MIN_REGION_S``, read when the coordinator is made).
    """

    def __init__(
        self,
        rank: int,
        action: str,
        timeout: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        hand_over_min_region_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.action = action
        self.timeout = timeout
        self._wait_timeout = _wait_arg(timeout)
        self._clock = clock
        self._hand_over_min_region_s = (
            _HAND_OVER_MIN_REGION_S
            if hand_over_min_region_s is None
            else hand_over_min_region_s
        )
        self._cond = threading.Condition(threading.Lock())
        self._state = _CoordinatorState.RUNNING
        self._turn = _Side.BACKWARD
        self._sides = (_SideTurns(), _SideTurns())
        self._rng = _RNGWindows(_Side.BACKWARD, _Side.FORWARD)

    @property
    def _stopped(self) -> bool:
        return self._state is _CoordinatorState.STOPPED

    # -- transitions --------------------------------------------------------

    def start(self, side: _Side) -> None:
        """Before ``side`` computes at all (see [Note: the hand-over policy])."""
        with self._cond:
            where = "the start of its sub-action"
            self._wait(
                side,
                where,
                lambda: self._may_start(side),
                f"for the {side.other.thread_name} thread to start communicating "
                "before computing",
            )
            self._sides[side].state = _TurnState.COMPUTING
            self._resume(side, where)

    def open(self, side: _Side, where: str, phase: str) -> None:
        """Enter a communication region of ``side`` (``where`` names the boundary)."""
        me = self._sides[side]
        with self._cond:
            if me.depth:
                me.depth += 1  # nested, e.g. recomputation inside a region
                if self._sides[side.other].waiting:
                    # it may wait for this side to park (inside an RNG window)
                    self._cond.notify_all()
                return
            self._wait(
                side, where, lambda: self._may_open(side), "for its turn to communicate"
            )
            if self._stopped:
                return
            me.state, me.depth, me.where = _TurnState.COMMUNICATING, 1, where
            me.opened_at = self._clock()
            me.regions += 1
            self._cond.notify_all()  # the other side may compute now
        if torch.autograd.profiler._is_profiler_enabled:
            rf = record_function(
                f"ep_overlap::{phase} communication ({side.thread_name} thread)"
            )
            rf.__enter__()
            me.profiler_range = rf

    def close(self, side: _Side, where: str) -> None:
        """Leave a communication region of ``side``; a close without an open is ignored.

        Leaving the outermost region hands the turn over and then waits until
        the other side has opened its next region (or finished).
        """
        me = self._sides[side]
        with self._cond:
            me.where = where
            if me.depth == 0:
                return
            me.depth -= 1
            if me.depth == 0:
                self._release(side, _TurnState.COMPUTING)
                self._hand_over(side, where)
            if not self._in_comm(side):
                self._resume(side, where)

    def await_inputs(self, side: _Side, wait: Callable[[], None], what: str) -> None:
        """Run ``wait``, ``side`` waiting for its input (``what``), before it starts.

        See [Note: a side waiting for its input].  ``wait`` has its own
        timeout (the receive's): meanwhile the other side's waits for this
        side do not time out.
        """
        me = self._sides[side]
        with self._cond:
            me.state, me.awaiting = _TurnState.AWAITING_INPUT, what
            me.awaiting_since = self._clock()
            self._cond.notify_all()
        try:
            wait()
        finally:
            with self._cond:
                me.awaited_long = _policy.hands_over(
                    self._clock() - me.awaiting_since, self._hand_over_min_region_s
                )
                me.state, me.awaiting = _TurnState.NOT_STARTED, None
                self._cond.notify_all()

    def awaits_inputs(self, side: _Side) -> bool:
        """Whether ``side`` is waiting for its input now."""
        with self._cond:
            return self._sides[side].state is _TurnState.AWAITING_INPUT

    def finish(self, side: _Side) -> None:
        """``side`` has finished its sub-action (or failed): the other runs freely."""
        with self._cond:
            if self._sides[side].depth:
                self._sides[side].depth = 0
                self._release(side, _TurnState.DONE)
            self._sides[side].state = _TurnState.DONE
            self._cond.notify_all()

    def stop(self) -> None:
        """A side failed: stop coordinating and wake every waiter."""
        with self._cond:
            self._state = _CoordinatorState.STOPPED
            self._cond.notify_all()

    @contextmanager
    def rng_window(
        self, side: _Side, devices: _RNGDevices, preserve: bool
    ) -> Iterator[None]:
        """A recomputation of ``side`` (inside ``torch.random.fork_rng``).

        See [Note: random numbers in an overlapped action].

        Args:
            side: the side that recomputes (the backward side).
            devices: the generators the recomputation may draw from.
            preserve: whether the recomputation installs saved states
                (``fork_rng`` enabled); if not, drawing raises.

        Raises:
            RuntimeError: a window without preserved states drew numbers.
        """
        other = side.other
        with self._cond:
            outermost = not self._rng.is_open
            if outermost:
                self._wait(
                    side,
                    "the start of a recomputation",
                    lambda: self._stopped or self._parked(other),
                    f"for the {other.thread_name} thread to pause before the "
                    "recomputation draws random numbers",
                )
            self._rng.begin(devices, self._sides[side].depth)
            start = None
            if not preserve and outermost:
                start = self._rng.saved_state_of_other()
        failed = False
        try:
            yield
        except BaseException as e:
            # non-reentrant checkpoint ends a recomputation early with an exception
            early_stop = getattr(
                sys.modules.get("torch.utils.checkpoint"),
                "_StopRecomputationError",
                (),
            )
            failed = not isinstance(e, early_stop)
            raise
        finally:
            with self._cond:
                drew = (
                    start is not None
                    and not failed
                    and not self._stopped
                    and self._rng.drew_since(start)
                )
                self._rng.end()
                # whether this side counts as parked depends on its innermost window
                self._cond.notify_all()
            if drew:
                raise RuntimeError(
                    f"rank {self.rank}, action {self.action}: an "
                    "activation-checkpointing recomputation without RNG state "
                    "preservation (preserve_rng_state=False) drew random numbers "
                    f"on the {side.thread_name} thread of an overlapped "
                    "OVERLAP_F_B; it cannot draw the numbers the sequential "
                    "handler would. Use preserve_rng_state=True, or run "
                    "OVERLAP_F_B sequentially (register another OVERLAP_F_B "
                    "function)."
                )

    def regions_opened(self, side: _Side) -> int:
        """Regions ``side`` has opened so far."""
        with self._cond:
            return self._sides[side].regions

    def state_of(self, side: _Side) -> tuple[_TurnState, bool]:
        """``side``'s state, and whether it is parked in this coordinator."""
        with self._cond:
            return self._sides[side].state, self._sides[side].waiting > 0

    # -- internals (call with the lock held) --------------------------------

    # [Note: a side waiting for its input]
    # A side's receives (the backward's gradients, the forward's activations)
    # are waited on its own thread, in await_inputs, so that the other side
    # may compute meanwhile, as the sequential handler computes the forward
    # while the gradients are in flight.  A wait at least as long as a region
    # that is handed over counts as communication: the other side may start,
    # or compute on after handing over, as if this side had opened a region
    # (a shorter wait -- the input was there -- changes nothing, the hand-over
    # would cost more).  Once its input is there, a side whose wait was that
    # long starts only when the other side is not computing (parked, in a
    # region or done).  Turns to communicate are never given up for a wait:
    # the order of the regions is the same on every rank.

    def _may_start(self, side: _Side) -> bool:
        me, other = self._sides[side], self._sides[side.other]
        if self._stopped or other.state is _TurnState.DONE:
            return True
        if (
            me.awaited_long
            and other.state is _TurnState.COMPUTING
            and not other.waiting
        ):
            return False  # the other side ran ahead while this one waited
        return self._input_wait_is_long(other) or _policy.may_start(
            self._turn == side, other.regions, False
        )

    def _may_open(self, side: _Side) -> bool:
        other = self._sides[side.other]
        return self._stopped or _policy.may_open(
            self._turn == side, other.depth > 0, other.state is _TurnState.DONE
        )

    def _hand_over(self, side: _Side, where: str) -> None:
        """After a long enough region, wait until the other side opens its next one."""
        me, other = self._sides[side], self._sides[side.other]
        if not _policy.hands_over(
            self._clock() - me.opened_at, self._hand_over_min_region_s
        ):
            return
        at_hand_over = other.regions
        self._wait(
            side,
            where,
            lambda: (
                self._stopped
                or self._input_wait_is_long(other)
                or _policy.may_compute_on(
                    other.regions, at_hand_over, other.state is _TurnState.DONE
                )
            ),
            f"for the {side.other.thread_name} thread to start communicating "
            "before computing on",
        )

    def _input_wait_is_long(self, turns: _SideTurns) -> bool:
        """Whether ``turns``' side has waited for its input long enough to hand over."""
        return turns.state is _TurnState.AWAITING_INPUT and _policy.hands_over(
            self._clock() - turns.awaiting_since, self._hand_over_min_region_s
        )

    def _input_recheck_s(self, turns: _SideTurns) -> float | None:
        """Seconds until ``turns``' input wait becomes long (None: it is, or none)."""
        if turns.state is not _TurnState.AWAITING_INPUT:
            return None
        left = turns.awaiting_since + self._hand_over_min_region_s - self._clock()
        return left if left > 0 else None

    def _release(self, side: _Side, state: _TurnState) -> None:
        """``side`` leaves its outermost region for ``state``; the turn passes on."""
        me = self._sides[side]
        me.state, self._turn = state, side.other
        rf, me.profiler_range = me.profiler_range, None
        if rf is not None:
            rf.__exit__(None, None, None)
        self._cond.notify_all()

    def _in_comm(self, side: _Side) -> bool:
        """Inside a region opened after this side's innermost RNG window began."""
        base = 0
        if side == self._rng.side and self._rng.is_open:
            base = self._rng.depths[-1]
        return self._sides[side].depth > base

    def _parked(self, side: _Side) -> bool:
        """``side`` draws no random numbers now: finished, blocked or communicating."""
        me = self._sides[side]
        return (
            me.state in (_TurnState.DONE, _TurnState.AWAITING_INPUT)
            or me.waiting > 0
            or self._in_comm(side)
        )

    def _resume(self, side: _Side, where: str) -> None:
        """``side`` computes next: in an RNG window, it takes the generators first."""
        if not self._rng.is_open or self._rng.owner() == side:
            return
        other = side.other
        self._wait(
            side,
            where,
            lambda: (
                self._stopped
                or not self._rng.is_open
                or self._rng.owner() == side
                or self._parked(other)
            ),
            f"for the {other.thread_name} thread to pause drawing random numbers",
        )
        if not self._stopped:
            self._rng.hand_to(side)

    def _wait(
        self, side: _Side, where: str, predicate: Callable[[], bool], what: str
    ) -> bool:
        """Wait (lock held) until ``predicate``; True if this had to block."""
        if predicate():
            return False
        me, other = self._sides[side], self._sides[side.other]
        me.waiting += 1
        try:
            if other.waiting:
                # This side is parked now, which the other side may wait for: to
                # start after a long input wait, at the start of a recomputation
                # or to take the generators over.
                self._cond.notify_all()
            if self._wait_for(predicate, other):
                return True
        finally:
            me.waiting -= 1
        raise CommWaitTimeoutError(self._timeout_message(side, where, what))

    def _timeout_message(self, side: _Side, where: str, what: str) -> str:
        me, other = self._sides[side], self._sides[side.other]
        if other.depth:
            state = f"is inside its communication region (entered at {other.where})"
        elif other.where is None:
            state = "has not reached its first boundary"
        else:
            state = f"last passed {other.where} and has not reached its next boundary"
        return (
            f"rank {self.rank}, action {self.action}: the {side.thread_name} "
            f"thread waited more than {self.timeout:g} s at {where} {what} "
            f"(after {me.regions} regions of its own); the "
            f"{side.other.thread_name} thread {state}. Every collective inside "
            "a stage must be between ep_overlap marks, identically on every "
            "rank; raise the limit with ep_overlap.set_wait_timeout() or "
            f"${TIMEOUT_ENV} if the other side's compute is this long."
        )

    def _wait_for(self, predicate: Callable[[], bool], other: _SideTurns) -> bool:
        """``Condition.wait_for(predicate)`` within the timeout; False if it ran out.

        While ``other`` waits for its input the timeout does not run (that
        wait has its own), and the predicate is checked again when that wait
        becomes long (see [Note: a side waiting for its input]).
        """
        deadline = self._deadline()
        while not predicate():
            if other.state is _TurnState.AWAITING_INPUT:
                deadline = self._deadline()
                timeout = self._input_recheck_s(other)
                # the wait became long since the predicate was evaluated: nothing
                # will notify about that, so evaluate it again before waiting
                if timeout is None and predicate():
                    break
            elif deadline is None:
                timeout = None
            else:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return False
            self._cond.wait(timeout)
        return True

    def _deadline(self) -> float | None:
        if self._wait_timeout is None:
            return None
        return time.monotonic() + self._wait_timeout


class _ObservedCoordinator(_CommCoordinator):
    """A :class:`_CommCoordinator` reporting each transition to an ``ActionObserver``.

    Used for the actions started while an observer is set
    (``ep_overlap.observe_actions``), so that the plain one pays nothing.
    """

    def __init__(self, observer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._observer = observer

    def _timed(
        self, name: str, side: _Side, transition: Callable[..., None], *args: Any
    ) -> None:
        call = time.perf_counter()
        try:
            transition(side, *args)
        finally:
            self._observer.transition(name, side.thread_name, call, time.perf_counter())

    def start(self, side: _Side) -> None:
        self._timed("start", side, super().start)

    def open(self, side: _Side, where: str, phase: str) -> None:
        self._timed("open", side, super().open, where, phase)

    def close(self, side: _Side, where: str) -> None:
        self._timed("close", side, super().close, where)

    def finish(self, side: _Side) -> None:
        self._timed("finish", side, super().finish)
