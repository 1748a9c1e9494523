"""One-GPU check of torch_pipelining_ext; ``bash tools/gpu_check.sh`` runs it in the project's venv.

    bash tools/gpu_check.sh                      # both parts, at most 6 minutes on one GPU, no network
    python tools/gpu_check.py --skip-tests       # part (b) only, in the current interpreter

Part (a) -- the test variants that fit on one GPU:
``test/distributed/pipelining/test_schedule_single_rank.py`` (every schedule
with all stages on one rank, OVERLAP_F_B overlapped vs sequential, the MoE
model over NCCL with world size 1, FSDP2 on a one-rank mesh), in a pytest
subprocess; a CUDA variant that is skipped counts as a failure.

Part (b) -- device-level overlap with the stream plan, in this process:
``ScheduleDualPipeV`` with its two stages on one rank (world size 1, NCCL),
each stage ``--layers`` MoE-like layers whose dispatch and combine regions
(between the ``overlap`` marks) hold a communication stand-in kernel of
known duration, ``torch.cuda._sleep`` (one thread block spinning for a
calibrated number of cycles), in forward and in backward.  Inside an
overlapped action the stand-in runs as a ProcessGroupNCCL collective does: a
real one-rank collective, then the kernel on one communication stream ordered
after the issuing stream (``--standin comm-stream``); a second measurement
runs it on the issuing stream itself (``side-stream``: two communicators that
never wait for each other).  See [Note: where the stand-in runs].  It measures

* the step time with the package's OVERLAP_F_B and with a sequential one
  (interleaved, medians);
* from a profiler trace of one overlapped step, the fraction of the stand-in
  kernels' time inside OVERLAP_F_B actions (those on the stream plan's side
  streams) during which a compute kernel of another stream runs -- the
  communication the other side's compute hides on the device (see
  :func:`device_overlap`); the sequential step's trace, where everything is
  on one stream, is analysed alike as a control (about 0);
* bitwise equality of every loss and gradient of the two handlers, every step
  (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` makes cuBLAS deterministic across
  streams; ``gpu_check.sh`` sets it);
* warnings: Python warnings and everything written to stderr (C++ warnings
  of any thread) while part (b) runs; a warning of the caching allocator or
  about ``record_stream`` fails the check.

Targets: the tests pass, device hidden fraction >= 0.8, bitwise equal, no
allocator warning.  Without CUDA it exits with status 3 at once, saying why.
``--device cpu`` runs part (b) on the CPU instead (gloo, a sleep for the
stand-in kernel): nothing device-level to measure, but every step of the
script runs, so a change to it can be checked without a GPU.
The last line is machine-readable::

    gpu_check=pass|fail|no_cuda|dry_run tests_passed=... tests_failed=... tests_skipped_cuda=... hidden_fraction_device=...
    hidden_fraction_device_sequential=... step_ratio=... bitwise_equal=... allocator_warnings=... seconds=...
    actions_timed=... simulated_step_ratio=... hidden_fraction_device_side_stream=...
    step_ratio_side_stream=...

(one line; ``step_ratio`` is overlapped / sequential step time; the verdict
is the comm-stream measurement's, and both must be bitwise equal).  Part (b) also
records the device time of each plain action's kernels in the sequential step
(``action_kernel_times.json`` in ``--out``: compute and stand-in time per
stage and computation), and ``simulated_step_ratio`` is what the schedule
simulator (``torch_pipelining_ext.sim``) predicts for ``step_ratio`` from
those times: a prediction to compare with the measured ratio.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from typing import Any


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE_GPU_TESTS = ["test/distributed/pipelining/test_schedule_single_rank.py"]
EXIT_NO_CUDA = 3
HIDDEN_TARGET = 0.8
STANDIN_KERNEL = (
    "spin_kernel"  # the kernel torch.cuda._sleep launches (aten/src/ATen/cuda/Sleep.cu)
)
_ALLOCATOR_WARNING = re.compile(
    r"alloc|record_stream", re.IGNORECASE
)  # CUDACachingAllocator, allocation, ...
_WARNING_LINE = re.compile(
    r"warn|^\[W\d|^W\d{4}", re.IGNORECASE
)  # Python, c10 and glog-style warnings


# --------------------------------------------------------------------------- #
# Fail fast without CUDA                                                       #
# --------------------------------------------------------------------------- #


def cuda_problem() -> str | None:
    """Why this interpreter cannot run the check on a GPU, or None if it can."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e}); run through tools/gpu_check.sh, which uses the project's venv"
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None). The check needs a CUDA "
            "build of torch in the venv, e.g. from PyPI on a machine with network access once: "
            "TORCH_VERSION=2.14.1 bash tools/gpu_check.sh (creates .venv/torch-2.14.1)"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: torch.cuda.is_available() is False"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
            + "; check the driver (nvidia-smi) or run on a machine with a CUDA GPU"
        )
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL; the check runs NCCL with world size 1"
    return None


