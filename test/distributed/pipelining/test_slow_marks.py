# Owner(s): ["oncall: distributed"]
"""The slow tests: ``slow_only`` both skips them by default and marks them,
so that CI's slow step (``PYTORCH_TEST_WITH_SLOW=1 PYTORCH_TEST_SKIP_FAST=1``)
runs exactly the tests the default step skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

from common_pipelining import local_ranks_env
from torch.testing._internal.common_utils import run_tests, TestCase


HERE = Path(__file__).resolve().parent

# A module of tests: a slow class that inherits a test it shares with a class
# that runs by default, a slow test function, and a covering parametrisation.
_MODULE = textwrap.dedent(
    """
    import json, sys, unittest
    from common_pipelining import parametrize_covering, slow_only
    from torch.testing._internal.common_utils import (
        instantiate_parametrized_tests, TestCase,
    )

    class _Shared:
        def test_shared(self):
            pass

    class Fast(_Shared, TestCase):
        def test_fast(self):
            pass

        @slow_only("slow")
        def test_slow_function(self):
            pass

        @parametrize_covering(a=[1, 2], b=["x", "y"])
        def test_grid(self, a, b):
            pass

    instantiate_parametrized_tests(Fast)

    @slow_only("slow")
    class Slow(_Shared, TestCase):
        def test_own(self):
            pass

    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__]).run(result)
    skipped = {t.id().split(".", 1)[1] for t, _ in result.skipped}
    assert not result.errors and not result.failures, result.errors + result.failures
    print(json.dumps(sorted(skipped)))
    """
)

_ALL = {
    "Fast.test_fast",
    "Fast.test_shared",
    "Fast.test_slow_function",
    "Fast.test_grid_a_1_b_x",
    "Fast.test_grid_a_1_b_y",
    "Fast.test_grid_a_2_b_x",
    "Fast.test_grid_a_2_b_y",
    "Slow.test_shared",
    "Slow.test_own",
}
_SLOW = {
    "Fast.test_slow_function",
    "Fast.test_grid_a_1_b_y",  # the covering subset is (1, x), (2, y)
    "Fast.test_grid_a_2_b_x",
    "Slow.test_shared",
    "Slow.test_own",
}


_MODES = {
    "default": {},
    "slow": {"PYTORCH_TEST_WITH_SLOW": "1"},
    "skip_fast": {"PYTORCH_TEST_WITH_SLOW": "1", "PYTORCH_TEST_SKIP_FAST": "1"},
}


class SlowMarksTest(TestCase):
    skipped: dict[str, set[str] | str]

    @classmethod
    def setUpClass(cls) -> None:
        """The module above in one child process per mode, the three at once."""
        super().setUpClass()
        environ = {**local_ranks_env(), "PYTHONPATH": str(HERE)}
        for name in ("PYTORCH_TEST_WITH_SLOW", "PYTORCH_TEST_SKIP_FAST"):
            environ.pop(name, None)
        procs = {
            mode: subprocess.Popen(
                [sys.executable, "-c", _MODULE],
                env={**environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for mode, env in _MODES.items()
        }
        cls.skipped = {}
        for mode, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            cls.skipped[mode] = (
                set(json.loads(out.strip().splitlines()[-1]))
                if proc.returncode == 0
                else f"exit status {proc.returncode}:\n{err[-3000:]}"
            )

    def test_default_skips_the_slow_tests(self) -> None:
        self.assertEqual(self.skipped["default"], _SLOW)

    def test_slow_runs_everything(self) -> None:
        self.assertEqual(self.skipped["slow"], set())

    def test_skip_fast_runs_the_slow_tests_alone(self) -> None:
        self.assertEqual(self.skipped["skip_fast"], _ALL - _SLOW)

    def test_slow_switch_is_read_in_one_place(self) -> None:
        """Only ``slow_only`` reads ``TEST_WITH_SLOW``: a test skipped by hand
        on it would carry no mark, and CI's slow step would never run it."""
        readers = []
        for path in sorted(HERE.glob("*.py")):
            with tokenize.open(path) as f:
                tokens = tokenize.generate_tokens(f.readline)
                if any(
                    t.type == tokenize.NAME and t.string == "TEST_WITH_SLOW"
                    for t in tokens
                ):
                    readers.append(path.name)
        self.assertEqual(readers, ["common_pipelining.py"])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_tests()
