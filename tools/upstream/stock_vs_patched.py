"""Train every multi-stage schedule of the installed torch; compare two such runs bitwise.

    python stock_vs_patched.py --out FILE        # train, save the results to FILE
    python stock_vs_patched.py --compare A B     # exit 1 unless A and B are equal bitwise

``check.sh`` runs it for a refactor patch on torch 2.15.0 without and with the
patch (the two trees first on ``PYTHONPATH``): every schedule class that
``_PipelineScheduleRuntime`` runs, a CSV schedule with OVERLAP_F_B, FSDP2
stages, a step with ``return_outputs=False`` and ``loss_kwargs``.  Each runs
two SGD steps on two gloo ranks; every microbatch loss, output and parameter
afterwards is saved.  It imports torch only.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


DIM = 8
N_MICROBATCHES = 4
MB_SIZE = 2
WORLD = 2
CSV = """\
0F0,0F1,0F2,0F3,3F0,3I0,3F1,3W0,3I1,3F2,3W1,(3F3;3B2)OVERLAP_F_B,3B3,0B0,0B1,0B2,0B3
1F0,2F0,1F1,2F1,1F2,2F2,(1F3;2B0)OVERLAP_F_B,2F3,1B0,2B1,1B1,2B2,1B2,2B3,1B3
"""
# name, schedule class, V placement, fully_shard the stages
CASES = (
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", False, False),
    ("LoopedBFS", "ScheduleLoopedBFS", False, False),
    ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", False, False),
    ("ZBVZeroBubble", "ScheduleZBVZeroBubble", True, False),
    ("DualPipeV", "ScheduleDualPipeV", True, False),
    ("CSV", "ScheduleDualPipeV", True, False),
    ("Interleaved1F1B-FSDP", "ScheduleInterleaved1F1B", False, True),
    ("DualPipeV-FSDP", "ScheduleDualPipeV", True, True),
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor, scale: float = 1.0):
    return scale * nn.functional.mse_loss(output, target)


def _run_case(rank: int, case: tuple, mesh, results: dict) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    name, class_name, v_shape, fsdp = case
    n_stages = 2 * WORLD
    indices = [rank, n_stages - 1 - rank] if v_shape else [rank, rank + WORLD]
    torch.manual_seed(0)
    ref = nn.Sequential(*(Block() for _ in range(n_stages)))
    modules = [copy.deepcopy(ref[i]) for i in indices]
    group = None
    if fsdp:
        modules = [fully_shard(m, mesh=mesh["dp"]) for m in modules]
        group = mesh["pp"].get_group()
    stages = [
        PipelineStage(m, i, n_stages, torch.device("cpu"), group=group)
        for m, i in zip(modules, indices)
    ]
    schedule = getattr(schedules, class_name)(stages, N_MICROBATCHES, loss_fn=loss_fn)
    if name == "CSV":
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(CSV)
        schedule._load_csv(f.name)
        os.unlink(f.name)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    out_of_steps = []
    # the second step without outputs and with loss kwargs
    options = ({}, {"return_outputs": False, "loss_kwargs": {"scale": 2.0}})
    for step_options in options:
        x = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
        y = torch.randn(N_MICROBATCHES * MB_SIZE, DIM, generator=gen)
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses, **step_options)
        optimizer.step()
        optimizer.zero_grad()
        out_of_steps.append((out, [loss.detach() for loss in losses]))
    results[name] = {
        "steps": out_of_steps,
        "params": [
            p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for p in params
        ],
    }


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp"))
    results: dict = {}
    for case in CASES:
        _run_case(rank, case, mesh, results)
        dist.barrier()
    torch.save(results, f"{out}.rank{rank}")
    dist.destroy_process_group()


def _flatten(obj, prefix: str = ""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _flatten(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def compare(a: str, b: str) -> int:
    n, differ = 0, []
    for rank in range(WORLD):
        left = dict(_flatten(torch.load(f"{a}.rank{rank}", weights_only=False)))
        right = dict(_flatten(torch.load(f"{b}.rank{rank}", weights_only=False)))
        if left.keys() != right.keys():
            differ.append(f"rank {rank}: different results")
            continue
        for key, value in left.items():
            other = right[key]
            n += 1
            same = (
                torch.equal(value, other)
                if isinstance(value, torch.Tensor)
                else value == other
            )
            if not same:
                differ.append(f"rank {rank} {key}")
    if differ:
        print(", ".join(differ[:5]))
        return 1
    print(f"{len(CASES)} schedules, {n} tensors and values on {WORLD} ranks")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, (os.path.join(tmp, "init"), args.out), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
