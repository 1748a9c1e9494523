"""The one place where ``torch_pipelining_ext`` touches torch.

Every change the package makes to the installed torch is a :class:`Patch`:

* ``name`` -- what the patch is called in reports and logs;
* ``targets`` -- the attributes it replaces or adds (``module`` + dotted ``attr``),
  each with ``make(original) -> replacement``;
* ``probe`` -- a feature probe: returns ``(PatchNeeded, reason)``,
  ``(AlreadyUpstream, reason)`` or ``(NotSupported, reason)`` (a torch it
  recognises but the patch is not written for: reported, not warned about, and
  whatever relies on the patch checks its status), and raises when it cannot
  recognise the torch internals it would patch;
* undo is always the same: each target gets back the very object that was there
  before (``setattr`` of the saved original, or ``delattr`` when the attribute
  did not exist), then the patch's ``cleanup``, if it has one, removes what its
  code registered with torch while it ran.

The table of patches lives in ``patches.json`` (read by ``_table.py``); this module only knows how to
apply, undo and report them.  Application is atomic per patch (all targets or
none), idempotent, and guarded by a lock so that two threads importing the
package at once apply each patch exactly once.

A patch that cannot be applied never breaks ``import torch_pipelining_ext``:
it is reported as ``skipped`` (probe could not recognise torch) or ``failed``
(applying raised; every target already set is rolled back), and one warning
names all such patches -- unless strict mode asks to fail closed (see
``torch_pipelining_ext.patch``), which raises :class:`PatchError` with
:func:`format_report`'s table instead.
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any


__all__ = [
    "AlreadyUpstream",
    "Patch",
    "PatchNeeded",
    "NotSupported",
    "PatchError",
    "PatchRecord",
    "PatchStatus",
    "Target",
]

logger = logging.getLogger(__name__)


class _Missing:
    """Marks an attribute that did not exist before a patch added it."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()

# ``1`` makes the package fail closed (see ``torch_pipelining_ext.patch``).
STRICT_ENV = "TORCH_PIPELINING_EXT_STRICT"

# Probe verdicts.
PatchNeeded = "needed"
AlreadyUpstream = "upstream"
NotSupported = "unsupported"


class PatchStatus(str, enum.Enum):
    """What happened to a patch (see :func:`torch_pipelining_ext.patch_report`)."""

    APPLIED = "applied"
    UPSTREAM = "upstream"
    SKIPPED = "skipped"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"
    DISABLED = "disabled"
    NOT_APPLIED = "not applied"


class PatchError(RuntimeError):
    """Strict mode refused this torch: a patch was skipped or failed, or the
    release is outside the tested range.  The message holds the patch table."""


@dataclass(frozen=True)
class Target:
    """One attribute a patch replaces or adds.

    Args:
        module: importable module that owns the attribute, e.g.
            ``"torch.distributed.pipelining.schedules"``.
        attr: dotted path below the module, e.g.
            ``"_PipelineScheduleRuntime.register_custom_function"``.  When the
            owner is a mapping (``sys.modules``, say), the last part is a key.
        make: ``make(original) -> replacement``; ``original`` is the current
            object, or ``None`` when the attribute does not exist yet.
        key: a mapping key that may contain dots; when given, ``attr`` is the
            full dotted path to the mapping, e.g. ``Target("sys", "modules",
            make, key="torch.distributed.pipelining.stage_split")``.
    """

    module: str
    attr: str
    make: Callable[[Any], Any]
    key: str | None = None

    @property
    def qualname(self) -> str:
        if self.key is not None:
            return f"{self.module}.{self.attr}[{self.key!r}]"
        return f"{self.module}.{self.attr}"

    def _owner_and_name(self) -> tuple[object, str]:
        owner: object = importlib.import_module(self.module)
        if self.key is not None:
            path, name = self.attr.split("."), self.key
        else:
            *path, name = self.attr.split(".")
        for part in path:
            owner = (
                owner[part]
                if isinstance(owner, MutableMapping)
                else getattr(owner, part)
            )
        return owner, name

    def _get(self) -> object:
        owner, name = self._owner_and_name()
        if isinstance(owner, MutableMapping):
            return owner.get(name, _MISSING)
        # Look in the owner's own __dict__ for classes so that an inherited
        # attribute is restored by deletion rather than by copying it down.
        if isinstance(owner, type):
            return owner.__dict__.get(name, _MISSING)
        return getattr(owner, name, _MISSING)

    def _set(self, value: object) -> None:
        owner, name = self._owner_and_name()
        if isinstance(owner, MutableMapping):
            if value is _MISSING:
                owner.pop(name, None)
            else:
                owner[name] = value
        elif value is _MISSING:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, value)


@dataclass
class Patch:
    """A named, reversible change to torch.

    Args:
        name: short identifier shown by ``python -m torch_pipelining_ext``.
        targets: attributes the patch installs; applied all-or-nothing.
        probe: feature probe returning ``(verdict, reason)`` where verdict is
            :data:`PatchNeeded` or :data:`AlreadyUpstream`.  Raising means the
            torch internals were not recognised and the patch is skipped.
        description: one line on what the patch adds.
        upstream: the upstream file/PR the patch corresponds to.
        requires: names of patches that must be applied (or upstream) first.
        env_disable: environment variable that, when set to ``1``, disables
            just this patch.
        cleanup: called when the patch is undone, after its targets are
            restored: for what the patched code registered with torch while
            it ran (kernels with ``torch.library``, say), which no attribute
            holds.
    """

    name: str
    targets: tuple[Target, ...]
    probe: Callable[[], tuple[str, str]]
    description: str = ""
    upstream: str = ""
    requires: tuple[str, ...] = ()
    env_disable: str | None = None
    cleanup: Callable[[], None] | None = None
    # Runtime state, owned by the registry.
    _saved: list[tuple[Target, object]] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class PatchRecord:
    """What happened to one patch; returned by ``patch_report()``."""

    name: str
    status: PatchStatus
    reason: str
    targets: tuple[str, ...]

    def as_dict(self) -> dict[str, str | list[str]]:
        return {
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "targets": list(self.targets),
        }


