"""Expert-parallel communication in overlapped pipeline actions.

An ``OVERLAP_F_B`` action of a ``_PipelineScheduleRuntime``
(``ScheduleDualPipeV``, or a CSV schedule) pairs the forward of one
microbatch with the backward of another.  A schedule that registers
:func:`overlap_f_b` for it runs the forward on the calling thread and the
backward on a worker thread; both may issue collectives (the expert-parallel
all-to-alls of their MoE layers, and any other).  Every rank must issue the
collectives of one communicator in the same order, so inside an overlapped
action **every collective either thread issues is coordinated** -- marked or
not, from ``torch.distributed``, functional collectives (DTensor, FSDP2), C++
(DDP) or an autograd backward: it runs inside a communication region of its
side, implicit where no mark opened one.

* **Marks are a performance hint.**  :func:`dispatch_begin` /
  :func:`dispatch_end` around a token dispatch (its count exchange included)
  and :func:`combine_begin` / :func:`combine_end` around the combine say where
  a side communicates, so that the other side computes meanwhile (on CPU the
  two threads hand the processor over at the marks).  Autograd mirrors them
  in backward; :func:`wrap_dispatch_combine` puts them around existing
  ``dispatch`` and ``combine`` methods.  Outside an overlapped action a mark
  only passes its tensors through.
* **The strict rule** (a communicator both sides use): the two sides'
  collectives take turns, the backward side first, identically on every rank;
  a side keeps its turns while it waits for its input.
* **Each side its own communicator** (the free rule): after
  :func:`create_twin_group` (once, at set-up, on every rank), the forward side
  uses the group and the backward side its twin, as :func:`side_group` says
  when asked at the time of the collective.  Their collectives wait for
  nobody: the side whose input is there communicates first.  On gloo; NCCL
  keeps the strict rule until a GPU run shows the free order safe there.
  :func:`all_to_all` is a differentiable all-to-all with the marks and the
  per-side communicator built in.

Rules for MoE code: code inside a marked region must not draw random numbers
(the other thread may own the generators then); activation checkpointing
around marked layers works (the recomputation re-issues the layer's forward
collectives on the backward side).  A failure in either thread releases the
other; the action re-raises it on the calling thread.  A thread that waits
for the other longer than :func:`get_wait_timeout` seconds raises
:class:`CommWaitTimeoutError` naming the boundary, the action and the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext.overlap import _groups
from torch_pipelining_ext.overlap import _marks as _ep_marks
from torch_pipelining_ext.overlap._groups import CollectiveOrderError
from torch_pipelining_ext.overlap._marks import _Boundary
from torch_pipelining_ext.overlap._settings import (
    DEFAULT_WAIT_TIMEOUT_S,
    SETTINGS,
    TIMEOUT_ENV,
)
from torch_pipelining_ext.overlap._turns import CommWaitTimeoutError


__all__ = [
    "ActionObserver",
    "CollectiveOrderError",
    "CommWaitTimeoutError",
    "DEFAULT_WAIT_TIMEOUT_S",
    "all_to_all",
    "combine_begin",
    "combine_end",
    "create_twin_group",
    "dispatch_begin",
    "dispatch_end",
    "get_wait_timeout",
    "observe_actions",
    "overlap_f_b",
    "register_thread_state",
    "set_wait_timeout",
    "side_group",
    "TIMEOUT_ENV",
    "twin_group",
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
    SETTINGS.set_wait_timeout(seconds)


def get_wait_timeout() -> float:
    """The timeout :func:`set_wait_timeout` describes, in seconds (``math.inf``: none).

    ``$TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT`` takes the same values as
    :func:`set_wait_timeout`, written as a number (``inf`` for no limit).

    Raises:
        ValueError: the environment variable is set to anything else.
    """
    return SETTINGS.wait_timeout()


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
        nested ones included), ``"collective"`` (before a collective is
        issued, marked or not) or ``"finish"`` (the sub-action ended); the
        time between ``call`` and ``ret`` is spent waiting for the other side.
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
    previous = SETTINGS.swap_observer(observer)
    try:
        yield observer
    finally:
        SETTINGS.swap_observer(previous)


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
    The worker already runs under the calling thread's torch state (grad,
    inference and autocast modes, the TorchFunctionMode and TorchDispatchMode
    stacks and with them the default device, saved-tensor hooks, accelerator
    device, intra-op thread count; see ``overlap/_thread_state.py``) and in a
    copy of its ``contextvars`` context.  State kept in ``threading.local`` (a
    device mesh, a communication backend's per-thread settings) is not visible
    there; for it, register a pair:

    * ``capture()`` runs on the calling thread at the start of every
      overlapped action and returns a value;
    * ``apply(value)`` runs on the worker thread and returns a context manager
      that is entered around the backward sub-action and exited after it.

    Example::

        handle = overlap.register_thread_state(
            lambda: my_lib.current_mesh(),
            lambda mesh: my_lib.use_mesh(mesh),
        )
        ...
        handle.remove()

    Returns:
        A handle whose ``remove()`` unregisters the pair.
    """
    return _ep_marks.register_thread_state(capture, apply)


