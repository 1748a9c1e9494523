"""torchtitan's thread-local SPMD state on the backward thread of overlapped actions.

Private helper of :mod:`torch_pipelining_ext.overlap`: a pair for
:func:`~torch_pipelining_ext.overlap.register_thread_state` that carries
what torchtitan's default SPMD backend (``spmd_types``) keeps per thread over
to the worker thread of an overlapped ``OVERLAP_F_B``:

* the meshes of ``torchtitan.distributed.spmd_types`` (its ``threading.local``:
  the dense and sparse meshes and the stack of current meshes that
  ``current_spmd_mesh()`` reads, e.g. in the token dispatcher's all-to-alls);
* the current-mesh stack of the ``spmd_types`` library
  (``spmd_types.set_current_mesh``).

Autograd's multithreading switch, which torchtitan turns off on the thread
that initialises it (``torch.autograd.set_multithreading_enabled``) so that
backward runs on the thread that holds the meshes, needs nothing here: the
engine carries it to the worker with the rest of torch's thread state.

Nothing here imports torchtitan; see [Note: torchtitan thread state].
``TORCH_PIPELINING_EXT_TORCHTITAN_THREAD_STATE=0`` when the package is imported
(or :func:`torch_pipelining_ext.patch` is called) registers no pair: for a
model that carries the state itself, and for negative controls.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext import overlap
from torch_pipelining_ext._patching._registry import STRICT_ENV
from torch_pipelining_ext.overlap._settings import Registration


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: torchtitan thread state]
# torchtitan's default SPMD backend keeps its meshes in ``threading.local``
# objects, which the worker thread of an overlapped OVERLAP_F_B does not see:
# a backward that needs a mesh there (the recomputation of a checkpointed MoE
# layer calls the token dispatcher, which asks ``current_spmd_mesh()`` for the
# EP process group) finds none.  The pair below copies the caller's state to
# the worker for the backward sub-action and restores the worker's own after.
#
# Registration: the pair is registered once, when this package is imported,
# and does nothing unless torchtitan (or the ``spmd_types`` library) is
# already imported when an overlapped action starts: ``capture`` looks the
# modules up in ``sys.modules`` and never imports them.  A model that uses
# their meshes has imported them by then, so this is correct whatever the
# import order, and it needs no import hook and no change to the overlap
# engine; the cost without torchtitan is two dictionary look-ups per action.
#
# Copies, not shared objects: each thread pushes and pops its mesh stacks
# (``maybe_set_sparse_mesh()`` around every dispatch), and the two threads of
# an action run at once, so the worker gets its own list with the caller's
# entries (the meshes themselves are shared; they are not changed in place).
#
# Refused: spmd_types' type checking (``spmd_types.checker.typecheck``) is a
# TorchFunctionMode, which is per thread in C++ and holds state of the thread
# that entered it; it cannot be entered on a second thread while the first is
# inside it.  Rather than run the backward unchecked, an overlapped action
# under it raises; the sequential handler runs it.
#
# Layout: the attribute names are torchtitan 0.3.0's and spmd_types 0.2.x's
# (``_MESH_TLS``, ``_state._tls.mesh_stack``).  Where the modules are loaded
# and the backend is ``spmd_types`` but the layout is not found, the action
# raises instead of running a backward without meshes.  A release other than
# the one written for (``_WRITTEN_FOR``; the release from the top module's
# ``__version__`` or the installed distribution's metadata) is named once per
# process in a RuntimeWarning when its state is first captured, and refused
# with an error under ``TORCH_PIPELINING_EXT_STRICT=1``: the same names may
# hold other state in another release.

THREAD_STATE_ENV = "TORCH_PIPELINING_EXT_TORCHTITAN_THREAD_STATE"
# the releases (major.minor) whose private thread state this module reads
_WRITTEN_FOR = {"torchtitan": "0.3", "spmd_types": "0.2"}
_checked_releases: set[str] = set()
_TORCHTITAN_SPMD = "torchtitan.distributed.spmd_types"
_TORCHTITAN_UTILS = "torchtitan.distributed.utils"
_SPMD_TYPES_STATE = "spmd_types._state"


class _SpmdThreadState(NamedTuple):
    """What one thread holds of torchtitan's SPMD state (``None``: that library is not loaded)."""

    torchtitan: dict[str, Any] | None  # the attributes of torchtitan's ``_MESH_TLS``
    spmd_mesh_stack: list[Any] | None  # the ``spmd_types`` library's current-mesh stack


def _copied(attributes: dict[str, Any]) -> dict[str, Any]:
    return {
        name: list(value) if isinstance(value, list) else value
        for name, value in attributes.items()
    }


def _torchtitan_backend() -> str | None:
    utils = sys.modules.get(_TORCHTITAN_UTILS)
    get_backend = getattr(utils, "get_spmd_backend", None)
    return get_backend() if callable(get_backend) else None


def _unknown_layout(what: str) -> RuntimeError:
    return RuntimeError(
        f"OVERLAP_F_B: {what} was not found, so torchtitan's SPMD meshes cannot be carried to the backward "
        "thread of an overlapped action; use torchtitan's 'partial_dtensor' SPMD backend, or run OVERLAP_F_B "
        "sequentially (schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b))"
    )


