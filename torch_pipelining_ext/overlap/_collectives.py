"""Every collective an overlapped action issues, coordinated: see [Note: collectives in an overlapped action]."""

from __future__ import annotations

import functools
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
# operators: the package registers, once, a kernel per operator that takes a
# ProcessGroup, at a dispatch key only the threads of an action reach (see
# [Note: where the coordination kernels sit]).  The kernel looks up the
# overlapped action its thread runs a side of (a thread-local binding, see
# _marks.py); on any other thread it passes the call on at once.  Inside an
# action it issues the collective inside a region of its side (the implicit
# region of an unmarked collective), taking the STRICT turn unless the
# collective is FREE (the side's own twin communicator, see [Note: twin
# groups]).  What is ordered is the issue: an async collective's wait() may
# come later, anywhere.
#
# The kernels are registered when the first schedule that runs OVERLAP_F_B
# concurrently is built (or the first overlapped action runs), so a process
# that never overlaps has none; unpatch() removes them.  Registration happens
# once per process on the thread that builds the schedule, normally before
# any other thread issues collectives (the dispatcher does not guard dispatch
# against a concurrent registration).
#
# A collective on the other side's own communicator is refused before it is
# issued (it would race with that side's FREE collectives); every rank of the
# group runs the same program, so every rank refuses it at the same point.

# [Note: where the coordination kernels sit]
# A Python kernel costs every call that reaches it a Python call (the
# interpreter lock, boxing the arguments: tools/bench_overlap.py part 3 shows
# tens of microseconds on a loaded machine).  Registered at c10d's
# BackendSelect key, which every dispatch passes, it would cost every
# collective of the process that much, FSDP2's hundreds a step included, from
# the first overlapping schedule until unpatch().  So the kernels sit at the
# PythonTLSSnapshot key instead, and _marks.bound() adds that key to the
# thread-local include set of the two threads of an action, for as long as
# they run a side: any other thread's collectives never reach a kernel and pay
# nothing (a thread under a TorchDispatchMode has the key too: its
# collectives reach the kernel, which passes them on).  The choice, measured against the alternatives:
#
# * Installing the BackendSelect kernels for the duration of each action
#   costs about 0.1 ms per action, and must not race a collective another
#   thread dispatches meanwhile (registration is not guarded against
#   dispatch): no good where a data loader or checkpoint thread communicates.
# * Keys whose only aten kernels are fallthroughs (PreDispatch, or the
#   tracer's key) cost the threads of an action nothing per operator, but a
#   higher-order operator (torch.cond, flex_attention, which torch.compile
#   traces) refuses a key it does not know: compiling inside an action fails.
# * PythonTLSSnapshot is one of the keys higher-order operators pass through,
#   and what every TorchDispatchMode adds to its thread already: its fallback
#   snapshots the thread's dispatch keys and passes every operator on.  That
#   boxed fallback costs the threads of an action about 0.1 us per operator
#   (a 4-element add, 7% on this machine; not measurable in a small MLP's
#   forward and backward), and entering and leaving the key about 1 us per
#   side; part 3 of the benchmark reports both beside the cost outside an
#   action.
#
# An operator that already has a kernel at PythonTLSSnapshot (not in any
# release we know) gets its kernel at BackendSelect, where every collective
# of the process reaches it (with a warning); _Interception.operators says
# where each one sits.  Code that replaces a thread's whole dispatch-key set
# with one saved elsewhere (the autograd functions of some higher-order
# operators run their backward under the forward's set) leaves the key out
# of it: collectives inside such a backward on the backward side would not be
# coordinated.  The autograd engine's own threads inherit the set of the
# thread that started the backward, so they reach the kernels.


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


# Where the kernels may sit, in order of preference: see [Note: where the
# coordination kernels sit].
_THREAD_KEY = _marks.THREAD_KEY.name
_PERMANENT_KEY = "BackendSelect"


@functools.cache
def _thread_key_passes_modes() -> bool:
    """Whether a Python kernel at PythonTLSSnapshot runs under a TorchDispatchMode.

    Some releases' Python fallback asserts that PythonTLSSnapshot ran its own
    fallback first (``PythonFallbackKernel.cpp``: ``tls_on_entry``) when a
    dispatch mode is active (seen on 2.9 and 2.10, not on 2.13 or 2.15): a
    kernel there would break every collective under a mode, so those releases
    keep the kernels at BackendSelect (a Python call per collective).  Probed
    by behaviour, once, on an operator of the probe's own namespace.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    key = getattr(torch._C.DispatchKey, _THREAD_KEY)
    after = torch._C._dispatch_keyset_full_after(key)
    library = torch.library.Library("torch_pipelining_ext_key_probe", "DEF")
    try:
        library.define("passthrough(Tensor x) -> Tensor")
        library.impl("passthrough", lambda x: x.clone(), "CompositeExplicitAutograd")
        op = torch.ops.torch_pipelining_ext_key_probe.passthrough.default

        def kernel(keyset: Any, x: torch.Tensor) -> torch.Tensor:
            return op.redispatch(keyset & after, x)

        library.impl("passthrough", kernel, _THREAD_KEY, with_keyset=True)

        class _PassOn(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return func(*args, **(kwargs or {}))

        try:
            with _PassOn():
                op(torch.ones(1))
        except RuntimeError as e:
            if "tls_on_entry" not in str(e):
                raise
            return False
        return True
    finally:
        library._destroy()


def _keys() -> tuple[str, ...]:
    """The keys the kernels may sit at on this torch, in order of preference."""
    if _thread_key_passes_modes():
        return (_THREAD_KEY, _PERMANENT_KEY)
    return (_PERMANENT_KEY,)


class _Interception:
    """The coordination kernels of the ``c10d`` operators (one per process).

    Attributes:
        operators: the operators that have one, and the key each one's sits at.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._library: torch.library.Library | None = None
        self.operators: dict[str, str] = {}

    @property
    def installed(self) -> bool:
        return self._library is not None

    def install(self, keys: tuple[str, ...] | None = None) -> None:
        """Register a kernel per operator at the first of ``keys`` (default: :func:`_keys`) it has none at."""
        if keys is None:
            keys = _keys()
        with self._lock:
            if self._library is not None:
                return
            library = torch.library.Library("c10d", "IMPL")
            operators = {}
            for name, op, index in _collective_ops():
                free = [
                    key
                    for key in keys
                    if not torch._C._dispatch_has_kernel_for_dispatch_key(
                        op._schema.name, key
                    )
                ]
                if not free:
                    logger.warning(
                        "overlap: c10d::%s has kernels at %s; its collectives "
                        "are not coordinated in overlapped actions",
                        name,
                        ", ".join(keys),
                    )
                    continue
                if free[0] != keys[0]:
                    logger.warning(
                        "overlap: c10d::%s has a %s kernel; its coordination "
                        "kernel sits at %s, where every collective reaches it",
                        name,
                        keys[0],
                        free[0],
                    )
                library.impl(
                    name, _make_kernel(op, index, free[0]), free[0], with_keyset=True
                )
                operators[name] = free[0]
            self._library, self.operators = library, operators
            logger.debug("overlap: coordinating %d c10d operators", len(operators))

    def uninstall(self) -> None:
        with self._lock:
            library, self._library, self.operators = self._library, None, {}
            if library is not None:
                library._destroy()


def _make_kernel(op: Any, index: int, key: str) -> Callable[..., Any]:
    name = op._schema.name.partition("::")[2]
    after = torch._C._dispatch_keyset_full_after(getattr(torch._C.DispatchKey, key))

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
