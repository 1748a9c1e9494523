"""Expert-parallel communication boundaries for overlapped pipeline actions.

Upstream target: a new public module ``torch/distributed/pipelining/ep_overlap.py``.

While this package is patched, an ``OVERLAP_F_B`` action of a
``_PipelineScheduleRuntime`` (``ScheduleDualPipeV``, or a CSV schedule) runs
the forward of one microbatch on the calling thread and the backward of
another on a worker thread (``_overlap.py``).  Both threads may issue the
expert-parallel all-to-alls of their MoE layers.  Two threads must never issue
collectives on one process group at once, and every rank must issue its
collectives in the same order, so MoE code marks where its communication is:

* in forward, :func:`dispatch_begin` / :func:`dispatch_end` around the token
  dispatch and :func:`combine_begin` / :func:`combine_end` around the combine
  (each takes and returns tensors);
* autograd mirrors the marks in backward: the backward of ``*_end`` opens the
  backward communication region and the backward of ``*_begin`` closes it;
* :func:`wrap_dispatch_combine` applies the marks to existing ``dispatch`` and
  ``combine`` methods of the MoE modules of a model, without editing it.

Outside an overlapped action a mark only passes its tensors through (one
autograd node when they require grad, so that a backward run later inside an
overlapped action is coordinated).  Inside one, a coordinator owned by that
action makes the two threads take turns: at most one thread is inside a
communication region at any moment, the regions are granted strictly
alternately -- the backward thread's first, then the forward thread's first,
and so on -- and once one thread has finished its sub-action the other runs
its remaining regions freely.  At each boundary the threads also hand the
processor over, so that while one thread communicates the other computes (see
``_CommCoordinator``).  The order of collectives on each rank therefore
depends only on the two sub-actions, not on timing, and is the same on every
rank of an EP group (all of them run the same two stages in the same action).

Rules for MoE code:

* every collective that the stage's forward or backward issues from inside a
  stage must be inside a region (the token-count exchange of a dispatch
  included);
* code inside a region must not draw random numbers (it runs while the other
  thread may own the generators, see ``_CommCoordinator``);
* regions do not need to match across the two threads: the sides may have
  different numbers of MoE layers (none, too), and one side may finish long
  before the other;
* activation checkpointing around layers with marks works: the recomputation
  runs on the backward thread, re-issues the layer's forward collectives, and
  its marks open regions of the backward side.  A mark met while the same
  thread is already inside a region nests (the region closes when the
  outermost one does), so recomputation triggered from inside a backward region
  cannot break the alternation.

Failures: an exception in either thread stops the coordination and releases
the other thread (which finishes its sub-action uncoordinated); the action
then re-raises the error on the calling thread.  A thread that waits for its
turn longer than :func:`get_wait_timeout` seconds raises
:class:`CommWaitTimeoutError` naming the boundary, the action and the rank.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import sys
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle


__all__ = [
    "CommWaitTimeoutError",
    "DEFAULT_WAIT_TIMEOUT_S",
    "combine_begin",
    "combine_end",
    "dispatch_begin",
    "dispatch_end",
    "get_wait_timeout",
    "register_thread_state",
    "set_wait_timeout",
    "wrap_dispatch_combine",
]

TIMEOUT_ENV = "TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT"
# A side hands the processor over after a region only if the region took at
# least this long: waking the other thread costs tens to hundreds of
# microseconds, more than a shorter region can hide.
_HAND_OVER_MIN_REGION_S = 0.5e-3
DEFAULT_WAIT_TIMEOUT_S = 600.0
_timeout_s: float | None = None  # set_wait_timeout(); None: environment or default


class CommWaitTimeoutError(RuntimeError):
    """A thread of an overlapped action waited too long for its turn to communicate."""


def _check_timeout(value: object, source: str) -> float:
    """``value`` as a timeout in seconds: a positive number, ``math.inf`` for no limit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{source}: the timeout must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{source}: the timeout must be a positive number of seconds (inf: no limit), got {value!r}")
    return seconds


