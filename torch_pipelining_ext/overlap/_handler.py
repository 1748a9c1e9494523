"""Concurrent OVERLAP_F_B: the forward and the backward sub-actions on two threads.

A schedule opts in with
``schedule.register_custom_function(OVERLAP_F_B, overlap.overlap_f_b)``.

Running one action::

    calling thread                            worker thread
    --------------                            -------------
    prepare_compute_action(F), then (B)
      (everything order-sensitive)
    hand B to the worker ------------------> wait for B's gradients
    wait for F's activations                  B compute
    F compute                                 (communication regions
    (communication regions take turns          take turns with F's)
     with B's)
    wait for B <---------------------------- done
    re-raise the first failure, naming rank and action

The bookkeeping is the runtime's own (``prepare_compute_action``), done on
the calling thread in schedule order; only the two computes run concurrently,
under a ``_CommCoordinator`` owned by the action, so that the model's
communication marks (``overlap``) and every collective either thread issues
go through it (see [Note: collectives in an overlapped action]).  The worker
runs under the caller's thread state (see [Note: thread state of the backward
thread]).  An action returns or raises only once both sides are done.

"rank R" in messages and thread names is the global rank (of the default
process group); ``schedule.rank`` is the pipeline rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule

from torch_pipelining_ext.overlap import _collectives
from torch_pipelining_ext.overlap import _marks as _ep_marks
from torch_pipelining_ext.overlap._settings import SETTINGS
from torch_pipelining_ext.overlap._streams import _StreamPlan
from torch_pipelining_ext.overlap._thread_state import _ThreadState
from torch_pipelining_ext.overlap._turns import (
    _CommCoordinator,
    _ObservedCoordinator,
    _wait_arg,
)
from torch_pipelining_ext.overlap.policy import Side


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action

    from torch_pipelining_ext._schedule_runtime import (
        CustomFunctionRuntime,
        CustomFunctionStage,
    )


# A side's receive wait, left to its thread by prepare_compute_action(...,
# wait_inputs=False), and what it awaits.
_InputWait = tuple[Callable[[], None], str]


__all__ = ["overlap_f_b"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _OverlapState:
    """What concurrent OVERLAP_F_B keeps on a schedule, as its ``_overlap_state``.

    Attributes:
        backward_worker: the backward thread of the step in progress.
        stage_streams: stage index -> accelerator stream of the overlapped
            actions, created on first use and kept across steps.
        unmarked_pairs: (forward stage, backward stage) pairs whose
            concurrent run passed no communication mark in this step.
    """

    backward_worker: _BackwardWorker | None = None
    stage_streams: dict[int, Any] | None = None
    unmarked_pairs: set[tuple[int, int]] = dataclasses.field(default_factory=set)

    def end_step(self, owner: str) -> None:
        """The step of ``owner`` (a schedule's name) ended, however it ended.

        Closes and joins the step's backward thread and forgets its unmarked
        pairs.
        """
        self.unmarked_pairs.clear()
        if self.backward_worker is not None:
            worker, self.backward_worker = self.backward_worker, None
            worker.close_after_step(owner)


def _state(schedule: Any) -> _OverlapState:
    """``schedule``'s :class:`_OverlapState`, created on first use."""
    state = getattr(schedule, "_overlap_state", None)
    if state is None:
        state = schedule._overlap_state = _OverlapState()
    return state


def _global_rank(schedule: Any) -> int:
    """This process's rank in the default group (else ``schedule.rank``)."""
    return dist.get_rank() if dist.is_initialized() else getattr(schedule, "rank", 0)


def _schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


def _forward_and_backward(action: _Action) -> tuple[int, int] | None:
    """Positions of the forward and the backward-like sub-action (None: not a pair)."""
    s = _schedules()
    subs = action.sub_actions or ()
    if len(subs) != 2:
        return None
    kinds = [a.computation_type for a in subs]
    backward_types = (s.FULL_BACKWARD, s.BACKWARD_INPUT, s.BACKWARD_WEIGHT)
    for f, b in ((0, 1), (1, 0)):
        if kinds[f] == s.FORWARD and kinds[b] in backward_types:
            return f, b
    return None


def overlap_f_b(action: _Action, ctx: Any) -> None:
    """Run an OVERLAP_F_B action with its forward and backward sub-actions concurrently.

    Custom-function protocol: ``(action, ctx: PipelineContext) -> None``.
    The sub-actions' bookkeeping runs first, on this thread, in schedule
    order; then the backward computes on a worker thread while the forward
    computes here.  A pair that is not one forward plus one FULL_BACKWARD,
    BACKWARD_INPUT or BACKWARD_WEIGHT runs sequentially.

    Raises:
        RuntimeError: a sub-action failed (or waited too long at a
            communication boundary); the message names the global rank and
            the action, the original exception is the cause.
    """
    schedule: CustomFunctionRuntime = ctx.schedule_ref
    global_rank = _global_rank(schedule)
    pair = _forward_and_backward(action)
    state = _state(schedule)
    stages: dict[int, Any] = schedule._local_stages()
    stage_pair: tuple[int, int] | None = None
    if pair is not None:
        assert action.sub_actions is not None  # a pair: two sub-actions
        stage_pair = (
            action.sub_actions[pair[0]].stage_index,
            action.sub_actions[pair[1]].stage_index,
        )
    if (
        pair is None
        or _same_fsdp_stage(stages, action)
        or stage_pair in state.unmarked_pairs
    ):
        logger.debug("[rank %s] %s: sub-actions run in turn", global_rank, action)
        _run_sequentially(schedule, action, ctx, pair)
        return
    logger.debug("[rank %s] %s: sub-actions run concurrently", global_rank, action)
    assert action.sub_actions is not None and stage_pair is not None  # a pair
    # In schedule order, on this thread: everything order-sensitive.  Each
    # side waits for its receives itself.
    computes = [
        schedule.prepare_compute_action(sub, ctx, wait_inputs=False)
        for sub in action.sub_actions
    ]
    f, b = pair
    fwd_action, bwd_action = action.sub_actions[f], action.sub_actions[b]
    # Every fully_shard module of both stages is unsharded now, so that
    # neither thread's compute issues a data-parallel collective (whose order
    # would then depend on timing) except the last backward's reduce-scatter.
    for sub in (fwd_action, bwd_action):
        stage: CustomFunctionStage = stages[sub.stage_index]
        stage._unshard_fsdp_modules()
    streams = _StreamPlan.for_action(state, stages, fwd_action, bwd_action)
    coordinator = _run_overlapped(
        computes[f],
        computes[b],
        global_rank=global_rank,
        action=str(action),
        sub_actions=(str(fwd_action), str(bwd_action)),
        streams=streams,
        worker=_worker_for(state, global_rank),
        input_waits=(_input_wait(computes[f]), _input_wait(computes[b])),
        first=Side.FORWARD if f < b else Side.BACKWARD,
    )
    if streams is not None:
        # the device may run the two sides' kernels at once: it stays concurrent
        streams.record_handoffs(stages, fwd_action, bwd_action)
    elif not any(coordinator.regions_opened(side) for side in Side):
        # [Note: stage pairs without marks]
        # Neither sub-action passed a communication mark, so the forward side
        # waited for the backward side to finish: nothing overlapped, and the
        # two threads only added their hand-overs.  The rest of the step runs
        # this stage pair's OVERLAP_F_B sequentially -- same results, by the
        # bitwise contract.  The decision depends only on the marks passed,
        # which every rank of a group passes alike, never on timing; each step
        # decides afresh.
        state.unmarked_pairs.add(stage_pair)


def _input_wait(compute: Any) -> _InputWait | None:
    """The receive wait a prepared compute left pending, and what it awaits."""
    inputs = compute.inputs
    return None if inputs is None else (compute.wait_inputs, inputs)


def _run_sequentially(
    schedule: CustomFunctionRuntime,
    action: _Action,
    ctx: Any,
    pair: tuple[int, int] | None,
) -> None:
    """The sub-actions one after the other (reported to the observer, if one is set)."""
    observer = SETTINGS.observer  # see overlap.observe_actions
    assert action.sub_actions is not None  # an OVERLAP_F_B action
    for i, sub_action in enumerate(action.sub_actions):
        if observer is None or pair is None:
            schedule.perform_action(sub_action, ctx)
        else:
            side = Side.FORWARD if i == pair[0] else Side.BACKWARD
            compute = schedule.prepare_compute_action(sub_action, ctx)
            _observed(observer, side, compute)()


def _same_fsdp_stage(stages: dict[int, Any], action: _Action) -> bool:
    """Both sub-actions on one stage that holds ``fully_shard`` modules.

    Such a pair runs sequentially: FSDP2 keeps per-module state (training
    state, unsharded parameters) that its forward and backward hooks change.
    Run concurrently on one stage, the backward's pre-backward hook would
    all-gather a layer or not depending on whether the forward thread had
    resharded it yet, so the data-parallel collectives of a rank would
    depend on thread timing.
    """
    assert action.sub_actions is not None  # a pair (see overlap_f_b)
    fwd, bwd = action.sub_actions
    if fwd.stage_index != bwd.stage_index:
        return False
    stage = stages.get(fwd.stage_index)
    return stage is not None and isinstance(stage.submod, FSDPModule)


# --------------------------------------------------------------------------- #
# Running two closures as one overlapped action                                #
# --------------------------------------------------------------------------- #


class _BackwardWorker:
    """The thread that runs the backward sub-actions of one schedule's step.

    A thread that has run torch code once runs it faster the next time (its
    allocator and math-library state are warm: a fresh thread costs
    milliseconds per action), so one worker serves every OVERLAP_F_B action
    of a step; it is held in the schedule's :class:`_OverlapState`, and closed
    and joined when the step ends, however it ends.
    """

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # a task did not finish in time: the thread cannot be joined
        self.stuck = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            task()

    def submit(self, task: Callable[[], None]) -> threading.Event:
        """Run ``task`` (which must not raise) on the worker; set when it returns."""
        done = threading.Event()

        def run() -> None:
            try:
                task()
            finally:
                done.set()

        self._tasks.put(run)
        return done

    def close(self, timeout: float | None) -> bool:
        """Stop the thread after its task; False if it lives on after ``timeout``."""
        self._tasks.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close_after_step(self, owner: str) -> None:
        """Close and join the thread at the end of ``owner``'s step; log if stuck."""
        if self.stuck or not self.close(_wait_arg(SETTINGS.wait_timeout())):
            logger.error(
                "the OVERLAP_F_B backward thread of %s is stuck; it is left behind",
                owner,
            )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.stuck


def _worker_name(global_rank: int) -> str:
    return f"OVERLAP_F_B backward (rank {global_rank})"


def _worker_for(state: _OverlapState, global_rank: int) -> _BackwardWorker:
    """The backward thread of the schedule's step in progress, started on first use."""
    if state.backward_worker is None or not state.backward_worker.alive:
        state.backward_worker = _BackwardWorker(_worker_name(global_rank))
    return state.backward_worker


def _run_side(
    side: Side,
    compute: Callable[[], None],
    coordinator: _CommCoordinator,
    profiler_label: str | None,
    streams: _StreamPlan | None,
    input_wait: _InputWait | None = None,
) -> None:
    """Run one side's ``compute`` on its stream with its marks bound.

    ``input_wait`` (the side's receive wait, and what it awaits) runs first,
    on the side's stream, as the coordinator's ``await_inputs``.  With a
    ``profiler_label`` (the profiler is on) it runs in a ``record_function``.
    """
    before_start = None
    if input_wait is not None:
        before_start = functools.partial(coordinator.await_inputs, side, *input_wait)
    with contextlib.ExitStack() as stack:
        if profiler_label is not None:
            stack.enter_context(
                record_function(f"OVERLAP_F_B {side.thread_name} {profiler_label}")
            )
        if streams is not None:
            stack.enter_context(streams.current(side))
        stack.enter_context(_ep_marks.bound(coordinator, side, before_start))
        compute()


def _run_overlapped(
    forward: Callable[[], None],
    backward: Callable[[], None],
    *,
    global_rank: int,
    action: str,
    sub_actions: tuple[str, str] = ("forward", "backward"),
    streams: _StreamPlan | None = None,
    timeout: float | None = None,
    worker: _BackwardWorker | None = None,
    input_waits: tuple[_InputWait | None, _InputWait | None] = (None, None),
    first: Side = Side.FORWARD,
) -> _CommCoordinator:
    """Run ``backward`` on the worker thread and ``forward`` here, coordinated.

    Waits for both, re-raises the first failure, returns the coordinator.
    ``global_rank`` names the process in messages.  Without ``worker`` a
    thread is started and joined for this call.  ``input_waits``: the sides'
    receive waits (forward, backward), each run on its side's thread before
    it starts; ``first``: the side the sequential handler runs first.
    """
    timeout = SETTINGS.wait_timeout() if timeout is None else timeout
    wait_timeout = _wait_arg(timeout)
    coordinator, forward, backward = _coordinated(
        global_rank, action, timeout, forward, backward, first
    )
    failures: list[tuple[Side, BaseException]] = []
    failures_lock = threading.Lock()

    def fail(side: Side, error: BaseException) -> None:
        with failures_lock:
            failures.append((side, error))
        coordinator.stop()  # release the other side now, whatever failed

    def run(side: Side, compute: Callable[[], None]) -> None:
        label = sub_actions[side] if state.profiling else None
        _run_side(side, compute, coordinator, label, streams, input_waits[side])

    def backward_task() -> None:
        # Everything on the worker, its set-up included, is guarded: a failure
        # reaches the caller at once instead of the thread's excepthook.
        try:
            state.context.run(state.call_applied, run, Side.BACKWARD, backward)
        except BaseException as e:
            fail(Side.BACKWARD, e)

    own_worker = worker is None
    _collectives.install()
    _ep_marks._FORK_RNG_WINDOW.register()
    state = _ThreadState.capture()
    if worker is None:
        worker = _BackwardWorker(_worker_name(global_rank))
    if streams is not None:
        streams.start()
    backward_done = worker.submit(backward_task)
    try:
        run(Side.FORWARD, forward)
    except BaseException as e:
        fail(Side.FORWARD, e)
    finally:
        # Always waited for, even on KeyboardInterrupt: no work outlives the action.
        finished = _wait_backward(backward_done, coordinator, wait_timeout)
        if own_worker and finished:
            worker.close(wait_timeout)
        if streams is not None:
            streams.join()
    where = f"rank {global_rank}, action {action}"
    if not finished:
        coordinator.stop()
        worker.stuck = True
        raise RuntimeError(
            f"{where}: the backward sub-action {sub_actions[Side.BACKWARD]} "
            f"did not finish within {timeout:g} s after the forward sub-action "
            "did (see torch_pipelining_ext.overlap.set_wait_timeout)"
        )
    if failures:
        _reraise(where, sub_actions, failures)
    return coordinator


def _wait_backward(
    done: threading.Event, coordinator: _CommCoordinator, timeout: float | None
) -> bool:
    """Wait for the backward side to finish; False after ``timeout`` seconds.

    The time it waits for its input does not count (that wait has its own
    timeout, the receive's).
    """
    while not done.wait(timeout):
        if not coordinator.awaits_inputs(Side.BACKWARD):
            return False
    return True


def _coordinated(
    global_rank: int,
    action: str,
    timeout: float,
    forward: Callable[[], None],
    backward: Callable[[], None],
    first: Side,
) -> tuple[_CommCoordinator, Callable[[], None], Callable[[], None]]:
    """The action's coordinator and its two computes, reporting to the observer.

    See ``overlap.observe_actions``: without an observer this is the plain
    coordinator and the computes as given.
    """
    observer = SETTINGS.observer
    if observer is None:
        coordinator = _CommCoordinator(
            rank=global_rank, action=action, timeout=timeout, first=first
        )
        return coordinator, forward, backward
    coordinator = _ObservedCoordinator(
        observer, rank=global_rank, action=action, timeout=timeout, first=first
    )
    return (
        coordinator,
        _observed(observer, Side.FORWARD, forward),
        _observed(observer, Side.BACKWARD, backward),
    )


def _observed(
    observer: Any, side: Side, compute: Callable[[], None]
) -> Callable[[], None]:
    """``compute``, reporting its start and end to ``observer``."""

    def observed() -> None:
        start = time.perf_counter()
        try:
            compute()
        finally:
            observer.sub_action(side.thread_name, start, time.perf_counter())

    return observed


def _reraise(
    where: str,
    sub_actions: tuple[str, str],
    failures: list[tuple[Side, BaseException]],
) -> None:
    """Raise an action's first failure, naming ``where`` and the sub-action."""
    side, error = failures[0]
    if not isinstance(error, Exception):
        raise error  # KeyboardInterrupt, SystemExit: as they are
    also = ""
    if len(failures) > 1:
        other_side, other = failures[1]
        also = (
            f" (then the {other_side.thread_name} sub-action failed: "
            f"{_describe(other)})"
        )
    raise RuntimeError(
        f"{where}: the {side.thread_name} sub-action {sub_actions[side]} failed: "
        f"{_describe(error)}{also}"
    ) from error


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of ``error``'s chain of explicit causes."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def _describe(error: BaseException) -> str:
    """``Type: message`` of the root cause, then of ``error`` if it wraps it."""
    root = _root_cause(error)
    text = f"{type(root).__name__}: {root}"
    if root is not error:
        first_line = str(error).split("\n", 1)[0]
        text += f" (raised as {type(error).__name__}: {first_line})"
    return text
