"""Pipeline-parallel features for ``torch.distributed.pipelining``, as patches.

``import torch_pipelining_ext`` adds to the installed torch (2.9 - 2.15) what its
``torch.distributed.pipelining`` lacks.  Each addition is a patch in the table
``_patching/patches.json``; patches are chosen by feature probes
(``_patching/_probes.py``), never by version string, and a patch whose
behaviour torch already has is reported as ``upstream`` and left alone.

Set ``TORCH_PIPELINING_EXT_DISABLE=1`` to import the package without patching,
``TORCH_PIPELINING_EXT_STRICT=1`` to make the import fail closed (see
:func:`patch`).  ``python -m torch_pipelining_ext`` prints the patch table.
"""

from __future__ import annotations

import os
import re
import threading
import warnings

import torch

from torch_pipelining_ext import _torchtitan_compat
from torch_pipelining_ext._patching._registry import (
    format_report,
    PatchError,
    PatchRecord,
    PatchStatus,
    STRICT_ENV,
)
from torch_pipelining_ext._patching._table import _REGISTRY


__all__ = [
    "__version__",
    "DISABLE_ENV",
    "PatchError",
    "PatchRecord",
    "PatchStatus",
    "patch",
    "patch_report",
    "STRICT_ENV",
    "TESTED_TORCH",
    "unpatch",
]

__version__ = "0.1.0"

DISABLE_ENV = "TORCH_PIPELINING_EXT_DISABLE"

# The torch minors the test suite runs on (first, last), see README.md.
TESTED_TORCH = ((2, 9), (2, 15))

_lock = threading.Lock()


def _untested_release(version: str) -> str | None:
    """Why ``version`` (``torch.__version__``) is outside :data:`TESTED_TORCH`, or None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    (first, last) = TESTED_TORCH
    if match is None:
        return f"torch {version!r}: not a release number"
    minor = (int(match.group(1)), int(match.group(2)))
    if first <= minor <= last:
        return None
    tested = f"{first[0]}.{first[1]} - {last[0]}.{last[1]}"
    return f"torch {version} is outside the tested releases ({tested})"


def patch(strict: bool | None = None) -> list[PatchRecord]:
    """Apply every needed patch that is not applied yet; idempotent.

    Also registers the thread state that the backward thread of an
    overlapped OVERLAP_F_B needs from torchtitan (inert without it).

    Without strict mode a patch that is skipped or failed, or a torch outside
    :data:`TESTED_TORCH`, gives one ``RuntimeWarning`` and the rest of the
    package works without it.  Strict mode fails closed instead: it undoes
    every patch (as :func:`unpatch`) and raises :class:`PatchError` with the
    patch table.  Patches turned off by their environment variable
    (``disabled``) and patches whose probe recognised a torch they are not
    written for (``unsupported``: what relies on them refuses to run or runs
    as stock torch does, e.g. one recompute per parameter group in the weight
    pass before torch 2.10) are not refused.

    Args:
        strict: fail closed; ``None`` reads ``$TORCH_PIPELINING_EXT_STRICT``
            (``1`` turns it on), which ``import torch_pipelining_ext`` uses.

    Returns:
        The patch report (see :func:`patch_report`).

    Raises:
        PatchError: in strict mode, when a patch was skipped or failed, or
            torch is outside the tested releases.
    """
    if strict is None:
        strict = os.environ.get(STRICT_ENV, "") not in ("", "0")
    with _lock:
        # inert unless torchtitan is imported, see [Note: torchtitan thread state]
        _torchtitan_compat.register()
        report = _REGISTRY.apply_all(os.environ, warn=not strict)
        untested = _untested_release(torch.__version__)
        if not strict:
            if untested is not None:
                warnings.warn(
                    f"torch_pipelining_ext: {untested}; the patches' probes decide "
                    f"what to change, but no test has run on this release "
                    f"({STRICT_ENV}=1 refuses it)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return report
        refused = [
            f"{r.name} {r.status.value}"
            for r in report
            if r.status in (PatchStatus.SKIPPED, PatchStatus.FAILED)
        ]
        if untested is None and not refused:
            return report
        _REGISTRY.undo_all()
        _torchtitan_compat.unregister()
    reasons = ([untested] if untested else []) + refused
    raise PatchError(
        f"torch_pipelining_ext strict mode ({STRICT_ENV}=1 or patch(strict=True)) "
        f"refuses torch {torch.__version__}: {'; '.join(reasons)}. Every patch was "
        f"undone. What happened to each:\n{format_report(report)}"
    )


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
