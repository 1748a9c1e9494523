"""What the package's ``scale_grads`` costs against stock torch's (patch 0003).

    python tools/upstream/bench_scale_grads.py [--params 1e6,16e6,64e6] [--repeat 5]

When a step starts with gradients carried over from earlier steps (gradient
accumulation across ``step()`` calls), stock torch divides them again; the
package scales each microbatch's loss by ``1/n`` instead and divides nothing
(see ``[Note: scale_grads scales the loss]``).  For each size this runs, side by
side in one run, a one-stage ``ScheduleGPipe`` step (world size 1, gloo) whose
stage holds one float32 parameter of that many elements, with a gradient
carried in:

* ``stock``: after ``torch_pipelining_ext.unpatch()``;
* ``fixed``: after ``torch_pipelining_ext.patch()``;
* ``adamw``: one ``torch.optim.AdamW(foreach=True)`` step on the same
  parameter, the per-step cost every training loop pays anyway;
* ``add_``: one in-place addition over the parameter, timed alone (what the
  earlier design of the fix, which set carried gradients aside, added).

Stock and fixed steps alternate (after each switch one step runs untimed:
the first step after ``patch()`` or ``unpatch()`` pays one-time costs that
would be counted against whichever side comes second).  Each step is
profiled once for memory (``torch.profiler``, CPU): ``extra peak`` is how much
higher the fixed step's peak of live allocations is than the stock step's.  The last line is
machine-readable, for the largest size: ``step_ratio`` is fixed / stock (whole
steps), ``overhead_vs_adamw`` is ``add_ / adamw``, ``extra_peak_bytes`` is
``extra peak``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import torch_pipelining_ext


class _Scale(torch.nn.Module):
    """``x * w`` summed over ``w``'s elements: a gradient of ``w``'s size, little else."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum(-1, keepdim=True)


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_bytes(fn) -> int:
    """The peak of the bytes ``fn`` allocated on the CPU and had not freed yet."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    events = sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage),
        key=lambda e: e.time_range.start,
    )
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _measure(size: int, n: int, repeat: int) -> tuple[float, ...]:
    """Seconds of a stock step, a fixed step, an AdamW step, the added ``add_``;
    the fixed step's extra peak bytes."""
    module = _Scale(size)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n, loss_fn=lambda out, y: (out - y).square().mean())
    x, y = torch.randn(n, 1), torch.randn(n, 1)
    schedule.step(x, target=y)  # gradients carried into every step below
    optimizer = torch.optim.AdamW(module.parameters(), foreach=True)
    optimizer.step()  # its state allocated before timing

    def step() -> None:
        schedule.step(x, target=y)

    def timed(patched: bool) -> float:
        (torch_pipelining_ext.patch if patched else torch_pipelining_ext.unpatch)()
        step()  # the first step after patch() / unpatch() warms up again: not timed
        return _median_seconds(step, 1)

    timed(False), timed(True)  # warm-up
    # stock and fixed steps alternate, so that drift affects both alike
    stock, fixed = (
        statistics.median(ts)
        for ts in zip(*((timed(False), timed(True)) for _ in range(repeat)))
    )
    torch_pipelining_ext.unpatch()
    stock_bytes = _peak_bytes(step)
    torch_pipelining_ext.patch()
    fixed_bytes = _peak_bytes(step)
    adamw = _median_seconds(optimizer.step, repeat)
    grad, other = module.w.grad, module.w.grad.clone()
    added = _median_seconds(lambda: grad.add_(other), repeat)
    return stock, fixed, adamw, added, fixed_bytes - stock_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params", default="1e6,16e6,64e6", help="comma-separated parameter sizes"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
        try:
            _report(args)
        finally:
            dist.destroy_process_group()


def _report(args: argparse.Namespace) -> None:
    status = {r.name: r.status.value for r in torch_pipelining_ext.patch_report()}
    n = args.microbatches
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
        f"{args.repeat}, {n} microbatches; patch scale_grads_per_step: "
        f"{status['scale_grads_per_step']}"
    )
    print(
        f"{'params':>10} {'stock ms':>9} {'fixed ms':>9} {'fixed/stock':>11} "
        f"{'adamw ms':>9} {'add_ ms':>8} {'add_/adamw':>10} {'extra peak':>12}"
    )
    for size in (int(float(s)) for s in args.params.split(",")):
        stock, fixed, adamw, added, extra = _measure(size, n, args.repeat)
        print(
            f"{size:>10} {stock * 1e3:>9.2f} {fixed * 1e3:>9.2f} {fixed / stock:>11.3f} "
            f"{adamw * 1e3:>9.2f} {added * 1e3:>8.2f} {added / adamw:>10.2f} {extra:>12}"
        )
    print(
        f"bench_scale_grads params={size} step_ratio={fixed / stock:.3f} "
        f"overhead_vs_adamw={added / adamw:.2f} extra_peak_bytes={extra}"
    )


if __name__ == "__main__":
    main()
