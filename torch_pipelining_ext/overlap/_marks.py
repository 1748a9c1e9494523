"""The communication marks of ``torch_pipelining_ext.overlap`` and the threads they bind to.

A mark finds the coordinator (``_turns._CommCoordinator``) of the
overlapped action its thread runs a side of -- through a thread-local binding
set by :func:`bound`, or, for the autograd engine's device threads, the one
overlapped backward running in the process -- and passes its boundary there.
A bound thread reaches the coordination kernels of the ``c10d`` operators
(:data:`THREAD_KEY`).
A collective issued on such a thread goes through :meth:`_Binding.collective`
(see [Note: collectives in an overlapped action]).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext.overlap import _draws, _groups
from torch_pipelining_ext.overlap._rng import _rng_devices
from torch_pipelining_ext.overlap._settings import Registration, SETTINGS
from torch_pipelining_ext.overlap._turns import _CommCoordinator
from torch_pipelining_ext.overlap.policy import Side


__all__: list[str] = []


class _Boundary(enum.Enum):
    """A mark; ``opens`` says whether it opens its region in forward."""

    DISPATCH_BEGIN = ("dispatch", True)
    DISPATCH_END = ("dispatch", False)
    COMBINE_BEGIN = ("combine", True)
    COMBINE_END = ("combine", False)

    def __init__(self, phase: str, opens: bool) -> None:
        self.phase = phase
        self.opens = opens

    def describe(self, backward: bool) -> str:
        name = f"{self.phase}_{'begin' if self.opens else 'end'}"
        if not backward:
            return f"{name} (forward)"
        # autograd runs the marks in reverse: *_end opens the backward region
        return f"{name} (backward of the {self.phase} communication)"


class _Binding(NamedTuple):
    """A thread runs ``side`` of the action ``coordinator`` coordinates."""

    coordinator: _CommCoordinator
    side: Side

    def collective(
        self, op_name: str, group: dist.ProcessGroup, issue: Callable[[], Any]
    ) -> Any:
        """Run ``issue`` (the collective ``op_name`` on ``group``) coordinated."""
        local = _BINDINGS.local
        if getattr(local, "issuing", False):
            return issue()  # a collective issuing another one: already coordinated
        coordinator = self.coordinator
        where = f"rank {coordinator.rank}, action {coordinator.action}"
        order = _groups.order_for(op_name, group, self.side, where)
        with coordinator.collective(self.side, op_name, group.group_name, order):
            local.issuing = True
            try:
                return issue()
            finally:
                local.issuing = False


# The dispatch key of the coordination kernels: a thread reaches them while it
# runs a side (see [Note: where the coordination kernels sit]).
THREAD_KEY = torch._C.DispatchKey.PythonTLSSnapshot


class _Bindings:
    """Which side of which overlapped action the threads run (one per process: ``_BINDINGS``).

    A thread that :func:`bound` binds finds its binding in ``local`` (with
    ``issuing``: it is issuing a coordinated collective).  The backward sides
    running in the process are kept too, for the threads that are not bound:
    the autograd engine runs backward nodes of accelerator tensors on its own
    device threads, which did not call :func:`bound`.
    """

    def __init__(self) -> None:
        self.local = threading.local()
        self._lock = threading.Lock()
        self._backward: list[_Binding] = []

    def backward_sides(self) -> list[_Binding]:
        with self._lock:
            return list(self._backward)

    def current(self) -> _Binding | None:
        """This thread's binding (an engine thread's: the one backward side)."""
        binding = getattr(self.local, "binding", None)
        if binding is None and self._backward:
            return self._engine_thread_binding()
        return binding

    @contextmanager
    def bind(self, binding: _Binding) -> Iterator[None]:
        """Bind this thread to ``binding`` until exit, then to what it had."""
        previous = getattr(self.local, "binding", None)
        self.local.binding = binding
        backward = binding.side is Side.BACKWARD
        if backward:
            with self._lock:
                self._backward.append(binding)
        try:
            yield
        finally:
            self.local.binding = previous
            if backward:
                with self._lock:
                    self._backward.remove(binding)

    def _engine_thread_binding(self) -> _Binding | None:
        """The binding of an autograd device thread running an overlapped backward."""
        if not isinstance(threading.current_thread(), threading._DummyThread):
            # a Python thread that is not bound: not in an overlapped action
            return None
        if torch._C._current_graph_task_id() == -1:
            return None
        candidates = self.backward_sides()
        if len(candidates) > 1:
            actions = ", ".join(b.coordinator.action for b in candidates)
            raise RuntimeError(
                "torch_pipelining_ext.overlap: an autograd device thread reached a "
                f"communication boundary while {len(candidates)} overlapped actions "
                f"run backward in this process ({actions}); it cannot tell which one "
                "it belongs to. Run one pipeline schedule step at a time per process."
            )
        return candidates[0] if candidates else None


_BINDINGS = _Bindings()


# the binding of the calling thread (None: it runs no side)
_current_binding = _BINDINGS.current


@contextmanager
def bound(
    coordinator: _CommCoordinator,
    side: Side,
    before_start: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run ``side`` of ``coordinator``'s action on this thread: its marks coordinate.

    ``before_start`` runs before ``side`` starts (its input wait, see
    ``_CommCoordinator.await_inputs``).  On exit ``side`` is finished; on an
    exception the coordination is stopped first so the other side is
    released.
    """
    try:
        with (
            _BINDINGS.bind(_Binding(coordinator, side)),
            torch._C._IncludeDispatchKeyGuard(THREAD_KEY),
        ):
            if before_start is not None:
                before_start()
            coordinator.start(side)
            yield
    except BaseException:
        coordinator.stop()
        raise
    finally:
        coordinator.finish(side)