# --------------------------------------------------------------------------- #
# Part (a): the single-GPU test variants                                       #
# --------------------------------------------------------------------------- #


def run_tests(
    pytest_args: Sequence[str], timeout_s: float, out_dir: str
) -> dict[str, Any]:
    """Run the single-GPU test modules in a pytest subprocess; counts from its JUnit XML."""
    xml = os.path.join(out_dir, "tests.xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *SINGLE_GPU_TESTS,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    cmd += list(pytest_args)
    print("(a) " + " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, timeout=timeout_s, capture_output=True, text=True
        )
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = (
            -1,
            f"pytest did not finish within {timeout_s:g} s\n"
            + (e.stdout or b"").decode(errors="replace"),
        )
    result = {
        "rc": rc,
        "seconds": time.perf_counter() - t0,
        "passed": 0,
        "failed": 0,
        "skipped_cuda": [],
    }
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}.{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                result["failed"] += 1
            elif case.find("skipped") is not None:
                if "cuda" in name.lower():
                    result["skipped_cuda"].append(name)
            else:
                result["passed"] += 1
    if rc != 0 or result["failed"] or not result["passed"]:
        result["failed"] = max(result["failed"], 1)
        tail = "\n".join(output.strip().splitlines()[-40:])
        print(f"    pytest exited with {rc}:\n{tail}", flush=True)
    return result


# --------------------------------------------------------------------------- #
# Part (b): device-level overlap                                               #
# --------------------------------------------------------------------------- #


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(
    a: float, b: float, merged: list[tuple[float, float]], starts: list[float]
) -> float:
    """Length of [a, b] covered by ``merged`` (sorted, disjoint; ``starts`` their starts)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def _kernel_stream(event: dict[str, Any]) -> Any:
    return event.get("args", {}).get("stream", event.get("tid"))


def device_overlap(
    events: Sequence[dict[str, Any]],
    standin: str = STANDIN_KERNEL,
    inside_actions: bool = True,
) -> dict[str, Any]:
    """How much stand-in kernel time overlaps compute kernels of other streams, from Chrome-trace events.

    The caller's stream is the stream of the step's first kernel (DualPipeV's
    first forward runs before any OVERLAP_F_B action, on the caller's
    stream); stand-in kernels on other streams ran inside overlapped actions.
    For each of those (each of all with ``inside_actions=False``), the time
    during which a compute (non-stand-in) kernel of any other stream runs
    counts as hidden.

    Returns:
        ``fraction`` (hidden / stand-in time counted; nan without any),
        ``standin_us``, ``hidden_us``, ``n_standin`` (counted),
        ``n_standin_all``, ``n_kernels``, ``streams``.
    """
    kernels = [
        e
        for e in events
        if e.get("ph") == "X"
        and str(e.get("cat", "")).lower() == "kernel"
        and "dur" in e
        and "ts" in e
    ]
    if not kernels:
        return {"fraction": math.nan, "standin_us": 0.0, "hidden_us": 0.0, "n_standin": 0,
                "n_standin_all": 0, "n_kernels": 0, "streams": []}  # fmt: skip
    caller = _kernel_stream(min(kernels, key=lambda e: float(e["ts"])))
    compute: dict[Any, list[tuple[float, float]]] = {}
    standins = []
    for e in kernels:
        a = float(e["ts"])
        b = a + float(e["dur"])
        if standin in str(e.get("name", "")):
            standins.append((_kernel_stream(e), a, b))
        else:
            compute.setdefault(_kernel_stream(e), []).append((a, b))
    others: dict[Any, tuple[list[tuple[float, float]], list[float]]] = {}
    total = hidden = 0.0
    inside = 0
    for stream, a, b in standins:
        if inside_actions and stream == caller:
            continue
        if stream not in others:
            merged = _merge(
                [iv for s, ivs in compute.items() if s != stream for iv in ivs]
            )
            others[stream] = (merged, [m[0] for m in merged])
        merged, starts = others[stream]
        total += b - a
        hidden += _covered(a, b, merged, starts)
        inside += 1
    return {
        "fraction": hidden / total if total > 0 else math.nan,
        "standin_us": total,
        "hidden_us": hidden,
        "n_standin": inside,
        "n_standin_all": len(standins),
        "n_kernels": len(kernels),
        "streams": sorted({str(_kernel_stream(e)) for e in kernels}),
    }


_PP_ACTION = re.compile(r"^PP:(\d+)(F|I|W|B)(\d+)$")


def action_kernel_times(
    events: Sequence[dict[str, Any]], standin: str = STANDIN_KERNEL
) -> dict[str, dict[str, float]]:
    """Per plain action (``PP:<stage><F|I|W|B><mb>`` ranges), its kernels' device time, from Chrome-trace events.

    A kernel belongs to the action whose range holds the CPU launch with the
    same ``correlation`` id: the range of the launching thread, else the only
    range open at the launch (a backward's kernels are launched by autograd's
    device thread) -- so the trace must be of a sequential step, one action at
    a time; stand-in kernels count as communication.  Returns
    ``"<stage><kind>"`` -> ``compute_us``, ``standin_us`` (medians over the
    microbatches) and ``n``.  Without kernel events (a CPU run) the range's own
    duration is the compute time.
    """
    ranges = []
    for e in events:
        m = _PP_ACTION.match(str(e.get("name", "")))
        # (not the device-side copies of the ranges, "gpu_user_annotation")
        if (
            m
            and e.get("ph") == "X"
            and "dur" in e
            and not str(e.get("cat", "")).startswith("gpu_")
        ):
            ranges.append(
                (
                    float(e["ts"]),
                    float(e["ts"]) + float(e["dur"]),
                    e.get("tid"),
                    m.group(1) + m.group(2),
                )
            )
    kernels = {}
    for e in events:
        if (
            e.get("ph") == "X"
            and str(e.get("cat", "")).lower() == "kernel"
            and "correlation" in e.get("args", {})
        ):
            kernels[e["args"]["correlation"]] = e
    per: dict[tuple[float, str], list[float]] = {}
    if kernels:
        for e in events:
            corr = e.get("args", {}).get("correlation")
            if corr not in kernels or str(e.get("cat", "")).lower() == "kernel":
                continue
            ts = float(e.get("ts", 0.0))
            holding = [r for r in ranges if r[0] <= ts <= r[1]]
            # a backward's kernels are launched by autograd's device thread,
            # not the thread that opened the range: the range of the launching
            # thread if any, else the one range open at that time
            same = [r for r in holding if r[2] == e.get("tid")]
            if same or len(holding) == 1:
                a, _, _, key = (same or holding)[0]
                k = kernels[corr]
                slot = per.setdefault((a, key), [0.0, 0.0])
                slot[1 if standin in str(k.get("name", "")) else 0] += float(k["dur"])
    else:
        for a, b, _, key in ranges:
            per[(a, key)] = [b - a, 0.0]
    out: dict[str, dict[str, float]] = {}
    by_key: dict[str, list[list[float]]] = {}
    for (_, key), v in per.items():
        by_key.setdefault(key, []).append(v)
    for key, vs in sorted(by_key.items()):
        out[key] = {
            "compute_us": statistics.median(v[0] for v in vs),
            "standin_us": statistics.median(v[1] for v in vs),
            "n": float(len(vs)),
        }
    return out


def simulated_step_ratio(
    schedule: Any,
    times: dict[str, dict[str, float]],
    regions: int,
    region_s: float,
    cpu: bool,
) -> float:
    """The simulator's overlapped / sequential step time of ``schedule`` with the measured per-action times.

    Each F and I/B gets ``regions`` communication regions of ``region_s``
    seconds (the stand-in) between equal compute pieces; a kind not timed on
    its own (B of a stage that only ran it inside OVERLAP_F_B) is I + W.
    """
    from torch_pipelining_ext.sim import OverlapModel, StageCost, simulate

    def segs(compute_s: float) -> tuple[float, ...]:
        piece = max(compute_s, 0.0) / (regions + 1)
        out = [piece]
        for _ in range(regions):
            out += [region_s, piece]
        return tuple(out)

    def compute(stage: int, kind: str) -> float | None:
        t = times.get(f"{stage}{kind}")
        if t is None:
            return None
        c = t["compute_us"] * 1e-6
        if cpu:  # the range's duration includes the stand-in sleeps
            c -= regions * region_s if kind in "FIB" else 0.0
        return max(c, 0.0)

    costs = []
    for stage in range(len(schedule.stage_index_to_group_rank)):
        f, i, w, b = (compute(stage, k) for k in "FIWB")
        if i is None and b is None and w is not None:
            # a first stage's I has no kernels (its input needs no gradient):
            # its W ran the whole backward, communication regions included
            b, w = w, None
        if f is None or (i is None and b is None):
            return math.nan
        i = i if i is not None else b / 2
        w = w if w is not None else (b - i if b is not None else 0.0)
        costs.append(
            StageCost(
                forward=segs(f),
                backward_input=segs(i),
                backward_weight=w,
                full_backward=segs(b) if b is not None else None,
            )
        )
    model = OverlapModel(streams=not cpu)
    on = simulate(schedule, costs, overlap=model).step_time
    off = simulate(schedule, costs, overlap=OverlapModel(enabled=False)).step_time
    return on / off


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect file descriptor 2 (C++ warnings of every thread included); the lines land in the list."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def measure_overlap(
    args: argparse.Namespace, out_dir: str, standin: str = "comm-stream"
) -> dict[str, Any]:
    """Part (b) with one stand-in model; returns the numbers for the summary.

    ``standin`` is where the stand-in kernel runs (see [Note: where the
    stand-in runs]): ``"comm-stream"`` or ``"side-stream"``.
    """
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.distributed.pipelining import schedules as sched

    import torch_pipelining_ext  # (applies the patches)
    from torch_pipelining_ext import overlap
    from torch_pipelining_ext.runtime import sequential_overlap_f_b

    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compute, as on CPU
    else:  # the dry run: the same steps on the CPU, a sleep for the stand-in kernel
        device = torch.device("cpu")
    owns_pg = not dist.is_initialized()
    if owns_pg:
        kwargs = {"device_id": device} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            **kwargs,
        )

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def elapsed_ms(fn: Any) -> float:
        if not cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    # Stand-in duration: calibrate cycles per millisecond of torch.cuda._sleep.
    cycles_per_ms = math.nan
    if cuda:
        torch.cuda._sleep(1000)
        probe = 20_000_000
        cycles_per_ms = statistics.median(
            probe / elapsed_ms(lambda: torch.cuda._sleep(probe)) for _ in range(3)
        )

    # [Note: where the stand-in runs]
    # ProcessGroupNCCL runs a collective on a stream of its own, ordered after
    # the issuing stream, and a wait on its work makes the issuing stream wait
    # for that stream; a group's collectives are thereby queued on the device
    # in the order they were issued.  "comm-stream" models this: inside an
    # overlapped action the stand-in is a real one-rank collective, which the
    # overlap's turn-taking sees as one on a communicator both sides use,
    # followed by the stand-in kernel on one communication stream.  Outside
    # an overlapped action it runs on the current stream, so that the trace
    # tells the two apart by stream.
    # "side-stream" runs it on the current stream always: communication on two
    # communicators that never wait for each other.
    comm_stream = (
        torch.cuda.Stream(device) if cuda and standin == "comm-stream" else None
    )
    in_overlapped_action = [False]  # set by the OVERLAP_F_B function below

    class StandIn(torch.autograd.Function):
        """Communication stand-in: a kernel of known duration, forward and backward."""

        cycles = 0
        seconds = 0.0  # the dry run's sleep

        @staticmethod
        def wait() -> None:
            if not cuda:
                time.sleep(StandIn.seconds)
                return
            if comm_stream is None or not in_overlapped_action[0]:
                torch.cuda._sleep(StandIn.cycles)
                return
            dist.all_reduce(torch.zeros(1, device=device))
            issuing = torch.cuda.current_stream(device)
            comm_stream.wait_stream(issuing)
            with torch.cuda.stream(comm_stream):
                torch.cuda._sleep(StandIn.cycles)
            issuing.wait_stream(comm_stream)

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            StandIn.wait()
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            StandIn.wait()
            return grad

    class Layer(nn.Module):
        """Attention-like block, dispatch region, expert block, combine region."""

        def __init__(self, dim: int) -> None:
            super().__init__()
            self.attn_in, self.attn_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.expert_in, self.expert_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

        def attention(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.attn_out(torch.tanh(self.attn_in(x)))

        def expert(self, x: torch.Tensor) -> torch.Tensor:
            return self.expert_out(F.gelu(self.expert_in(x)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.attention(x)
            t = overlap.dispatch_end(StandIn.apply(overlap.dispatch_begin(h)))
            t = self.expert(t)
            t = overlap.combine_end(StandIn.apply(overlap.combine_begin(t)))
            return h + t

    torch.manual_seed(0)
    parts = [
        nn.Sequential(*(Layer(args.dim) for _ in range(args.layers))).to(device)
        for _ in range(2)
    ]
    x = torch.randn(args.microbatches * args.tokens, args.dim, device=device)
    target = torch.randn_like(x)
    with torch.no_grad():
        layer, xm = parts[0][0], x[: args.tokens]
        for _ in range(3):
            layer.attention(xm), layer.expert(xm)
        block_ms = statistics.median(
            elapsed_ms(lambda: layer.attention(xm)) for _ in range(10)
        )
    latency_ms = args.latency_ms if args.latency_ms is not None else block_ms
    if cuda:
        StandIn.cycles = max(1, int(latency_ms * cycles_per_ms))
    StandIn.seconds = latency_ms / 1e3

    stages = [PipelineStage(part, i, 2, device) for i, part in enumerate(parts)]
    schedule = ScheduleDualPipeV(stages, args.microbatches, loss_fn=F.mse_loss)
    patches = {r.name: r.status for r in torch_pipelining_ext.patch_report()}
    if patches.get("overlap_f_b") not in (
        torch_pipelining_ext.PatchStatus.APPLIED,
        torch_pipelining_ext.PatchStatus.UPSTREAM,
    ):
        raise RuntimeError(
            "the package's OVERLAP_F_B patch is not applied (is TORCH_PIPELINING_EXT_DISABLE=1 set?): "
            f"{patches.get('overlap_f_b')}"
        )
    # the two handlers, registered explicitly: one function that each step points at either
    handlers = {"overlap": overlap.overlap_f_b, "sequential": sequential_overlap_f_b}
    current = {"mode": "overlap"}

    def overlap_f_b(action: Any, ctx: Any) -> None:
        in_overlapped_action[0] = current["mode"] == "overlap"
        try:
            handlers[current["mode"]](action, ctx)
        finally:
            in_overlapped_action[0] = False

    schedule.register_custom_function(sched.OVERLAP_F_B, overlap_f_b)
    n_overlap = sum(
        a.computation_type == sched.OVERLAP_F_B
        for a in schedule.pipeline_order_with_comms[0]
    )

    def step(mode: str) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
        current["mode"] = mode
        for part in parts:
            part.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        synchronize()
        t0 = time.perf_counter()
        schedule.step(x, target=target, losses=losses)
        synchronize()
        dt = time.perf_counter() - t0
        grads = [p.grad.detach().clone() for part in parts for p in part.parameters()]
        return dt, [loss.detach() for loss in losses], grads

    times: dict[str, list[float]] = {"overlap": [], "sequential": []}
    first: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    bitwise = True
    mismatch = ""
    for rnd in range(args.warmup + args.steps):
        order = ("overlap", "sequential") if rnd % 2 == 0 else ("sequential", "overlap")
        results = {}
        for mode in order:
            dt, losses, grads = step(mode)
            results[mode] = (losses, grads)
            if rnd >= args.warmup:
                times[mode].append(dt)
            first.setdefault(mode, (losses, grads))
        for mode, (losses, grads) in results.items():
            ref_losses, ref_grads = first["sequential"]
            if not (
                all(map(torch.equal, losses, ref_losses))
                and all(map(torch.equal, grads, ref_grads))
            ):
                if bitwise:
                    mismatch = (
                        f"round {rnd}: {mode} differs from the first sequential step"
                    )
                bitwise = False

    from torch.profiler import profile, ProfilerActivity

    traces = {}
    for mode in ("overlap", "sequential"):
        try:
            from torch._C._profiler import _ExperimentalConfig

            config = {
                "experimental_config": _ExperimentalConfig(profile_all_threads=True)
            }
        except (ImportError, TypeError):
            config = {}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, **config) as prof:
            step(mode)
        path = os.path.join(out_dir, f"trace_{mode}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            traces[mode] = json.load(f).get("traceEvents", [])
    hidden = device_overlap(traces["overlap"])
    control = device_overlap(traces["sequential"], inside_actions=False)["fraction"]
    # per-action kernel times of the sequential step, for calibrating the simulator on the device
    kernel_times = action_kernel_times(traces["sequential"])
    with open(os.path.join(out_dir, "action_kernel_times.json"), "w") as f:
        json.dump(kernel_times, f, indent=1)
    try:
        sim_ratio = simulated_step_ratio(
            schedule, kernel_times, 2 * args.layers, latency_ms / 1e3, cpu=not cuda
        )
    except (
        Exception
    ) as e:  # the check's other results stand; say why there is no prediction
        print(f"    simulator: no prediction ({type(e).__name__}: {e})", flush=True)
        sim_ratio = math.nan
    if owns_pg:
        dist.destroy_process_group()
    t_o, t_s = (
        statistics.median(times["overlap"]),
        statistics.median(times["sequential"]),
    )
    return {
        "torch": torch.__version__,
        "standin": standin,
        "gpu": torch.cuda.get_device_name(device) if cuda else "CPU (dry run)",
        "block_ms": block_ms,
        "latency_ms": latency_ms,
        "cycles_per_ms": cycles_per_ms,
        "overlap_actions": n_overlap,
        "overlap_step_ms": t_o * 1e3,
        "sequential_step_ms": t_s * 1e3,
        "step_ratio": t_o / t_s,
        "device": hidden,
        "control_fraction": control,
        "bitwise_equal": bitwise,
        "mismatch": mismatch,
        "traces": [os.path.join(out_dir, f"trace_{m}.json") for m in traces],
        "action_kernel_times": kernel_times,
        "simulated_step_ratio": sim_ratio,
    }


def _measure_with_warnings(
    args: argparse.Namespace, out_dir: str, standin: str = "comm-stream"
) -> tuple[dict[str, Any], list[str]]:
    """Part (b) with every warning captured: (result, warning lines)."""
    with (
        captured_stderr() as stderr_lines,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        try:
            result = measure_overlap(args, out_dir, standin)
        except BaseException as e:
            result = {"error": f"{type(e).__name__}: {e}"}
    for line in stderr_lines:  # what was written to stderr, as it would have been
        print(line, file=sys.stderr)
    found = [
        f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})"
        for w in caught
    ]
    found += [line for line in stderr_lines if _WARNING_LINE.search(line)]
    return result, found


# --------------------------------------------------------------------------- #
# Driver                                                                       #
# --------------------------------------------------------------------------- #


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else format(v, spec)


def _print_summary(
    args: argparse.Namespace,
    tests: dict[str, Any],
    result: dict[str, Any],
    found: list[str],
    allocator: list[str],
    side: dict[str, Any],
) -> None:
    print("\ngpu_check summary")
    if not args.skip_tests:
        print(
            f"  (a) single-GPU tests: {tests['passed']} passed, {tests['failed']} failed, "
            f"{len(tests['skipped_cuda'])} CUDA variants skipped ({tests['seconds']:.0f} s)"
        )
        for name in tests["skipped_cuda"][:5]:
            print(f"      skipped: {name}")
    if args.skip_overlap:
        return
    if "error" in result:
        print(f"  (b) FAILED: {result['error']}")
    else:
        r, dev = result, result["device"]
        print(
            f"  (b) {r['gpu']}, torch {r['torch']}: {args.layers} layers per stage, dim {args.dim}, "
            f"{args.tokens} tokens per microbatch, {args.microbatches} microbatches, "
            f"{r['overlap_actions']} OVERLAP_F_B actions; stand-in on the {r['standin']}"
        )
        print(
            f"      one block {r['block_ms']:.2f} ms; stand-in {r['latency_ms']:.2f} ms ({r['cycles_per_ms']:.0f} cycles/ms)"
        )
        print(
            f"      step time: overlap {r['overlap_step_ms']:.1f} ms, sequential {r['sequential_step_ms']:.1f} ms, "
            f"ratio {r['step_ratio']:.3f} (medians of {args.steps})"
        )
        print(
            f"      device hidden fraction {_fmt(dev['fraction'])} (target >= {HIDDEN_TARGET}): "
            f"{dev['hidden_us'] / 1e3:.1f} of {dev['standin_us'] / 1e3:.1f} ms of stand-in time inside actions "
            f"({dev['n_standin']} of {dev['n_standin_all']} stand-in kernels; streams {', '.join(dev['streams'])}); "
            f"sequential control {_fmt(r['control_fraction'])}"
        )
        same = "bitwise equal" if r["bitwise_equal"] else f"DIFFERENT ({r['mismatch']})"
        print(f"      losses and gradients, overlap vs sequential: {same}")
        print(
            f"      simulator: {len(r['action_kernel_times'])} actions timed, predicted step ratio "
            f"{_fmt(r['simulated_step_ratio'])} vs measured {r['step_ratio']:.3f} (a prediction from those times)"
        )
        print(f"      traces: {', '.join(r['traces'])}")
    if "error" in side:
        print(f"  (b') side-stream stand-in FAILED: {side['error']}")
    elif side:
        same = (
            "bitwise equal"
            if side["bitwise_equal"]
            else f"DIFFERENT ({side['mismatch']})"
        )
        print(
            f"  (b') stand-in on the side stream: device hidden fraction "
            f"{_fmt(side['device']['fraction'])}, step ratio {side['step_ratio']:.3f}, {same}"
        )
    print(
        f"      warnings: {len(found)}, of the allocator or record_stream: {len(allocator)}"
    )
    for w in found[:10]:
        print(f"        {w}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-tests", action="store_true", help="skip part (a)")
    p.add_argument("--skip-overlap", action="store_true", help="skip part (b)")
    p.add_argument(
        "--tests-timeout", type=float, default=240.0, help="seconds for part (a)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="directory for traces and the test report (default: a temporary one)",
    )
    p.add_argument(
        "--dim", type=int, default=2048, help="width of the MoE-like layers (part b)"
    )
    p.add_argument(
        "--tokens", type=int, default=4096, help="tokens per microbatch (part b)"
    )
    p.add_argument(
        "--layers", type=int, default=4, help="MoE-like layers per stage (part b)"
    )
    p.add_argument("--microbatches", type=int, default=8, help="part (b)")
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps of each handler (part b)"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps of each handler (part b)"
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="stand-in duration (default: one block's compute)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a dry run of part (b) on the CPU (no part (a), nothing measured on a device; checks the plumbing)",
    )
    p.add_argument(
        "--standin",
        choices=("both", "comm-stream", "side-stream"),
        default="both",
        help="where the communication stand-in runs (part b; see [Note: where the "
        "stand-in runs]): both measures comm-stream (the verdict) then side-stream",
    )
    p.add_argument(
        "pytest_args", nargs="*", help="extra pytest arguments for part (a), after --"
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    # before any cuBLAS handle exists (gpu_check.sh sets it too): deterministic across streams
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    dry_run = args.device == "cpu"
    if dry_run:
        args.skip_tests = True
    problem = None if dry_run else cuda_problem()
    if problem is not None:
        print(f"gpu_check: {problem}", file=sys.stderr, flush=True)
        print("gpu_check=no_cuda")
        return EXIT_NO_CUDA

    out_dir = args.out or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(out_dir, exist_ok=True)
    tests: dict[str, Any] = {
        "passed": 0,
        "failed": 0,
        "skipped_cuda": [],
        "seconds": 0.0,
    }
    if not args.skip_tests:
        tests = run_tests(args.pytest_args, args.tests_timeout, out_dir)
    result: dict[str, Any] = {}
    side: dict[str, Any] = {}
    found: list[str] = []
    if not args.skip_overlap:
        backend = "gloo, a dry run on the CPU" if dry_run else "NCCL"
        print(
            f"(b) device-level overlap: ScheduleDualPipeV, 2 stages on 1 rank ({backend}, world size 1)",
            flush=True,
        )
        primary = "side-stream" if args.standin == "side-stream" else "comm-stream"
        result, found = _measure_with_warnings(args, out_dir, primary)
        if args.standin == "both" and not dry_run:
            side_dir = os.path.join(out_dir, "side_stream")
            os.makedirs(side_dir, exist_ok=True)
            side, found_side = _measure_with_warnings(args, side_dir, "side-stream")
            found += found_side
    allocator = [w for w in found if _ALLOCATOR_WARNING.search(w)]

    _print_summary(args, tests, result, found, allocator, side)
    hidden = result.get("device", {}).get("fraction", math.nan)
    control = result.get("control_fraction", math.nan)
    ratio = result.get("step_ratio", math.nan)
    bitwise = result.get("bitwise_equal")
    checks = []
    if not args.skip_tests:
        checks.append(
            tests["failed"] == 0 and tests["passed"] > 0 and not tests["skipped_cuda"]
        )
    if not args.skip_overlap:
        checks += [
            "error" not in result,
            bool(bitwise),
            not side or ("error" not in side and bool(side["bitwise_equal"])),
            dry_run or hidden >= HIDDEN_TARGET,
            not allocator,
        ]
    ok = bool(checks) and all(checks)
    seconds = time.perf_counter() - t_start
    verdict = ("dry_run" if ok else "fail") if dry_run else ("pass" if ok else "fail")
    print(f"  {verdict.upper()} in {seconds:.0f} s")
    print(
        f"gpu_check={verdict} tests_passed={tests['passed']} tests_failed={tests['failed']} "
        f"tests_skipped_cuda={len(tests['skipped_cuda'])} hidden_fraction_device={_fmt(hidden)} "
        f"hidden_fraction_device_sequential={_fmt(control)} step_ratio={_fmt(ratio)} "
        f"bitwise_equal={'na' if bitwise is None else ('yes' if bitwise else 'no')} "
        f"allocator_warnings={len(allocator)} seconds={seconds:.0f} "
        f"actions_timed={len(result.get('action_kernel_times', {}))} "
        f"simulated_step_ratio={_fmt(result.get('simulated_step_ratio', math.nan))} "
        f"hidden_fraction_device_side_stream={_fmt(side.get('device', {}).get('fraction', math.nan))} "
        f"step_ratio_side_stream={_fmt(side.get('step_ratio', math.nan))}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
