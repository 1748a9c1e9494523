# Owner(s): ["oncall: distributed"]
"""Tests of the end-to-end demo, ``python -m torch_pipelining_ext.demo``.

* The entry point itself, in a subprocess, for two steps on four local ranks
  (gloo; NCCL too when four GPUs exist) with ``--trace``: exit status 0, finite
  losses, the overlapped run's microbatch losses bitwise equal to the
  sequential run's, both close to the single-process reference, and the
  Chrome traces, the PNG timeline and summary.json written.
* Argument validation: bad input exits with status 2 and a message naming the
  flag to change, before any process is spawned; far more local ranks than
  CPU cores get a warning.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from unittest import mock

import torch
from common_pipelining import nccl_decorators
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skip_but_pass_in_sandcastle_if,
    subtest,
    TestCase,
)

import torch_pipelining_ext  # noqa: F401
from torch_pipelining_ext.demo import train


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_TIMEOUT_S = 600


def _demo_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch_pipelining_ext.demo", *flags]


def _run_demo(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # not under torchrun: the demo spawns its ranks
    return subprocess.run(
        _demo_cmd(*flags), cwd=_REPO, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )


class DemoRunTest(TestCase):
    @parametrize("backend", ["gloo", subtest("nccl", decorators=nccl_decorators(4))])
    def test_two_steps_with_trace(self, backend: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            trace_dir = os.path.join(tmp, "trace")
            proc = _run_demo("--steps", "2", "--backend", backend, "--trace", trace_dir)
            self.assertEqual(proc.returncode, 0, msg=f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
            out = proc.stdout
            # one progress line per step, then the table
            self.assertRegex(out, r"(?m)^step +1/2 +loss \d+\.\d+ +step time: overlap +\d+\.\d ms")
            self.assertRegex(out, r"(?m)^step +2/2 ")
            self.assertRegex(out, r"(?m)^final loss \(step 2\) +\d+\.\d+ +\d+\.\d+ +\d+\.\d+$")
            self.assertIn("overlap vs sequential: losses identical (torch.equal", out)

            with open(os.path.join(trace_dir, "summary.json")) as f:
                r = json.load(f)
            self.assertEqual(r["args"]["backend"], backend)
            for key in ("overlap_losses", "sequential_losses", "reference_losses"):
                self.assertEqual(len(r[key]), 2)
                self.assertTrue(all(math.isfinite(x) for x in r[key]), r[key])
            n_mb = r["args"]["microbatches"] * r["args"]["ep"]
            self.assertEqual([len(step) for step in r["overlap_mb_losses"]], [n_mb, n_mb])
            self.assertTrue(all(math.isfinite(x) for step in r["overlap_mb_losses"] for x in step))
            # overlapped == sequential, bitwise (JSON floats round-trip exactly)
            self.assertTrue(r["losses_equal"])
            self.assertTrue(r["params_equal"])
            self.assertEqual(r["overlap_mb_losses"], r["sequential_mb_losses"])
            # the real overlap handler ran, on real OVERLAP_F_B actions
            self.assertEqual(r["overlap_handler"], "torch_pipelining_ext._overlap.overlap_f_b")
            self.assertGreater(r["overlap_f_b_actions"], 0)
            # the pipelined runs trained the model the single-process reference trains
            torch.testing.assert_close(
                torch.tensor(r["overlap_losses"]), torch.tensor(r["reference_losses"]), rtol=1e-4, atol=1e-5
            )
            self.assertLess(r["overlap_losses"][1], r["overlap_losses"][0])

            # traces: one Chrome trace per rank and run, with the overlap ranges
            world = r["args"]["pp"] * r["args"]["ep"]
            for mode in ("overlap", "sequential"):
                for rank in range(world):
                    with open(os.path.join(trace_dir, f"trace_{mode}_rank{rank}.json")) as f:
                        names = {e.get("name") for e in json.load(f)["traceEvents"]}
                    self.assertTrue(any(n.startswith("OVERLAP_F_B forward ") for n in names if n), mode)
                    self.assertTrue(any(n.startswith("OVERLAP_F_B backward ") for n in names if n), mode)
                    if mode == "overlap":
                        self.assertTrue(any(n.startswith("ep_overlap::") for n in names if n))
            self._check_phases(trace_dir, world)
            self._check_png(os.path.join(trace_dir, "timeline.png"))

    def _check_phases(self, trace_dir: str, world: int) -> None:
        from torch_pipelining_ext.demo import _timeline

        for rank in range(world):
            overlap = _timeline.phases_from_chrome_trace(os.path.join(trace_dir, f"trace_overlap_rank{rank}.json"))
            seq = _timeline.phases_from_chrome_trace(os.path.join(trace_dir, f"trace_sequential_rank{rank}.json"))
            # overlapped: the backward sub-actions ran on the worker thread, the
            # forward ones on the caller; sequential: everything on the caller
            self.assertTrue(any(s["thread"] == "worker" and s["lane"] == "B" for s in overlap["spans"]))
            self.assertFalse(any(s["thread"] == "worker" and s["lane"] == "F" for s in overlap["spans"]))
            self.assertTrue(all(s["thread"] == "caller" for s in seq["spans"]))
            for ph in (overlap, seq):
                self.assertTrue(ph["overlap_actions"])
                self.assertEqual({s["lane"] for s in ph["spans"]}, {"F", "B"})
                self.assertTrue(any(s["compute"] for s in ph["spans"]))

    def _check_png(self, path: str) -> None:
        with open(path, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        from matplotlib.image import imread

        img = imread(path)
        self.assertGreater(img.shape[0], 400)
        self.assertGreater(img.shape[1], 800)


class DemoArgumentsTest(TestCase):
    """Bad input fails in argument parsing: exit status 2, a message saying what to change, no process spawned."""

    def _error(self, argv: list[str], environ: dict[str, str] | None = None) -> str:
        stderr = io.StringIO()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        env.update(environ or {})
        with (
            mock.patch.dict(os.environ, env, clear=True),
            mock.patch("torch.multiprocessing.start_processes", side_effect=AssertionError("spawned")) as spawn,
            mock.patch.object(train, "_run_rank", side_effect=AssertionError("ran a rank")) as run_rank,
            contextlib.redirect_stderr(stderr),
            self.assertRaises(SystemExit) as cm,
        ):
            train.main(argv)
        self.assertEqual(cm.exception.code, 2, stderr.getvalue())
        spawn.assert_not_called()
        run_rank.assert_not_called()
        return stderr.getvalue()

    def test_defaults(self) -> None:
        args = train.parse_args([], environ={})
        self.assertEqual((args.pp, args.ep, args.schedule), (2, 2, "DualPipeV"))
        self.assertIn(args.backend, ("gloo", "nccl"))
        if torch.cuda.device_count() < 4:
            self.assertEqual(args.backend, "gloo")

    def test_schedule_names(self) -> None:
        for name, want in (
            ("ScheduleDualPipeV", "DualPipeV"),
            ("dualpipev", "DualPipeV"),
            ("interleaved1f1b", "Interleaved1F1B"),
            ("1F1B", "1F1B"),
        ):
            self.assertEqual(train.parse_args(["--schedule", name], environ={}).schedule, want)

    def test_unknown_schedule(self) -> None:
        msg = self._error(["--schedule", "Zigzag"])
        self.assertIn("unknown --schedule 'Zigzag'", msg)
        self.assertIn("DualPipeV", msg)

    def test_world_size_under_torchrun(self) -> None:
        msg = self._error([], {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})
        self.assertIn("torchrun started 3 processes but --pp 2 x --ep 2 = 4", msg)

    def test_experts_not_divisible_by_ep(self) -> None:
        msg = self._error(["--experts", "3"])
        self.assertIn("--experts 3 is not divisible by --ep 2", msg)
        self.assertIn("--experts 2", msg)

    def test_too_few_layers(self) -> None:
        msg = self._error(["--dense-layers", "1", "--moe-layers", "2"])
        self.assertIn("3 layers", msg)
        self.assertIn("cannot fill 4 pipeline stages", msg)
        self.assertIn("at least 4 layers", msg)
        msg = self._error(["--pp", "4", "--ep", "1", "--schedule", "1F1B", "--moe-layers", "2", "--dense-layers", "1"])
        self.assertIn("cannot fill 4 pipeline stages", msg)

    def test_too_few_microbatches(self) -> None:
        msg = self._error(["--microbatches", "3"])
        self.assertIn("ScheduleDualPipeV needs at least as many microbatches as stages (4)", msg)
        msg = self._error(["--schedule", "Interleaved1F1B", "--microbatches", "5"])
        self.assertIn("multiple of its 2 rounds", msg)

    def test_non_positive_sizes(self) -> None:
        for flag in ("--pp", "--ep", "--steps", "--microbatches", "--experts"):
            self.assertIn(f"{flag} must be at least 1, got 0", self._error([flag, "0"]))
        self.assertIn("--moe-layers must be at least 0, got -1", self._error(["--moe-layers", "-1"]))
        msg = self._error(["--comm-latency-ms", "-1"])
        self.assertIn("--comm-latency-ms must be a number of milliseconds >= 0", msg)

    def test_comm_latency_bounds(self) -> None:
        # inf made every rank die in time.sleep, 1e12 hung; nan compares false with everything
        for value in ("inf", "-inf", "nan", "1e12", "1000.5", "-0.5"):
            msg = self._error([f"--comm-latency-ms={value}"])
            self.assertIn("--comm-latency-ms must be a number of milliseconds >= 0 and <= 1000", msg)
            self.assertIn(f"got {float(value):g}", msg)
        for value in ("0", "0.25", "1000"):
            args = train.parse_args(["--comm-latency-ms", value], environ={})
            self.assertEqual(args.comm_latency_ms, float(value))

    def _parse_with_stderr(self, argv: list[str], environ: dict[str, str], cores: int) -> str:
        stderr = io.StringIO()
        with mock.patch.object(train, "_cpu_cores", return_value=cores), contextlib.redirect_stderr(stderr):
            train.parse_args(argv, environ=environ)
        return stderr.getvalue()

    def test_warns_when_ranks_far_exceed_cores(self) -> None:
        many = ["--pp", "2", "--ep", "64", "--experts", "64", "--backend", "gloo"]
        msg = self._parse_with_stderr(many, {}, cores=2)
        self.assertIn("warning: --pp 2 x --ep 64 starts 128 local ranks on 2 CPU core(s)", msg)
        self.assertIn("use at most 8 ranks here", msg)
        # the default 4 ranks on 2 cores, or 128 ranks on 64 cores: no warning
        self.assertEqual(self._parse_with_stderr(["--backend", "gloo"], {}, cores=2), "")
        self.assertEqual(self._parse_with_stderr(many, {}, cores=64), "")
        # under torchrun only rank 0 warns, about the ranks of its own node
        torchrun = {"WORLD_SIZE": "128", "LOCAL_WORLD_SIZE": "16"}
        self.assertIn("starts 16 local ranks", self._parse_with_stderr(many, {**torchrun, "RANK": "0"}, cores=2))
        self.assertEqual(self._parse_with_stderr(many, {**torchrun, "RANK": "5"}, cores=2), "")

    @skip_but_pass_in_sandcastle_if(torch.cuda.device_count() >= 4, "this machine can run the demo on NCCL")
    def test_nccl_without_gpus(self) -> None:
        msg = self._error(["--backend", "nccl"])
        self.assertIn("--backend nccl needs NCCL and one CUDA device per local rank (4)", msg)

    def test_trace_dir_not_creatable(self) -> None:
        with tempfile.NamedTemporaryFile() as f:
            msg = self._error(["--trace", os.path.join(f.name, "sub")])
        self.assertIn("--trace", msg)
        self.assertIn("cannot create the directory", msg)

    def test_entry_point_exit_status(self) -> None:
        # the real command line, in a fresh interpreter
        proc = _run_demo("--experts", "5")
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("usage: python -m torch_pipelining_ext.demo", proc.stderr)
        self.assertIn("--experts 5 is not divisible by --ep 2", proc.stderr)
        self.assertEqual(proc.stdout, "")


instantiate_parametrized_tests(DemoRunTest)


if __name__ == "__main__":
    run_tests()
