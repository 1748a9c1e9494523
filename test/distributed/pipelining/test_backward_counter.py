# Owner(s): ["oncall: distributed"]
"""Unit tests of ``BackwardCounter`` and its schedule attribute
(``torch_pipelining_ext/_backward_counter.py``): Counter compatibility,
``record_backward`` with two threads inside it at once, reset, and the data descriptor
that puts a counter on every ``_PipelineScheduleRuntime``."""

from __future__ import annotations

import copy
import pickle
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.testing._internal.common_utils import (
    run_tests,
    TestCase,
)

import torch_pipelining_ext
from torch_pipelining_ext._backward_counter import (
    _BackwardCounterAttribute,
    BackwardCounter,
)


_TIMEOUT_S = 30.0


class _TwoThreadCounter(BackwardCounter):
    """A ``BackwardCounter`` that forces two threads into ``record_backward`` together.

    A thread that has read a count (``self[stage_idx]`` in ``record_backward``)
    waits, before using it, until the other thread has arrived: it has read a
    count too, or it has started to take the counter's lock.  So the second
    read happens before the first thread stores its count, unless the lock
    keeps the second thread out until then.  Waits time out with an error
    naming the thread, so a broken counter fails and never hangs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arrived: set[str] = set()
        self._arrival = threading.Condition()
        self._lock = _AnnouncingLock(self._lock, self._arrive)

    def _arrive(self) -> None:
        with self._arrival:
            self._arrived.add(threading.current_thread().name)
            self._arrival.notify_all()

    def __getitem__(self, stage_idx: int) -> int:
        count = super().__getitem__(stage_idx)
        self._arrive()
        with self._arrival:
            if not self._arrival.wait_for(
                lambda: len(self._arrived) >= 2, timeout=_TIMEOUT_S
            ):
                raise RuntimeError(
                    f"{threading.current_thread().name} read the count of stage {stage_idx} and waited "
                    f"{_TIMEOUT_S} s for the other thread to arrive (arrived: {sorted(self._arrived)})"
                )
        return count


class _AnnouncingLock:
    """Wraps a lock: ``announce()`` runs before each acquire, which may block."""

    def __init__(self, lock: Any, announce: Callable[[], None]) -> None:
        self._inner = lock
        self._announce = announce

    def __enter__(self) -> bool:
        self._announce()
        return self._inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class BackwardCounterTest(TestCase):
    def test_counter_compatible(self) -> None:
        c = BackwardCounter(n_microbatches=3)
        self.assertIsInstance(c, Counter)
        self.assertEqual(c[5], 0)  # missing stages read as 0
        c[5] += 1  # upstream-style update
        c[5] += 1
        self.assertEqual(c[5], 2)
        self.assertEqual(c, Counter({5: 2}))
        self.assertEqual(c.most_common(1), [(5, 2)])
        c.clear()
        self.assertEqual(c, Counter())
        self.assertEqual(len(c), 0)

    def test_record_backward_reports_last_once(self) -> None:
        c = BackwardCounter(n_microbatches=3)
        self.assertEqual([c.record_backward(0) for _ in range(3)], [False, False, True])
        self.assertEqual([c.record_backward(1) for _ in range(3)], [False, False, True])
        self.assertTrue(c.is_last_backward(0))
        self.assertFalse(BackwardCounter(n_microbatches=3).is_last_backward(0))

    def test_record_backward_past_last_raises(self) -> None:
        c = BackwardCounter(n_microbatches=1)
        self.assertTrue(c.record_backward(2))
        with self.assertRaisesRegex(
            RuntimeError, "stage 2 ran backward 2 times in one step.*reset"
        ):
            c.record_backward(2)

    def test_record_backward_needs_n_microbatches(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "n_microbatches is not set"):
            BackwardCounter().record_backward(0)

    def test_reset_starts_a_new_step(self) -> None:
        c = BackwardCounter(n_microbatches=2)
        for step in range(3):
            c.reset() if step % 2 else c.clear()
            self.assertEqual(
                [c.record_backward(7), c.record_backward(7)], [False, True]
            )

    def test_record_backward_is_thread_safe(self) -> None:
        # Two threads count the last two backwards of one stage.  Each thread,
        # having read the stage's count, waits until the other thread has read
        # it too or is waiting for the counter's lock (see _TwoThreadCounter).
        # Without the lock both read 0 and both store 1: a count is lost and
        # neither thread sees the last backward.  With it, the second thread
        # reads the first one's count.
        c = _TwoThreadCounter(n_microbatches=2)
        results: dict[str, bool] = {}
        errors: list[BaseException] = []

        def work() -> None:
            try:
                results[threading.current_thread().name] = c.record_backward(0)
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=work, name=f"counting-{i}") for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=_TIMEOUT_S)
            self.assertFalse(t.is_alive(), f"{t.name} did not finish")
        self.assertEqual(errors, [])
        self.assertEqual(dict(c), {0: 2})
        self.assertEqual(
            sorted(results.values()), [False, True]
        )  # exactly one saw the last backward

    def test_copy_and_pickle_keep_n_microbatches(self) -> None:
        c = BackwardCounter({1: 2}, n_microbatches=4)
        for other in (
            c.copy(),
            copy.copy(c),
            copy.deepcopy(c),
            pickle.loads(pickle.dumps(c)),
        ):
            self.assertIsInstance(other, BackwardCounter)
            self.assertEqual(other, c)
            self.assertEqual(other.n_microbatches, 4)
            self.assertFalse(other.record_backward(1))
            self.assertTrue(other.record_backward(1))
            self.assertEqual(c[1], 2)  # independent of the original


class _Schedule:
    """Stands in for a schedule: the attribute needs only ``_n_microbatches``."""

    backward_counter = _BackwardCounterAttribute()

    def __init__(self, n_microbatches: int) -> None:
        self._n_microbatches = n_microbatches


class BackwardCounterAttributeTest(TestCase):
    def test_created_on_first_use(self) -> None:
        s = _Schedule(4)
        counter = s.backward_counter
        self.assertIsInstance(counter, BackwardCounter)
        self.assertEqual(counter.n_microbatches, 4)
        self.assertIs(s.backward_counter, counter)
        self.assertIs(s.__dict__["backward_counter"], counter)

    def test_upstream_assignment_is_converted(self) -> None:
        s = _Schedule(2)
        s.backward_counter = Counter()  # what upstream's __init__ does
        self.assertIsInstance(s.backward_counter, BackwardCounter)
        s.backward_counter[0] += 1
        self.assertTrue(s.backward_counter.record_backward(0))
        s.backward_counter = Counter({3: 1})  # counts are kept
        self.assertEqual(s.backward_counter[3], 1)
        counter = BackwardCounter(n_microbatches=2)
        s.backward_counter = counter
        self.assertIs(s.backward_counter, counter)
        del s.backward_counter
        self.assertIsNot(s.backward_counter, counter)

    def test_per_schedule(self) -> None:
        a, b = _Schedule(1), _Schedule(3)
        a.backward_counter[0] += 1
        self.assertEqual(b.backward_counter[0], 0)
        self.assertEqual(
            (a.backward_counter.n_microbatches, b.backward_counter.n_microbatches),
            (1, 3),
        )

    def test_installed_on_pipeline_schedule_runtime(self) -> None:
        self.assertIn(
            torch_pipelining_ext.PatchStatus.APPLIED,
            {
                r.status
                for r in torch_pipelining_ext.patch_report()
                if r.name == "schedule_backward_counter"
            },
        )
        self.assertIsInstance(
            _PipelineScheduleRuntime.__dict__["backward_counter"],
            _BackwardCounterAttribute,
        )
        schedule = _PipelineScheduleRuntime.__new__(
            _PipelineScheduleRuntime
        )  # no stages needed
        schedule._n_microbatches = 2
        self.assertIsInstance(schedule.backward_counter, BackwardCounter)
        self.assertEqual(schedule.backward_counter.n_microbatches, 2)


if __name__ == "__main__":
    run_tests()
