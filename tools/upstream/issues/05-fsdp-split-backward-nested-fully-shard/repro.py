"""Split (I/W) backward with nested fully_shard modules: gradients missing.

One process (gloo, CPU), FSDP2 over a one-rank mesh, two stages on the rank,
each stage a module of two Linear+ReLU layers with fully_shard on every layer
and then on the stage (the usual FSDP2 recipe).  ScheduleZBVZeroBubble and
ScheduleInterleavedZeroBubble (BACKWARD_INPUT / BACKWARD_WEIGHT), and, for
comparison, ScheduleInterleaved1F1B (full backward), two microbatches; every
parameter gradient is compared with a single-process reference.

Run with a stock torch:  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor


DIM = 4
N = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def wrong_gradients(schedule_class: type, mesh, x, y) -> list[str]:
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block())
    stages, modules = [], []
    for i in (0, 1):
        module = copy.deepcopy(ref[i])
        for layer in module.layers:
            fully_shard(layer, mesh=mesh)
        modules.append(fully_shard(module, mesh=mesh))
        stages.append(PipelineStage(modules[i], i, 2, torch.device("cpu")))
    schedule_class(stages, N, loss_fn=loss_fn).step(x, target=y)
    for x_mb, y_mb in zip(x.chunk(N), y.chunk(N)):
        (loss_fn(ref(x_mb), y_mb) / N).backward()
    wrong = []
    for i, module in enumerate(modules):
        for (name, p), r in zip(module.named_parameters(), ref[i].parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if grad is None:
                wrong.append(f"stage {i} {name}: no gradient")
            elif not torch.allclose(grad, r.grad):
                ratio = (grad.norm() / r.grad.norm()).item()
                wrong.append(f"stage {i} {name}: |grad| / |reference| = {ratio:.4f}")
    print(f"{schedule_class.__name__}: {len(wrong)} wrong gradients")
    for line in wrong:
        print(f"  {line}")
    return wrong


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    print(f"torch {torch.__version__}")
    x, y = torch.randn(2 * N, DIM), torch.randn(2 * N, DIM)
    split = (ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        found = {c.__name__: wrong_gradients(c, mesh, x, y) for c in split}
        full = wrong_gradients(ScheduleInterleaved1F1B, mesh, x, y)
        dist.destroy_process_group()
    found = {name: wrong for name, wrong in found.items() if wrong}
    if full:
        print("the full-backward control is wrong too: not this defect")
        return 2
    if found:
        print(
            "defect present: split backward with nested fully_shard modules: "
            + "; ".join(
                f"{n}: {len(w)} wrong gradients ({w[0]})" for n, w in found.items()
            )
            + " (the full backward is right)"
        )
        return 1
    print("defect absent: every gradient matches the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
