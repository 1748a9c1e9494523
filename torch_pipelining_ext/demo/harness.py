"""What the demo and ``tools/bench_hf_overlap.py`` share: starting the ranks,
the simulated link the expert-parallel all-to-alls run over, and agreeing
across ranks.

The link is an :class:`torch_pipelining_ext.hf.ExpertParallelTransport`: every
token all-to-all also waits the link's latency, standing in for a slower
link than the ranks have (loopback), and the time spent in the all-to-alls
can be measured.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_pipelining_ext import hf, launcher


__all__ = [
    "SimulatedLink",
    "all_ranks",
    "all_to_alls_per_step",
    "calibrate_link_latency",
    "cpu_cores",
    "fused_experts_problem",
    "launch",
]

_PG_TIMEOUT = timedelta(seconds=300)
_CALIBRATION_REPEATS = 20


# ---------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------


under_torchrun = launcher.under_torchrun
cpu_cores = launcher.cpu_cores


def fused_experts_problem() -> str | None:
    """Why this environment cannot run the demo's expert parallelism (None if it can)."""
    try:
        import transformers
    except ImportError:
        return "the demo needs transformers 5.x: pip install 'torch_pipelining_ext[hf]'"
    if not hf.has_fused_experts():
        return (
            f"the demo needs transformers 5.x (fused experts, which expert parallelism shards); transformers "
            f"{transformers.__version__} is installed: pip install 'transformers>=5,<6'"
        )
    return None


def launch(
    args: argparse.Namespace, fn: Callable[[argparse.Namespace, int], Any]
) -> Any:
    """Run ``fn(args, rank)`` on every rank (torchrun's, or ``pp * ep`` local
    gloo processes, one intra-op thread each) with
    :func:`torch_pipelining_ext.launcher.launch`; returns what it returned on
    rank 0 (under torchrun: on this rank)."""
    return launcher.launch(
        _with_args_first,
        args.pp * args.ep,
        fn,
        args,
        timeout=_PG_TIMEOUT,
        threads_per_rank=1,
    )


def _with_args_first(rank: int, fn: Callable, args: argparse.Namespace) -> Any:
    return fn(args, rank)


# ---------------------------------------------------------------------------
# The simulated link
# ---------------------------------------------------------------------------


def calibrate_link_latency(
    parts: list[torch.nn.Module], tokens_per_microbatch: int, top_k: int
) -> float:
    """Seconds one MoE layer's local experts compute on one microbatch
    (forward; each rank receives ``tokens * top_k`` slots, spread evenly
    over the experts): the fastest of a few repeats, the mean over all ranks."""
    module, shard = hf.expert_parallel_shards(parts)[0]
    per_expert = max(1, tokens_per_microbatch * top_k // shard.num_experts)
    counts = torch.full((shard.size, shard.local), per_expert)
    tokens = torch.randn(
        int(counts.sum()),
        module.gate_up_proj.shape[-1],
        dtype=module.gate_up_proj.dtype,
    )
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


def all_to_alls_per_step(parts: list[torch.nn.Module], microbatches: int) -> int:
    """Token all-to-alls this rank runs per step: every microbatch passes each
    local MoE layer once forward (dispatch, combine) and once backward (the same two)."""
    return 4 * microbatches * len(hf.expert_parallel_shards(parts))


class SimulatedLink(hf.ExpertParallelTransport):
    """The expert-parallel transport of the demo and the benchmark.

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
        self, output, input, output_split_sizes, input_split_sizes, group
    ) -> None:
        with self._timed():
            super().tokens(output, input, output_split_sizes, input_split_sizes, group)
            if self.latency_s:
                time.sleep(self.latency_s)


# ---------------------------------------------------------------------------
# Across ranks
# ---------------------------------------------------------------------------


def all_ranks(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