def set_wait_timeout(seconds: float | None) -> None:
    """Set how long a thread of an overlapped action may wait for the other, in seconds.

    Applies to actions started afterwards, in this process, and takes
    precedence over ``$TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT``.  The wait
    includes the other thread's compute up to its next boundary, so keep it
    generous.

    Args:
        seconds: a positive number of seconds; ``math.inf`` waits without a
            limit; ``None`` goes back to the environment variable, or
            :data:`DEFAULT_WAIT_TIMEOUT_S` (600 s) when it is not set.

    Raises:
        TypeError: ``seconds`` is not a number (``bool`` and ``str`` included).
        ValueError: ``seconds`` is zero, negative or NaN.
    """
    global _timeout_s
    _timeout_s = None if seconds is None else _check_timeout(seconds, "set_wait_timeout")


def get_wait_timeout() -> float:
    """The timeout that :func:`set_wait_timeout` describes, in seconds (``math.inf``: no limit).

    ``$TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT`` takes the same values as
    :func:`set_wait_timeout`, written as a number (``inf`` for no limit).

    Raises:
        ValueError: the environment variable is set to anything else.
    """
    if _timeout_s is not None:
        return _timeout_s
    env = os.environ.get(TIMEOUT_ENV, "").strip()
    if not env:
        return DEFAULT_WAIT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV}={env!r} is not a number of seconds (inf: no limit)") from None
    try:
        return _check_timeout(value, f"${TIMEOUT_ENV}={env!r}")
    except ValueError as e:
        raise ValueError(str(e)) from None


def _wait_arg(seconds: float) -> float | None:
    """A timeout for ``threading`` waits and joins: ``None`` for no limit."""
    return None if math.isinf(seconds) else seconds


# --------------------------------------------------------------------------- #
# The coordinator: one per overlapped action                                   #
# --------------------------------------------------------------------------- #


