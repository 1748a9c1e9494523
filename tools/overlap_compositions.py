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

    python tools/overlap_compositions.py [--timeout 900] [-k dualpipev]

Each composition runs in its own pytest process, so that a hang (past
``--timeout``) is reported as ``HUNG`` and the rest still run.  Last line:
``compositions=N failures=M`` (gloo compositions; NCCL variants are not
run).  Exits non-zero when a composition fails or hangs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "test" / "distributed" / "pipelining" / "test_schedule_overlap.py"


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """(exit status, or None after ``timeout`` seconds; output)."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one composition may take (a hang fails)",
    )
    parser.add_argument(
        "-k", default="", help="only compositions whose test id contains this"
    )
    args = parser.parse_args(argv)
    env = dict(os.environ, TORCH_PIPELINING_EXT_FULL_MATRIX="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    status, out = _run([*pytest, "--collect-only", str(TEST)], env, 300.0)
    ids = [
        line.strip()
        for line in out.splitlines()
        if "::" in line and "NCCL" not in line and args.k in line
    ]
    if status != 0 or not ids:
        print(out)
        print("compositions=0 failures=0")
        return 1
    failures = 0
    for test_id in ids:
        status, out = _run([*pytest, test_id], env, args.timeout)
        verdict = "passed" if status == 0 else ("HUNG" if status is None else "FAILED")
        if (
            status == 5 or "skipped" in out.splitlines()[-1:][0]
            if out.strip()
            else False
        ):
            verdict = "skipped"
        failures += verdict in ("HUNG", "FAILED")
        print(f"{verdict:8} {test_id.split('::', 1)[1]}", flush=True)
    print(f"compositions={len(ids)} failures={failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
