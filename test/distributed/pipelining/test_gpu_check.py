# Owner(s): ["oncall: distributed"]
"""``tools/gpu_check.sh`` / ``tools/gpu_check.py`` where they cannot run, and their trace analysis.

* Without CUDA the check fails at once (exit status 3), says why on stderr
  and prints ``gpu_check=no_cuda`` as its last line: the shell script before
  it touches a virtual environment, the Python entry point before it imports
  anything but torch.  (On a machine with CUDA these cases are skipped: the
  check would really run.)
* :func:`device_overlap` on a hand-made Chrome trace: stand-in kernels on the
  side streams, compute kernels on the other side's stream, kernels on the
  caller's stream outside the actions.
* Part (b) as a dry run on the CPU (``--device cpu``, tiny sizes): every step
  of the measurement but the device-level one, the bitwise comparison of the
  two handlers included; and the capture of Python and C++ (stderr) warnings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from unittest import mock

import torch
from torch.testing._internal.common_utils import run_tests, TestCase


_REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
_SCRIPT = os.path.join(_REPO, "tools", "gpu_check.sh")
_NO_GPU_DEVICE = shutil.which("nvidia-smi") is None and not os.path.exists(
    "/dev/nvidiactl"
)


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location(
        "gpu_check", os.path.join(_REPO, "tools", "gpu_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def _run_script(env_update: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_update)
    return subprocess.run(
        ["bash", _SCRIPT],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@unittest.skipIf(
    torch.cuda.is_available(),
    "CUDA is available here: the GPU check would run for real",
)
class GpuCheckWithoutCudaTest(TestCase):
    @unittest.skipUnless(_NO_GPU_DEVICE, "this machine has an NVIDIA driver")
    def test_script_without_gpu_fails_before_the_venv(self) -> None:
        # a venv directory that does not exist: reaching tools/_env.sh would try to create it
        missing = os.path.join(_REPO, ".venv", "gpu-check-test-must-not-exist")
        proc = _run_script({"VENV_DIR": missing, "GPU_CHECK_PYTHON": ""})
        self.assertEqual(proc.returncode, 3, proc.stderr)
        self.assertIn("gpu_check: no NVIDIA GPU on this machine", proc.stderr)
        self.assertEqual(proc.stdout.strip().splitlines()[-1], "gpu_check=no_cuda")
        self.assertFalse(os.path.exists(missing))

    def test_script_with_cpu_only_torch(self) -> None:
        # past the device probe, this interpreter's torch cannot use CUDA
        proc = _run_script(
            {"GPU_CHECK_SKIP_DEVICE_PROBE": "1", "GPU_CHECK_PYTHON": sys.executable}
        )
        self.assertEqual(proc.returncode, 3, proc.stderr)
        self.assertIn("gpu_check: torch ", proc.stderr)
        self.assertRegex(proc.stderr, r"CPU-only build|sees no GPU")
        self.assertEqual(proc.stdout.strip().splitlines()[-1], "gpu_check=no_cuda")

    def _main(self, argv: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = gpu_check.main(argv)
        return rc, out.getvalue(), err.getvalue()

    def test_entry_point_cpu_only_build(self) -> None:
        with mock.patch.object(torch.version, "cuda", None):
            rc, out, err = self._main([])
        self.assertEqual(rc, gpu_check.EXIT_NO_CUDA)
        self.assertIn(f"torch {torch.__version__} is a CPU-only build", err)
        self.assertIn("TORCH_VERSION=2.14.1 bash tools/gpu_check.sh", err)
        self.assertEqual(out.strip().splitlines()[-1], "gpu_check=no_cuda")

    def test_entry_point_cuda_build_without_gpu(self) -> None:
        with (
            mock.patch.object(torch.version, "cuda", "12.8"),
            mock.patch.object(torch.cuda, "is_available", return_value=False),
            mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}),
        ):
            rc, out, err = self._main(["--skip-tests"])
        self.assertEqual(rc, gpu_check.EXIT_NO_CUDA)
        self.assertIn("(CUDA 12.8) sees no GPU", err)
        self.assertIn("CUDA_VISIBLE_DEVICES=''", err)
        self.assertEqual(out.strip().splitlines()[-1], "gpu_check=no_cuda")


def _kernel(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream}}  # fmt: skip


SPIN = "at::cuda::(anonymous namespace)::spin_kernel(long)"


class DeviceOverlapTest(TestCase):
    def test_fraction_of_standin_time_under_other_streams_compute(self) -> None:
        events = [
            _kernel(
                "gemm", 7, 0.0, 10.0
            ),  # the step's first kernel: stream 7 is the caller's
            _kernel(SPIN, 7, 10.0, 10.0),  # outside the actions: not counted
            # an action: the backward side (stream 14) communicates first, the forward side computes
            _kernel(SPIN, 14, 20.0, 10.0),
            _kernel("gemm", 13, 22.0, 10.0),  # hides 8 of its 10
            _kernel(SPIN, 13, 32.0, 10.0),
            _kernel("gemm", 14, 30.0, 6.0),  # hides 4 of its 10 ...
            _kernel("gemm", 14, 36.0, 2.0),  # ... and 2 more
            _kernel(
                "gemm", 13, 33.0, 1.0
            ),  # same stream as the stand-in: hides nothing
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "ts": 20.0,
                "dur": 30.0,
            },  # not a kernel
            {
                "ph": "i",
                "cat": "kernel",
                "name": "marker",
                "ts": 25.0,
            },  # not a complete event
        ]
        r = gpu_check.device_overlap(events)
        self.assertEqual(r["n_standin"], 2)
        self.assertEqual(r["n_standin_all"], 3)
        self.assertEqual(r["standin_us"], 20.0)
        self.assertEqual(r["hidden_us"], 14.0)
        self.assertAlmostEqual(r["fraction"], 0.7)
        self.assertEqual(r["streams"], ["13", "14", "7"])
        # every stand-in counted (the sequential control): the caller's one hides nothing
        r = gpu_check.device_overlap(events, inside_actions=False)
        self.assertEqual(
            (r["n_standin"], r["standin_us"], r["hidden_us"]), (3, 30.0, 14.0)
        )

    def test_sequential_trace_hides_nothing(self) -> None:
        events = [
            _kernel("gemm", 7, 0.0, 5.0),
            _kernel(SPIN, 7, 5.0, 5.0),
            _kernel("gemm", 7, 10.0, 5.0),
        ]
        self.assertEqual(
            gpu_check.device_overlap(events, inside_actions=False)["fraction"], 0.0
        )
        r = gpu_check.device_overlap(events)
        self.assertEqual(r["n_standin"], 0)
        self.assertTrue(math.isnan(r["fraction"]))  # nothing to hide inside actions
        self.assertEqual(gpu_check.device_overlap([])["n_kernels"], 0)

    def test_stream_from_tid_without_args(self) -> None:
        events = [
            _kernel("gemm", 7, 0.0, 1.0),
            _kernel(SPIN, 3, 1.0, 4.0),
            _kernel("gemm", 4, 0.0, 3.0),
        ]
        for e in events:
            del e["args"]
        self.assertAlmostEqual(gpu_check.device_overlap(events)["fraction"], 0.5)


class ActionKernelTimesTest(TestCase):
    @staticmethod
    def _launch(corr: int, tid: int, ts: float) -> dict:
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid,
                "ts": ts, "dur": 1.0, "args": {"correlation": corr}}  # fmt: skip

    @staticmethod
    def _range(name: str, tid: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "user_annotation", "name": name, "tid": tid, "ts": ts,
                "dur": dur}  # fmt: skip

    def test_backward_kernels_launched_by_another_thread(self) -> None:
        # the step loop (tid 1) opens the ranges; a backward's kernels are
        # launched by autograd's device thread (tid 2)
        kernels = [
            _kernel("gemm", 7, 100.0, 30.0),
            _kernel(SPIN, 7, 130.0, 20.0),
            _kernel("gemm", 7, 150.0, 50.0),
            _kernel(SPIN, 7, 200.0, 20.0),
        ]
        for corr, k in enumerate(kernels):
            k["args"]["correlation"] = corr
        events = kernels + [
            self._range("PP:0F0", 1, 0.0, 10.0),
            self._launch(0, 1, 2.0),
            self._launch(1, 1, 3.0),
            self._range("PP:0B0", 1, 20.0, 10.0),
            self._launch(2, 2, 22.0),
            self._launch(3, 2, 23.0),
            self._launch(9, 2, 50.0),  # no kernel of that correlation
            # its device-side copy is not a range
            self._range("PP:0B0", 7, 150.0, 70.0) | {"cat": "gpu_user_annotation"},
        ]
        times = gpu_check.action_kernel_times(events)
        self.assertEqual(
            times,
            {
                "0F": {"compute_us": 30.0, "standin_us": 20.0, "n": 1.0},
                "0B": {"compute_us": 50.0, "standin_us": 20.0, "n": 1.0},
            },
        )

    def test_launch_while_two_ranges_of_other_threads_are_open(self) -> None:
        k = _kernel("gemm", 7, 100.0, 30.0)
        k["args"]["correlation"] = 0
        events = [
            k,
            self._range("PP:0F0", 1, 0.0, 10.0),
            self._range("PP:1F0", 3, 0.0, 10.0),
            self._launch(0, 2, 5.0),  # ambiguous: attributed to neither
        ]
        self.assertEqual(gpu_check.action_kernel_times(events), {})


class GpuCheckDryRunTest(TestCase):
    def test_measurement_dry_run_on_cpu(self) -> None:
        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as tmp:
            argv = [
                "--device",
                "cpu",
                "--dim",
                "32",
                "--tokens",
                "16",
                "--layers",
                "2",
                "--microbatches",
                "4",
            ]
            argv += [
                "--steps",
                "1",
                "--warmup",
                "1",
                "--latency-ms",
                "0.5",
                "--out",
                tmp,
            ]
            out = io.StringIO()
            with contextlib.redirect_stdout(out), mock.patch.dict(os.environ):
                rc = gpu_check.main(argv)
            self.assertTrue(os.path.exists(os.path.join(tmp, "trace_overlap.json")))
        last = out.getvalue().strip().splitlines()[-1]
        self.assertEqual(rc, 0, out.getvalue())
        self.assertTrue(last.startswith("gpu_check=dry_run "), last)
        self.assertIn(" bitwise_equal=yes ", last)
        self.assertIn(" allocator_warnings=0 ", last)
        self.assertIn("5 OVERLAP_F_B actions", out.getvalue())

    def test_warnings_of_python_and_cpp_are_captured(self) -> None:
        def measure(args, out_dir, standin="comm-stream"):
            warnings.warn("a Python warning")
            sys.stderr.flush()
            os.write(
                2,
                b"[W1130 12:00:00.000 CUDACachingAllocator.cpp:1] Warning: block freed on another stream\n",
            )
            os.write(2, b"plain output\n")
            return {"ok": True}

        err = io.StringIO()
        with (
            mock.patch.object(gpu_check, "measure_overlap", measure),
            contextlib.redirect_stderr(err),
        ):
            result, found = gpu_check._measure_with_warnings(None, "")
        self.assertEqual(result, {"ok": True})
        self.assertEqual(len(found), 2, found)
        self.assertTrue(found[0].startswith("UserWarning: a Python warning"), found)
        self.assertIn("CUDACachingAllocator", found[1])
        self.assertEqual(
            [w for w in found if gpu_check._ALLOCATOR_WARNING.search(w)], [found[1]]
        )


if __name__ == "__main__":
    run_tests()
