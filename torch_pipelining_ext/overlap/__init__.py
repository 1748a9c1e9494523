"""Expert-parallel communication marks for overlapped pipeline actions.

An ``OVERLAP_F_B`` action of a ``_PipelineScheduleRuntime``
(``ScheduleDualPipeV``, or a CSV schedule) pairs the forward of one
microbatch with the backward of another.  A schedule that registers
:func:`overlap_f_b` for it runs the forward on the calling thread and the
backward on a worker thread; both may issue the expert-parallel all-to-alls of
their MoE layers.  Two threads must never issue collectives on one process
group at once, and every rank must issue its collectives in the same order, so
MoE code marks where its communication is:

* in forward, :func:`dispatch_begin` / :func:`dispatch_end` around the token
  dispatch and :func:`combine_begin` / :func:`combine_end` around the combine
  (each takes and returns tensors); :func:`wrap_dispatch_combine` puts them
  around existing ``dispatch`` and ``combine`` methods;
* autograd mirrors the marks in backward: the backward of ``*_end`` opens the
  backward communication region and the backward of ``*_begin`` closes it.

Outside an overlapped action a mark only passes its tensors through (one
autograd node when they require grad, so that a backward run later inside an
overlapped action is coordinated).  Inside one, the two threads take turns:
at most one is inside a communication region at any moment, regions are
granted alternately, the backward thread's first, and once one thread has
finished its sub-action the other runs its remaining regions freely.  The
order of collectives on each rank therefore depends only on the two
sub-actions, never on timing, and is the same on every rank of an EP group.

Rules for MoE code:

* every collective that a stage's forward or backward issues must be inside a
  region (the token-count exchange of a dispatch included);
* code inside a region must not draw random numbers (the other thread may
  own the generators then);
* the two sides may have different numbers of regions (none, too);
* activation checkpointing around marked layers works: the recomputation
  re-issues the layer's forward collectives on the backward thread, its marks
  open regions of the backward side, and a mark met inside a region nests.

A failure in either thread releases the other; the action re-raises it on the
calling thread.  A thread that waits for its turn longer than
:func:`get_wait_timeout` seconds raises :class:`CommWaitTimeoutError` naming
the boundary, the action and the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext.overlap import _marks as _ep_marks
from torch_pipelining_ext.overlap import _turns as _ep_turns
from torch_pipelining_ext.overlap._marks import _Boundary
from torch_pipelining_ext.overlap._turns import (
    CommWaitTimeoutError,
    DEFAULT_WAIT_TIMEOUT_S,
    TIMEOUT_ENV,
)


__all__ = [
    "ActionObserver",
    "CommWaitTimeoutError",
    "DEFAULT_WAIT_TIMEOUT_S",
    "combine_begin",
    "combine_end",
    "dispatch_begin",
    "dispatch_end",
    "get_wait_timeout",
    "observe_actions",
    "overlap_f_b",
    "register_thread_state",
    "set_wait_timeout",
    "TIMEOUT_ENV",
    "wrap_dispatch_combine",
]


def set_wait_timeout(seconds: float | None) -> None:
    """Set how long a thread of an overlapped action may wait for the other (seconds).

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
    _ep_turns._set_timeout(seconds)


def get_wait_timeout() -> float:
    """The timeout :func:`set_wait_timeout` describes, in seconds (``math.inf``: none).

    ``$TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT`` takes the same values as
    :func:`set_wait_timeout`, written as a number (``inf`` for no limit).

    Raises:
        ValueError: the environment variable is set to anything else.
    """
    return _ep_turns._get_timeout()


class ActionObserver:
    """Receives timestamps of the overlapped actions run under :func:`observe_actions`.

    Subclass it and override what you need; the defaults do nothing.  Each
    method is called on the thread the event happened on (the calling thread
    for the forward side, the worker thread for the backward side), with
    ``time.perf_counter()`` values, and must not raise.  ``side`` is
    ``"forward"`` or ``"backward"``.
    """

    def sub_action(self, side: str, start: float, end: float) -> None:
        """``side``'s sub-action computed from ``start`` to ``end``."""

    def transition(self, name: str, side: str, call: float, ret: float) -> None:
        """``side`` called the turn-taking at ``call`` and went on at ``ret``.

        ``name`` is ``"start"`` (before the sub-action computes), ``"open"``
        / ``"close"`` (a mark entering / leaving a communication region,
        nested ones included) or ``"finish"`` (the sub-action ended); the time
        between ``call`` and ``ret`` is spent waiting for the other side.
        """


@contextmanager
def observe_actions(observer: ActionObserver) -> Iterator[ActionObserver]:
    """Report the overlapped actions that start in the ``with`` block to ``observer``.

    For benchmarks and for debugging the turn-taking; one observer per
    process at a time (an inner block replaces an outer one until it exits).
    Without an observer an action pays one ``is None`` check.

    Raises:
        TypeError: ``observer`` is not an :class:`ActionObserver`.
    """
    if not isinstance(observer, ActionObserver):
        raise TypeError(
            "observe_actions: expected an ActionObserver, got "
            f"{type(observer).__name__}"
        )
    previous = _ep_turns._set_observer(observer)
    try:
        yield observer
    finally:
        _ep_turns._set_observer(previous)


def dispatch_begin(*tensors: Any) -> Any:
    """Mark the start of an expert-parallel dispatch (its count exchange included).

    Args:
        tensors: the tensors the dispatch sends (anything else passes through).

    Returns:
        The tensors, to be used in their place (one value for one argument,
        else a tuple).  Gradients flow through unchanged; in backward, passing
        this mark closes the dispatch's backward communication.
    """
    return _ep_marks.mark(_Boundary.DISPATCH_BEGIN, tensors)


def dispatch_end(*tensors: Any) -> Any:
    """Mark the end of an expert-parallel dispatch; see :func:`dispatch_begin`.

    Pass the tensors the dispatch received; in backward, passing this mark
    opens the dispatch's backward communication.
    """
    return _ep_marks.mark(_Boundary.DISPATCH_END, tensors)


def combine_begin(*tensors: Any) -> Any:
    """Mark the start of an expert-parallel combine; see :func:`dispatch_begin`."""
    return _ep_marks.mark(_Boundary.COMBINE_BEGIN, tensors)


def combine_end(*tensors: Any) -> Any:
    """Mark the end of an expert-parallel combine; see :func:`dispatch_end`."""
    return _ep_marks.mark(_Boundary.COMBINE_END, tensors)


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
    return _ep_marks.wrap_dispatch_combine(target, dispatch, combine)


def register_thread_state(
    capture: Callable[[], Any],
    apply: Callable[[Any], AbstractContextManager[Any]],
) -> RemovableHandle:
    """Carry a library's thread-local state to the backward thread of an action.

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
    return _ep_marks.register_thread_state(capture, apply)


def overlap_f_b(action: Any, ctx: Any) -> None:
    """Custom function that runs an ``OVERLAP_F_B`` action's sub-actions concurrently.

    Register it on a schedule to opt in::

        schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)

    The threads are started on first use (see ``_overlap.py``).
    """
    from torch_pipelining_ext.overlap import _handler

    _handler.overlap_f_b(action, ctx)
