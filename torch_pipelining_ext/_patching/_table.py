"""The patch table: every change ``torch_pipelining_ext`` makes to torch, in order.

The table itself is data, ``patches.json`` beside this module: read it to know
what the package does to your torch (``python -m torch_pipelining_ext`` prints
what happened to each entry).  Each feature lists its patches in the order they
are applied; a patch runs after the patches it ``requires``.  A patch names

* ``probe``: the function of ``_probes.py`` that decides whether torch already
  has the behaviour;
* ``targets``: each a ``module`` and dotted ``attr`` (``key``: a mapping key
  below it, e.g. ``sys.modules``), with its replacement, a package object
  written ``"module:name"`` (``"module"`` alone: the package module itself):
  ``install`` puts that object there, ``wrap`` puts ``factory(original)``
  there (one wrapper per original, so two names of one function keep one
  object), ``call`` puts ``factory(*args)`` there;
* ``description``, ``upstream`` (the upstream file the code is written for),
  ``env_disable`` (a variable that turns the patch off), ``why``;
* ``cleanup``: a package function (``"module:name"``) that ``unpatch()``
  calls after restoring the targets, for what the patched code registered
  with torch itself (``torch.library`` kernels).

Undo is uniform: ``unpatch()`` puts back the very objects that were there
before.  Nothing outside this table assigns to torch attributes.  Package
objects are imported when a patch is applied, so a feature module that fails to
import on an unrecognised torch only removes its own patches
(``_PatchRegistry._apply_one`` records the failure as that patch's reason).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_pipelining_ext._patching._registry import _PatchRegistry, Patch, Target


__all__: list[str] = []

_TABLE = Path(__file__).with_name("patches.json")
_KINDS = ("install", "wrap", "call")


def _obj(spec: str) -> Any:
    """The package object ``"module:name"`` (``"module"``: the module itself)."""
    module, _, name = spec.partition(":")
    obj = importlib.import_module(f"torch_pipelining_ext.{module}")
    return getattr(obj, name) if name else obj


def _probe(name: str) -> Callable[[], tuple[str, str]]:
    """The probe ``name`` of ``_probes.py``, imported when it runs."""

    def run() -> tuple[str, str]:
        from torch_pipelining_ext._patching import _probes

        return getattr(_probes, name)()

    return run


def _make(entry: dict[str, Any], wrappers: dict[Any, Any]) -> Callable[[Any], Any]:
    """``make(original)`` of one target entry of the table."""
    kinds = [k for k in _KINDS if k in entry]
    if len(kinds) != 1:
        raise ValueError(
            f"patch table: target {entry['module']}.{entry['attr']} needs exactly "
            f"one of {', '.join(_KINDS)}, has {kinds or 'none'}"
        )
    kind, spec = kinds[0], entry[kinds[0]]
    if kind == "install":
        return lambda original: _obj(spec)
    if kind == "call":
        return lambda original: _obj(spec)(*entry.get("args", ()))

    def wrap(original: Any) -> Any:
        # keyed by identity (a list such as __all__ is unhashable); the entry
        # keeps the original alive, so its id is not reused
        key = (spec, id(original))
        if key not in wrappers:
            wrappers[key] = (original, _obj(spec)(original))
        return wrappers[key][1]

    return wrap


def _patch(entry: dict[str, Any], wrappers: dict[Any, Any]) -> Patch:
    targets = tuple(
        Target(t["module"], t["attr"], make=_make(t, wrappers), key=t.get("key"))
        for t in entry["targets"]
    )
    return Patch(
        name=entry["name"],
        targets=targets,
        probe=_probe(entry["probe"]),
        description=entry.get("description", ""),
        upstream=entry.get("upstream", ""),
        requires=tuple(entry.get("requires", ())),
        env_disable=entry.get("env_disable"),
        cleanup=_cleanup(entry["cleanup"]) if "cleanup" in entry else None,
    )


def _cleanup(spec: str) -> Callable[[], None]:
    """The package function ``spec``, imported when it is called."""

    def cleanup() -> None:
        _obj(spec)()

    return cleanup


def _patches(table: Path = _TABLE) -> list[Patch]:
    """The table's patches, in order."""
    wrappers: dict[Any, Any] = {}
    features = json.loads(table.read_text())["features"]
    return [_patch(e, wrappers) for f in features for e in f["patches"]]


_REGISTRY = _PatchRegistry(_patches())