def create_twin_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """Give ``group`` a twin: a second process group over the same ranks.

    During an overlapped OVERLAP_F_B the forward side communicates over
    ``group`` and the backward side over the twin (ask :func:`side_group`),
    so that the two sides' collectives on it need no common order (on gloo;
    see the module docstring).  Call it once, at set-up -- when the stages
    or the schedule are built -- and before any collective runs on another
    thread.

    It is a collective over the default process group: **every** rank calls
    it at the same time, each with its own group (an expert-parallel group
    per set of ranks, say), and every rank takes part in creating the twins
    of all of them (``torch.distributed.new_group``).  A group that already
    has a twin keeps it.

    Args:
        group: the group (``None``: the default group).

    Returns:
        The twin of ``group``.

    Raises:
        ValueError: the ranks of one group passed it with different backends,
            or some of them had given it a twin already.
    """
    return _groups.create_twin(group)


def twin_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """The twin :func:`create_twin_group` gave ``group``, or ``None``."""
    return _groups.twin_of(group)


def side_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The process group the calling code must use for a collective on ``group``.

    On the backward side of an overlapped OVERLAP_F_B (the worker thread, a
    recomputation included) the twin of ``group``; everywhere else --
    the forward side, plain actions, outside a schedule -- ``group`` itself,
    and ``group`` whenever it has no twin.  Ask it when the collective is
    issued: the forward of a layer and its backward may run on different
    sides, so a backward must not reuse the group its forward used::

        def backward(ctx, grad):
            out = torch.empty_like(grad)
            dist.all_to_all_single(out, grad, group=overlap.side_group(ctx.group))

    A collective issued on the other side's communicator raises
    :class:`CollectiveOrderError` before it is issued.
    """
    return _ep_marks.side_group(group)


def all_to_all(
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    phase: str = "dispatch",
) -> torch.Tensor:
    """A differentiable ``all_to_all_single`` for expert parallelism, overlap-ready.

    Sends ``input`` split along dim 0 by ``input_split_sizes`` (equal splits
    if ``None``) and returns what the ranks of ``group`` sent to this one
    (``output_split_sizes`` rows each).  Its backward is the reverse exchange.
    Both run inside the communication marks of ``phase`` (``"dispatch"`` or
    ``"combine"``) and on the communicator :func:`side_group` gives *when they
    run*: inside an overlapped OVERLAP_F_B a twinned group's forward and
    backward exchanges run on the two sides' own communicators.

    Args:
        input: the rows to send, grouped by destination rank.
        output_split_sizes: rows received from each rank (``None``: equal).
        input_split_sizes: rows sent to each rank (``None``: equal).
        group: the expert-parallel group (``None``: the default group).
        phase: which marks to put around the exchange.

    Raises:
        ValueError: ``phase`` is not one of the two, or only one of the split
            size lists is given.
    """
    from torch_pipelining_ext.overlap import _all_to_all

    return _all_to_all.all_to_all(
        input, output_split_sizes, input_split_sizes, group, phase
    )


def overlap_f_b(action: Any, ctx: Any) -> None:
    """Custom function that runs an ``OVERLAP_F_B`` action's sub-actions concurrently.

    Register it on a schedule to opt in::

        schedule.register_custom_function(OVERLAP_F_B, overlap.overlap_f_b)

    The threads are started on first use (see ``_overlap.py``).
    """
    from torch_pipelining_ext.overlap import _handler

    _handler.overlap_f_b(action, ctx)
