"""Schedule1F1B.pipeline_order is not a valid schedule for the last rank.

Run with a stock torch (CPU, one process):  python repro.py
Exit status 1: the defect is present; 0: it is not.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining.schedules import _ComputationType, _validate_schedule


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
            last = order[pp - 1]
            forwards = sorted(
                a.microbatch_index
                for a in last
                if a is not None and a.computation_type == _ComputationType.FORWARD
            )
            print(f"\n{pp} ranks, {n} microbatches: rank {pp - 1} runs")
            print("  " + " ".join(str(a) for a in last if a is not None))
            print(f"  forward microbatches: {forwards} (expected {list(range(n))})")
            try:
                _validate_schedule(order, pp, pp, n)
                print("  _validate_schedule: accepted")
            except AssertionError as e:
                first_line = str(e).splitlines()[0]
                print(f"  _validate_schedule: AssertionError: {first_line}")
                found.append(f"{pp} ranks/{n} microbatches: {first_line}")
                continue
            if forwards != list(range(n)):
                found.append(f"{pp} ranks/{n} microbatches: forwards {forwards}")
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
