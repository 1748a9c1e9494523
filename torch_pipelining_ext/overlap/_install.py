"""How this package installs concurrent OVERLAP_F_B (the ``overlap_f_b`` patch).

A schedule of stock torch opts in by registering ``overlap.overlap_f_b``.  Here
the patch table puts :class:`_FunctionMapWithOverlap` over the runtime's
default custom-function map, so every ``_PipelineScheduleRuntime`` built
while the package is patched runs OVERLAP_F_B with :func:`default_overlap_f_b`;
opt out globally with ``TORCH_PIPELINING_EXT_OVERLAP=0`` (schedules built
while it is set do not get it) or per schedule by registering another
OVERLAP_F_B function.  :func:`_register_fork_rng_hook` and
:func:`_make_fork_rng` add a hook registry to ``torch.random.fork_rng``
that torch lacks, see [Note: fork_rng hooks].
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext import _schedule_runtime
from torch_pipelining_ext.overlap import _collectives, _marks
from torch_pipelining_ext.overlap._handler import overlap_f_b


__all__: list[str] = []

OVERLAP_ENV = "TORCH_PIPELINING_EXT_OVERLAP"


def overlap_enabled() -> bool:
    """False when ``$TORCH_PIPELINING_EXT_OVERLAP`` is ``0`` (opt out globally)."""
    return os.environ.get(OVERLAP_ENV, "1").strip() != "0"


def _patch_applied() -> bool:
    """Whether the ``overlap_f_b`` patch is applied now.

    (A schedule built before ``unpatch()`` keeps its map.)
    """
    from torch.distributed.pipelining import schedules

    descriptor = inspect.getattr_static(
        schedules._PipelineScheduleRuntime, _schedule_runtime._FUNCTION_MAP, None
    )
    return isinstance(descriptor, _FunctionMapWithOverlap)


def default_overlap_f_b(action: Any, ctx: Any) -> None:
    """The OVERLAP_F_B function a patched schedule starts with.

    :func:`~torch_pipelining_ext.overlap._handler.overlap_f_b` while the
    patch is applied; once ``unpatch()`` has removed the schedule methods the
    handler calls, the sub-actions one after the other.
    """
    if _patch_applied():
        overlap_f_b(action, ctx)
    else:
        _schedule_runtime.sequential_overlap_f_b(action, ctx)


class _FunctionMapWithOverlap(_schedule_runtime._FunctionMapWithDefaults):
    """The runtime's default function map, :func:`default_overlap_f_b` for OVERLAP_F_B.

    Installed over ``_schedule_runtime._FunctionMapWithDefaults`` by the
    ``overlap_f_b`` patch: a schedule created while it is installed runs
    OVERLAP_F_B concurrently, unless ``$TORCH_PIPELINING_EXT_OVERLAP`` is
    ``0`` then (its map holds the sequential handler).  Nothing else of the
    schedule changes: the step loop finds the function as it finds any
    registered one, and registering another OVERLAP_F_B function -- the
    per-schedule opt-out -- replaces it without a warning.
    """

    def overlap_function(self) -> Callable[..., None]:
        if not overlap_enabled():
            return _schedule_runtime.sequential_overlap_f_b
        # a schedule is built: coordinate collectives from now on, registered
        # before the step's threads run (see [Note: collectives in an
        # overlapped action])
        _collectives.install()
        return default_overlap_f_b

    def is_default(self, computation_type: Any, function: Any) -> bool:
        # the OVERLAP_F_B default depends on the environment when the map was made
        from torch.distributed.pipelining import schedules

        if computation_type == schedules.OVERLAP_F_B:
            return (
                function is default_overlap_f_b
                or function is _schedule_runtime.sequential_overlap_f_b
            )
        return super().is_default(computation_type, function)


# [Note: fork_rng hooks]
# The package adds to torch.random (no upstream patch: the overlap's RFC,
# tools/upstream/rfc-overlap-f-b/RFC.md, asks core for it): a hook
# registered with _register_fork_rng_hook(hook) is called as hook(devices,
# enabled, device_type) whenever fork_rng is entered, and the context manager it
# returns is entered before fork_rng saves the generator states and exited
# after it restores them.  The overlap's hook (_marks._fork_rng_window) opens
# an RNG window on the backward side of an overlapped action.  On torches
# without it the patch table installs these two.
_ForkRngHook = Callable[[Any, bool, str | None], AbstractContextManager[object]]


class _ForkRngHooks:
    """The hooks of [Note: fork_rng hooks], in registration order (one per process)."""

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, _ForkRngHook] = OrderedDict()

    def register(self, hook: _ForkRngHook) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)  # holds a weak reference to the dict
        self._hooks[handle.id] = hook
        return handle

    def hooks(self) -> tuple[_ForkRngHook, ...]:
        return tuple(self._hooks.values())


_FORK_RNG_HOOKS = _ForkRngHooks()


def _register_fork_rng_hook(hook: _ForkRngHook) -> RemovableHandle:
    """``torch.random._register_fork_rng_hook``: see [Note: fork_rng hooks]."""
    return _FORK_RNG_HOOKS.register(hook)


def _make_fork_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.random.fork_rng`` entering the registered hooks around the original."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    @contextlib.contextmanager
    def fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        with contextlib.ExitStack() as hooks:
            for hook in _FORK_RNG_HOOKS.hooks():
                hooks.enter_context(
                    hook(
                        arguments.get("devices"),
                        bool(arguments.get("enabled", True)),
                        arguments.get("device_type"),
                    )
                )
            with original(*args, **kwargs):
                yield

    return fork_rng


def cleanup() -> None:
    """What ``unpatch()`` removes besides the patch's targets.

    The coordination kernels of the collectives and the overlap's own
    ``fork_rng`` hook, both registered by the first overlapped action (or
    schedule) after ``patch()``; the next one registers them again.
    """
    _collectives.uninstall()
    _marks._FORK_RNG_WINDOW.remove()
