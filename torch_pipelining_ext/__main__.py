"""``python -m torch_pipelining_ext``: versions, devices, backends and the patch table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TypedDict

import torch
import torch.distributed as dist

import torch_pipelining_ext
from torch_pipelining_ext._patching._registry import format_report


class _Environment(TypedDict):
    torch_pipelining_ext: str
    torch: str
    python: str
    accelerator: str | None
    cuda_gpus: int
    backends: dict[str, bool]


def _environment() -> _Environment:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
    }
    accel = None
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        accel = str(torch.accelerator.current_accelerator())
    return {
        "torch_pipelining_ext": torch_pipelining_ext.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "accelerator": accel,
        "cuda_gpus": gpus,
        "backends": backends,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_pipelining_ext",
        description="Show which torch_pipelining_ext patches this torch got.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print machine-readable JSON"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1, with the table, if strict mode (TORCH_PIPELINING_EXT_STRICT=1) would refuse this torch",
    )
    args = parser.parse_args(argv)
    if args.strict:
        try:
            torch_pipelining_ext.patch(strict=True)
        except torch_pipelining_ext.PatchError as e:
            print(e, file=sys.stderr)
            return 1

    env = _environment()
    report = torch_pipelining_ext.patch_report()
    if args.json:
        print(
            json.dumps(
                {"environment": env, "patches": [r.as_dict() for r in report]}, indent=2
            )
        )
        return 0

    print(f"torch_pipelining_ext {env['torch_pipelining_ext']}")
    print(f"torch                {env['torch']} (python {env['python']})")
    backends = ", ".join(
        f"{k}={'yes' if v else 'no'}" for k, v in env["backends"].items()
    )
    print(f"backends             {backends}")
    print(
        f"devices              cpu, cuda GPUs: {env['cuda_gpus']}, accelerator: {env['accelerator'] or 'none'}"
    )
    (first, last) = torch_pipelining_ext.TESTED_TORCH
    untested = torch_pipelining_ext._untested_release(torch.__version__)
    print(
        f"tested               torch {first[0]}.{first[1]} - {last[0]}.{last[1]}"
        f" ({untested or 'this release is one of them'})"
    )
    print()
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
