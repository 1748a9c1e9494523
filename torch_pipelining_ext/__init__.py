"""Pipeline-parallel features for ``torch.distributed.pipelining``, as patches.

``import torch_pipelining_ext`` adds to the installed torch (2.9 - 2.15) what its
``torch.distributed.pipelining`` lacks.  Each addition is a patch in the table
``_patching/patches.json``; patches are chosen by feature probes
(``_patching/_probes.py``), never by version string, and a patch whose
behaviour torch already has is reported as ``upstream`` and left alone.

Set ``TORCH_PIPELINING_EXT_DISABLE=1`` to import the package without patching.
``python -m torch_pipelining_ext`` prints the patch table.
"""

from __future__ import annotations

import os
import threading

from torch_pipelining_ext import _torchtitan_compat
from torch_pipelining_ext._patching._registry import PatchRecord, PatchStatus
from torch_pipelining_ext._patching._table import _REGISTRY


__all__ = [
    "__version__",
    "DISABLE_ENV",
    "PatchRecord",
    "PatchStatus",
    "patch",
    "patch_report",
    "unpatch",
]

__version__ = "0.1.0"

DISABLE_ENV = "TORCH_PIPELINING_EXT_DISABLE"

_lock = threading.Lock()


def patch() -> list[PatchRecord]:
    """Apply every needed patch that is not applied yet; idempotent.

    Also registers the thread state that the backward thread of an
    overlapped OVERLAP_F_B needs from torchtitan (inert without it).

    Returns:
        The patch report (see :func:`patch_report`).
    """
    with _lock:
        # inert unless torchtitan is imported, see [Note: torchtitan thread state]
        _torchtitan_compat.register()
        return _REGISTRY.apply_all(os.environ)


def unpatch() -> None:
    """Restore every attribute the package patched to the object that was there
    before (by identity), and remove the package's thread-state hooks.
    :func:`patch` applies the patches again.

    Schedules built while patched keep their custom-function maps (the
    package's defaults included, e.g. the concurrent OVERLAP_F_B handler);
    build a schedule again after ``unpatch()`` for stock behaviour.
    """
    with _lock:
        _REGISTRY.undo_all()
        _torchtitan_compat.unregister()


def patch_report() -> list[PatchRecord]:
    """One :class:`PatchRecord` per patch: name, status, reason, targets.

    Status is one of ``applied``, ``upstream`` (torch already has the
    behaviour), ``skipped`` (the probe did not recognise this torch, or a
    patch it requires is missing), ``unsupported`` (a torch the patch is not
    written for, which its probe recognised; not warned about), ``failed``
    (applying raised and was rolled
    back), ``disabled`` (an environment variable turned it off) or
    ``not applied`` (``patch()`` not called, or undone by ``unpatch()``).
    """
    return _REGISTRY.report()


if os.environ.get(DISABLE_ENV, "") in ("", "0"):
    patch()
