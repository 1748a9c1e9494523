"""What scaling only the current step's gradients costs (patch 0002, ``_grad_scaling.py``).

    python tools/upstream/bench_scale_grads.py [--params 1e6,16e6,64e6] [--repeat 5]

When a step starts with gradients carried over from earlier steps (gradient
accumulation across ``step()`` calls), the fix keeps a copy of them for the
step and ``scale_grads`` scales only the difference: one ``clone`` at the
start of the step, one ``sub_`` and one ``add_`` at the end, on top of torch's
``div_``.  With ``zero_grad()`` before every step nothing is copied.  For each
size this times, side by side in one run on one stage holding one parameter
of that many float32 elements:

* ``stock``: torch's ``clear_runtime_states`` + ``scale_grads`` (``div_``),
  as they are after ``torch_pipelining_ext.unpatch()``;
* ``fixed``: the same two methods of ``_PipelineStageBase`` after
  ``torch_pipelining_ext.patch()``, with a gradient carried in;
* ``adamw``: one ``torch.optim.AdamW(foreach=True)`` step on the same
  parameter, the per-step cost every training loop pays anyway.

The last line is machine-readable: ``overhead_vs_adamw`` is
``(fixed - stock) / adamw`` for the largest size, ``extra_bytes`` the memory
the copy holds during a step (the size of the carried gradients).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
from torch.distributed.pipelining.stage import _PipelineStageBase

import torch_pipelining_ext


def _stage_methods() -> tuple[object, object]:
    """``_PipelineStageBase``'s ``clear_runtime_states`` and ``scale_grads`` as they are now."""
    return _PipelineStageBase.clear_runtime_states, _PipelineStageBase.scale_grads


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params", default="1e6,16e6,64e6", help="comma-separated parameter sizes"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch_pipelining_ext.unpatch()
    stock_clear, stock_scale = _stage_methods()
    torch_pipelining_ext.patch()
    status = {r.name: r.status.value for r in torch_pipelining_ext.patch_report()}[
        "scale_grads_per_step"
    ]
    fixed_clear, fixed_scale = _stage_methods()
    n = args.microbatches
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeat}, {n} microbatches; "
        f"patch scale_grads_per_step: {status}"
    )
    print(
        f"{'params':>10} {'stock ms':>9} {'fixed ms':>9} {'adamw ms':>9} {'(fixed-stock)/adamw':>20}"
    )
    last = None
    for size in (int(float(s)) for s in args.params.split(",")):
        param = torch.nn.Parameter(torch.randn(size))
        param.grad = torch.randn(size)
        # the attributes the two methods use, for one stage holding one parameter
        stage = types.SimpleNamespace(
            submod=torch.nn.Module(),
            has_backward=True,
            fwd_cache={},
            output_chunks=[],
            args_recv_info={},
        )
        stage.submod.p = param
        optimizer = torch.optim.AdamW([param], foreach=True)
        optimizer.step()  # state allocated before timing

        def stock_step() -> None:
            stock_clear(stage)
            stock_scale(stage, n)

        def fixed() -> None:
            fixed_clear(stage)
            fixed_scale(stage, n)

        stock = _best(stock_step, args.repeat)
        patched = _best(fixed, args.repeat)
        adamw = _best(optimizer.step, args.repeat)
        ratio = (patched - stock) / adamw
        print(
            f"{size:>10} {stock * 1e3:>9.2f} {patched * 1e3:>9.2f} {adamw * 1e3:>9.2f} {ratio:>20.2f}"
        )
        last = (size, ratio, size * param.element_size())
    size, ratio, extra = last
    print(
        f"bench_scale_grads params={size} overhead_vs_adamw={ratio:.2f} extra_bytes={extra}"
    )


if __name__ == "__main__":
    main()
