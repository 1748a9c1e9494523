"""What ``tools/bench_hf_overlap.py`` and ``tools/bench_moe_balance.py``
share with the demo: starting the ranks, the environment check, and (from
:mod:`torch_pipelining_ext.train.compare`, their home) the simulated link
the expert-parallel all-to-alls run over and agreeing across ranks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch_pipelining_ext import hf, launcher
from torch_pipelining_ext.train.compare import (
    all_ranks,
    all_to_alls_per_step,
    calibrate_link_latency,
    SimulatedLink,
)


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


def _with_args_first(
    rank: int, fn: Callable[[argparse.Namespace, int], Any], args: argparse.Namespace
) -> Any:
    return fn(args, rank)
