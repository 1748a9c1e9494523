"""How this package installs concurrent OVERLAP_F_B on torch (the ``overlap_f_b`` patch).

Upstream, a schedule opts in by registering ``ep_overlap.overlap_f_b``.  Here
the patch table puts :class:`_FunctionMapWithOverlap` over the runtime's
default custom-function map, so every ``_PipelineScheduleRuntime`` built
while the package is patched runs OVERLAP_F_B with :func:`default_overlap_f_b`;
opt out globally with ``TORCH_PIPELINING_EXT_OVERLAP=0`` (schedules built
while it is set do not get it) or per schedule by registering another
OVERLAP_F_B function.  :func:`_make_fork_rng` is the ``torch.random.fork_rng``
hook of [Note: random numbers in an overlapped action] (``_rng.py``), which
upstream would place in ``torch.random`` or ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_pipelining_ext import _schedule_runtime
from torch_pipelining_ext.overlap import _marks as _ep_marks
from torch_pipelining_ext.overlap._handler import overlap_f_b
from torch_pipelining_ext.overlap._rng import _RNGDevices
from torch_pipelining_ext.overlap._turns import _Side


__all__: list[str] = []

OVERLAP_ENV = "TORCH_PIPELINING_EXT_OVERLAP"


def overlap_enabled() -> bool:
    """False when ``$TORCH_PIPELINING_EXT_OVERLAP`` is ``0`` (opt out globally)."""
    return os.environ.get(OVERLAP_ENV, "1").strip() != "0"


def _patch_applied() -> bool:
    """Whether the ``overlap_f_b`` patch is applied now (a schedule built before ``unpatch()`` keeps its map)."""
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
    """The runtime's default custom-function map, with :func:`default_overlap_f_b` for OVERLAP_F_B.

    Installed over ``_schedule_runtime._FunctionMapWithDefaults`` by the
    ``overlap_f_b`` patch: a schedule created while it is installed runs
    OVERLAP_F_B concurrently, unless ``$TORCH_PIPELINING_EXT_OVERLAP`` is
    ``0`` then (its map holds the sequential handler).  Nothing else of the
    schedule changes: the step loop finds the function as it finds any
    registered one, and registering another OVERLAP_F_B function -- the
    per-schedule opt-out -- replaces it without a warning.
    """

    def overlap_function(self) -> Callable[..., None]:
        return (
            default_overlap_f_b
            if overlap_enabled()
            else _schedule_runtime.sequential_overlap_f_b
        )

    def is_default(self, computation_type: Any, function: Any) -> bool:
        # the OVERLAP_F_B default depends on the environment when the map was made
        from torch.distributed.pipelining import schedules

        if computation_type == schedules.OVERLAP_F_B:
            return (
                function is default_overlap_f_b
                or function is _schedule_runtime.sequential_overlap_f_b
            )
        return super().is_default(computation_type, function)


def _rng_devices(devices: Any, device_type: str | None) -> _RNGDevices:
    """The generators ``torch.random.fork_rng(devices, device_type=...)`` forks, resolved as it does."""
    if device_type == "meta":
        return _RNGDevices(None, ())
    if device_type is None:
        accelerator = (
            torch.accelerator.current_accelerator()
            if hasattr(torch, "accelerator")
            else None
        )
        device_type = accelerator.type if accelerator is not None else "cuda"
    module = torch.get_device_module(device_type)
    if devices is None:
        devices = range(module.device_count())
    indices = tuple(
        d if isinstance(d, int) else (torch.device(d).index or 0) for d in devices
    )
    return _RNGDevices(device_type, indices)


def _make_fork_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.random.fork_rng`` that, on the backward side of an overlapped action, opens an RNG window.

    Activation checkpointing recomputes inside ``fork_rng``; see [Note:
    random numbers in an overlapped action] in ``_rng.py``.  Anywhere
    else it is the original.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    @contextlib.contextmanager
    def fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
        binding = _ep_marks._current_binding()
        if binding is None or binding.side is not _Side.BACKWARD:
            with original(*args, **kwargs):
                yield
            return
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        devices = _rng_devices(
            bound.arguments.get("devices"), bound.arguments.get("device_type")
        )
        preserve = bool(bound.arguments.get("enabled", True))
        with binding.coordinator.rng_window(binding.side, devices, preserve):
            with original(*args, **kwargs):
                yield

    return fork_rng
