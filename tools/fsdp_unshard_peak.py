"""Peak unsharded FSDP2 parameter bytes of a pipeline rank: overlapped OVERLAP_F_B vs the sequential path.

PP=2 x DP=2 on 4 gloo/CPU ranks, ScheduleDualPipeV over 4 stages of
``FSDPMLPStage`` (``fully_shard`` on every layer and on the stage root,
resharded after forward), one step each, side by side in the same processes:

* ``stock``      -- torch without this package (``torch_pipelining_ext.unpatch()``;
  its split-backward gradients are wrong, see ``tools/fsdp_pp_gradients.py``);
* ``upstream``   -- the schedule built with ``TORCH_PIPELINING_EXT_OVERLAP=0``:
  OVERLAP_F_B's sub-actions run one after the other with torch's per-action
  semantics (``_schedule_runtime.run_action``, as every plain action): wait
  for the root's unshard and let every nested module all-gather in its own
  pre-forward / pre-backward hook;
* ``overlapped`` -- the package's concurrent OVERLAP_F_B, which unshards every
  FSDP module of both sub-actions' stages before either computes, so that
  neither thread issues a data-parallel collective while the other may
  (their order would then depend on timing).

The unsharded bytes are the storage of every ``FSDPParam``'s all-gather
output on the rank, sampled after each allocation and each free.  Prints the
peak of each path in bytes and in layers (one nested ``fully_shard`` layer's
unsharded bytes), then a machine-readable last line::

    stock_peak_layers=… upstream_peak_layers=… overlapped_peak_layers=… extra_layers=… stage_layers=…

    python tools/fsdp_unshard_peak.py [--layers 8] [--dim 256]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


_ROOT = Path(__file__).resolve().parents[1]
PP, DP, N_STAGES, N_MICROBATCHES, MB_SIZE = 2, 2, 4, 4, 2


def _worker(rank: int, args: argparse.Namespace) -> list[dict]:
    """One rank's peaks (a process group of every rank is initialised);
    returns every rank's, by rank."""
    sys.path[:0] = [str(_ROOT), str(_ROOT / "test" / "distributed" / "pipelining")]
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    import torch_pipelining_ext
    from model_registry import FSDPMLPStage, fully_shard_stage

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids = [pp_rank, N_STAGES - 1 - pp_rank]

    params: list = []  # every FSDPParam of this rank's stages
    peak = [0]

    def unsharded_bytes() -> int:
        return sum(
            t.untyped_storage().nbytes() for fp in params for t in fp.all_gather_outputs
        )

    def sampled(fn):
        def wrapper(self, *a, **k):
            out = fn(self, *a, **k)
            peak[0] = max(peak[0], unsharded_bytes())
            return out

        return wrapper

    for name in (
        "init_all_gather_outputs",
        "alloc_all_gather_outputs",
        "free_unsharded_param",
    ):
        setattr(
            _fsdp_param.FSDPParam, name, sampled(getattr(_fsdp_param.FSDPParam, name))
        )

    def build(overlap: bool):
        torch.manual_seed(0)
        modules = [
            fully_shard_stage(FSDPMLPStage(args.dim, args.layers), mesh["dp"])
            for _ in stage_ids
        ]
        stages = [
            PipelineStage(m, i, N_STAGES, "cpu", group=mesh["pp"].get_group())
            for m, i in zip(modules, stage_ids)
        ]
        if not overlap:
            os.environ["TORCH_PIPELINING_EXT_OVERLAP"] = (
                "0"  # read when the schedule is built
            )
        try:
            schedule = ScheduleDualPipeV(
                stages, N_MICROBATCHES, loss_fn=torch.nn.functional.mse_loss
            )
        finally:
            os.environ.pop("TORCH_PIPELINING_EXT_OVERLAP", None)
        return modules, schedule

    x = torch.randn(
        N_MICROBATCHES * MB_SIZE, args.dim, generator=torch.Generator().manual_seed(0)
    )
    y = torch.randn(
        N_MICROBATCHES * MB_SIZE, args.dim, generator=torch.Generator().manual_seed(1)
    )
    result = {}
    for mode in ("stock", "upstream", "overlapped"):
        if mode == "stock":
            torch_pipelining_ext.unpatch()
        elif mode == "upstream":
            torch_pipelining_ext.patch()
        modules, schedule = build(overlap=mode == "overlapped")
        params[:] = [
            fp
            for m in modules
            for s in [m, *m.layers]
            for fp in s._get_fsdp_state()._fsdp_param_group.fsdp_params
        ]
        for _ in range(
            2
        ):  # the second step is measured (the first one initialises FSDP lazily)
            peak[0] = 0
            if pp_rank == 0:
                schedule.step(x, target=y, losses=[])
            else:
                schedule.step(target=y, losses=[])
        result[mode] = peak[0]
        for m in modules:
            m.zero_grad(set_to_none=True)
    # one nested layer, unsharded: a Linear(dim, dim)
    result["layer"] = (args.dim * args.dim + args.dim) * 4
    result["stage"] = (
        sum(p.numel() for p in FSDPMLPStage(args.dim, args.layers).parameters()) * 4
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return everyone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=8, help="nested fully_shard layers per stage"
    )
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()
    sys.path.insert(0, str(_ROOT))
    from torch_pipelining_ext import launcher

    results = launcher.launch(_worker, PP * DP, args, threads_per_rank=1)
    layer, stage = results[0]["layer"], results[0]["stage"]
    print(
        f"{args.layers} nested layers per stage, two stages per rank; one layer unsharded = {layer} bytes"
    )
    print(
        f"{'rank':>4}  {'stock peak':>12}  {'upstream peak':>14}  {'overlapped peak':>16}  {'extra layers':>12}"
    )
    for rank, r in enumerate(results):
        extra = (r["overlapped"] - r["stock"]) / layer
        print(
            f"{rank:>4}  {r['stock']:>12}  {r['upstream']:>14}  {r['overlapped']:>16}  {extra:>12.2f}"
        )
    stock = max(r["stock"] for r in results)
    up = max(r["upstream"] for r in results)
    ov = max(r["overlapped"] for r in results)
    print(
        f"stock_peak_layers={stock / layer:.2f} upstream_peak_layers={up / layer:.2f} "
        f"overlapped_peak_layers={ov / layer:.2f} extra_layers={(ov - stock) / layer:.2f} "
        f"stage_layers={stage / layer:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