class _Side(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1

    @property
    def other(self) -> _Side:
        return _Side(1 - self)

    @property
    def thread_name(self) -> str:
        return "forward" if self is _Side.FORWARD else "backward"


class _Boundary(enum.Enum):
    """A mark; ``opens`` says whether it opens its region in forward."""

    DISPATCH_BEGIN = ("dispatch", True)
    DISPATCH_END = ("dispatch", False)
    COMBINE_BEGIN = ("combine", True)
    COMBINE_END = ("combine", False)

    def __init__(self, phase: str, opens: bool) -> None:
        self.phase = phase
        self.opens = opens

    def describe(self, backward: bool) -> str:
        name = f"{self.phase}_{'begin' if self.opens else 'end'}"
        if not backward:
            return f"{name} (forward)"
        # autograd runs the marks in reverse: *_end opens the backward region
        return f"{name} (backward of the {self.phase} communication)"


class _RNGState(NamedTuple):
    """The random-number generator states one side of an action draws from."""

    cpu: torch.Tensor
    device_states: tuple[torch.Tensor, ...]


class _RNGDevices(NamedTuple):
    """The generators an RNG window covers: the CPU one and ``devices`` of ``device_type``."""

    device_type: str | None
    devices: tuple[int, ...]

    def capture(self) -> _RNGState:
        states: tuple[torch.Tensor, ...] = ()
        if self.devices:
            module = torch.get_device_module(self.device_type)
            states = tuple(module.get_rng_state(d) for d in self.devices)
        return _RNGState(torch.get_rng_state(), states)

    def install(self, state: _RNGState) -> None:
        torch.set_rng_state(state.cpu)
        if self.devices:
            module = torch.get_device_module(self.device_type)
            for d, s in zip(self.devices, state.device_states):
                module.set_rng_state(s, d)


class _CommCoordinator:
    """Turn-taking of the two threads of one overlapped action at communication boundaries.

    The policy (it depends only on the order of boundaries on each thread,
    never on timing):

    * **Communication turns alternate**, the backward side first: its first
      region, then the forward side's first, and so on; a side that has
      finished its sub-action gives up its turns.  Regions are exclusive.
    * **Compute is handed over at each boundary**: a side that closes its
      region waits, before computing on, until the other side has opened its
      next region (or finished); at the start the forward side waits likewise
      for the backward side's first region.  So while one thread
      communicates the other computes, and the two do not compete for the
      processor (or the GIL) the rest of the time -- the phase pattern of
      DualPipe: the backward's combine hides the forward's attention, the
      forward's dispatch the backward's MLP, and so on, which is why the
      backward side communicates first.  After a region shorter than 0.5 ms
      the closing side does not wait: waking the other thread would cost more
      than such a region can hide.  Hand-overs change when each thread
      computes, never the order of the regions.
    * **Random numbers** are drawn as the sequential handler draws them; see
      [Note: random numbers in an overlapped action].

    State, guarded by one ``threading.Condition``: ``turn`` (whose region is
    next), ``depth[side]`` (how deep ``side`` is inside its possibly nested
    region; at most one side is non-zero), ``regions[side]`` (regions opened
    so far), ``done[side]``, ``waiting[side]`` (blocked in this coordinator)
    and ``stopped`` (a side failed: nobody waits any more), and the RNG
    windows of the backward side.  Waiting on a ``Condition`` rather than a
    ``Barrier`` means a side woken because the other failed merely finds
    ``stopped`` set; there is no broken barrier to trip over.

    Args:
        rank: the global rank, for messages.
        action: the action, for messages.
        timeout: seconds a side may wait for the other (``math.inf``: no limit).
    """

    # [Note: random numbers in an overlapped action]
    # Under the sequential handler the forward sub-action draws from the
    # process's generators (CPU and accelerator) and the backward draws
    # nothing, except inside activation-checkpointing recomputation, which
    # torch.utils.checkpoint runs inside torch.random.fork_rng: it installs the
    # states saved in the original forward and puts the previous ones back
    # afterwards.  Run concurrently, the two threads would share one generator:
    # the forward would draw from the recomputation's states and the
    # recomputation's exit would discard the forward's draws.
    #
    # So fork_rng on the backward side opens an "RNG window" (the patch table
    # routes it here).  Outside windows the forward side owns the generators.
    # Inside one, exactly one side may compute at a time -- the owner -- and
    # ownership moves only while the other side is parked: blocked in this
    # coordinator, inside a communication region (marked communication draws
    # no random numbers), or finished.  Each move saves the generator states
    # of the side that stops and installs those of the side that resumes, so
    # each side draws its own sequence, as it would alone.  The outermost
    # window's exit installs the forward side's current states.  Windows
    # cannot deadlock the turn-taking: every wait in this class parks its
    # side, and a side that starts waiting wakes the other if that one waits
    # too (it may be waiting for exactly this side to park).  A window with
    # RNG preservation off (checkpoint(..., preserve_rng_state=False)) has no
    # states to replay; if its
    # recomputation draws numbers, the numbers the sequential handler would
    # draw are not known yet, so it raises instead of giving other results.

    def __init__(self, rank: int, action: str, timeout: float) -> None:
        self.rank = rank
        self.action = action
        self.timeout = timeout
        self._wait_timeout = _wait_arg(timeout)
        self._cond = threading.Condition(threading.Lock())
        self._turn = _Side.BACKWARD
        self._depth = [0, 0]
        self._regions = [0, 0]
        self._done = [False, False]
        self._waiting = [0, 0]
        self._stopped = False
        self._where: list[str | None] = [None, None]  # last boundary passed, per side
        self._opened_at = [0.0, 0.0]  # when the current region of each side was entered
        self._ranges: list[Any] = [None, None]  # open profiler ranges, per side
        # RNG windows (backward side only): region depth at each window's start.
        self._window_depths: list[int] = []
        self._rng_devices = _RNGDevices(None, ())
        self._rng_owner = _Side.FORWARD
        self._rng_saved: list[_RNGState | None] = [None, None]

    # -- transitions --------------------------------------------------------

    def open(self, side: _Side, where: str, phase: str) -> None:
        """Enter a communication region of ``side`` (``where`` names the boundary)."""
        with self._cond:
            if self._depth[side]:
                self._depth[side] += 1  # nested, e.g. recomputation inside a region
                if self._waiting[side.other]:
                    self._cond.notify_all()  # may have parked this side (inside an RNG window)
                return
            self._wait(side, where, lambda: self._may_open(side), "for its turn to communicate")
            if self._stopped:
                return
            self._depth[side] = 1
            self._regions[side] += 1
            self._where[side] = where
            self._opened_at[side] = time.perf_counter()
            self._cond.notify_all()  # the other side may compute now
        if torch.autograd.profiler._is_profiler_enabled:
            rf = record_function(f"ep_overlap::{phase} communication ({side.thread_name} thread)")
            rf.__enter__()
            self._ranges[side] = rf

    def close(self, side: _Side, where: str) -> None:
        """Leave a communication region of ``side``; a close without an open is ignored.

        Leaving the outermost region hands the turn over and then waits until
        the other side has opened its next region (or finished).
        """
        with self._cond:
            self._where[side] = where
            if self._depth[side] == 0:
                return
            self._depth[side] -= 1
            if self._depth[side] == 0:
                self._release(side)
                if time.perf_counter() - self._opened_at[side] >= _HAND_OVER_MIN_REGION_S:
                    # (a shorter region: handing the processor over would cost more than it hides)
                    other = side.other
                    target = self._regions[other] + 1
                    self._wait(
                        side,
                        where,
                        lambda: self._stopped or self._done[other] or self._regions[other] >= target,
                        f"for the {other.thread_name} thread to start communicating before computing on",
                    )
            if not self._in_comm(side):
                self._resume(side, where)

    def _start(self, side: _Side) -> None:
        """Before ``side`` computes at all: the side without the first turn waits for the other's first region."""
        with self._cond:
            other = side.other
            where = "the start of its sub-action"
            self._wait(
                side,
                where,
                lambda: self._turn == side or self._stopped or self._done[other] or self._regions[other] > 0,
                f"for the {other.thread_name} thread to start communicating before computing",
            )
            self._resume(side, where)

    def finish(self, side: _Side) -> None:
        """``side`` has finished its sub-action (or failed): let the other side run freely."""
        with self._cond:
            self._done[side] = True
            if self._depth[side]:
                self._depth[side] = 0
                self._release(side)
            self._cond.notify_all()

    def stop(self) -> None:
        """A side failed: stop coordinating and wake every waiter."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @contextmanager
    def rng_window(self, side: _Side, devices: _RNGDevices, preserve: bool) -> Iterator[None]:
        """A recomputation of ``side`` (inside ``torch.random.fork_rng``); see the RNG note above.

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
            outermost = not self._window_depths
            if outermost:
                self._wait(
                    side,
                    "the start of a recomputation",
                    lambda: self._stopped or self._parked(other),
                    f"for the {other.thread_name} thread to pause before the recomputation draws random numbers",
                )
                self._rng_devices = devices
                self._rng_saved[other] = devices.capture()
                self._rng_owner = side
            start = None if preserve or not outermost else self._rng_saved[other]
            self._window_depths.append(self._depth[side])
        failed = False
        try:
            yield
        except BaseException as e:
            # non-reentrant checkpoint ends a recomputation early with an exception
            early_stop = getattr(sys.modules.get("torch.utils.checkpoint"), "_StopRecomputationError", ())
            failed = not isinstance(e, early_stop)
            raise
        finally:
            with self._cond:
                self._window_depths.pop()
                # whether this side counts as parked depends on its innermost window
                self._cond.notify_all()
                if outermost:
                    drew = start is not None and not failed and not self._stopped and self._drew(start)
                    saved = self._rng_saved[other]
                    if saved is not None:
                        self._rng_devices.install(saved)
                    self._rng_saved = [None, None]
                    self._rng_owner = other
                    if drew:
                        raise RuntimeError(
                            f"rank {self.rank}, action {self.action}: an activation-checkpointing recomputation "
                            "without RNG state preservation (preserve_rng_state=False) drew random numbers on the "
                            f"{side.thread_name} thread of an overlapped OVERLAP_F_B; it cannot draw the numbers "
                            "the sequential handler would. Use preserve_rng_state=True, or run OVERLAP_F_B "
                            "sequentially (TORCH_PIPELINING_EXT_OVERLAP=0)."
                        )

    # -- internals (call with the lock held) --------------------------------

    def _may_open(self, side: _Side) -> bool:
        other = side.other
        return self._stopped or (self._depth[other] == 0 and (self._turn == side or self._done[other]))

    def _release(self, side: _Side) -> None:
        self._turn = side.other
        rf, self._ranges[side] = self._ranges[side], None
        if rf is not None:
            rf.__exit__(None, None, None)
        self._cond.notify_all()

    def _in_comm(self, side: _Side) -> bool:
        """Inside a communication region opened after this side's innermost RNG window began."""
        base = self._window_depths[-1] if side is _Side.BACKWARD and self._window_depths else 0
        return self._depth[side] > base

    def _parked(self, side: _Side) -> bool:
        """``side`` draws no random numbers now: finished, blocked here, or communicating."""
        return self._done[side] or self._waiting[side] > 0 or self._in_comm(side)

    def _resume(self, side: _Side, where: str) -> None:
        """``side`` computes next: inside an RNG window, take the generators over first."""
        if not self._window_depths or self._rng_owner == side:
            return
        other = side.other
        self._wait(
            side,
            where,
            lambda: self._stopped or not self._window_depths or self._rng_owner == side or self._parked(other),
            f"for the {other.thread_name} thread to pause drawing random numbers",
        )
        if self._stopped or not self._window_depths or self._rng_owner == side:
            return
        self._rng_saved[other] = self._rng_devices.capture()
        saved = self._rng_saved[side]
        if saved is not None:
            self._rng_devices.install(saved)
        self._rng_saved[side] = None
        self._rng_owner = side

    def _drew(self, start: _RNGState) -> bool:
        now = self._rng_devices.capture()
        return not torch.equal(now.cpu, start.cpu) or any(
            not torch.equal(a, b) for a, b in zip(now.device_states, start.device_states)
        )

    def _wait(self, side: _Side, where: str, predicate: Callable[[], bool], what: str) -> bool:
        """Wait (lock held) until ``predicate``; True if this had to block."""
        if predicate():
            return False
        self._waiting[side] += 1
        try:
            if self._waiting[side.other]:
                # This side is parked now, which the other side may be waiting
                # for (the start of a recomputation, before its RNG window is
                # recorded, or taking the generators over).
                self._cond.notify_all()
            if self._cond.wait_for(predicate, timeout=self._wait_timeout):
                return True
        finally:
            self._waiting[side] -= 1
        other = side.other
        if self._depth[other]:
            state = f"is inside its communication region (entered at {self._where[other]})"
        elif self._where[other] is None:
            state = "has not reached its first boundary"
        else:
            state = f"last passed {self._where[other]} and has not reached its next boundary"
        raise CommWaitTimeoutError(
            f"rank {self.rank}, action {self.action}: the {side.thread_name} thread waited more than "
            f"{self.timeout:g} s at {where} {what} (after {self._regions[side]} regions of its own); the "
            f"{other.thread_name} thread {state}. Every collective inside a stage must be between ep_overlap "
            f"marks, identically on every rank; raise the limit with ep_overlap.set_wait_timeout() or "
            f"${TIMEOUT_ENV} if the other side's compute is this long."
        )

    # -- thread binding -----------------------------------------------------

    @contextmanager
    def bound(self, side: _Side) -> Iterator[None]:
        """Run ``side``'s sub-action on this thread; marks on it are coordinated.

        On exit ``side`` is finished; on an exception the coordination is
        stopped first so the other side is released.
        """
        binding = _Binding(self, side)
        previous = getattr(_tls, "binding", None)
        _tls.binding = binding
        if side is _Side.BACKWARD:
            _register_backward(binding)
        try:
            self._start(side)
            yield
        except BaseException:
            self.stop()
            raise
        finally:
            _tls.binding = previous
            if side is _Side.BACKWARD:
                _unregister_backward(binding)
            self.finish(side)

    # For tests and messages.
    def regions_opened(self, side: _Side) -> int:
        with self._cond:
            return self._regions[side]


class _Binding(NamedTuple):
    coordinator: _CommCoordinator
    side: _Side


_tls = threading.local()

# Backward sides of the overlapped actions running in this process.  Only read
# by threads that are not bound: the autograd engine runs backward nodes of
# accelerator tensors on its own device threads, which did not call bound().
_active_backward: list[_Binding] = []
_active_lock = threading.Lock()


def _register_backward(binding: _Binding) -> None:
    with _active_lock:
        _active_backward.append(binding)


def _unregister_backward(binding: _Binding) -> None:
    with _active_lock:
        _active_backward.remove(binding)


def _engine_thread_binding() -> _Binding | None:
    """The binding of an autograd-engine device thread running an overlapped backward."""
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return None  # a Python thread that is not bound: not inside an overlapped action
    if torch._C._current_graph_task_id() == -1:
        return None
    with _active_lock:
        candidates = list(_active_backward)
    if len(candidates) > 1:
        raise RuntimeError(
            "ep_overlap: an autograd device thread reached a communication boundary while "
            f"{len(candidates)} overlapped actions run backward in this process "
            f"({', '.join(b.coordinator.action for b in candidates)}); it cannot tell which one it "
            "belongs to. Run one pipeline schedule step at a time per process."
        )
    return candidates[0] if candidates else None


def _current_binding() -> _Binding | None:
    binding = getattr(_tls, "binding", None)
    if binding is None and _active_backward:
        return _engine_thread_binding()
    return binding


# --------------------------------------------------------------------------- #
# The marks                                                                    #
# --------------------------------------------------------------------------- #


class _MarkBackward(torch.autograd.Function):
    """Identity whose backward passes the mirrored boundary."""

    @staticmethod
    def forward(ctx: Any, boundary: _Boundary, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.boundary = boundary
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        binding = _current_binding()
        if binding is not None:
            boundary: _Boundary = ctx.boundary
            where = boundary.describe(backward=True)
            if boundary.opens:  # *_begin: its backward ends the region
                binding.coordinator.close(binding.side, where)
            else:
                binding.coordinator.open(binding.side, where, f"{boundary.phase} backward")
        return (None, *grads)


def _mark(boundary: _Boundary, tensors: tuple[Any, ...]) -> Any:
    binding = _current_binding()
    if binding is not None and boundary.opens:
        binding.coordinator.open(binding.side, boundary.describe(backward=False), boundary.phase)
    out: Any = tensors
    if torch.is_grad_enabled():
        idx = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if idx:
            marked = _MarkBackward.apply(boundary, *(tensors[i] for i in idx))
            out = list(tensors)
            for i, t in zip(idx, marked):
                out[i] = t
            out = tuple(out)
    if binding is not None and not boundary.opens:
        binding.coordinator.close(binding.side, boundary.describe(backward=False))
    return out[0] if len(out) == 1 else out


def dispatch_begin(*tensors: Any) -> Any:
    """Mark the start of an expert-parallel dispatch (token all-to-all, count exchange included).

    Args:
        tensors: the tensors the dispatch sends (anything else passes through).

    Returns:
        The tensors, to be used in their place (one value for one argument,
        else a tuple).  Gradients flow through unchanged; in backward, passing
        this mark closes the dispatch's backward communication.
    """
    return _mark(_Boundary.DISPATCH_BEGIN, tensors)


def dispatch_end(*tensors: Any) -> Any:
    """Mark the end of an expert-parallel dispatch; see :func:`dispatch_begin`.

    Pass the tensors the dispatch received; in backward, passing this mark
    opens the dispatch's backward communication.
    """
    return _mark(_Boundary.DISPATCH_END, tensors)


def combine_begin(*tensors: Any) -> Any:
    """Mark the start of an expert-parallel combine; see :func:`dispatch_begin`."""
    return _mark(_Boundary.COMBINE_BEGIN, tensors)


def combine_end(*tensors: Any) -> Any:
    """Mark the end of an expert-parallel combine; see :func:`dispatch_end`."""
    return _mark(_Boundary.COMBINE_END, tensors)


# --------------------------------------------------------------------------- #
# Applying the marks to an existing model                                      #
# --------------------------------------------------------------------------- #


def _flat_tensors_marked(begin: Callable[..., Any], tree: Any) -> Any:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if positions:
        marked = begin(*(leaves[i] for i in positions))
        if len(positions) == 1:
            marked = (marked,)
        for i, t in zip(positions, marked):
            leaves[i] = t
    else:  # nothing to mark: still pass the boundary so that regions pair up
        begin()
    return tree_unflatten(leaves, spec)


class _MarkedMethod:
    """A dispatch or combine method with the marks around it.

    Holds the original bound method (not a closure over it) so that
    ``copy.deepcopy`` of the module -- which stage splitting does -- rebinds
    it to the copy.
    """

    def __init__(self, fn: Callable[..., Any], begin: Callable[..., Any], end: Callable[..., Any]) -> None:
        self.fn = fn
        self.begin = begin
        self.end = end
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _flat_tensors_marked(self.begin, (args, kwargs))
        return _flat_tensors_marked(self.end, self.fn(*args, **kwargs))


# Attribute values that are never dispatcher objects.
_NOT_DISPATCHERS = (
    nn.Module,
    torch.Tensor,
    type,
    types.FunctionType,
    types.MethodType,
    functools.partial,
    str,
    bytes,
    int,
    float,
    list,
    tuple,
    dict,
    set,
    type(None),
)


def _dispatcher_candidates(target: object) -> Iterator[tuple[str, object]]:
    """``target``; if it is a module, its submodules and the plain objects they hold as attributes."""
    if not isinstance(target, nn.Module):
        yield "", target
        return
    for fqn, module in target.named_modules():
        yield fqn, module
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, _NOT_DISPATCHERS):
                continue
            yield f"{fqn}.{attr}" if fqn else attr, value


def wrap_dispatch_combine(
    target: nn.Module | object,
    dispatch: str = "dispatch",
    combine: str = "combine",
) -> list[str]:
    """Put the communication marks around existing dispatch and combine methods.

    Every object that has both methods gets wrapped versions: ``target``
    itself and, when it is an ``nn.Module``, each submodule and each plain
    object that a module holds as an attribute (a token dispatcher kept by an
    experts module, for instance).  The tensors in the arguments pass the
    ``*_begin`` mark before the original method runs, the tensors in its
    result pass the ``*_end`` mark.  Only instances change, never classes,
    and applying it twice changes nothing; ``del obj.dispatch, obj.combine``
    undoes it.  An object shared by several modules is wrapped once.

    Everything the methods communicate (count exchanges included) must happen
    inside them, and they must be called in forward.

    Args:
        target: the model, one MoE module, or a dispatcher object.
        dispatch: name of the method that sends tokens to their experts.
        combine: name of the method that brings expert outputs back.

    Returns:
        Where marks were put: module FQNs (``""`` for ``target`` itself) and
        ``"<module FQN>.<attribute>"`` for objects held by modules.

    Raises:
        ValueError: ``dispatch`` and ``combine`` name the same method, or
            nothing in ``target`` has both methods.
        TypeError: an object with both methods cannot take instance
            attributes (``__slots__``).
    """
    if dispatch == combine:
        raise ValueError(f"wrap_dispatch_combine: dispatch and combine must be different methods, both are {dispatch!r}")
    wrapped: list[str] = []
    seen: set[int] = set()
    for name, obj in _dispatcher_candidates(target):
        fns = [getattr(obj, method, None) for method in (dispatch, combine)]
        if id(obj) in seen or not all(callable(f) for f in fns):
            continue
        seen.add(id(obj))
        for method, fn, begin, end in (
            (dispatch, fns[0], dispatch_begin, dispatch_end),
            (combine, fns[1], combine_begin, combine_end),
        ):
            if isinstance(fn, _MarkedMethod):
                continue
            try:
                object.__setattr__(obj, method, _MarkedMethod(fn, begin, end))
            except AttributeError as e:
                raise TypeError(
                    f"wrap_dispatch_combine: cannot wrap {type(obj).__name__}.{method} of {name or 'the target'!r}: "
                    f"{e}; mark the communication in its code with dispatch_begin/dispatch_end and "
                    "combine_begin/combine_end instead"
                ) from e
        wrapped.append(name)
    if not wrapped:
        raise ValueError(
            f"wrap_dispatch_combine: nothing in {type(target).__name__} (itself, a submodule, or an object a module "
            f"holds) has both a {dispatch!r} and a {combine!r} method"
        )
    return wrapped


# --------------------------------------------------------------------------- #
# Thread state of other libraries                                              #
# --------------------------------------------------------------------------- #

# handle id -> (capture, apply); an OrderedDict, as RemovableHandle holds a weak reference to it
_thread_state_hooks: OrderedDict[int, tuple[Callable[[], Any], Callable[[Any], AbstractContextManager[Any]]]] = (
    OrderedDict()
)


def register_thread_state(
    capture: Callable[[], Any],
    apply: Callable[[Any], AbstractContextManager[Any]],
) -> RemovableHandle:
    """Carry a library's thread-local state over to the backward thread of overlapped actions.

    An overlapped OVERLAP_F_B runs its backward sub-action on a worker thread.
    The worker already runs in a copy of the calling thread's ``contextvars``
    context and with its grad mode, autocast state, accelerator device and
    intra-op thread count.  State kept in ``threading.local`` (a device mesh,
    a communication backend's per-thread settings) is not visible there; for
    it, register a pair:

    * ``capture()`` runs on the calling thread at the start of every
      overlapped action and returns a value;
    * ``apply(value)`` runs on the worker thread and returns a context manager
      that is entered around the backward sub-action and exited after it.

    Example::

        handle = ep_overlap.register_thread_state(
            lambda: my_lib.current_mesh(),
            lambda mesh: my_lib.use_mesh(mesh),
        )
        ...
        handle.remove()

    Returns:
        A handle whose ``remove()`` unregisters the pair.
    """
    if not callable(capture) or not callable(apply):
        raise TypeError("register_thread_state: capture and apply must be callables")
    handle = RemovableHandle(_thread_state_hooks)
    _thread_state_hooks[handle.id] = (capture, apply)
    return handle
