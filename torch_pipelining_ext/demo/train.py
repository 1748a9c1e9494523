"""End-to-end demo: train a small MoE transformer with PP x EP and real OVERLAP_F_B overlap.

``python -m torch_pipelining_ext.demo`` (the README's main job) runs
:func:`main`.  With no flags it spawns ``pp * ep = 4`` local ranks (gloo over
loopback; NCCL when the machine has enough GPUs), builds the DeepSeek-style MoE
transformer of :mod:`torch_pipelining_ext.demo.model` with the same seed on
every rank, splits it into pipeline stages by module names
(:mod:`torch_pipelining_ext.stage_split`) and trains it with
``ScheduleDualPipeV`` on synthetic data, twice from the same initial weights:

* ``overlap``: the package's OVERLAP_F_B handler, which runs the backward of
  one microbatch on a worker thread while the forward of another runs on the
  calling thread, the two alternating at the expert-parallel communication
  boundaries;
* ``sequential``: an OVERLAP_F_B function that runs the two sub-actions one
  after the other (what upstream torch does).

The two runs step in turn (alternating which goes first) so that machine
drift affects both alike.  Their per-microbatch losses must be bitwise equal;
the demo checks it with ``torch.equal``.  Rank 0 then trains the unsplit model
in a single process on the same data, with the same microbatching and loss
scaling, as the reference, and prints a table.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the demo joins the env://
rendezvous instead of spawning, so it runs on several nodes too.  Local gloo
ranks are forked (as PyTorch's multi-process tests do: no rank re-imports
torch); CUDA ranks are spawned.

``--comm-latency-ms L`` adds ``L`` ms inside every expert-parallel dispatch and
combine, in forward and backward, standing in for a slower link than loopback
(what the overlap is there to hide).  ``--trace DIR`` profiles the last step of
both runs on every rank: Chrome traces, a PNG timeline drawn by
:mod:`torch_pipelining_ext.demo._timeline`, and ``summary.json``.

The exit status is 0 when the two runs' losses and parameters are identical
and the losses match the reference, 1 otherwise, and 2 for bad arguments
(rejected before any process starts).

Data layout: the expert-parallel group doubles as the data-parallel group of
the non-expert parameters (as in DeepSeek-V3 training): each EP rank trains on
its own slice of the global batch, MoE layers exchange tokens over the EP
group with ``all_to_all_single``, and after each step the non-expert gradients
are averaged over the EP group while the expert gradients (which the combine
backward already summed over all EP ranks' tokens) are divided by the EP size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.profiler import record_function

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import ep_overlap, stage_split
from torch_pipelining_ext.demo.model import is_expert_param, MoEModelArgs, MoETransformer


__all__ = ["DemoResult", "build_parser", "main", "parse_args", "run"]

# Fixed sizes of the synthetic task (the flags choose the parallel layout and
# the model's depth/width in experts).
_MICROBATCH_SIZE = 2
_SEQ_LEN = 16
_LR = 1e-2
_PG_TIMEOUT = timedelta(seconds=300)
_REFERENCE_RTOL = 1e-4
# --comm-latency-ms is added to every all-to-all in forward and backward, dozens
# of times per step: a second already makes a step take minutes.
_MAX_COMM_LATENCY_MS = 1000.0
# Local gloo ranks per CPU core above which the demo warns: every rank computes
# on the CPU, and with many ranks per core a step takes minutes.
_RANKS_PER_CORE_WARNING = 4
_PACKAGE_HANDLER = "torch_pipelining_ext._overlap.overlap_f_b"


# ---------------------------------------------------------------------------
# Schedules the demo supports
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ScheduleSpec:
    name: str  # key of torch's get_schedule_class
    stages_per_rank: int
    # returns None when n_microbatches is fine for pp, else the reason
    check_microbatches: Callable[[int, int], str | None]


def _at_least_stages(n_mb: int, num_stages: int, name: str) -> str | None:
    if n_mb < num_stages:
        return f"{name} needs at least as many microbatches as stages ({num_stages}); got --microbatches {n_mb}"
    return None


def _rounds_divide(n_mb: int, pp: int, name: str) -> str | None:
    # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble split the
    # microbatches into max(1, n_mb // pp) rounds of equal size.
    rounds = max(1, n_mb // pp)
    if n_mb % rounds != 0:
        return (
            f"{name} needs --microbatches to be a multiple of its {rounds} rounds (n_microbatches // pp); "
            f"got {n_mb}, use e.g. {rounds * pp}"
        )
    return None


_SCHEDULES: dict[str, _ScheduleSpec] = {
    spec.name.lower(): spec
    for spec in (
        _ScheduleSpec("DualPipeV", 2, lambda n, pp: _at_least_stages(n, 2 * pp, "ScheduleDualPipeV")),
        _ScheduleSpec("ZBVZeroBubble", 2, lambda n, pp: _at_least_stages(n, 2 * pp, "ScheduleZBVZeroBubble")),
        _ScheduleSpec("Interleaved1F1B", 2, lambda n, pp: _rounds_divide(n, pp, "ScheduleInterleaved1F1B")),
        _ScheduleSpec(
            "InterleavedZeroBubble", 2, lambda n, pp: _rounds_divide(n, pp, "ScheduleInterleavedZeroBubble")
        ),
        _ScheduleSpec("LoopedBFS", 2, lambda n, pp: None),
        _ScheduleSpec("1F1B", 1, lambda n, pp: _at_least_stages(n, pp, "Schedule1F1B")),
        _ScheduleSpec("GPipe", 1, lambda n, pp: None),
    )
}


def _schedule_spec(name: str) -> _ScheduleSpec | None:
    key = name.lower()
    if key.startswith("schedule"):
        key = key[len("schedule") :]
    return _SCHEDULES.get(key)


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line parser (see ``python -m torch_pipelining_ext.demo --help``)."""
    p = argparse.ArgumentParser(
        prog="python -m torch_pipelining_ext.demo",
        description=(
            "Train a small DeepSeek-style MoE transformer with pipeline (PP) x expert (EP) parallelism and "
            "real OVERLAP_F_B overlap; compare with sequential OVERLAP_F_B and a single-process reference. "
            "Spawns PP*EP local ranks, or joins a torchrun rendezvous when RANK/WORLD_SIZE are set."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (also the data-parallel size)")
    p.add_argument(
        "--schedule",
        default="DualPipeV",
        help="pipeline schedule: " + ", ".join(s.name for s in _SCHEDULES.values()),
    )
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step and EP rank")
    p.add_argument("--dense-layers", type=int, default=1, help="dense transformer layers (first)")
    p.add_argument("--moe-layers", type=int, default=4, help="MoE transformer layers (after the dense ones)")
    p.add_argument("--experts", type=int, default=4, help="routed experts per MoE layer (divisible by --ep)")
    p.add_argument("--steps", type=int, default=6, help="training steps (each run in both modes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the synthetic data")
    p.add_argument(
        "--comm-latency-ms",
        type=float,
        default=0.0,
        metavar="L",
        help=(
            "add L ms to every expert-parallel all-to-all, in forward and in backward, to stand in for a slower "
            f"link than loopback (what overlap hides); 0 <= L <= {_MAX_COMM_LATENCY_MS:g}"
        ),
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend; auto: nccl when every local rank gets its own CUDA device, else gloo",
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help=(
            "profile the last step of both runs: a Chrome trace per rank and run, a PNG timeline "
            "(needs matplotlib) and summary.json in DIR"
        ),
    )
    return p


def _launch_env(environ: dict[str, str]) -> tuple[bool, int, int]:
    """(under torchrun, world size, local world size)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = int(environ["WORLD_SIZE"])
        return True, world, int(environ.get("LOCAL_WORLD_SIZE", world))
    return False, -1, -1


def parse_args(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse and validate the demo's arguments; nothing is spawned.

    Bad input exits with status 2 and a message saying what to change (argparse
    style).  ``args.backend`` is resolved (never ``"auto"``) and
    ``args.schedule`` normalised to torch's schedule name.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = dict(os.environ) if environ is None else environ
    under_torchrun, world, local_world = _launch_env(environ)

    def error(message: str) -> NoReturn:
        # Under torchrun every rank validates; rank 0 alone explains.
        if under_torchrun and environ.get("RANK") != "0":
            sys.exit(2)
        parser.error(message)

    for flag, value, low in (
        ("--pp", args.pp, 1),
        ("--ep", args.ep, 1),
        ("--microbatches", args.microbatches, 1),
        ("--dense-layers", args.dense_layers, 0),
        ("--moe-layers", args.moe_layers, 0),
        ("--experts", args.experts, 1),
        ("--steps", args.steps, 1),
    ):
        if value < low:
            error(f"{flag} must be at least {low}, got {value}")

    # (not "< 0": nan compares false with everything; inf would reach time.sleep)
    if not 0 <= args.comm_latency_ms <= _MAX_COMM_LATENCY_MS:
        error(
            f"--comm-latency-ms must be a number of milliseconds >= 0 and <= {_MAX_COMM_LATENCY_MS:g}, got "
            f"{args.comm_latency_ms:g}: it is added to every all-to-all, forward and backward, dozens of times "
            "per step"
        )

    spec = _schedule_spec(args.schedule)
    if spec is None:
        error(
            f"unknown --schedule {args.schedule!r}; choose one of: " + ", ".join(s.name for s in _SCHEDULES.values())
        )
    args.schedule = spec.name

    if under_torchrun and world != args.pp * args.ep:
        error(
            f"torchrun started {world} processes but --pp {args.pp} x --ep {args.ep} = {args.pp * args.ep}; "
            f"start {args.pp * args.ep} processes (torchrun --nproc-per-node ...) or change --pp/--ep"
        )

    if args.experts % args.ep != 0:
        error(
            f"--experts {args.experts} is not divisible by --ep {args.ep}: every EP rank holds the same number of "
            f"experts; use e.g. --experts {args.ep * max(1, args.experts // args.ep)}"
        )

    num_stages = args.pp * spec.stages_per_rank
    n_layers = args.dense_layers + args.moe_layers
    if n_layers < num_stages:
        error(
            f"{n_layers} layers (--dense-layers {args.dense_layers} + --moe-layers {args.moe_layers}) cannot fill "
            f"{num_stages} pipeline stages (Schedule{spec.name} runs {spec.stages_per_rank} stage(s) on each of "
            f"--pp {args.pp} ranks); give at least {num_stages} layers or use a smaller --pp"
        )

    problem = spec.check_microbatches(args.microbatches, args.pp)
    if problem:
        error(problem)

    n_local = local_world if under_torchrun else args.pp * args.ep
    cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() >= n_local
    if args.backend == "auto":
        args.backend = "nccl" if cuda_ok and dist.is_nccl_available() else "gloo"
    elif args.backend == "nccl" and not (cuda_ok and dist.is_nccl_available()):
        error(
            f"--backend nccl needs NCCL and one CUDA device per local rank ({n_local}); this machine has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; use --backend gloo"
        )

    if args.trace is not None:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            error(f"--trace {args.trace!r}: cannot create the directory ({e.strerror}); pass a writable path")

    warning = _oversubscription_warning(args, n_local, _cpu_cores())
    if warning and not (under_torchrun and environ.get("RANK") != "0"):
        print(f"{parser.prog}: warning: {warning}", file=sys.stderr, flush=True)
    return args


def _cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _oversubscription_warning(args: argparse.Namespace, n_local: int, cores: int) -> str | None:
    """A warning when far more local gloo ranks than CPU cores would compute (None otherwise)."""
    if args.backend != "gloo" or n_local <= _RANKS_PER_CORE_WARNING * cores:
        return None
    return (
        f"--pp {args.pp} x --ep {args.ep} starts {n_local} local ranks on {cores} CPU core(s), "
        f"about {n_local / cores:.0f} per core: every rank computes on the CPU, so each step will take very "
        f"long; use at most {_RANKS_PER_CORE_WARNING * cores} ranks here (smaller --pp/--ep) or more machines"
    )


# ---------------------------------------------------------------------------
# Model, data, loss
# ---------------------------------------------------------------------------
# Everything that depends on torch_pipelining_ext.demo.model lives here.


def _model_args(args: argparse.Namespace) -> MoEModelArgs:
    return MoEModelArgs(
        n_dense_layers=args.dense_layers,
        n_moe_layers=args.moe_layers,
        n_experts=args.experts,
        top_k=min(2, args.experts),
        # the demo applies the ep_overlap marks itself (_build_model)
        comm_boundaries=False,
    )


def _build_model(args: argparse.Namespace, ep_group: dist.ProcessGroup | None, device: torch.device) -> nn.Module:
    """The whole model, seeded identically on every rank (experts sharded over ``ep_group``).

    Built on the CPU, so that the weights do not depend on the device's random
    number generator, then moved to ``device``.  The expert-parallel
    ``dispatch``/``combine`` methods get the ep_overlap communication marks,
    and inside them the simulated link latency of ``--comm-latency-ms``.
    """
    torch.manual_seed(args.seed)
    model = MoETransformer(_model_args(args), ep_group=ep_group)
    if ep_group is not None and args.moe_layers:
        if args.comm_latency_ms > 0:
            _add_latency(model, args.comm_latency_ms / 1e3)
        ep_overlap.wrap_dispatch_combine(model)
    return model.to(device)


class _LinkLatency(torch.autograd.Function):
    """Identity that sleeps in forward and in backward: a slower link than loopback."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class _WithLatency:
    """A dispatch/combine method whose received tensor passes :class:`_LinkLatency`.

    Holds the bound method as an attribute (not in a closure) so that the
    deep copies stage splitting makes call their own module's method.
    """

    def __init__(self, method: Callable[..., Any], seconds: float) -> None:
        self._latency_method = method
        self._latency_s = seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._latency_method(*args, **kwargs)
        if isinstance(out, tuple):
            return (_LinkLatency.apply(out[0], self._latency_s), *out[1:])
        return _LinkLatency.apply(out, self._latency_s)


def _add_latency(model: nn.Module, seconds: float) -> None:
    for module in model.modules():
        if callable(getattr(module, "dispatch", None)) and callable(getattr(module, "combine", None)):
            module.dispatch = _WithLatency(module.dispatch, seconds)
            module.combine = _WithLatency(module.combine, seconds)


def _vocab_size(args: argparse.Namespace) -> int:
    return _model_args(args).vocab_size


def _batch(args: argparse.Namespace, step: int, ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic batch of one EP rank in one step: ``microbatches`` microbatches, concatenated.

    The target of each token is a fixed permutation of the vocabulary applied to
    it, which the model learns within a few steps.
    """
    vocab = _vocab_size(args)
    gen = torch.Generator().manual_seed(((args.seed * 1_000_003) + step * 1009 + ep_rank) % (2**63))
    tokens = torch.randint(0, vocab, (args.microbatches * _MICROBATCH_SIZE, _SEQ_LEN), generator=gen)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(args.seed))
    return tokens, perm[tokens]


def _loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _module_names_per_stage(args: argparse.Namespace, num_stages: int) -> list[list[str]]:
    # An MoE layer costs about twice a dense one here; the embedding and the
    # head are cheap.  Balance the most expensive stage.
    costs = [1.0] * args.dense_layers + [2.0] * args.moe_layers
    return stage_split.generate_module_names_per_stage(
        num_stages,
        len(costs),
        layer_costs=costs,
        input_weight=0.5,
        output_weight=1.0,
    )


# ---------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class DemoResult:
    """What rank 0 reports (also returned by :func:`run` in the launching process).

    Losses are per step: the mean over all microbatches of all EP ranks.
    ``*_mb_losses`` hold every microbatch loss, ``[step][ep_rank * n_mb + mb]``.
    """

    args: dict[str, Any]
    torch_version: str
    overlap_losses: list[float]
    sequential_losses: list[float]
    reference_losses: list[float]
    overlap_mb_losses: list[list[float]]
    sequential_mb_losses: list[list[float]]
    losses_equal: bool
    params_equal: bool
    reference_max_diff: float
    reference_ok: bool
    overlap_step_s: list[float]
    sequential_step_s: list[float]
    overlap_f_b_s: dict[str, list[float]]
    overlap_f_b_actions: int
    overlap_handler: str
    trace_files: list[str]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method(args: argparse.Namespace) -> str:
    # Forking skips re-importing torch in every rank (seconds each on a small
    # machine), like PyTorch's own multi-process tests do; CUDA ranks and
    # platforms without a safe fork are spawned.
    if args.backend == "gloo" and sys.platform == "linux" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _spawn_entry(local_rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    result = _run_rank(args, local_rank, args.pp * args.ep, local_rank, f"tcp://127.0.0.1:{port}")
    if result is not None:
        queue.put(dataclasses.asdict(result))


def run(args: argparse.Namespace) -> DemoResult | None:
    """Run the demo with validated ``args`` (see :func:`parse_args`).

    Spawns ``pp * ep`` local processes, or, under torchrun, runs this process's
    rank.  Returns rank 0's :class:`DemoResult` (``None`` on other ranks).
    """
    under_torchrun, world, _ = _launch_env(dict(os.environ))
    if under_torchrun:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return _run_rank(args, rank, world, local_rank, "env://")

    import torch.multiprocessing as mp

    method = _start_method(args)
    if method == "spawn":
        # As torchrun does: one intra-op thread per rank unless told otherwise
        # (read when a rank's OpenMP runtime starts; applies to every thread).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context(method).SimpleQueue()
    port = _free_port()
    mp.start_processes(
        _spawn_entry, args=(args, port, queue), nprocs=args.pp * args.ep, join=True, start_method=method
    )
    if queue.empty():
        raise RuntimeError("rank 0 finished without reporting a result")
    return DemoResult(**queue.get())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_pipelining_ext.demo``; returns the exit status."""
    args = parse_args(argv)
    result = run(args)
    if result is None:  # not rank 0 under torchrun
        return 0
    return 0 if result.losses_equal and result.params_equal and result.reference_ok else 1


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------


def _run_rank(
    args: argparse.Namespace, rank: int, world: int, local_rank: int, init_method: str
) -> DemoResult | None:
    torch.set_num_threads(1)
    # torch >= 2.10 deprecates the autograd-aware all_to_all_single the model
    # uses (it still works); one warning per rank and layer buries the output.
    warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        args.backend, init_method=init_method, rank=rank, world_size=world, timeout=_PG_TIMEOUT
    )
    try:
        return _train(args, rank, device)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, device: torch.device) -> DemoResult | None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (args.pp, args.ep), mesh_dim_names=("pp", "ep"))
    ep_group = mesh["ep"].get_group()
    ep_rank = mesh["ep"].get_local_rank()

    model = _build_model(args, ep_group, device)
    spec = _schedule_spec(args.schedule)
    names = _module_names_per_stage(args, args.pp * spec.stages_per_rank)
    if rank == 0:
        _print_header(args, names)

    runs = {
        mode: _Run(mode, args, model, mesh, ep_group, ep_rank, names, device)
        for mode in ("overlap", "sequential")
    }
    del model

    step_s: dict[str, list[float]] = {m: [] for m in runs}
    mb_losses: dict[str, list[torch.Tensor]] = {m: [] for m in runs}
    trace_files: list[str] = []
    for step in range(args.steps):
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        profile = args.trace is not None and step == args.steps - 1
        for mode in order:
            losses, dt, trace = runs[mode].train_step(step, profile=profile, trace_dir=args.trace)
            step_s[mode].append(dt)
            mb_losses[mode].append(losses)
            if trace:
                trace_files.append(trace)
        if rank == 0:
            o, s = mb_losses["overlap"][-1], mb_losses["sequential"][-1]
            print(
                f"step {step + 1:>3}/{args.steps}  loss {o.mean().item():.6f}  "
                f"step time: overlap {step_s['overlap'][-1] * 1e3:7.1f} ms, "
                f"sequential {step_s['sequential'][-1] * 1e3:7.1f} ms"
                + ("" if torch.equal(o, s) else "  LOSSES DIFFER"),
                flush=True,
            )

    params_equal = _params_equal(runs["overlap"].parts, runs["sequential"].parts, device)
    ofb = {m: _gather_floats(r.overlap_f_b_s, device) for m, r in runs.items()}
    n_ofb = runs["overlap"].n_overlap_f_b
    if args.trace is not None:
        trace_files = _finish_trace(args, rank, trace_files, device)
    if rank != 0:
        return None

    reference = _reference_losses(args)
    overlap_losses = [t.mean().item() for t in mb_losses["overlap"]]
    ref_diff = max(abs(a - b) for a, b in zip(overlap_losses, reference))
    result = DemoResult(
        args=vars(args).copy(),
        torch_version=torch.__version__,
        overlap_losses=overlap_losses,
        sequential_losses=[t.mean().item() for t in mb_losses["sequential"]],
        reference_losses=reference,
        overlap_mb_losses=[t.tolist() for t in mb_losses["overlap"]],
        sequential_mb_losses=[t.tolist() for t in mb_losses["sequential"]],
        losses_equal=all(torch.equal(a, b) for a, b in zip(mb_losses["overlap"], mb_losses["sequential"])),
        params_equal=params_equal,
        reference_max_diff=ref_diff,
        # float rounding: reduction orders differ (all-reduce, all-to-all, batching)
        reference_ok=math.isfinite(ref_diff) and ref_diff <= _REFERENCE_RTOL * max(1.0, abs(reference[-1])),
        overlap_step_s=step_s["overlap"],
        sequential_step_s=step_s["sequential"],
        overlap_f_b_s=ofb,
        overlap_f_b_actions=n_ofb,
        overlap_handler=runs["overlap"].handler_name,
        trace_files=trace_files,
    )
    if args.trace is not None:
        summary = os.path.join(args.trace, "summary.json")
        result.trace_files.append(summary)
        with open(summary, "w") as f:
            json.dump(dataclasses.asdict(result), f, indent=1)
    _print_summary(result)
    return result