class _MarkBackward(torch.autograd.Function):
    """Identity whose backward passes the mirrored boundary."""

    @staticmethod
    def forward(
        ctx: Any, boundary: _Boundary, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.boundary = boundary
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        binding = _current_binding()
        if binding is not None:
            boundary: _Boundary = ctx.boundary
            where = boundary.describe(backward=True)
            if boundary.opens:  # *_begin: its backward ends the region
                binding.coordinator.close(binding.side, where)
            else:
                binding.coordinator.open(
                    binding.side, where, f"{boundary.phase} backward"
                )
        return (None, *grads)


def mark(boundary: _Boundary, tensors: tuple[Any, ...]) -> Any:
    """Pass ``boundary`` with ``tensors``: the body of the public marks."""
    binding = _current_binding()
    if binding is not None and boundary.opens:
        binding.coordinator.open(
            binding.side, boundary.describe(backward=False), boundary.phase
        )
    out: Any = tensors
    if torch.is_grad_enabled():
        idx = [
            i
            for i, t in enumerate(tensors)
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if idx:
            marked = _MarkBackward.apply(boundary, *(tensors[i] for i in idx))
            out = list(tensors)
            for i, t in zip(idx, marked):
                out[i] = t
            out = tuple(out)
    if binding is not None and not boundary.opens:
        binding.coordinator.close(binding.side, boundary.describe(backward=False))
    return out[0] if len(out) == 1 else out


def _flat_tensors_marked(boundary: _Boundary, tree: Any) -> Any:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if positions:
        marked = mark(boundary, tuple(leaves[i] for i in positions))
        if len(positions) == 1:
            marked = (marked,)
        for i, t in zip(positions, marked):
            leaves[i] = t
    else:  # nothing to mark: still pass the boundary so that regions pair up
        mark(boundary, ())
    return tree_unflatten(leaves, spec)


class _MarkedMethod:
    """A dispatch or combine method with the marks around it.

    Holds the original bound method (not a closure over it) so that
    ``copy.deepcopy`` of the module -- which stage splitting does -- rebinds
    it to the copy.
    """

    def __init__(
        self, fn: Callable[..., Any], begin: _Boundary, end: _Boundary
    ) -> None:
        self.fn = fn
        self.begin = begin
        self.end = end
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _flat_tensors_marked(self.begin, (args, kwargs))
        return _flat_tensors_marked(self.end, self.fn(*args, **kwargs))


# Attribute values that are never dispatcher objects.
_NOT_DISPATCHERS = (
    nn.Module,
    torch.Tensor,
    type,
    types.FunctionType,
    types.MethodType,
    functools.partial,
    str,
    bytes,
    int,
    float,
    list,
    tuple,
    dict,
    set,
    type(None),
)


def _dispatcher_candidates(target: object) -> Iterator[tuple[str, object]]:
    """``target``; if it is a module, its submodules and the plain objects they hold."""
    if not isinstance(target, nn.Module):
        yield "", target
        return
    for fqn, module in target.named_modules():
        yield fqn, module
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, _NOT_DISPATCHERS):
                continue
            yield f"{fqn}.{attr}" if fqn else attr, value


def wrap_dispatch_combine(
    target: nn.Module | object, dispatch: str, combine: str
) -> list[str]:
    """The body of ``overlap.wrap_dispatch_combine``."""
    if dispatch == combine:
        raise ValueError(
            "wrap_dispatch_combine: dispatch and combine must be different "
            f"methods, both are {dispatch!r}"
        )
    wrapped: list[str] = []
    seen: set[int] = set()
    for name, obj in _dispatcher_candidates(target):
        fns = [getattr(obj, method, None) for method in (dispatch, combine)]
        if id(obj) in seen or not all(callable(f) for f in fns):
            continue
        seen.add(id(obj))
        for method, fn, begin, end in (
            (dispatch, fns[0], _Boundary.DISPATCH_BEGIN, _Boundary.DISPATCH_END),
            (combine, fns[1], _Boundary.COMBINE_BEGIN, _Boundary.COMBINE_END),
        ):
            if isinstance(fn, _MarkedMethod):
                continue
            assert fn is not None  # both are callables (checked above)
            try:
                object.__setattr__(obj, method, _MarkedMethod(fn, begin, end))
            except AttributeError as e:
                raise TypeError(
                    f"wrap_dispatch_combine: cannot wrap {type(obj).__name__}."
                    f"{method} of {name or 'the target'!r}: {e}; mark the "
                    "communication in its code with dispatch_begin/dispatch_end "
                    "and combine_begin/combine_end instead"
                ) from e
        wrapped.append(name)
    if not wrapped:
        raise ValueError(
            f"wrap_dispatch_combine: nothing in {type(target).__name__} (itself, "
            f"a submodule, or an object a module holds) has both a {dispatch!r} "
            f"and a {combine!r} method"
        )
    return wrapped


def register_thread_state(
    capture: Callable[[], Any], apply: Callable[[Any], AbstractContextManager[Any]]
) -> RemovableHandle:
    """The body of ``overlap.register_thread_state``."""
    if not callable(capture) or not callable(apply):
        raise TypeError("register_thread_state: capture and apply must be callables")
    # RemovableHandle holds a weak reference to the OrderedDict
    handle = RemovableHandle(SETTINGS.thread_state_hooks)
    SETTINGS.thread_state_hooks[handle.id] = (capture, apply)
    return handle


@contextlib.contextmanager
def _fork_rng_window(
    devices: Any, enabled: bool, device_type: str | None
) -> Iterator[None]:
    """The ``torch.random.fork_rng`` hook: on the backward side, an RNG window.

    Activation checkpointing recomputes inside ``fork_rng``; see [Note: random
    numbers in an overlapped action].  On any other thread it does nothing.
    """
    binding = _current_binding()
    if binding is None or binding.side is not Side.BACKWARD:
        yield
        return
    window = binding.coordinator.rng_window(
        binding.side, _rng_devices(devices, device_type), enabled
    )
    with window, _draws.suspended():
        yield


# Registered by the first overlapped action, removed by unpatch().
_FORK_RNG_WINDOW = Registration(
    # installed on torch.random by the patch table (overlap._install), not in torch's stubs
    lambda: torch.random._register_fork_rng_hook(_fork_rng_window)  # type: ignore[attr-defined]
)


def side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The body of ``overlap.side_group``."""
    binding = _current_binding()
    return _groups.group_for(group, None if binding is None else binding.side)


def _make_backward_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """``BackwardCFunction.apply`` watching the backward side's random draws.

    See [Note: random numbers outside recomputation].
    """

    @functools.wraps(original)
    def apply(self: Any, *args: Any) -> Any:
        binding = _current_binding()
        if (
            binding is None
            or binding.side is not Side.BACKWARD
            or self._forward_cls is _MarkBackward  # the marks draw nothing
        ):
            return original(self, *args)
        with _draws._BackwardDraws(binding.coordinator, binding.side):
            return original(self, *args)

    return apply