class _PatchRegistry:
    """Applies and undoes a fixed sequence of patches; thread safe."""

    def __init__(self, patches: Iterable[Patch]) -> None:
        self._patches: list[Patch] = list(patches)
        names = [p.name for p in self._patches]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate patch names in {names}")
        self._lock = threading.RLock()
        self._records: dict[str, PatchRecord] = {
            p.name: PatchRecord(
                p.name,
                PatchStatus.NOT_APPLIED,
                "patch() not called",
                self._target_names(p),
            )
            for p in self._patches
        }

    @staticmethod
    def _target_names(p: Patch) -> tuple[str, ...]:
        return tuple(t.qualname for t in p.targets)

    def _record(self, p: Patch, status: PatchStatus, reason: str) -> None:
        self._records[p.name] = PatchRecord(
            p.name, status, reason, self._target_names(p)
        )

    def is_applied(self, name: str) -> bool:
        return self._records[name].status is PatchStatus.APPLIED

    def status(self, name: str) -> PatchStatus:
        return self._records[name].status

    def apply_all(
        self, environ: MutableMapping[str, str], *, warn: bool = True
    ) -> list[PatchRecord]:
        """Apply every patch whose probe says it is needed. Idempotent.

        With ``warn`` (the default), one ``RuntimeWarning`` names every patch
        skipped or failed; strict mode passes ``False`` and raises instead.
        """
        problems: list[PatchRecord] = []
        with self._lock:
            for p in self._patches:
                if self._records[p.name].status is PatchStatus.APPLIED:
                    continue
                self._apply_one(p, environ)
                rec = self._records[p.name]
                if rec.status in (PatchStatus.SKIPPED, PatchStatus.FAILED):
                    problems.append(rec)
        if problems and warn:
            warnings.warn(
                "torch_pipelining_ext: some patches were not applied to this torch "
                "(the rest of the package works without them): "
                + "; ".join(f"{r.name} {r.status.value}: {r.reason}" for r in problems),
                RuntimeWarning,
                stacklevel=3,
            )
        return self.report()

    def _apply_one(self, p: Patch, environ: MutableMapping[str, str]) -> None:
        if p.env_disable and environ.get(p.env_disable, "") not in ("", "0"):
            self._record(
                p,
                PatchStatus.DISABLED,
                f"disabled by {p.env_disable}={environ[p.env_disable]}",
            )
            return
        for dep in p.requires:
            dep_status = self._records[dep].status
            if dep_status not in (PatchStatus.APPLIED, PatchStatus.UPSTREAM):
                self._record(
                    p,
                    PatchStatus.SKIPPED,
                    f"requires patch {dep!r}, which is {dep_status.value}",
                )
                return
        try:
            verdict, reason = p.probe()
        except Exception as e:
            self._record(
                p,
                PatchStatus.SKIPPED,
                f"probe did not recognise this torch: {type(e).__name__}: {e}",
            )
            return
        if verdict == AlreadyUpstream:
            self._record(p, PatchStatus.UPSTREAM, reason)
            return
        if verdict == NotSupported:
            # recognised, and known not to be covered: reported, not warned
            # about (what relies on the patch checks its status and refuses)
            self._record(p, PatchStatus.UNSUPPORTED, reason)
            return
        if verdict != PatchNeeded:
            self._record(
                p, PatchStatus.SKIPPED, f"probe returned unknown verdict {verdict!r}"
            )
            return
        saved: list[tuple[Target, object]] = []
        try:
            for t in p.targets:
                original = t._get()
                replacement = t.make(None if original is _MISSING else original)
                t._set(replacement)
                saved.append((t, original))
        except Exception as e:
            for t, original in reversed(saved):
                t._set(original)
            self._record(
                p,
                PatchStatus.FAILED,
                f"applying raised {type(e).__name__}: {e}; rolled back",
            )
            return
        p._saved = saved
        self._record(p, PatchStatus.APPLIED, reason)
        logger.debug("applied patch %s (%s)", p.name, reason)

    def undo_all(self) -> None:
        """Restore every patched attribute to the object that was there before."""
        with self._lock:
            for p in reversed(self._patches):
                if self._records[p.name].status is not PatchStatus.APPLIED:
                    self._record(p, PatchStatus.NOT_APPLIED, "unpatch() called")
                    continue
                for t, original in reversed(p._saved):
                    t._set(original)
                p._saved = []
                if p.cleanup is not None:
                    p.cleanup()
                self._record(
                    p,
                    PatchStatus.NOT_APPLIED,
                    "unpatch() restored the original objects",
                )

    def report(self) -> list[PatchRecord]:
        with self._lock:
            return [self._records[p.name] for p in self._patches]

    def patches(self) -> list[Patch]:
        return list(self._patches)


def format_report(records: Iterable[PatchRecord]) -> str:
    """The patch table as ``python -m torch_pipelining_ext`` prints it: name, status, reason."""
    records = list(records)
    name_w = max([len("patch")] + [len(r.name) for r in records])
    status_w = max([len("status")] + [len(r.status.value) for r in records])
    lines = [
        f"{'patch':<{name_w}}  {'status':<{status_w}}  reason",
        f"{'-' * name_w}  {'-' * status_w}  {'-' * 6}",
    ]
    lines += [
        f"{r.name:<{name_w}}  {r.status.value:<{status_w}}  {r.reason}" for r in records
    ]
    return "\n".join(lines)