class _Run:
    """One training run (``overlap`` or ``sequential``): stage models, schedule, optimizer."""

    def __init__(
        self,
        mode: str,
        args: argparse.Namespace,
        model: nn.Module,
        mesh: Any,
        ep_group: dist.ProcessGroup,
        ep_rank: int,
        names: list[list[str]],
        device: torch.device,
    ) -> None:
        from torch.distributed.pipelining import schedules

        self.mode = mode
        self.args = args
        self.ep_group = ep_group
        self.ep_rank = ep_rank
        self.ep_size = dist.get_world_size(ep_group)
        cls = schedules.get_schedule_class(args.schedule)
        # split_module copies what each stage keeps, so the two runs start
        # from the same weights without sharing any.
        self.stages, self.parts = stage_split.pipeline_module_split(model, mesh["pp"], cls, device, names)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        kwargs = dict(n_microbatches=args.microbatches, loss_fn=_loss_fn, scale_grads=True)
        if issubclass(cls, schedules.PipelineScheduleSingle):
            self.schedule = cls(self.stages[0], **kwargs)
        else:
            self.schedule = cls(self.stages, **kwargs)
        self.expert_params = [p for part in self.parts for n, p in part.named_parameters() if is_expert_param(n)]
        self.dense_params = [p for part in self.parts for n, p in part.named_parameters() if not is_expert_param(n)]
        self.optimizer = torch.optim.AdamW(
            [p for part in self.parts for p in part.parameters()], lr=_LR, weight_decay=0.0, foreach=False
        )
        self.overlap_f_b_s: list[float] = []
        self.n_overlap_f_b = 0
        self.handler_name = "-"
        self._ofb_times: list[float] = []
        self._install_overlap_f_b()

    # -- OVERLAP_F_B -------------------------------------------------------

    def _install_overlap_f_b(self) -> None:
        from torch.distributed.pipelining import schedules

        sched = self.schedule
        if not isinstance(sched, schedules._PipelineScheduleRuntime):
            return
        order = getattr(sched, "pipeline_order_with_comms", None) or sched.pipeline_order
        self.n_overlap_f_b = sum(
            1 for a in order.get(sched.rank, []) if a is not None and a.computation_type == schedules.OVERLAP_F_B
        )
        if self.mode == "overlap":
            inner = sched._comp_type_to_function_map.get(schedules.OVERLAP_F_B)
            if inner is None:
                inner = _sequential_overlap_f_b
        else:
            inner = _sequential_overlap_f_b
        self.handler_name = f"{inner.__module__}.{inner.__qualname__}"
        times = []

        def timed(action, ctx):
            t0 = time.perf_counter()
            inner(action, ctx)
            times.append(time.perf_counter() - t0)

        self._ofb_times = times
        sched.register_custom_function(schedules.OVERLAP_F_B, timed)

    # -- one step ------------------------------------------------------------

    def train_step(
        self, step: int, *, profile: bool = False, trace_dir: str | None = None
    ) -> tuple[torch.Tensor, float, str | None]:
        """Run one step; returns (every microbatch loss of all EP ranks, seconds, trace file)."""
        args = self.args
        tokens, labels = _batch(args, step, self.ep_rank)
        device = self.stages[0].device
        tokens, labels = tokens.to(device), labels.to(device)
        self._ofb_times.clear()
        prof = _profiler(device) if profile else contextlib.nullcontext()
        dist.barrier()
        t0 = time.perf_counter()
        with prof:
            self.optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            inputs = (tokens,) if self.has_first else ()
            self.schedule.step(*inputs, target=labels if self.has_last else None, losses=losses)
            self._sync_grads()
            self.optimizer.step()
            all_losses = self._gather_losses(losses, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        self.overlap_f_b_s.append(sum(self._ofb_times))
        trace = None
        if profile:
            trace = os.path.join(trace_dir, f"trace_{self.mode}_rank{dist.get_rank()}.json")
            prof.export_chrome_trace(trace)
        return all_losses, dt, trace

    def _sync_grads(self) -> None:
        # Expert gradients already hold every EP rank's tokens; the rest is
        # data parallel over the EP group.
        if self.ep_size == 1:
            return
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.ep_size)
        grads = [p.grad for p in self.dense_params if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.ep_group)
            flat.div_(self.ep_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _gather_losses(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Every microbatch loss of every EP rank, on all ranks: ``[ep * n_mb]`` in EP-rank order."""
        n_mb = self.args.microbatches
        local = torch.full((n_mb + 1,), 0.0, dtype=torch.float32, device=device)
        if self.has_last:
            local[:n_mb] = torch.stack([l.detach().float().reshape(()) for l in losses])
            local[n_mb] = 1.0
        out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(out, local)
        by_ep: dict[int, torch.Tensor] = {}
        for r, t in enumerate(out):
            if t[n_mb].item() == 1.0:
                by_ep[r % self.ep_size] = t[:n_mb].cpu()
        return torch.cat([by_ep[e] for e in range(self.ep_size)])


def _sequential_overlap_f_b(action: Any, ctx: Any) -> None:
    """OVERLAP_F_B as upstream torch runs it: the sub-actions one after the other.

    Uses the package's per-action bookkeeping (``_schedule_runtime.run_action``),
    the same the overlapped handler uses; when profiling, each sub-action gets
    the range name the overlapped handler gives it.
    """
    from torch.distributed.pipelining import schedules

    from torch_pipelining_ext._schedule_runtime import run_action

    profiling = torch.autograd.profiler._is_profiler_enabled
    for sub in action.sub_actions:
        if profiling:
            side = "forward" if sub.computation_type == schedules.FORWARD else "backward"
            with record_function(f"OVERLAP_F_B {side} {sub}"):
                run_action(sub, ctx)
        else:
            run_action(sub, ctx)


def _params_equal(parts_a: list[nn.Module], parts_b: list[nn.Module], device: torch.device) -> bool:
    ok = all(
        torch.equal(a, b)
        for pa, pb in zip(parts_a, parts_b)
        for a, b in zip(pa.parameters(), pb.parameters())
    )
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _gather_floats(values: list[float], device: torch.device) -> list[float]:
    """Per step, the maximum over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


def _reference_losses(args: argparse.Namespace) -> list[float]:
    """Train the unsplit model in this process on all EP ranks' data; per-step mean losses.

    Same seed, same microbatches, same scaling as the pipelined run: every
    microbatch loss is divided by ``microbatches * ep`` before its backward.
    """
    model = _build_model(args, None, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.0, foreach=False)
    n = args.microbatches * args.ep
    out = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ep_rank in range(args.ep):
            tokens, labels = _batch(args, step, ep_rank)
            for x, y in zip(tokens.chunk(args.microbatches), labels.chunk(args.microbatches)):
                loss = _loss_fn(model(x), y)
                (loss / n).backward()
                total += loss.item()
        opt.step()
        out.append(total / n)
    return out


# ---------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------


def _profiler(device: torch.device) -> Any:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import profile, ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # profile_all_threads: the OVERLAP_F_B worker thread's ranges too.
    return profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))


