"""Every collective an overlapped action issues, coordinated: see [Note: collectives in an overlapped action]."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_pipelining_ext.overlap import _marks
from torch_pipelining_ext.overlap._operators import operators


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: collectives in an overlapped action]
# Two threads may not issue collectives on one communicator in an order that
# depends on timing: every rank must issue them in the same order.  So every
# collective either side of an overlapped action issues is coordinated, marked
# or not: torch.distributed's collectives and point-to-point operations (sync
# or async_op=True), batch_isend_irecv, functional collectives (DTensor's
# redistribute, FSDP2), collectives from C++ (DDP's reducer) and from custom
# ops or autograd backward.  They all reach torch's dispatcher as ``c10d::*``
# operators, whose ``BackendSelect`` entry is a fallthrough: the package
# registers there, once, a kernel per operator that takes a ProcessGroup.  The
# kernel looks up the overlapped action its thread runs a side of (a
# thread-local binding, see _marks.py); on any other thread it passes the
# call on at once.  Inside an action it issues the collective inside a region
# of its side (the implicit region of an unmarked collective), taking the
# STRICT turn unless the collective is FREE (the side's own twin
# communicator, see [Note: twin groups]).  What is ordered is the issue: an
# async collective's wait() may come later, anywhere.
#
# The kernels are registered when the first schedule that runs OVERLAP_F_B
# concurrently is built (or the first overlapped action runs), so a process
# that never overlaps pays nothing; afterwards each collective of the process
# passes one Python call (measured by tools/bench_overlap.py,
# ``collective_us``).  unpatch() removes them.  Registration happens once per
# process on the thread that builds the schedule, normally before any other
# thread issues collectives (the dispatcher does not guard dispatch against a
# concurrent registration).
#
# A collective on the other side's own communicator is refused before it is
# issued (it would race with that side's FREE collectives); every rank of the
# group runs the same program, so every rank refuses it at the same point.


def _process_group_index(op: Any) -> int | None:
    for i, argument in enumerate(op._schema.arguments):
        if "ProcessGroup" in str(argument.type):
            return i
    return None


def _collective_ops() -> list[tuple[str, Any, int]]:
    """(name, overload, index of its ProcessGroup argument) of every ``c10d::`` operator."""
    ops = []
    for name, _, op in operators("c10d"):
        index = _process_group_index(op)
        if index is not None:
            ops.append((name, op, index))
    return ops


class _Interception:
    """The ``BackendSelect`` kernels of the ``c10d`` operators (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._library: Any = None
        self.operators: tuple[str, ...] = ()

    @property
    def installed(self) -> bool:
        return self._library is not None

    def install(self) -> None:
        with self._lock:
            if self._library is not None:
                return
            after = torch._C._dispatch_keyset_full_after(
                torch._C.DispatchKey.BackendSelect
            )
            library = torch.library.Library("c10d", "IMPL")
            names = []
            for name, op, index in _collective_ops():
                if torch._C._dispatch_has_kernel_for_dispatch_key(
                    op._schema.name, "BackendSelect"
                ):
                    # torch's own kernel there (not a release we know): leave it
                    logger.warning(
                        "overlap: c10d::%s has a BackendSelect kernel; its "
                        "collectives are not coordinated in overlapped actions",
                        name,
                    )
                    continue
                library.impl(
                    name,
                    _make_kernel(op, index, after),
                    "BackendSelect",
                    with_keyset=True,
                )
                names.append(name)
            self._library, self.operators = library, tuple(names)
            logger.debug("overlap: coordinating %d c10d operators", len(names))

    def uninstall(self) -> None:
        with self._lock:
            library, self._library = self._library, None
            if library is not None:
                library._destroy()


def _make_kernel(op: Any, index: int, after: Any) -> Callable[..., Any]:
    name = op._schema.name.partition("::")[2]

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        binding = _marks._current_binding()
        if binding is None:
            return op.redispatch(keyset & after, *args, **kwargs)
        group = dist.ProcessGroup.unbox(args[index])
        return binding.collective(
            name, group, lambda: op.redispatch(keyset & after, *args, **kwargs)
        )

    return kernel


_INTERCEPTION = _Interception()


def install() -> None:
    """Coordinate every collective of overlapped actions from now on (idempotent)."""
    _INTERCEPTION.install()


def uninstall() -> None:
    """Remove the kernels (``unpatch()``)."""
    _INTERCEPTION.uninstall()
