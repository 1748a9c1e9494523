# Owner(s): ["oncall: distributed"]
"""Unit tests of ``BackwardCounter`` and its schedule attribute
(``torch_pipelining_ext/_backward_counter.py``): Counter compatibility,
``record_backward`` under concurrent threads, reset, and the data descriptor
that puts a counter on every ``_PipelineScheduleRuntime``."""

from __future__ import annotations

import copy
import pickle
import threading
from collections import Counter

from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext
from torch_pipelining_ext._backward_counter import _BackwardCounterAttribute, BackwardCounter


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
        with self.assertRaisesRegex(RuntimeError, "stage 2 ran backward 2 times in one step.*reset"):
            c.record_backward(2)

    def test_record_backward_needs_n_microbatches(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "n_microbatches is not set"):
            BackwardCounter().record_backward(0)

    def test_reset_starts_a_new_step(self) -> None:
        c = BackwardCounter(n_microbatches=2)
        for step in range(3):
            c.reset() if step % 2 else c.clear()
            self.assertEqual([c.record_backward(7), c.record_backward(7)], [False, True])

    @parametrize("n_threads", [2, 8])
    def test_record_backward_is_thread_safe(self, n_threads: int) -> None:
        n_stages, per_thread = 4, 500
        n_microbatches = n_threads * per_thread
        c = BackwardCounter(n_microbatches=n_microbatches)
        last: list[tuple[int, int]] = []  # (thread, stage) of every True
        barrier = threading.Barrier(n_threads)
        errors: list[BaseException] = []

        def work(thread: int) -> None:
            try:
                barrier.wait(timeout=30)
                for _ in range(per_thread):
                    for stage in range(n_stages):
                        if c.record_backward(stage):
                            last.append((thread, stage))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            self.assertFalse(t.is_alive(), "a counting thread did not finish")
        self.assertEqual(errors, [])
        self.assertEqual(dict(c), {stage: n_microbatches for stage in range(n_stages)})
        # Exactly one caller saw each stage's last backward.
        self.assertEqual(sorted(stage for _, stage in last), list(range(n_stages)))

    def test_copy_and_pickle_keep_n_microbatches(self) -> None:
        c = BackwardCounter({1: 2}, n_microbatches=4)
        for other in (c.copy(), copy.copy(c), copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
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
        self.assertEqual((a.backward_counter.n_microbatches, b.backward_counter.n_microbatches), (1, 3))

    def test_installed_on_pipeline_schedule_runtime(self) -> None:
        self.assertIn(
            torch_pipelining_ext.PatchStatus.APPLIED,
            {r.status for r in torch_pipelining_ext.patch_report() if r.name == "schedule_backward_counter"},
        )
        self.assertIsInstance(_PipelineScheduleRuntime.__dict__["backward_counter"], _BackwardCounterAttribute)
        schedule = _PipelineScheduleRuntime.__new__(_PipelineScheduleRuntime)  # no stages needed
        schedule._n_microbatches = 2
        self.assertIsInstance(schedule.backward_counter, BackwardCounter)
        self.assertEqual(schedule.backward_counter.n_microbatches, 2)


instantiate_parametrized_tests(BackwardCounterTest)


if __name__ == "__main__":
    run_tests()
