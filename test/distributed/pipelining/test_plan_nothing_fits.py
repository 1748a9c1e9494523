# Owner(s): ["oncall: distributed"]
"""The planner says why nothing fits and which flag helps; ``--strict`` makes
it an error; every flag has a help text."""

from __future__ import annotations

import contextlib
import io

from torch.testing._internal.common_utils import run_tests, TestCase

from torch_pipelining_ext.sim import plan


# DeepSeek-V3 on 1024 H800: without recomputation no candidate fits 90 % of 80 GB
ARGS = [
    "--model", "deepseek-v3", "--gpus", "1024", "--preset", "H800", "--pp", "16",
    "--ep", "64", "--schedules", "DualPipeV", "--microbatches", "64",
]  # fmt: skip


def _run(argv: list[str]) -> tuple[list[plan.Candidate], str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rows = plan.main(argv)
    return rows, out.getvalue()


class PlanNothingFitsTest(TestCase):
    def test_names_the_reason_and_the_flag(self) -> None:
        rows, text = _run(ARGS)
        self.assertTrue(rows)
        self.assertFalse(any(c.fits for c in rows))
        last = text.strip().splitlines()[-1]
        need = sorted(c.memory_bytes for c in rows)
        self.assertIn(f"each of the {len(rows)} candidates needs more memory", last)
        self.assertIn(
            f"limit of {0.9 * plan.HARDWARE_PRESETS['H800'].hbm_bytes / 2**30:.1f} GiB",
            last,
        )
        self.assertIn(f"from {need[0] / 2**30:.1f} to {need[-1] / 2**30:.1f} GiB", last)
        self.assertIn("With --recompute deepseek,", last)
        # the flag it names does make candidates fit
        fixed, text = _run([*ARGS, "--recompute", "deepseek"])
        fitting = [c for c in fixed if c.fits]
        self.assertTrue(fitting)
        self.assertIn(f"{len(fitting)} fit", last)
        self.assertNotIn("nothing fits", text)

    def test_nothing_helps(self) -> None:
        _, text = _run([*ARGS, "--recompute", "full", "--memory-limit-gib", "1"])
        last = text.strip().splitlines()[-1]
        self.assertIn("nothing fits", last)
        self.assertIn("Tried --pp 32: none makes one fit", last)

    def test_strict_exit_status(self) -> None:
        rows, _ = _run([*ARGS, "--quiet"])  # default: status 0 (returns)
        self.assertFalse(any(c.fits for c in rows))
        with self.assertRaises(SystemExit) as cm:
            _run([*ARGS, "--quiet", "--strict"])
        self.assertEqual(cm.exception.code, 1)

    def test_every_flag_has_help(self) -> None:
        parser = plan._parser()
        missing = [
            a.option_strings for a in parser._actions if a.option_strings and not a.help
        ]
        self.assertEqual(missing, [])


if __name__ == "__main__":
    run_tests()
