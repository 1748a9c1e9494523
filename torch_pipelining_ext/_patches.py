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
    return patches


_REGISTRY = _PatchRegistry(_patches())
