"""What the demo checks and reports (private to the demo).

:mod:`torch_pipelining_ext.demo.train` is the example of how to use the
package; this module holds what surrounds it: argument validation, timing,
the bitwise and reference checks, the printed report and ``--trace``.
Launching and the simulated link are in
:mod:`torch_pipelining_ext.demo.harness`, which ``tools/bench_hf_overlap.py``
shares.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from torch_pipelining_ext import hf
from torch_pipelining_ext.demo import harness


__all__: list[str] = []

_MAX_LATENCY_MS = 1000.0
_REFERENCE_RTOL = 1e-4


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def validate(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    environ: dict[str, str] | None,
) -> None:
    """Exit with status 2 and a message saying what to change when ``args`` cannot run."""
    environ = dict(os.environ) if environ is None else environ

    def error(message: str) -> NoReturn:
        if harness.under_torchrun(environ) and environ.get("RANK") != "0":
            sys.exit(2)  # under torchrun rank 0 alone explains
        parser.error(message)

    for flag in ("pp", "ep", "layers", "experts", "microbatches", "steps"):
        if getattr(args, flag) < 1:
            error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    latency = args.comm_latency_ms
    # (not "< 0": nan compares false with everything; inf would reach time.sleep)
    if latency is not None and not 0 <= latency <= _MAX_LATENCY_MS:
        error(
            f"--comm-latency-ms must be a number of milliseconds >= 0 and <= {_MAX_LATENCY_MS:g}, got {latency:g}: "
            "it is spent in every all-to-all, forward and backward, dozens of times per step"
        )
    if args.experts % args.ep:
        error(
            f"--experts {args.experts} is not divisible by --ep {args.ep}: every EP rank holds the same number of "
            f"experts; use e.g. --experts {args.ep * max(1, args.experts // args.ep)}"
        )
    stages = 2 * args.pp
    min_layers = stages + (1 if args.model == "deepseek_v3" else 0)
    if args.layers < min_layers:
        error(
            f"--layers {args.layers} cannot fill the {stages} stages of ScheduleDualPipeV on --pp {args.pp} ranks"
            + (
                " with an MoE layer after DeepSeek-V3's dense first layer"
                if args.model == "deepseek_v3"
                else ""
            )
            + f"; use at least --layers {min_layers}"
        )
    if args.microbatches < stages:
        error(
            f"ScheduleDualPipeV needs at least as many microbatches as stages ({stages}); got --microbatches "
            f"{args.microbatches}"
        )
    if (
        harness.under_torchrun(environ)
        and int(environ["WORLD_SIZE"]) != args.pp * args.ep
    ):
        error(
            f"torchrun started {environ['WORLD_SIZE']} processes but --pp {args.pp} x --ep {args.ep} = "
            f"{args.pp * args.ep}; start {args.pp * args.ep} (torchrun --nproc-per-node ...) or change --pp/--ep"
        )
    problem = harness.fused_experts_problem()
    if problem:
        error(problem)
    if args.trace is not None:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            error(
                f"--trace {args.trace!r}: cannot create the directory ({e.strerror}); pass a writable path"
            )


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


class Report:
    """Times both runs step by step, checks them against each other and the
    reference, prints the header, one line per step and the final table."""

    def __init__(
        self,
        args: argparse.Namespace,
        rank: int,
        runs: dict[str, Any],
        names: list[list[str]],
        tokens_per_microbatch: int,
        top_k: int,
    ) -> None:
        self.args, self.rank, self.runs = args, rank, runs
        parts = runs["overlap"].parts
        if args.comm_latency_ms is None:
            self.latency_s = harness.calibrate_link_latency(
                parts, tokens_per_microbatch, top_k
            )
            how = "= one MoE layer's local expert compute, forward, one microbatch: measured at start-up"
        else:
            self.latency_s = args.comm_latency_ms / 1e3
            how = (
                "--comm-latency-ms"
                if args.comm_latency_ms
                else "--comm-latency-ms 0: loopback only"
            )
        self.link = harness.SimulatedLink(self.latency_s)
        self._default_transport = hf.set_expert_parallel_transport(self.link)
        self.n_all_to_all = harness.all_to_alls_per_step(parts, args.microbatches)
        self.step_s: dict[str, list[float]] = {m: [] for m in runs}
        self.comm_s: list[
            float
        ] = []  # per step, in the sequential run (mean over ranks)
        self.local_losses: dict[str, list[list[torch.Tensor]]] = {m: [] for m in runs}
        self.global_loss: dict[str, list[float]] = {m: [] for m in runs}
        self.identical_steps: list[bool] = []
        self.loads: dict[str, Any] = {}  # mode -> the last step's hf.ExpertLoad
        self.params_equal = False
        self.reference_losses: list[float] = []
        if args.trace is not None:
            _name_sequential_sub_actions(runs["sequential"].schedule)
        if rank == 0:
            world, cores = args.pp * args.ep, harness.cpu_cores()
            print(
                f"torch {torch.__version__}, transformers {_transformers_version()}: tiny {args.model}, "
                f"{args.layers} layers, {args.experts} experts ({args.experts // args.ep} per EP rank), "
                f"random init; ScheduleDualPipeV, {2 * args.pp} stages on {world} gloo ranks: PP={args.pp} x "
                f"EP={args.ep}; {args.microbatches} microbatches per step and EP rank",
                flush=True,
            )
            for i, stage in enumerate(names):
                print(
                    f"  stage {i}: {', '.join(n for n in stage if not n.endswith('rotary_emb'))}"
                )
            print(
                f"simulated link: {self.latency_s * 1e3:.2f} ms per token all-to-all, forward and backward ({how})"
            )
            if world > cores:
                print(
                    f"note: {world} ranks on {cores} CPU cores: while one rank waits on the link another computes on "
                    "its core, so the overlap finds less idle time to fill than with a core (or GPU) per rank",
                    flush=True,
                )

    @contextlib.contextmanager
    def timed(self, mode: str, step: int) -> Iterator[None]:
        """Time one step of ``mode`` (slowest rank); profile it if it is the last and --trace is set."""
        trace = self.args.trace is not None and step == self.args.steps - 1
        prof = _profiler() if trace else contextlib.nullcontext()
        comm = (
            self.link.measuring() if mode == "sequential" else contextlib.nullcontext()
        )
        dist.barrier()
        t0 = time.perf_counter()
        with prof, comm:
            yield
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        self.step_s[mode].append(dt.item())
        if mode == "sequential":
            c = torch.tensor([self.link.seconds], dtype=torch.float64)
            dist.all_reduce(c)
            self.comm_s.append(c.item() / dist.get_world_size())
        if trace:
            prof.export_chrome_trace(
                os.path.join(self.args.trace, f"trace_{mode}_rank{self.rank}.json")
            )

    def losses(self, mode: str, step: int, losses: list[torch.Tensor]) -> None:
        self.local_losses[mode].append(losses)
        total = (
            torch.stack(losses).sum().double()
            if losses
            else torch.zeros((), dtype=torch.float64)
        )
        dist.all_reduce(
            total
        )  # the last stages' losses of the EP ranks average to the global batch's loss
        self.global_loss[mode].append(total.item() / self.args.ep)

    def expert_load(self, mode: str, load: hf.ExpertLoad) -> None:
        self.loads[mode] = load

    def print_step(self, step: int) -> None:
        a, b = self.local_losses["overlap"][step], self.local_losses["sequential"][step]
        self.identical_steps.append(
            harness.all_ranks(
                len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
            )
        )
        if self.rank == 0:
            differ = "" if self.identical_steps[-1] else "  LOSSES DIFFER"
            print(
                f"step {step + 1:>2}/{self.args.steps}  loss {self.global_loss['overlap'][step]:.6f}  step time: "
                f"overlapped {self.step_s['overlap'][step] * 1e3:7.1f} ms, sequential "
                f"{self.step_s['sequential'][step] * 1e3:7.1f} ms{differ}",
                flush=True,
            )

    def params_identical(
        self, parts_a: list[torch.nn.Module], parts_b: list[torch.nn.Module]
    ) -> None:
        self.params_equal = harness.all_ranks(
            all(
                torch.equal(x, y)
                for a, b in zip(parts_a, parts_b)
                for x, y in zip(a.parameters(), b.parameters())
            )
        )

    def reference(self, losses: list[float]) -> None:
        self.reference_losses = losses

    def summary(self) -> dict[str, Any]:
        """The measured numbers (rank 0: with the reference)."""
        skip = (
            1 if self.args.steps > 1 else 0
        )  # the first step also runs shape inference
        t_o = statistics.median(self.step_s["overlap"][skip:])
        t_s = statistics.median(self.step_s["sequential"][skip:])
        simulated = self.n_all_to_all * self.latency_s
        comm = statistics.median(self.comm_s[skip:])
        ref = self.reference_losses
        diff = (
            max(abs(a - b) for a, b in zip(self.global_loss["overlap"], ref))
            if ref
            else math.nan
        )
        return dict(
            overlap_s=t_o,
            sequential_s=t_s,
            ratio=t_o / t_s,
            comm_s=comm,
            simulated_s=simulated,
            hidden_fraction=(t_s - t_o) / comm if comm > 0 else math.nan,
            losses_identical=all(self.identical_steps),
            params_identical=self.params_equal,
            reference_max_diff=diff,
            reference_ok=bool(ref) and diff <= _REFERENCE_RTOL * max(1.0, abs(ref[-1])),
            latency_ms=self.latency_s * 1e3,
            medians_of=f"step {skip + 1}"
            if skip + 1 == self.args.steps
            else f"steps {skip + 1}-{self.args.steps}",
        )

    def finish(self) -> int:
        """Print the table (rank 0); the exit status, on every rank."""
        status = torch.zeros(1)
        if self.rank == 0:
            r = self.summary()
            self._print_table(r)
            status[0] = (
                0
                if r["losses_identical"] and r["params_identical"] and r["reference_ok"]
                else 1
            )
        dist.broadcast(status, src=0)
        hf.set_expert_parallel_transport(self._default_transport)
        if self.args.trace is not None:
            self._finish_trace()
        return int(status.item())

    def _print_table(self, r: dict[str, Any]) -> None:
        n = self.args.steps
        fl = {m: f"{self.global_loss[m][-1]:.6f}" for m in self.runs}
        rows = [
            ("", "overlapped", "sequential", "reference"),
            (
                f"final loss (step {n})",
                fl["overlap"],
                fl["sequential"],
                f"{self.reference_losses[-1]:.6f}",
            ),
            (
                f"step time ({r['medians_of']}, median)",
                f"{r['overlap_s'] * 1e3:.1f} ms",
                f"{r['sequential_s'] * 1e3:.1f} ms",
                "-",
            ),
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        print()
        for row in rows:
            print(
                "  ".join(
                    c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                    for i, c in enumerate(row)
                ).rstrip()
            )
        print()
        print(f"time overlapped / sequential: {r['ratio']:.2f} (slowest rank per step)")
        if r["comm_s"] > 0:
            print(
                f"communication hidden: {r['hidden_fraction']:.2f} = (sequential - overlapped) / time the sequential "
                f"run spends in all-to-alls ({r['comm_s'] * 1e3:.0f} ms per step and rank: "
                f"{self.n_all_to_all} x {r['latency_ms']:.2f} ms = {r['simulated_s'] * 1e3:.0f} ms of simulated "
                "link, the rest loopback and waiting for the other EP rank)"
            )
        if r["simulated_s"] == 0:
            print(
                "note: no simulated link (--comm-latency-ms 0): loopback all-to-alls leave little to hide"
            )
        yes = {True: "yes", False: "NO"}
        print(
            f"losses identical: {yes[r['losses_identical']]} (torch.equal, every microbatch loss of every rank, "
            f"{n} steps); weights after step {n} identical: {yes[r['params_identical']]}"
        )
        print(
            f"vs the unsplit model on the global batch: max |loss difference| {r['reference_max_diff']:.1e} over {n} "
            f"steps ({'float rounding' if r['reference_ok'] else 'UNEXPECTEDLY LARGE'})",
            flush=True,
        )
        if "overlap" in self.loads:
            print(f"step {n}, all ranks: {self.loads['overlap'].summary()}", flush=True)

    def _finish_trace(self) -> None:
        """Every rank extracts the phases of its traces, rank 0 draws them all (works across nodes)."""
        from torch_pipelining_ext.demo import _load_plot, _timeline

        files = [
            os.path.join(self.args.trace, f"trace_{mode}_rank{self.rank}.json")
            for mode in self.runs
        ]
        phases = {
            os.path.basename(f): _timeline.phases_from_chrome_trace(f) for f in files
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, phases)
        if self.rank != 0:
            return
        world = self.args.pp * self.args.ep
        print(
            f"trace: {self.args.trace}/trace_{{overlap,sequential}}_rank{{0..{world - 1}}}.json (last step)"
        )
        merged = {name: ph for g in gathered for name, ph in g.items()}
        png = os.path.join(self.args.trace, "timeline.png")
        title = f"tiny {self.args.model}, PP={self.args.pp} x EP={self.args.ep}, ScheduleDualPipeV, last step"
        try:
            _timeline.plot_timeline(merged, png, title=title)
        except ImportError:
            print(
                "note: no timeline.png: matplotlib is not installed (pip install 'torch_pipelining_ext[plot]')"
            )
            return
        print(f"timeline: {png}", flush=True)
        if "overlap" in self.loads:
            png = os.path.join(self.args.trace, "expert_load.png")
            title = f"tiny {self.args.model}, step {self.args.steps}: tokens per expert, all ranks and microbatches"
            _load_plot.plot_expert_load(self.loads["overlap"], png, title=title)
            print(f"expert load: {png}", flush=True)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _profiler() -> Any:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import profile, ProfilerActivity

    # profile_all_threads: the OVERLAP_F_B worker thread's ranges too
    return profile(
        activities=[ProfilerActivity.CPU],
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    )


def _name_sequential_sub_actions(schedule: Any) -> None:
    """Give the sequential run's sub-actions the profiler ranges the concurrent
    handler gives them (``OVERLAP_F_B forward 0F3``), so the traces compare."""
    from torch.distributed.pipelining import schedules

    from torch_pipelining_ext.runtime import run_action

    def named(action: Any, ctx: Any) -> None:
        for sub in action.sub_actions or ():
            side = (
                "forward" if sub.computation_type == schedules.FORWARD else "backward"
            )
            with record_function(f"OVERLAP_F_B {side} {sub}"):
                run_action(sub, ctx)

    schedule.register_custom_function(schedules.OVERLAP_F_B, named)
