# Owner(s): ["oncall: distributed"]
"""``tools/bench_train.py`` without running the trainer (its timings are
never asserted):

* ``--dry-run`` prints, round by round in the order overlap, no_overlap,
  1f1b, trainer commands that the trainer's own checks accept (the flags and
  the layout), the modes differing by ``--no-overlap`` and ``--schedule
  1F1B`` alone, the flags after ``--`` passed on; then its last line.
* Its arithmetic on made-up ``metrics.jsonl`` records: the warm-up steps
  left out, the median of the steps' tokens/s, the per-round ratios
  and their medians over all rounds and over the quiet ones, the losses of
  the overlapped and sequential runs compared bitwise, the last line.
* Bad arguments exit with status 2.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import shlex
import sys

from torch.testing._internal.common_utils import run_tests, TestCase

from torch_pipelining_ext.train import build_parser
from torch_pipelining_ext.train._options import check_options


_TOOL = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "..",
    "tools",
    "bench_train.py",
)


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_train", _TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench_train = _load_tool()


def _records(step_times: list[float], tokens: int = 100, loss0: float = 5.0):
    return [
        {
            "step": i + 1,
            "step_time_s": t,
            "tokens": tokens,
            "tokens_per_s": tokens / t,
            "loss": loss0 - 0.1 * i,
        }
        for i, t in enumerate(step_times)
    ]


def _run(mode: str, round_: int, tokens_per_s: float, after_s: float, losses=None):
    # busy-loop times 1 s before the run (the best seen), ``after_s`` after it
    return bench_train.Run(
        mode, round_, tokens_per_s, 1.0, losses or [5.0, 4.5], (1.0, after_s), 1.0
    )


class BenchTrainTest(TestCase):
    def _main(self, argv: list[str]) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = bench_train.main(argv)
        return code, out.getvalue()

    def test_dry_run_commands_are_accepted_by_the_trainer(self) -> None:
        code, out = self._main(["--dry-run", "--rounds", "2", "--", "--seed", "7"])
        self.assertEqual(code, 0)
        lines = out.strip().splitlines()
        self.assertEqual(lines[-1], "bench_train=dry_run runs=6")
        commands = lines[:-1]
        self.assertEqual(
            [line.split(":")[0] for line in commands],
            [
                f"round {n} {m}"
                for n in (1, 2)
                for m in ("overlap", "no_overlap", "1f1b")
            ],
        )
        parser = build_parser()
        parsed = []
        for line in commands:
            argv = shlex.split(line.split(": ", 1)[1])
            self.assertEqual(argv[:3], ["python", "-m", "torch_pipelining_ext.train"])
            args = parser.parse_args(argv[3:])
            layout = check_options(args, environ={})  # raises on a bad combination
            self.assertEqual((layout.pp, layout.ep, layout.world_size), (1, 2, 2))
            self.assertEqual(args.seed, 7)
            self.assertEqual(args.checkpoint_every, 0)
            parsed.append(args)
        overlap, no_overlap, one_f_one_b = parsed[:3]
        self.assertEqual((overlap.schedule, overlap.no_overlap), ("DualPipeV", False))
        self.assertEqual(
            (no_overlap.schedule, no_overlap.no_overlap), ("DualPipeV", True)
        )
        self.assertEqual(
            (one_f_one_b.schedule, one_f_one_b.no_overlap), ("1F1B", False)
        )
        # every run its own directory
        self.assertEqual(len({a.run_dir for a in parsed}), 6)

    def test_measure_leaves_the_warmup_out(self) -> None:
        # the medians of the steps after the warm-up: one slow step moves no median
        records = _records([9.0, 9.0, 0.5, 4.0, 0.25])
        tokens_per_s, median = bench_train.measure(records, warmup=2)
        self.assertEqual(tokens_per_s, 100 / 0.5)
        self.assertEqual(median, 0.5)
        with self.assertRaisesRegex(ValueError, "no step after the first 5"):
            bench_train.measure(records, warmup=5)

    def test_summary_and_last_line(self) -> None:
        runs = [
            # round 1: quiet (probe 1 / 1.25 = 0.8); overlap 1.2x no_overlap, 0.8x 1f1b
            _run("overlap", 1, 120.0, 1.0),
            _run("no_overlap", 1, 100.0, 1.25),
            _run("1f1b", 1, 150.0, 1.0),
            # round 2: busy (probe 0.5): overlap 0.5x no_overlap, 0.25x 1f1b
            _run("overlap", 2, 50.0, 2.0),
            _run("no_overlap", 2, 100.0, 1.0),
            _run("1f1b", 2, 200.0, 1.0),
            # round 3: quiet (probe 1.0); 1.4x and 1.0x
            _run("overlap", 3, 140.0, 1.0),
            _run("no_overlap", 3, 100.0, 1.0),
            _run("1f1b", 3, 140.0, 1.0),
        ]
        # a start-up busy-loop time of 2 s: the best probe (1 s) is the baseline
        s = bench_train.summarize(runs, quiet_probe=0.8, baseline_s=2.0)
        self.assertEqual(s.rounds, 3)
        self.assertEqual(s.round_probes, [0.8, 0.5, 1.0])
        self.assertEqual(s.quiet_rounds, 2)
        self.assertAlmostEqual(s.ratios["no_overlap"], 1.2)
        self.assertAlmostEqual(s.ratios["1f1b"], 0.8)
        self.assertAlmostEqual(s.quiet_ratios["no_overlap"], (1.2 + 1.4) / 2)
        self.assertAlmostEqual(s.quiet_ratios["1f1b"], (0.8 + 1.0) / 2)
        self.assertEqual(
            s.tokens_per_s, {"overlap": 120.0, "no_overlap": 100.0, "1f1b": 150.0}
        )
        self.assertTrue(s.losses_identical)
        fields = dict(f.split("=") for f in bench_train.last_line(s, 5).split())
        self.assertEqual(fields["ratio_no_overlap"], "1.200")
        self.assertEqual(fields["ratio_1f1b_quiet"], "0.900")
        self.assertEqual(fields["quiet_rounds"], "2")
        self.assertEqual(fields["cpu_probe_min"], "0.50")
        self.assertEqual(fields["cpu_probe"], "0.80")
        self.assertEqual(fields["timed_steps"], "5")
        self.assertEqual(fields["losses_identical"], "1")
        # a start-up busy loop of 0.5 s, faster than every probe: every round at
        # most 0.5, none quiet (nan); one differing loss: not identical
        runs[0] = _run("overlap", 1, 120.0, 1.0, losses=[5.0, 4.5000001])
        s = bench_train.summarize(runs, quiet_probe=0.8, baseline_s=0.5)
        self.assertEqual(s.round_probes, [0.4, 0.25, 0.5])
        self.assertEqual(s.quiet_rounds, 0)
        self.assertTrue(math.isnan(s.quiet_ratios["no_overlap"]))
        self.assertFalse(s.losses_identical)
        self.assertIn("losses_identical=0", bench_train.last_line(s, 5))

    def test_bad_arguments_exit_2(self) -> None:
        for argv in (
            ["--warmup", "8", "--steps", "8"],
            ["--rounds", "0"],
            ["--quiet-probe", "1.5"],
        ):
            with self.subTest(argv=argv), contextlib.redirect_stderr(io.StringIO()):
                with self.assertRaises(SystemExit) as cm:
                    bench_train.parse_args(argv)
                self.assertEqual(cm.exception.code, 2)


if __name__ == "__main__":
    run_tests()
