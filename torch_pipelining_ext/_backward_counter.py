"""Per-step count of backward passes for ``_PipelineScheduleRuntime``.

Upstream (``torch/distributed/pipelining/schedules.py``) moved the backward
counter from a local of ``_step_microbatches`` onto the schedule in the 2.10
cycle (the PR that added ``register_custom_function``), so that custom action
functions can decide, like the built-in path, which backward is a stage's
last one in the step -- the one that must synchronise data-parallel gradients.
Upstream keeps a plain ``collections.Counter`` there and updates it with
``schedule.backward_counter[stage_idx] += 1``.  That read-modify-write is not
atomic, so two actions running on two threads can lose a count and never see
their last backward.

The package's own runtime counts on the step's thread only: the concurrent
OVERLAP_F_B handler does the bookkeeping of both sub-actions, counting
included, in schedule order before it hands the backward compute to its
second thread (``_schedule_runtime.prepare_compute_action``).  The lock is for
custom action functions, which may count from threads of their own.

:class:`BackwardCounter` is a ``Counter`` (so upstream-style code keeps
working) with one atomic operation, :meth:`BackwardCounter.record_backward`.
:class:`_BackwardCounterAttribute` is the class-level data descriptor that
puts one on every ``_PipelineScheduleRuntime``: a data descriptor takes
precedence over the instance ``__dict__``, so upstream's
``self.backward_counter = Counter()`` in ``__init__`` and its
``self.backward_counter.clear()`` at the start of every step go through it,
and no torch method has to be replaced.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any


__all__ = ["BackwardCounter"]


class BackwardCounter(Counter):
    """Counts FULL_BACKWARD and BACKWARD_WEIGHT actions per stage in one step.

    BACKWARD_INPUT does not count: a microbatch's backward is complete only
    once its weight gradient is accumulated.  A stage's backward number
    ``n_microbatches`` is its last backward of the step, after which gradients
    are reduced across data-parallel ranks and scaled.

    Reads, ``counter[stage_idx] += 1`` and :meth:`clear` behave as for
    ``collections.Counter``.  :meth:`record_backward` is the thread-safe way to
    count; use it from code that may run concurrently with other actions.

    Args:
        counts: initial counts, as for ``collections.Counter``.
        n_microbatches: number of microbatches per step, i.e. the count at
            which a stage's backward is its last one.
    """

    def __init__(
        self,
        counts: Mapping[int, int] | Iterable[int] | None = None,
        /,
        *,
        n_microbatches: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.n_microbatches = n_microbatches
        super().__init__(counts)

    def record_backward(self, stage_idx: int) -> bool:
        """Count one backward of ``stage_idx``; return whether it is the stage's last.

        Atomic with respect to other :meth:`record_backward` calls, so exactly
        one caller per stage and step gets ``True``.

        Raises:
            RuntimeError: the stage already had ``n_microbatches`` backwards in
                this step (the schedule runs a backward twice, or the counter
                was not reset between steps).
        """
        if self.n_microbatches is None:
            raise RuntimeError("BackwardCounter.n_microbatches is not set")
        with self._lock:
            count = self[stage_idx] + 1
            if count > self.n_microbatches:
                raise RuntimeError(
                    f"stage {stage_idx} ran backward {count} times in one step, "
                    f"but the schedule has {self.n_microbatches} microbatches; "
                    "was the backward counter reset at the start of the step?"
                )
            self[stage_idx] = count
            return count == self.n_microbatches

    def is_last_backward(self, stage_idx: int) -> bool:
        """Whether ``stage_idx`` has had all its backwards in this step."""
        return (
            self.n_microbatches is not None and self[stage_idx] >= self.n_microbatches
        )

    def reset(self) -> None:
        """Forget every count; called at the start of every ``step()``."""
        with self._lock:
            super().clear()

    def clear(self) -> None:  # keeps upstream's ``backward_counter.clear()`` atomic
        self.reset()

    def copy(self) -> BackwardCounter:
        return type(self)(dict(self), n_microbatches=self.n_microbatches)

    def __reduce__(self) -> tuple[Any, ...]:
        # A lock does not pickle; rebuild the counter from its counts.
        return (_rebuild_backward_counter, (dict(self), self.n_microbatches))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_microbatches={self.n_microbatches}, {dict(self)!r})"


def _rebuild_backward_counter(
    counts: dict[int, int], n_microbatches: int | None
) -> BackwardCounter:
    return BackwardCounter(counts, n_microbatches=n_microbatches)


class _BackwardCounterAttribute:
    """Data descriptor for ``_PipelineScheduleRuntime.backward_counter``.

    Get: the schedule's :class:`BackwardCounter`, created on first use with
    the schedule's ``_n_microbatches`` (torch 2.9 has no counter on the
    schedule; schedules built before the patch get one too).  Set: anything
    Counter-like is converted, keeping its counts, so upstream's
    ``self.backward_counter = Counter()`` stores a :class:`BackwardCounter`.

    The counter is kept in the instance ``__dict__`` under the same name; a
    data descriptor shadows it, and once the patch is undone the stored
    counter -- still a ``Counter`` -- is what the plain attribute holds.
    """

    _name = "backward_counter"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        counter = obj.__dict__.get(self._name)
        if not isinstance(counter, BackwardCounter):
            counter = self._coerce(obj, counter)
            obj.__dict__[self._name] = counter
        return counter

    def __set__(
        self, obj: Any, value: Mapping[int, int] | Iterable[int] | None
    ) -> None:
        obj.__dict__[self._name] = self._coerce(obj, value)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self._name, None)

    @staticmethod
    def _coerce(obj: Any, value: Any) -> BackwardCounter:
        n_microbatches = getattr(obj, "_n_microbatches", None)
        if isinstance(value, BackwardCounter):
            if value.n_microbatches is None:
                value.n_microbatches = n_microbatches
            return value
        return BackwardCounter(value or None, n_microbatches=n_microbatches)
