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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function


__all__ = [
    "CommWaitTimeoutError",
    "combine_begin",
    "combine_end",
    "dispatch_begin",
    "dispatch_end",
    "get_wait_timeout",
    "set_wait_timeout",
    "wrap_dispatch_combine",
]

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT"
# A side hands the processor over after a region only if the region took at
# least this long: waking the other thread costs tens to hundreds of
# microseconds, more than a shorter region can hide.
_HAND_OVER_MIN_REGION_S = 0.5e-3
_DEFAULT_TIMEOUT_S = 600.0
_timeout_s: float | None = None  # set_wait_timeout(); None: environment or default

class CommWaitTimeoutError(RuntimeError):
    """A thread of an overlapped action waited too long for its turn to communicate."""


def set_wait_timeout(seconds: float | None) -> None:
    """Set how long a thread may wait for its turn to communicate, in seconds.

    ``None`` restores the default: ``$TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT``, or
    600 s.  Applies to actions started afterwards.  The wait includes the other
    thread's compute up to its next boundary, so keep it generous.
    """
    global _timeout_s
    if seconds is not None and not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    _timeout_s = seconds


def get_wait_timeout() -> float:
    """The timeout, in seconds, that :func:`set_wait_timeout` describes."""
    if _timeout_s is not None:
        return _timeout_s
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds") from None
        if value > 0:
            return value
    return _DEFAULT_TIMEOUT_S


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

    State, guarded by one ``threading.Condition``: ``turn`` (whose region is
    next), ``depth[side]`` (how deep ``side`` is inside its possibly nested
    region; at most one side is non-zero), ``regions[side]`` (regions opened
    so far), ``done[side]`` and ``stopped`` (a side failed: nobody waits any
    more).  Waiting on a ``Condition`` rather than a ``Barrier`` means a side
    woken because the other failed merely finds ``stopped`` set; there is no
    broken barrier to trip over.

    Args:
        rank: the global rank, for messages.
        action: the action, for messages.
        timeout: seconds a side may wait for the other.
    """

    def __init__(self, rank: int, action: str, timeout: float) -> None:
        self.rank = rank
        self.action = action
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._turn = _Side.BACKWARD
        self._depth = [0, 0]
        self._regions = [0, 0]
        self._done = [False, False]
        self._stopped = False
        self._where: list[str | None] = [None, None]  # last boundary passed, per side
        self._opened_at = [0.0, 0.0]  # when the current region of each side was entered
        self._ranges: list[Any] = [None, None]  # open profiler ranges, per side

    # -- transitions --------------------------------------------------------

    def open(self, side: _Side, where: str, phase: str) -> None:
        """Enter a communication region of ``side`` (``where`` names the boundary)."""
        with self._cond:
            if self._depth[side]:
                self._depth[side] += 1  # nested, e.g. recomputation inside a region
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
            if self._depth[side]:
                return
            self._release(side)
            if time.perf_counter() - self._opened_at[side] < _HAND_OVER_MIN_REGION_S:
                return  # a short region: handing the processor over would cost more than it hides
            other = side.other
            target = self._regions[other] + 1
            self._wait(
                side,
                where,
                lambda: self._stopped or self._done[other] or self._regions[other] >= target,
                f"for the {other.thread_name} thread to start communicating before computing on",
            )

    def _start(self, side: _Side) -> None:
        """Before ``side`` computes at all: the side without the first turn waits for the other's first region."""
        with self._cond:
            other = side.other
            self._wait(
                side,
                "the start of its sub-action",
                lambda: self._turn == side or self._stopped or self._done[other] or self._regions[other] > 0,
                f"for the {other.thread_name} thread to start communicating before computing",
            )

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

    def _wait(self, side: _Side, where: str, predicate: Callable[[], bool], what: str) -> None:
        if predicate() or self._cond.wait_for(predicate, timeout=self.timeout):
            return
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


def wrap_dispatch_combine(
    model: nn.Module,
    dispatch: str = "dispatch",
    combine: str = "combine",
) -> list[str]:
    """Put the communication marks around existing dispatch and combine methods.

    For ``model`` and every submodule that has both methods, the instance gets
    wrapped versions: the tensors in the arguments pass the ``*_begin`` mark
    before the original method runs, the tensors in its result pass the
    ``*_end`` mark.  Classes are not modified, and applying it twice changes
    nothing.  ``del module.dispatch, module.combine`` undoes it.

    Everything the methods communicate (count exchanges included) must happen
    inside them, and they must be called in forward.

    Args:
        model: the model (or one MoE module).
        dispatch: name of the method that sends tokens to their experts.
        combine: name of the method that brings expert outputs back.

    Returns:
        The qualified names of the modules that were wrapped.

    Raises:
        ValueError: no module of ``model`` has both methods.
    """
    wrapped = []
    for fqn, module in model.named_modules():
        fns = [getattr(module, name, None) for name in (dispatch, combine)]
        if not all(callable(f) for f in fns):
            continue
        for name, fn, begin, end in (
            (dispatch, fns[0], dispatch_begin, dispatch_end),
            (combine, fns[1], combine_begin, combine_end),
        ):
            if not isinstance(fn, _MarkedMethod):
                object.__setattr__(module, name, _MarkedMethod(fn, begin, end))
        wrapped.append(fqn)
    if not wrapped:
        raise ValueError(
            f"wrap_dispatch_combine: no module of {type(model).__name__} has both a {dispatch!r} and a "
            f"{combine!r} method"
        )
    return wrapped
