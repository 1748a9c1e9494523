# Owner(s): ["oncall: distributed"]
"""Tests of the end-to-end demo, ``python -m torch_pipelining_ext.demo``:
the trainer's comparison mode (``python -m torch_pipelining_ext.train
--compare-sequential``) with the demo's flags.

* The entry point itself, in a subprocess, for two steps of the default
  layout (two gloo ranks, EP=2, both V-stages on each) with a simulated link
  and ``--trace``: exit status 0, the overlapped run's losses bitwise equal to
  the sequential run's, both equal to the unsplit Hugging Face model's on the
  global batch (float tolerance), the table, the traces and the timeline; the
  temporary directory of its data is gone afterwards.
* A reference that disagrees makes the exit status 1.
* Argument validation: bad input exits with status 2 and a message naming the
  flag to change, before any process starts; so does a transformers without
  fused experts (4.x).

Needs transformers 5.x (fused experts); the run tests skip without it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from common_pipelining import local_ranks_env, REPO
from torch.testing._internal.common_utils import run_tests, TestCase

import torch_pipelining_ext  # noqa: F401
from torch_pipelining_ext import launcher
from torch_pipelining_ext.demo import harness, train
from torch_pipelining_ext.train import build_parser, compare
from torch_pipelining_ext.train._options import check_options
from torch_pipelining_ext.train.timeline import EP_COMM_RANGE


_TIMEOUT_S = 300
_NO_FUSED = harness.fused_experts_problem()
# small enough for a few seconds per step on 2 CPU cores
_SHORT = [
    "--steps",
    "2",
    "--layers",
    "2",
    "--microbatches",
    "2",
    "--comm-latency-ms",
    "0.5",
    "--batch-size",
    "8",
]


def _run_demo(*flags: str, tmpdir: str | None = None) -> subprocess.CompletedProcess:
    env = local_ranks_env()  # not under torchrun: the demo starts its ranks
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    return subprocess.run(
        [sys.executable, "-m", "torch_pipelining_ext.demo", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )


@unittest.skipIf(_NO_FUSED is not None, _NO_FUSED or "")
class DemoRunTest(TestCase):
    def test_two_steps_with_trace(self) -> None:
        with (
            tempfile.TemporaryDirectory() as tmp,
            tempfile.TemporaryDirectory() as tmpdir,
        ):
            proc = _run_demo(*_SHORT, "--trace", tmp, tmpdir=tmpdir)
            self.assertEqual(os.listdir(tmpdir), [])  # the data's directory is gone
            out = proc.stdout
            self.assertEqual(
                proc.returncode, 0, msg=f"stdout:\n{out}\nstderr:\n{proc.stderr}"
            )
            self.assertIn("2 stages on 2 gloo ranks: PP=1 x EP=2", out)
            self.assertIn("simulated link: 0.50 ms per token all-to-all", out)
            self.assertRegex(
                out, r"(?m)^step  1/2  loss \d+\.\d+  step time: overlapped +\d+\.\d ms"
            )
            self.assertNotIn("LOSSES DIFFER", out)
            # the table: overlapped == sequential to the printed digits, the reference within float rounding
            final = re.search(r"(?m)^final loss \(step 2\) +(\S+) +(\S+) +(\S+)$", out)
            self.assertIsNotNone(final, out)
            overlapped, sequential, reference = (float(x) for x in final.groups())
            self.assertEqual(overlapped, sequential)
            self.assertAlmostEqual(overlapped, reference, delta=1e-4 * abs(reference))
            self.assertRegex(out, r"time overlapped / sequential: \d+\.\d\d")
            # 2 layers x 2 microbatches x 4 token all-to-alls per step and rank
            self.assertRegex(
                out,
                r"communication hidden: -?\d+\.\d\d = .* 16 x 0\.50 ms = 8 ms of simulated link",
            )
            self.assertIn("losses identical: yes (torch.equal", out)
            self.assertIn("weights after step 2 identical: yes", out)
            self.assertIn("(float rounding)", out)
            # the last step's expert load: both MoE layers, all ranks and microbatches
            self.assertRegex(
                out,
                r"(?m)^step 2, all ranks: expert load max/mean per MoE layer \(1\.00 = balanced\): "
                r"0: \d+\.\d\d, 1: \d+\.\d\d; padding 0\.0% of slots, 0 dropped$",
            )
            for mode in ("overlap", "sequential"):
                for rank in (0, 1):
                    self.assertTrue(
                        os.path.getsize(
                            os.path.join(tmp, f"trace_{mode}_rank{rank}.json")
                        )
                        > 0
                    )
            # the timeline finds the overlap's communication ranges by name
            with open(os.path.join(tmp, "trace_overlap_rank0.json")) as f:
                names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
            self.assertTrue(any(EP_COMM_RANGE.match(n) for n in names))
            for png in ("timeline.png", "expert_load.png"):
                with open(os.path.join(tmp, png), "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", png)

    def test_reference_mismatch_exits_1(self) -> None:
        # in this process: the forked ranks inherit the patch; rank 0's reference is off by 1%
        real = compare.reference_losses

        def off(plan, data):
            return [x * 1.01 for x in real(plan, data)]

        with mock.patch.object(compare, "reference_losses", off), _quiet_fds():
            status = train.main(
                [
                    "--steps",
                    "1",
                    "--layers",
                    "2",
                    "--microbatches",
                    "2",
                    "--comm-latency-ms",
                    "0",
                    "--batch-size",
                    "8",
                ]
            )
        self.assertEqual(status, 1)


@contextlib.contextmanager
def _quiet_fds():
    """Send file descriptors 1 and 2 (the forked ranks' output too) to /dev/null."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


class DemoArgumentsTest(TestCase):
    """Bad input fails before any process starts: exit status 2, a message saying what to change."""

    def _error(self, argv: list[str], environ: dict[str, str] | None = None) -> str:
        stderr = io.StringIO()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        }
        env.update(environ or {})
        with (
            mock.patch.dict(os.environ, env, clear=True),
            mock.patch.object(
                launcher, "launch", side_effect=AssertionError("launched")
            ) as launch,
            contextlib.redirect_stderr(stderr),
        ):
            try:
                status = train.main(argv)
            except SystemExit as e:  # argparse's own errors
                status = e.code
        self.assertEqual(status, 2, stderr.getvalue())
        launch.assert_not_called()
        return stderr.getvalue()

    def _args(self, *argv: str):
        """The demo's flags, then ``argv``, parsed and checked."""
        args = build_parser().parse_args([*train.DEMO_FLAGS, *argv])
        check_options(args, {})
        return args

    def test_without_fused_experts(self) -> None:
        # transformers 4.x holds experts as separate modules: the demo says what to install
        with mock.patch(
            "torch_pipelining_ext.hf.has_fused_experts", return_value=False
        ):
            msg = self._error([])
        self.assertIn("--ep > 1 needs transformers 5.x (fused experts", msg)
        self.assertIn("pip install 'transformers>=5,<6'", msg)

    def test_defaults(self) -> None:
        args = self._args()
        self.assertEqual(
            (
                args.compare_sequential,
                args.pp,
                args.ep,
                args.model_type,
                args.comm_latency_ms,
            ),
            (True, 1, 2, "qwen3_moe", None),
        )

    @unittest.skipIf(_NO_FUSED is not None, _NO_FUSED or "")
    def test_bad_arguments(self) -> None:
        for argv, want in (
            (["--experts", "5"], "5 experts are not divisible by --ep 2"),
            (
                ["--pp", "2", "--microbatches", "2", "--batch-size", "8"],
                "needs at least as many microbatches as stages (4)",
            ),
            (["--microbatches", "3"], "cannot be cut into --microbatches 3"),
            # the demo's former --model TYPE is the trainer's --model-type
            (["--model", "llama"], "llama has no experts"),
            (["--model", "gpt2"], "invalid choice: 'gpt2'"),
            (
                ["--no-overlap"],
                "--compare-sequential runs ScheduleDualPipeV's OVERLAP_F_B both ways",
            ),
            (["--schedule", "1F1B", "--dtype", "bfloat16"], "drop --schedule, --dtype"),
        ):
            self.assertIn(want, self._error(argv))
        for flag in (
            "--pp",
            "--ep",
            "--layers",
            "--experts",
            "--microbatches",
            "--steps",
        ):
            self.assertIn(f"{flag} must be at least 1, got 0", self._error([flag, "0"]))
        msg = self._error([], {"RANK": "0", "WORLD_SIZE": "3"})
        self.assertIn("the world of 3 ranks is not divisible by --pp 1 x --ep 2", msg)
        with tempfile.NamedTemporaryFile() as f:
            self.assertIn(
                "cannot create it or write there",
                self._error(["--trace", os.path.join(f.name, "sub")]),
            )

    def test_comm_latency_bounds(self) -> None:
        # inf would reach time.sleep, 1e12 hang; nan compares false with everything
        for value in ("inf", "-inf", "nan", "1e12", "1000.5", "-0.5"):
            msg = self._error([f"--comm-latency-ms={value}"])
            self.assertIn(
                "--comm-latency-ms must be a number of milliseconds >= 0 and <= 1000",
                msg,
            )
        for value in ("0", "0.25", "1000"):
            self.assertEqual(
                self._args("--comm-latency-ms", value).comm_latency_ms, float(value)
            )

    def test_entry_point_exit_status(self) -> None:
        # the real command line, in a fresh interpreter
        proc = _run_demo("--experts", "5")
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("python -m torch_pipelining_ext.train: error:", proc.stderr)
        self.assertIn("5 experts are not divisible by --ep 2", proc.stderr)
        self.assertEqual(proc.stdout, "")


if __name__ == "__main__":
    run_tests()
