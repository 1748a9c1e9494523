"""The patch table: every change ``torch_pipelining_ext`` makes to torch, in order.

Read this file to know what the package does to your torch.  Each entry names
its targets, the replacement (``make(original) -> new``), the feature probe
that decides whether torch already has the behaviour, and the upstream file
the code is written for.  Undo is uniform: ``unpatch()`` puts back the very
objects that were there before.  Nothing outside this table assigns to torch
attributes.

Order matters: a patch runs after the patches it ``requires``.
"""

from __future__ import annotations

from torch_pipelining_ext._patching import _PatchRegistry, Patch, Target  # noqa: F401


_PIPELINING = "torch.distributed.pipelining"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"


def _patches() -> list[Patch]:
    # Imports are local so that a feature module failing to import on an
    # unrecognised torch only removes its own patches (see _safe_patches()).
    patches: list[Patch] = []
    patches.append(_stage_split_patch())
    return patches


# --- stage_split: torch.distributed.pipelining.stage_split (new public module) ---
def _stage_split_patch() -> Patch:
    def probe() -> tuple[str, str]:
        from torch_pipelining_ext.stage_split import _upstream_probe

        return _upstream_probe()

    def module(original: object) -> object:
        import torch_pipelining_ext.stage_split as stage_split

        return stage_split

    return Patch(
        name="stage_split",
        targets=(
            # `from torch.distributed.pipelining.stage_split import split_module`
            Target("sys", "modules", make=module, key=f"{_PIPELINING}.stage_split"),
            # `torch.distributed.pipelining.stage_split.split_module`
            Target(_PIPELINING, "stage_split", make=module),
        ),
        probe=probe,
        description="split_module / pipeline_module_split: build pipeline stages by module FQN",
        upstream="torch/distributed/pipelining/stage_split.py (new)",
    )


_REGISTRY = _PatchRegistry(_patches())
