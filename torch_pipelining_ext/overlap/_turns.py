"""Turn-taking of the two threads of an overlapped OVERLAP_F_B action.

One :class:`_CommCoordinator` per action decides when each side may issue a
collective and when it may compute; ``_marks`` calls it at the marks and
around every collective either thread issues (``_collectives``).  The rule
itself is ``overlap.policy``'s.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.profiler import record_function

from torch_pipelining_ext.overlap import policy
from torch_pipelining_ext.overlap._rng import _RNGDevices, _RNGWindows
from torch_pipelining_ext.overlap._settings import (
    DEFAULT_WAIT_TIMEOUT_S,
    SETTINGS,
    TIMEOUT_ENV,
)
from torch_pipelining_ext.overlap.policy import Order, Side


__all__ = ["CommWaitTimeoutError", "DEFAULT_WAIT_TIMEOUT_S", "TIMEOUT_ENV"]


class CommWaitTimeoutError(RuntimeError):
    """A thread of an overlapped action waited too long for the other one."""


def _wait_arg(seconds: float) -> float | None:
    """A timeout for ``threading`` waits and joins: ``None`` for no limit."""
    return None if math.isinf(seconds) else seconds


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


@dataclasses.dataclass(frozen=True)
class _Collective:
    """One collective a side issued during the action: what, on which group, how ordered."""

    op: str
    group: str
    order: Order


@dataclasses.dataclass
class _SideTurns:
    """One side's part of a coordinator's state."""

    state: _TurnState = _TurnState.NOT_STARTED
    depth: int = 0  # nesting of the current region (> 0 exactly when COMMUNICATING)
    regions: int = 0  # regions opened so far (marked and implicit)
    holds_turn: bool = False  # issued a STRICT collective in the current region
    yielded: bool = False  # waits for the other side to finish: gives up its turns
    waiting: int = 0  # blocked in the coordinator (parked)
    where: str | None = None  # last boundary passed
    opened_at: float = 0.0  # clock() when the current region was entered
    awaiting: str | None = None  # the input awaited (AWAITING_INPUT)
    awaiting_since: float = 0.0  # clock() when the input wait began
    awaited_long: bool = False  # the input wait was long enough to hand over
    profiler_range: Any = None
    collectives: list[_Collective] = dataclasses.field(default_factory=list)


class _CommCoordinator:
    """Turn-taking of the two threads of one overlapped action.

    The rule is [Note: the overlap rule] (``overlap/policy.py``); it depends
    only on the order of boundaries and collectives on each thread, never on
    timing, for everything that must be the same on every rank:

    * **Collectives**: each one either thread issues runs inside a region (a
      marked one, or an implicit one around it, :meth:`collective`).  STRICT
      collectives take turns, backward side first; FREE ones (the side's own
      communicator) wait for nobody.
    * **Compute is handed over at region boundaries** (``policy.hands_over``).
    * **Inputs**: a side may first wait for its receives
      (:meth:`await_inputs`); see [Note: a side waiting for its input].
    * **Random numbers** are drawn as the sequential handler draws them; see
      [Note: random numbers in an overlapped action].

    State, guarded by one ``threading.Condition``: the coordinator's
    :class:`_CoordinatorState`, ``turn`` (whose STRICT region is next), a
    :class:`_SideTurns` per side and the backward side's :class:`_RNGWindows`.
    A side woken because the other failed finds the coordinator STOPPED.

    Args:
        rank: the global rank, for messages.
        action: the action, for messages.
        timeout: seconds a side may wait for the other (``math.inf``: no limit).
        clock: measures region lengths (tests inject one).
        hand_over_min_region_s: shorter regions are not handed over (default:
            ``SETTINGS.hand_over_min_region_s``, read when the coordinator is made).
        first: the side whose sub-action the sequential handler runs first
            (see [Note: random numbers outside recomputation]).
    """

    def __init__(
        self,
        rank: int,
        action: str,
        timeout: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        hand_over_min_region_s: float | None = None,
        first: Side = Side.FORWARD,
    ) -> None:
        self.rank = rank
        self.first = first
        self.action = action
        self.timeout = timeout
        self._wait_timeout = _wait_arg(timeout)
        self._clock = clock
        self._hand_over_min_region_s = (
            SETTINGS.hand_over_min_region_s
            if hand_over_min_region_s is None
            else hand_over_min_region_s
        )
        self._cond = threading.Condition(threading.Lock())
        self._state = _CoordinatorState.RUNNING
        self._turn = Side.BACKWARD
        self._sides = (_SideTurns(), _SideTurns())
        self._rng = _RNGWindows(Side.BACKWARD, Side.FORWARD)

    @property
    def _stopped(self) -> bool:
        return self._state is _CoordinatorState.STOPPED

    # -- transitions --------------------------------------------------------

    def start(self, side: Side) -> None:
        """Before ``side`` computes at all (see ``policy.may_start``)."""
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

    def open(self, side: Side, where: str, phase: str) -> None:
        """Enter a marked region of ``side`` (``where`` names the boundary).

        A marked region waits for nobody: its collectives do, each as its
        Order says (:meth:`collective`).
        """
        me = self._sides[side]
        with self._cond:
            self._enter(side, where)
        if me.depth == 1 and torch.autograd.profiler._is_profiler_enabled:
            rf = record_function(
                f"OVERLAP_F_B {phase} communication ({side.thread_name} thread)"
            )
            rf.__enter__()
            me.profiler_range = rf

    def close(self, side: Side, where: str) -> None:
        """Leave a region of ``side``; a close without an open is ignored.

        Leaving the outermost region passes the turn on if the region held it,
        and hands the processor over (``policy.hands_over``).
        """
        self._close(side, where)

    def _close(self, side: Side, where: str) -> None:
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

    @contextmanager
    def collective(
        self, side: Side, op: str, group: str, order: Order
    ) -> Iterator[None]:
        """Issue one collective of ``side`` (``op`` on ``group``) inside a region.

        Outside a marked region it gets an implicit one.  A STRICT collective
        first takes the turn, unless its region already holds it.
        """
        where = f"{op} on group {group}"
        self._begin_collective(side, _Collective(op, group, order), where)
        try:
            yield
        finally:
            self._close(side, where)

    def _begin_collective(
        self, side: Side, collective: _Collective, where: str
    ) -> None:
        me = self._sides[side]
        with self._cond:
            me.collectives.append(collective)
            if collective.order is Order.STRICT and not me.holds_turn:
                self._wait(
                    side,
                    where,
                    lambda: self._may_take_turn(side),
                    "for its turn to issue a collective on a communicator both "
                    "sides use",
                )
                if not self._stopped:
                    me.holds_turn = True
            self._enter(side, where)

    def await_inputs(self, side: Side, wait: Callable[[], None], what: str) -> None:
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
                me.awaited_long = policy.hands_over(
                    self._clock() - me.awaiting_since, self._hand_over_min_region_s
                )
                me.state, me.awaiting = _TurnState.NOT_STARTED, None
                self._cond.notify_all()

    def awaits_inputs(self, side: Side) -> bool:
        """Whether ``side`` is waiting for its input now."""
        with self._cond:
            return self._sides[side].state is _TurnState.AWAITING_INPUT

    def finish(self, side: Side) -> None:
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
        self, side: Side, devices: _RNGDevices, preserve: bool
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

    def random_draw(self, side: Side, what: str) -> None:
        """``side`` is about to draw random numbers with ``what``, outside a recomputation.

        See [Note: random numbers outside recomputation]: the second side
        waits until the first has finished.

        Raises:
            RuntimeError: ``side`` runs first under the sequential handler, or
                draws inside a communication region.
        """
        me, other = self._sides[side], self._sides[side.other]
        with self._cond:
            if self._stopped or other.state is _TurnState.DONE:
                return
            if self._rng.is_open and self._rng.owner() == side:
                return  # a recomputation: its window gives it its numbers
            problem = None
            if side is self.first:
                problem = (
                    "its sub-action runs first under the sequential handler, so "
                    "the other side's numbers would have to wait for it"
                )
            elif me.depth:
                problem = f"it is inside a communication region (entered at {me.where})"
            if problem is not None:
                raise RuntimeError(
                    f"rank {self.rank}, action {self.action}: the "
                    f"{side.thread_name} side of an overlapped OVERLAP_F_B draws "
                    f"random numbers with {what} outside activation-checkpointing "
                    f"recomputation while the {side.other.thread_name} side is "
                    f"still running, and {problem}: it cannot get the numbers the "
                    "sequential handler draws. Draw them in forward (or in a "
                    "recomputation), or run OVERLAP_F_B sequentially "
                    "(runtime.sequential_overlap_f_b)."
                )
            me.yielded = True
            self._cond.notify_all()
            self._wait(
                side,
                f"{what} (a random draw)",
                lambda: self._stopped or other.state is _TurnState.DONE,
                f"for the {side.other.thread_name} thread to finish before drawing "
                "random numbers",
            )

    def regions_opened(self, side: Side) -> int:
        """Regions ``side`` has opened so far (marked and implicit)."""
        with self._cond:
            return self._sides[side].regions

    def collectives(self, side: Side) -> list[_Collective]:
        """The collectives ``side`` issued so far, in order, with their Order."""
        with self._cond:
            return list(self._sides[side].collectives)

    def state_of(self, side: Side) -> tuple[_TurnState, bool]:
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
    # region or done).  A waiting side keeps its turns for STRICT collectives:
    # their order is the same on every rank.  FREE collectives wait for
    # nobody, so with per-side communicators a side waiting for its input
    # holds nobody back.

    def _enter(self, side: Side, where: str) -> None:
        """``side`` enters a region (nested: deeper)."""
        me = self._sides[side]
        me.depth += 1
        if me.depth > 1:
            if self._sides[side.other].waiting:
                # it may wait for this side to park (inside an RNG window)
                self._cond.notify_all()
            return
        me.state, me.where = _TurnState.COMMUNICATING, where
        me.opened_at = self._clock()
        me.regions += 1
        self._cond.notify_all()  # the other side may compute now

    def _computing(self, turns: _SideTurns) -> bool:
        """Whether ``turns``' side computes now (not in a region, parked, waiting for input or done)."""
        return turns.state is _TurnState.COMPUTING and not turns.waiting

    def _may_start(self, side: Side) -> bool:
        me, other = self._sides[side], self._sides[side.other]
        if self._stopped or other.state is _TurnState.DONE:
            return True
        if (
            me.awaited_long
            and other.state is _TurnState.COMPUTING
            and not other.waiting
        ):
            return False  # the other side ran ahead while this one waited
        return policy.may_start(
            side is Side.BACKWARD,
            other.regions,
            # (the other side done: returned True above)
            other.yielded or self._input_wait_is_long(other),
        )

    def _may_take_turn(self, side: Side) -> bool:
        other = self._sides[side.other]
        return self._stopped or policy.may_take_turn(
            self._turn == side,
            other.holds_turn,
            other.state is _TurnState.DONE or other.yielded,
        )

    def _hand_over(self, side: Side, where: str) -> None:
        """After a long enough region, wait until the other side opens its next one."""
        me, other = self._sides[side], self._sides[side.other]
        if not policy.hands_over(
            self._clock() - me.opened_at, self._hand_over_min_region_s
        ):
            return
        at_hand_over = other.regions
        self._wait(
            side,
            where,
            lambda: (
                self._stopped
                or policy.may_compute_on(
                    other.regions, at_hand_over, self._computing(other)
                )
            ),
            f"for the {side.other.thread_name} thread to start communicating "
            "before computing on",
        )

    def _input_wait_is_long(self, turns: _SideTurns) -> bool:
        """Whether ``turns``' side has waited for its input long enough to hand over."""
        return turns.state is _TurnState.AWAITING_INPUT and policy.hands_over(
            self._clock() - turns.awaiting_since, self._hand_over_min_region_s
        )

    def _input_recheck_s(self, turns: _SideTurns) -> float | None:
        """Seconds until ``turns``' input wait becomes long (None: it is, or none)."""
        if turns.state is not _TurnState.AWAITING_INPUT:
            return None
        left = turns.awaiting_since + self._hand_over_min_region_s - self._clock()
        return left if left > 0 else None

    def _release(self, side: Side, state: _TurnState) -> None:
        """``side`` leaves its outermost region for ``state``; a held turn passes on."""
        me = self._sides[side]
        me.state = state
        if me.holds_turn:
            me.holds_turn, self._turn = False, side.other
        rf, me.profiler_range = me.profiler_range, None
        if rf is not None:
            rf.__exit__(None, None, None)
        self._cond.notify_all()

    def _in_comm(self, side: Side) -> bool:
        """Inside a region opened after this side's innermost RNG window began."""
        base = 0
        if side == self._rng.side and self._rng.is_open:
            base = self._rng.depths[-1]
        return self._sides[side].depth > base

    def _parked(self, side: Side) -> bool:
        """``side`` draws no random numbers now: finished, blocked or communicating."""
        me = self._sides[side]
        return (
            me.state in (_TurnState.DONE, _TurnState.AWAITING_INPUT)
            or me.waiting > 0
            or self._in_comm(side)
        )

    def _resume(self, side: Side, where: str) -> None:
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
        self, side: Side, where: str, predicate: Callable[[], bool], what: str
    ) -> bool:
        """Wait (lock held) until ``predicate``; True if this had to block."""
        if predicate():
            return False
        me, other = self._sides[side], self._sides[side.other]
        me.waiting += 1
        try:
            # This side is parked now, which the other side may wait for: to
            # compute on after a hand-over, to start after a long input wait,
            # at the start of a recomputation or to take the generators over.
            self._cond.notify_all()
            if self._wait_for(predicate, other):
                return True
        finally:
            me.waiting -= 1
        raise CommWaitTimeoutError(self._timeout_message(side, where, what))

    def _timeout_message(self, side: Side, where: str, what: str) -> str:
        me, other = self._sides[side], self._sides[side.other]
        if other.depth:
            state = f"is inside its communication region (entered at {other.where})"
        elif other.where is None:
            state = "has not reached its first boundary"
        else:
            state = f"last passed {other.where} and has not reached its next boundary"
        if me.depth and me.where is not None and me.where != where:
            where = f"{where} (inside its region entered at {me.where})"
        return (
            f"rank {self.rank}, action {self.action}: the {side.thread_name} "
            f"thread waited more than {self.timeout:g} s at {where} {what} "
            f"(after {me.regions} regions of its own); the "
            f"{side.other.thread_name} thread {state}. Raise the limit with "
            f"overlap.set_wait_timeout() or ${TIMEOUT_ENV} if the other side's "
            "compute is this long."
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
    (``overlap.observe_actions``), so that the plain one pays nothing.
    """

    def __init__(self, observer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._observer = observer

    def _timed(
        self, name: str, side: Side, transition: Callable[..., None], *args: Any
    ) -> None:
        call = time.perf_counter()
        try:
            transition(side, *args)
        finally:
            self._observer.transition(name, side.thread_name, call, time.perf_counter())

    def start(self, side: Side) -> None:
        self._timed("start", side, super().start)

    def open(self, side: Side, where: str, phase: str) -> None:
        self._timed("open", side, super().open, where, phase)

    def _begin_collective(
        self, side: Side, collective: _Collective, where: str
    ) -> None:
        self._timed("collective", side, super()._begin_collective, collective, where)

    def close(self, side: Side, where: str) -> None:
        self._timed("close", side, super().close, where)

    def finish(self, side: Side) -> None:
        self._timed("finish", side, super().finish)