def _release_of(distribution: str) -> str | None:
    """The loaded release of ``distribution``: its top module's ``__version__``, else its metadata."""
    version = getattr(sys.modules.get(distribution), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_release(distribution: str) -> None:
    """Warn once (raise in strict mode) when ``distribution`` is not the release written for."""
    if distribution in _checked_releases:
        return
    release = _release_of(distribution)
    written_for = _WRITTEN_FOR[distribution]
    if release is not None and release.split("+")[0].startswith(written_for + "."):
        _checked_releases.add(distribution)
        return
    message = (
        f"torch_pipelining_ext carries {distribution}'s private thread state to the backward thread "
        f"of an overlapped OVERLAP_F_B as {distribution} {written_for}.x lays it out, and found "
        f"{distribution} {release or '(release unknown)'}; check the overlapped run against "
        f"the sequential one (schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b))"
    )
    if os.environ.get(STRICT_ENV, "") not in ("", "0"):
        raise RuntimeError(f"{message}; refused by {STRICT_ENV}=1")
    _checked_releases.add(distribution)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _thread_local(module: Any, name: str) -> threading.local | None:
    value = getattr(module, name, None)
    return value if isinstance(value, threading.local) else None


def _capture() -> _SpmdThreadState | None:
    """The calling thread's state; ``None`` when neither library is loaded."""
    titan = sys.modules.get(_TORCHTITAN_SPMD)
    spmd_state = sys.modules.get(_SPMD_TYPES_STATE)
    if titan is None and spmd_state is None:
        return None
    titan_attrs = None
    if titan is not None:
        _check_release("torchtitan")
        tls = _thread_local(titan, "_MESH_TLS")
        if tls is not None:
            titan_attrs = _copied(vars(tls))
        elif _torchtitan_backend() == "spmd_types":
            raise _unknown_layout(
                f"the threading.local '_MESH_TLS' of {_TORCHTITAN_SPMD}"
            )
    spmd_stack = None
    if spmd_state is not None:
        _check_release("spmd_types")
        tls = _thread_local(spmd_state, "_tls")
        if tls is not None:
            if getattr(tls, "current_mode", None) is not None:
                raise RuntimeError(
                    "OVERLAP_F_B: spmd_types type checking is active (spmd_types.checker.typecheck); it is per "
                    "thread and cannot be carried to the backward thread of an overlapped action.  Run the "
                    "step without type checking, or run OVERLAP_F_B sequentially "
                    "(schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b))"
                )
            spmd_stack = list(getattr(tls, "mesh_stack", []))
        elif _torchtitan_backend() == "spmd_types":
            raise _unknown_layout(f"the threading.local '_tls' of {_SPMD_TYPES_STATE}")
    return _SpmdThreadState(titan_attrs, spmd_stack)


@contextlib.contextmanager
def _replaced_attributes(
    tls: threading.local, attributes: dict[str, Any]
) -> Iterator[None]:
    """This thread's view of ``tls`` holds ``attributes`` (copies) until exit, then what it held before."""
    own = vars(tls)
    before = dict(own)
    own.clear()
    own.update(_copied(attributes))
    try:
        yield
    finally:
        own.clear()
        own.update(before)


@contextlib.contextmanager
def _apply(state: _SpmdThreadState | None) -> Iterator[None]:
    """Enter ``state`` (from :func:`_capture` on the calling thread) on this thread."""
    if state is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if state.torchtitan is not None:
            tls = _thread_local(sys.modules[_TORCHTITAN_SPMD], "_MESH_TLS")
            assert tls is not None  # captured from it
            stack.enter_context(_replaced_attributes(tls, state.torchtitan))
        if state.spmd_mesh_stack is not None:
            tls = _thread_local(sys.modules[_SPMD_TYPES_STATE], "_tls")
            assert tls is not None
            stack.enter_context(
                _replaced_attributes(
                    tls, {**vars(tls), "mesh_stack": state.spmd_mesh_stack}
                )
            )
        logger.debug(
            "%s: torchtitan SPMD state applied (torchtitan meshes: %s, spmd_types mesh stack depth: %s)",
            threading.current_thread().name,
            sorted(state.torchtitan) if state.torchtitan is not None else None,
            len(state.spmd_mesh_stack) if state.spmd_mesh_stack is not None else None,
        )
        yield


def _register_pair() -> RemovableHandle | None:
    if os.environ.get(THREAD_STATE_ENV, "1").strip() == "0":
        return None
    return overlap.register_thread_state(_capture, _apply)


_REGISTRATION = Registration(_register_pair)


def register() -> RemovableHandle | None:
    """Register the pair with :func:`overlap.register_thread_state` (once; later calls return the same handle).

    Registers nothing and returns ``None`` while ``$TORCH_PIPELINING_EXT_TORCHTITAN_THREAD_STATE`` is ``0``.
    """
    return _REGISTRATION.register()


def unregister() -> None:
    """Remove the pair registered by :func:`register` (nothing if it is not registered)."""
    _REGISTRATION.remove()
