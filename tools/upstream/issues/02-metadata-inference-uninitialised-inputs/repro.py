"""Dynamic metadata inference materialises probe inputs with torch.empty_strided.

Two processes (gloo, CPU), two stages, ScheduleGPipe, two microbatches.  The
second stage records the inputs its forward is called with: the metadata probe
(by design, once, before the first step) and the real microbatches.  A
data-dependent forward (a toy router that counts the tokens per expert, as an
MoE layer does before its all-to-all) shows what it decides on each input.  The
probe input should be deterministic (zeros); it is uninitialised memory.

Run with a stock torch:  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


N_MICROBATCHES = 2
DIM = 4
EXPERTS = 4


class RecordingRouter(nn.Module):
    """Records every input; routes each row to its argmax "expert"."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.calls: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.detach().clone())
        return self.proj(x)


def route(x: torch.Tensor) -> list[int]:
    # tokens per expert: the split sizes an MoE all-to-all would exchange
    return torch.bincount(x.nan_to_num().argmax(-1), minlength=EXPERTS).tolist()


def run(rank: int, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    # uninitialised memory made visible, the same on every run: with
    # deterministic algorithms, torch.empty / empty_strided fill with NaN
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2
    )
    torch.manual_seed(0)
    first = nn.Linear(DIM, DIM)
    router = RecordingRouter()
    module = first if rank == 0 else router
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(
        stage, N_MICROBATCHES, loss_fn=lambda out, y: out.pow(2).mean()
    )
    x = torch.arange(N_MICROBATCHES * 2 * DIM, dtype=torch.float32).view(-1, DIM)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=torch.zeros(N_MICROBATCHES * 2, DIM))
        with torch.no_grad():
            real = [first(mb) for mb in x.chunk(N_MICROBATCHES)]
        lines = [f"stage 1 forward calls: {len(router.calls)}"]
        unexpected = []
        for i, seen in enumerate(router.calls):
            matches = [j for j, r in enumerate(real) if torch.equal(seen, r)]
            zeros = not matches and not seen.any()
            what = f"microbatch {matches[0]}" if matches else "no microbatch"
            what += ", all zeros" if zeros else ""
            lines.append(
                f"  call {i}: input is {what}; finite={bool(seen.isfinite().all())}; "
                f"tokens per expert {route(seen)}; values {seen.flatten()[:6].tolist()}"
            )
            if not matches and not zeros:
                unexpected.append(i)
        lines.append(
            "  the real microbatches route " + ", ".join(str(route(r)) for r in real)
        )
        with open(result_path, "w") as f:
            f.write("\n".join(lines) + f"\nUNEXPECTED {unexpected}\n")
    dist.destroy_process_group()


def main() -> int:
    print(f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result")
        mp.spawn(run, args=(os.path.join(tmp, "store"), result_path), nprocs=2)
        with open(result_path) as f:
            *lines, last = f.read().splitlines()
    print("\n".join(lines))
    unexpected = last.removeprefix("UNEXPECTED ")
    if unexpected != "[]":
        print(
            f"defect present: the metadata probe called stage 1's forward (calls "
            f"{unexpected}) on an input that is neither a microbatch's activation nor "
            "zeros: uninitialised memory from torch.empty_strided"
        )
        return 1
    print(
        "defect absent: stage 1's forward saw zeros (the probe) and the real activations"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
