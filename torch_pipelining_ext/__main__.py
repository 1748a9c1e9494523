"""``python -m torch_pipelining_ext``: versions, devices, backends and the patch table."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import torch_pipelining_ext


def _environment() -> dict[str, object]:
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
    args = parser.parse_args(argv)

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
    )  # type: ignore[union-attr]
    print(f"backends             {backends}")
    print(
        f"devices              cpu, cuda GPUs: {env['cuda_gpus']}, accelerator: {env['accelerator'] or 'none'}"
    )
    print()
    name_w = max([len("patch")] + [len(r.name) for r in report])
    status_w = max([len("status")] + [len(r.status.value) for r in report])
    print(f"{'patch':<{name_w}}  {'status':<{status_w}}  reason")
    print(f"{'-' * name_w}  {'-' * status_w}  {'-' * 6}")
    for r in report:
        print(f"{r.name:<{name_w}}  {r.status.value:<{status_w}}  {r.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
