"""``--compare-sequential``: the trainer's steps with the concurrent and the
sequential OVERLAP_F_B side by side, and the unsplit model as reference.

Run by ``python -m torch_pipelining_ext.train --compare-sequential`` (and
``python -m torch_pipelining_ext.demo``, its preset); the simulated link and
its helpers also serve ``tools/bench_hf_overlap.py``.  :func:`run_rank`
builds the plan's pipeline twice from the same weights (``_pipeline.py``:
the stages, AdamW, the learning-rate schedule, clipping, FSDP2 over the data
ranks), one running ScheduleDualPipeV's OVERLAP_F_B concurrently, the other
sequentially (what stock torch runs), and trains both on the same batches,
alternating which goes first so that drift on a busy machine hits both
alike.  :class:`Report` times them, checks that their losses and weights are
bitwise equal and that rank 0's unsplit Hugging Face model, trained with the
same optimizer on the global batches, has the same losses within float
rounding, prints one line per step and the final table, and with ``--trace``
profiles the last step (:mod:`torch_pipelining_ext.train.timeline`) and plots its expert load.

The expert-parallel all-to-alls run over a :class:`SimulatedLink`, an
:class:`torch_pipelining_ext.hf.ExpertParallelTransport` on which every
token all-to-all also waits the link's latency, standing in for a slower
link than the ranks have (loopback); it is what the overlap can hide.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.pipelining import schedules

from torch_pipelining_ext import hf, launcher
from torch_pipelining_ext.runtime import run_action
from torch_pipelining_ext.train import _data, _model, _plot, _state, timeline
from torch_pipelining_ext.train._loop import rank_device
from torch_pipelining_ext.train._pipeline import adamw, lr_rule, Pipeline
from torch_pipelining_ext.train._plan import RunPlan


__all__ = [
    "SimulatedLink",
    "all_ranks",
    "all_to_alls_per_step",
    "calibrate_link_latency",
    "run_rank",
]

MODES = ("overlap", "sequential")
_CALIBRATION_REPEATS = 20
_REFERENCE_RTOL = 1e-4


def run_rank(rank: int, plan: RunPlan) -> int:
    """One rank's comparison; returns the exit status (the same on every
    rank): 0 when both runs agree bitwise and with the reference, else 1."""
    args, layout = plan.args, plan.layout
    device = rank_device(plan, rank)
    parallel = launcher.parallel_layout(
        layout.pp, layout.dp, layout.ep, device_type=device.type
    )
    _state.seed_rank(args.seed, 0, rank)
    runs = {
        mode: Pipeline(
            plan, parallel, device, resuming=False, overlap=mode == "overlap"
        )
        for mode in MODES
    }
    data = _data.Sequences(plan.stream, args.seq_len, args.seed, not args.no_shuffle)
    data_mesh = runs["overlap"].data
    report = Report(plan, rank, runs)  # calibrates the link, prints the header
    for step in range(args.steps):
        ids = data.batch(
            step * args.batch_size,
            args.batch_size,
            data_mesh.get_local_rank(),
            data_mesh.size(),
        ).to(device)
        for mode in MODES if step % 2 == 0 else reversed(MODES):
            with report.timed(mode, step):
                losses = runs[mode].forward_backward(ids)
                load = runs[mode].update()[2]
            report.record(mode, losses, load)
        report.print_step(step)
    report.params_identical()
    if rank == 0:
        report.reference_losses = reference_losses(plan, data)
    return report.finish()


def reference_losses(plan: RunPlan, data: _data.Sequences) -> list[float]:
    """The unsplit Hugging Face model trained on the global batches as the
    pipeline trains (AdamW, learning-rate schedule, clipping): per-step loss."""
    import transformers

    args = plan.args
    if args.model is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32
        )
    else:
        model = _model.initial_model(plan.config, args.seed)
    model.train()
    optimizer = adamw(model, args)
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_rule(args))
    out = []
    for step in range(args.steps):
        optimizer.zero_grad()
        ids = data.batch(step * args.batch_size, args.batch_size, 0, 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.max_grad_norm or math.inf
        )
        optimizer.step()
        lr.step()
        out.append(loss.item())
    return out


# ---------------------------------------------------------------------------
# The simulated link
# ---------------------------------------------------------------------------


class SimulatedLink(hf.ExpertParallelTransport):
    """The expert-parallel transport of the comparison and the benchmarks.

    Every token all-to-all (forward and backward) also waits
    ``latency_s``, standing in for a slower link than the ranks have
    (loopback); the wait releases the GIL, as a network transfer does.
    While :meth:`measuring`, the wall time spent in the all-to-alls (token
    counts, tokens and the wait) is added up in ``seconds``: measured on
    the sequential run only, where all of it is on the calling thread, it is
    the time the overlap could hide, including the waits for the other EP
    ranks to reach the same all-to-all, which the overlap hides too.
    """

    def __init__(self, latency_s: float = 0.0) -> None:
        if not latency_s >= 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency_s!r}")
        self.latency_s = float(latency_s)
        self.seconds = 0.0
        self._measuring = False

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Add up the time spent in the all-to-alls of the block (from 0)."""
        self.seconds, self._measuring = 0.0, True
        try:
            yield
        finally:
            self._measuring = False

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._measuring:
                self.seconds += time.perf_counter() - t0

    def counts(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        with self._timed():
            super().counts(output, input, group)

    def tokens(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: dist.ProcessGroup,
    ) -> None:
        with self._timed():
            super().tokens(output, input, output_split_sizes, input_split_sizes, group)
            if self.latency_s:
                time.sleep(self.latency_s)


def calibrate_link_latency(
    parts: Sequence[torch.nn.Module], tokens_per_microbatch: int, top_k: int
) -> float:
    """Seconds one MoE layer's local experts compute on one microbatch
    (forward; each rank receives ``tokens * top_k`` slots, spread evenly
    over the experts): the fastest of a few repeats, the mean over all ranks
    (0 without expert parallelism)."""
    shards = hf.expert_parallel_shards(parts)
    if not shards:
        return 0.0
    module, shard = shards[0]
    per_expert = max(1, tokens_per_microbatch * top_k // shard.num_experts)
    counts = torch.full((shard.size, shard.local), per_expert)
    weight = module.gate_up_proj
    assert isinstance(weight, torch.Tensor)
    tokens = torch.randn(int(counts.sum()), weight.shape[-1], dtype=weight.dtype)
    times = []
    with torch.no_grad():
        for i in range(_CALIBRATION_REPEATS + 3):
            t0 = time.perf_counter()
            hf.run_local_experts(module, tokens, counts)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    # the fastest repeat: on a busy machine the others include time the process was not running
    mean = torch.tensor([min(times)], dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def all_to_alls_per_step(parts: Sequence[torch.nn.Module], microbatches: int) -> int:
    """Token all-to-alls this rank runs per step: every microbatch passes each
    local MoE layer once forward (dispatch, combine) and once backward (the same two)."""
    return 4 * microbatches * len(hf.expert_parallel_shards(parts))


def all_ranks(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


class Report:
    """Times both runs step by step, checks them against each other and the
    reference, prints the header, one line per step and the final table."""

    def __init__(self, plan: RunPlan, rank: int, runs: dict[str, Pipeline]) -> None:
        args, layout = plan.args, plan.layout
        self.args, self.layout, self.rank, self.runs = args, layout, rank, runs
        self.model = args.model or f"tiny {args.model_type}"
        parts = runs["overlap"].parts
        local_batch = args.batch_size // layout.data_ranks
        if args.comm_latency_ms is None:
            self.latency_s = calibrate_link_latency(
                parts,
                local_batch // args.microbatches * args.seq_len,
                getattr(plan.config, "num_experts_per_tok", 1),
            )
            how = "= one MoE layer's local expert compute, forward, one microbatch: measured at start-up"
        else:
            self.latency_s = args.comm_latency_ms / 1e3
            how = (
                "--comm-latency-ms"
                if args.comm_latency_ms
                else "--comm-latency-ms 0: loopback only"
            )
        self.link = SimulatedLink(self.latency_s)
        self._default_transport = hf.set_expert_parallel_transport(self.link)
        self.n_all_to_all = all_to_alls_per_step(parts, args.microbatches)
        self.step_s: dict[str, list[float]] = {m: [] for m in runs}
        # per step, in the sequential run (mean over ranks)
        self.comm_s: list[float] = []
        self.local_losses: dict[str, list[list[torch.Tensor]]] = {m: [] for m in runs}
        self.global_loss: dict[str, list[float]] = {m: [] for m in runs}
        self.identical_steps: list[bool] = []
        self.loads: dict[str, hf.ExpertLoad] = {}  # mode -> the last step's
        self.params_equal = False
        self.reference_losses: list[float] = []
        if args.trace is not None:
            os.makedirs(args.trace, exist_ok=True)
            _name_sequential_sub_actions(runs["sequential"].schedule)
        if rank == 0:
            self._print_header(plan, how)

    def _print_header(self, plan: RunPlan, how: str) -> None:
        import transformers

        args, layout, experts = self.args, self.layout, plan.num_experts
        backend = "gloo" if args.device == "cpu" else "NCCL"
        dp = f" x DP={layout.dp}" if layout.dp > 1 else ""
        print(
            f"torch {torch.__version__}, transformers {transformers.__version__}: {self.model}, "
            f"{plan.config.num_hidden_layers} layers, {experts} experts ({experts // layout.ep} per EP rank), "
            f"{'random init' if args.model is None else 'pretrained'}; ScheduleDualPipeV, {layout.num_stages} "
            f"stages on {layout.world_size} {backend} ranks: PP={layout.pp}{dp} x EP={layout.ep}; "
            f"{args.microbatches} microbatches per step and {'EP' if layout.dp == 1 else 'data'} rank",
            flush=True,
        )
        names = hf.hf_module_names_per_stage(
            hf.meta_causal_lm(plan.config), layout.num_stages
        )
        for i, stage in enumerate(names):
            print(
                f"  stage {i}: {', '.join(n for n in stage if not n.endswith('rotary_emb'))}"
            )
        print(
            f"simulated link: {self.latency_s * 1e3:.2f} ms per token all-to-all, forward and backward ({how})"
        )
        cores = launcher.cpu_cores()
        if args.device == "cpu" and layout.world_size > cores:
            print(
                f"note: {layout.world_size} ranks on {cores} CPU cores: while one rank waits on the link another "
                "computes on its core, so the overlap finds less idle time to fill than with a core (or GPU) per rank",
                flush=True,
            )

    @contextlib.contextmanager
    def timed(self, mode: str, step: int) -> Iterator[None]:
        """Time one step of ``mode`` (slowest rank); profile it if it is the last and --trace is set."""
        trace = self.args.trace is not None and step == self.args.steps - 1
        prof: contextlib.AbstractContextManager[Any] = (
            _profiler() if trace else contextlib.nullcontext()
        )
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
            assert isinstance(prof, torch.profiler.profile)
            prof.export_chrome_trace(self._trace_file(mode))

    def _trace_file(self, mode: str) -> str:
        return os.path.join(self.args.trace, f"trace_{mode}_rank{self.rank}.json")

    def record(
        self, mode: str, losses: list[torch.Tensor], load: hf.ExpertLoad | None
    ) -> None:
        """One step of ``mode``: its microbatch losses and expert load."""
        self.local_losses[mode].append([loss.detach() for loss in losses])
        self.global_loss[mode].append(self.runs[mode].global_loss(losses))
        if load is not None:
            self.loads[mode] = load

    def print_step(self, step: int) -> None:
        a, b = self.local_losses["overlap"][step], self.local_losses["sequential"][step]
        self.identical_steps.append(
            all_ranks(len(a) == len(b) and all(map(torch.equal, a, b)))
        )
        if self.rank == 0:
            differ = "" if self.identical_steps[-1] else "  LOSSES DIFFER"
            print(
                f"step {step + 1:>2}/{self.args.steps}  loss {self.global_loss['overlap'][step]:.6f}  step time: "
                f"overlapped {self.step_s['overlap'][step] * 1e3:7.1f} ms, sequential "
                f"{self.step_s['sequential'][step] * 1e3:7.1f} ms{differ}",
                flush=True,
            )

    def params_identical(self) -> None:
        """Whether both runs' weights are bitwise equal on every rank."""
        pairs = zip(self.runs["overlap"].parts, self.runs["sequential"].parts)
        self.params_equal = all_ranks(
            all(
                torch.equal(_local(x), _local(y))
                for a, b in pairs
                for x, y in zip(a.parameters(), b.parameters())
            )
        )

    def summary(self) -> dict[str, Any]:
        """The measured numbers (rank 0: with the reference)."""
        # the first step also runs shape inference
        skip = 1 if self.args.steps > 1 else 0
        t_o = statistics.median(self.step_s["overlap"][skip:])
        t_s = statistics.median(self.step_s["sequential"][skip:])
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
            simulated_s=self.n_all_to_all * self.latency_s,
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
            ok = r["losses_identical"] and r["params_identical"] and r["reference_ok"]
            status[0] = 0 if ok else 1
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
        phases = {
            os.path.basename(f): timeline.phases_from_chrome_trace(f)
            for f in map(self._trace_file, self.runs)
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, phases)
        if self.rank != 0:
            return
        trace, layout = self.args.trace, self.layout
        print(
            f"trace: {trace}/trace_{{overlap,sequential}}_rank{{0..{layout.world_size - 1}}}.json (last step)"
        )
        merged = {name: ph for g in gathered for name, ph in g.items()}
        png = os.path.join(trace, "timeline.png")
        title = f"{self.model}, PP={layout.pp} x EP={layout.ep}, ScheduleDualPipeV, last step"
        try:
            timeline.plot_timeline(merged, png, title=title)
        except ImportError:
            print(
                "note: no timeline.png: matplotlib is not installed (pip install 'torch_pipelining_ext[plot]')"
            )
            return
        print(f"timeline: {png}", flush=True)
        if "overlap" in self.loads:
            png = os.path.join(trace, "expert_load.png")
            title = f"{self.model}, step {self.args.steps}: tokens per expert, all ranks and microbatches"
            _plot.plot_expert_load(self.loads["overlap"], png, title=title)
            print(f"expert load: {png}", flush=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2's are DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


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

    def named(action: Any, ctx: Any) -> None:
        for sub in action.sub_actions or ():
            side = (
                "forward" if sub.computation_type == schedules.FORWARD else "backward"
            )
            with record_function(f"OVERLAP_F_B {side} {sub}"):
                run_action(sub, ctx)

    schedule.register_custom_function(schedules.OVERLAP_F_B, named)