def _finish_trace(args: argparse.Namespace, rank: int, files: list[str], device: torch.device) -> list[str]:
    from torch_pipelining_ext.demo import _timeline

    # Every rank extracts its phases; rank 0 draws them all (works across nodes).
    phases = {os.path.basename(f): _timeline.phases_from_chrome_trace(f) for f in files}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, phases)
    if rank != 0:
        return files
    merged: dict[str, Any] = {}
    for g in gathered:
        merged.update(g)
    png = os.path.join(args.trace, "timeline.png")
    title = (
        f"Schedule{args.schedule}, PP={args.pp} x EP={args.ep}, {args.microbatches} microbatches, "
        f"last step (torch {torch.__version__})"
    )
    try:
        _timeline.plot_timeline(merged, png, title=title)
    except ImportError:
        print(
            "note: matplotlib is not installed, so no PNG timeline was drawn "
            "(pip install 'torch_pipelining_ext[plot]'); the Chrome traces are in " + args.trace,
            flush=True,
        )
        return sorted(os.path.join(args.trace, f) for f in merged)
    return sorted(os.path.join(args.trace, f) for f in merged) + [png]


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _print_header(args: argparse.Namespace, names: list[list[str]]) -> None:
    print(
        f"torch {torch.__version__}, {args.backend}, {args.pp * args.ep} ranks: PP={args.pp} x EP={args.ep}; "
        f"Schedule{args.schedule}, {args.microbatches} microbatches of {_MICROBATCH_SIZE}x{_SEQ_LEN} tokens "
        f"per EP rank; {args.dense_layers} dense + {args.moe_layers} MoE layers, {args.experts} experts "
        f"({args.experts // args.ep} per EP rank)",
        flush=True,
    )
    for i, stage in enumerate(names):
        print(f"  stage {i}: {', '.join(stage)}", flush=True)


