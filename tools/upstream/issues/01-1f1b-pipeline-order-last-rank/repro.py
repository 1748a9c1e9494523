"""Schedule1F1B.pipeline_order is not a valid schedule for the last rank.

Reads the public ``pipeline_order`` attribute of Schedule1F1B and checks the
last rank's actions: one forward per microbatch 0 .. n-1, and no backward
before the forward of its microbatch.

Run with a stock torch (CPU, one process):  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import os
import re
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


def check(actions: list) -> tuple[list[int], str | None]:
    """The forward microbatches, and the first backward that runs before its forward.

    Reads each action's text form: ``1F0`` is stage 1, forward, microbatch 0.
    """
    forwards: list[int] = []
    first_bad = None
    for position, action in enumerate(actions):
        _, kind, mb = re.fullmatch(r"(\d+)([A-Z_]+)(\d*)", str(action)).groups()
        if kind == "F":
            forwards.append(int(mb))
        elif kind in ("B", "I") and first_bad is None and int(mb) not in forwards:
            first_bad = f"{action} (action {position})"
    return forwards, first_bad


def main() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}")
    # pipeline_order holds every rank's actions and depends only on the number
    # of stages and microbatches, so one process (world size 1) shows all ranks.
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        for pp, n in ((2, 2), (4, 4), (4, 8)):
            stage = PipelineStage(nn.Linear(4, 4), 0, pp, torch.device("cpu"))
            order = Schedule1F1B(stage, n_microbatches=n).pipeline_order
            last = [a for a in order[pp - 1] if a is not None]
            forwards, first_bad = check(last)
            print(f"\n{pp} ranks, {n} microbatches: rank {pp - 1} runs")
            print("  " + " ".join(str(a) for a in last))
            print(f"  forward microbatches: {forwards} (expected {list(range(n))})")
            print(f"  first backward before its forward: {first_bad or 'none'}")
            problems = []
            if forwards != list(range(n)):
                problems.append(f"forwards {forwards}")
            if first_bad:
                problems.append(f"{first_bad} before its forward")
            if problems:
                found.append(f"{pp} ranks/{n} microbatches: " + ", ".join(problems))
        dist.destroy_process_group()
    print()
    if found:
        print(
            "defect present: Schedule1F1B.pipeline_order is not a valid schedule "
            "for the last rank (" + "; ".join(found) + ")"
        )
        return 1
    print("defect absent: every Schedule1F1B.pipeline_order checked is valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
