"""Overlapped vs sequential OVERLAP_F_B in every composition (the full test matrix).

Runs ``test/distributed/pipelining/test_schedule_overlap.py`` with
``TORCH_PIPELINING_EXT_FULL_MATRIX=1``: random ops on/off x activation
checkpointing none/full/selective x expert-parallel marks on/off x
ScheduleDualPipeV and a CSV schedule with a same-stage pair, and FSDP2
(PP=2 x DP=2, nested ``fully_shard``) with random delays whose recorded
collectives must not depend on timing.  Each composition compares outputs,
every microbatch loss and every gradient bitwise with the sequential handler
over two steps with an optimizer step between.  The suite itself runs a
covering subset.

    python tools/overlap_compositions.py [-- extra pytest arguments]

Last line: ``compositions=N failures=M`` (NCCL variants are not counted when
they skip).  Exits non-zero when a composition fails or none ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "test" / "distributed" / "pipelining" / "test_schedule_overlap.py"


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    env = dict(os.environ, TORCH_PIPELINING_EXT_FULL_MATRIX="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", str(TEST), "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *extra]
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        if not report.exists():
            print("error: pytest wrote no report", file=sys.stderr)
            print("compositions=0 failures=0")
            return 1
        cases = ET.parse(report).getroot().iter("testcase")
        ran = failed = 0
        for case in cases:
            if case.find("skipped") is not None:
                continue
            ran += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                print(f"FAILED {case.get('name')}")
    print(f"compositions={ran} failures={failed}")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
