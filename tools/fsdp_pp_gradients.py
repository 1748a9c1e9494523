"""FSDP2 x pipeline gradients against a single-process reference, side by side.

Runs PP=2 x DP=2 on 4 gloo/CPU ranks (the setting of
test/distributed/pipelining/test_schedule_fsdp.py: 4 stages of
``FSDPMLPStage``, ``fully_shard`` on every layer and on the stage root, both
data-parallel replicas fed the same batch) for every multi-stage schedule,
once per configuration, and prints for each stage the range of
``|grad| / |reference grad|`` over its parameters after one step and after a
second step without ``zero_grad`` (1.0000 everywhere is right), and how many
parameters got no gradient.

Configurations (each in fresh processes):

* ``torch``     -- the package imported with ``TORCH_PIPELINING_EXT_DISABLE=1``;
* ``no-fsdp-fix`` -- the package without its FSDP split-backward fix;
* ``no-scale-fix`` -- the package without its per-step gradient scaling;
* ``package``   -- everything applied.

    python tools/fsdp_pp_gradients.py [--configs torch,package] [--schedules ScheduleDualPipeV]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


_ROOT = Path(__file__).resolve().parents[1]
_CONFIGS = {
    "torch": {"TORCH_PIPELINING_EXT_DISABLE": "1"},
    "no-fsdp-fix": {"TORCH_PIPELINING_EXT_DISABLE_FSDP_FIX": "1"},
    "no-scale-fix": {"TORCH_PIPELINING_EXT_DISABLE_SCALE_GRADS_FIX": "1"},
    "package": {},
}
_SCHEDULES = [
    "ScheduleDualPipeV",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleavedZeroBubble",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
]
DIM, N_MICROBATCHES, MB_SIZE, PP, DP = 8, 4, 2, 2, 2
N_STAGES = 2 * PP


def _worker(rank: int, schedules: list[str], out_dir: str) -> None:
    """One rank of a configuration (its process group is initialised):
    writes the gradient ratios of its stages (data-parallel rank 0)."""
    sys.path[:0] = [str(_ROOT), str(_ROOT / "test" / "distributed" / "pipelining")]
    import torch
    import torch.nn as nn

    import torch_pipelining_ext  # noqa: F401
    from model_registry import FSDPMLPStage, fully_shard_stage
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sched

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    loss_fn = nn.functional.mse_loss
    results = []
    for name in schedules:
        schedule_class = getattr(sched, name)
        try:
            torch.manual_seed(0)
            ref = nn.Sequential(*(FSDPMLPStage(DIM) for _ in range(N_STAGES)))
            v_shape = name in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble")
            indices = (
                [pp_rank, N_STAGES - 1 - pp_rank]
                if v_shape
                else [pp_rank, pp_rank + PP]
            )
            modules = [
                fully_shard_stage(copy.deepcopy(ref[i]), mesh["dp"]) for i in indices
            ]
            stages = [
                PipelineStage(
                    m, i, N_STAGES, torch.device("cpu"), group=mesh["pp"].get_group()
                )
                for m, i in zip(modules, indices)
            ]
            schedule = schedule_class(stages, N_MICROBATCHES, loss_fn=loss_fn)
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
            y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
            for step in (1, 2):
                schedule.step(x, target=y)
                for x_mb, y_mb in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)):
                    (loss_fn(ref(x_mb), y_mb) / N_MICROBATCHES).backward()
                for module, i in zip(modules, indices):
                    ratios, missing = [], 0
                    for p, ref_p in zip(module.parameters(), ref[i].parameters()):
                        if p.grad is None:
                            missing += 1
                            continue
                        grad = p.grad.full_tensor()
                        ratios.append((grad.norm() / ref_p.grad.norm()).item())
                    results.append(
                        dict(
                            schedule=name,
                            step=step,
                            stage=i,
                            ratios=ratios,
                            missing=missing,
                        )
                    )
        except Exception as e:
            results.append(
                dict(
                    schedule=name,
                    error=f"{type(e).__name__}: {str(e).splitlines()[0][:90]}",
                )
            )
            traceback.print_exc()
            break  # the process group may be unusable now
    if dp_rank == 0:
        Path(out_dir, f"pp{pp_rank}.json").write_text(json.dumps(results))


def _run_config(config: str, schedules: list[str]) -> list[dict]:
    """The ranks of one configuration, in a process of its own (the package's
    switches are read when it is imported), started by the launcher."""
    import subprocess

    with tempfile.TemporaryDirectory() as out_dir:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TORCH_PIPELINING_EXT_DISABLE")
        }
        env.update(_CONFIGS[config])
        code = (
            f"import sys, datetime; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(_ROOT)!r}]; "
            "from torch_pipelining_ext import launcher; import fsdp_pp_gradients as t; "
            f"launcher.launch(t._worker, {PP * DP:d}, {schedules!r}, {out_dir!r}, "
            "timeout=datetime.timedelta(seconds=60), threads_per_rank=1)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        results = []
        for f in sorted(Path(out_dir).glob("pp*.json")):
            results.extend(json.loads(f.read_text()))
        if not results:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results = [dict(schedule=s, error=tail[:90]) for s in schedules]
        return results


def _cell(rows: list[dict], schedule: str, stage: int, step: int) -> str:
    for r in rows:
        if r["schedule"] == schedule and "error" in r:
            return "error"
        if (
            r["schedule"] == schedule
            and r.get("stage") == stage
            and r.get("step") == step
        ):
            lo, hi = (
                (min(r["ratios"]), max(r["ratios"]))
                if r["ratios"]
                else (float("nan"),) * 2
            )
            text = f"{lo:.4f}" if abs(hi - lo) < 5e-5 else f"{lo:.4f}-{hi:.4f}"
            return text + (f" ({r['missing']} none)" if r["missing"] else "")
    return "-"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="torch,no-fsdp-fix,no-scale-fix,package")
    parser.add_argument("--schedules", default=",".join(_SCHEDULES))
    args = parser.parse_args()
    configs, schedules = args.configs.split(","), args.schedules.split(",")
    table = {c: _run_config(c, schedules) for c in configs}
    print(
        f"torch {torch.__version__}: |grad| / |reference grad| per parameter (min-max over a stage's parameters)"
    )
    width = 26
    print(
        f"{'schedule':<30} {'stage':>5} {'step':>4}  "
        + "".join(f"{c:<{width}}" for c in configs)
    )
    for schedule in schedules:
        for stage in range(N_STAGES):
            for step in (1, 2):
                cells = "".join(
                    f"{_cell(table[c], schedule, stage, step):<{width}}"
                    for c in configs
                )
                print(f"{schedule:<30} {stage:>5} {step:>4}  {cells}")
    for c in configs:
        for r in table[c]:
            if "error" in r:
                print(f"{c}: {r['schedule']}: {r['error']}")


if __name__ == "__main__":
    main()