def _median_ms(values: list[float]) -> float:
    # The first step includes one-time set-up (shape inference, thread pools);
    # the profiled step includes the profiler.
    vals = values[1:] if len(values) > 1 else values
    return statistics.median(vals) * 1e3


def _print_summary(r: DemoResult) -> None:
    args = r.args
    n_steps = len(r.overlap_losses)
    n_mb = len(r.overlap_mb_losses[0])
    t_o, t_s = _median_ms(r.overlap_step_s), _median_ms(r.sequential_step_s)
    a_o, a_s = _median_ms(r.overlap_f_b_s["overlap"]), _median_ms(r.overlap_f_b_s["sequential"])
    rows = [
        ("", "overlap", "sequential", "reference"),
        (
            f"final loss (step {n_steps})",
            f"{r.overlap_losses[-1]:.6f}",
            f"{r.sequential_losses[-1]:.6f}",
            f"{r.reference_losses[-1]:.6f}",
        ),
        ("step time (median)", f"{t_o:.1f} ms", f"{t_s:.1f} ms", "-"),
    ]
    if r.overlap_f_b_actions:
        rows.append(("  in OVERLAP_F_B actions", f"{a_o:.1f} ms", f"{a_s:.1f} ms", "-"))
    width = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [""]
    for row in rows:
        cells = [cell.ljust(width[i]) if i == 0 else cell.rjust(width[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append(
        f"overlap vs sequential: losses {'identical' if r.losses_equal else 'DIFFERENT'} (torch.equal on all "
        f"{n_steps} x {n_mb} microbatch losses), parameters after step {n_steps} "
        f"{'identical' if r.params_equal else 'DIFFERENT'}"
    )
    lines.append(
        f"vs single-process reference: max |loss difference| over {n_steps} steps {r.reference_max_diff:.1e} "
        + ("(float rounding)" if r.reference_ok else "(UNEXPECTEDLY LARGE)")
    )
    medians = {1: "step 1", 2: "step 2"}.get(n_steps, f"medians of steps 2-{n_steps}")
    if not r.overlap_f_b_actions:
        lines.append(f"Schedule{args['schedule']} has no OVERLAP_F_B actions here: both runs are sequential")
    elif t_s > 0 and a_s > 0:
        lines.append(
            f"time overlap / sequential: {t_o / t_s:.2f} per step, {a_o / a_s:.2f} inside the "
            f"{r.overlap_f_b_actions} OVERLAP_F_B actions of each rank ({medians}, slowest rank)"
        )
        if r.overlap_handler != _PACKAGE_HANDLER:
            lines.append(
                "note: the package's OVERLAP_F_B handler is not installed (TORCH_PIPELINING_EXT_OVERLAP=0, or "
                "torch_pipelining_ext unpatched): the overlap run was sequential too"
            )
        elif args["comm_latency_ms"] == 0 and args["backend"] == "gloo" and args["ep"] > 1 and args["moe_layers"]:
            lines.append(
                "note: all-to-all over loopback takes next to no time, so there is little communication to hide; "
                "--comm-latency-ms 5 stands in for a slower link"
            )
    if r.trace_files:
        names = ", ".join(os.path.basename(f) for f in r.trace_files)
        lines.append(f"trace ({args['trace']}): {names}")
    print("\n".join(lines), flush=True)
