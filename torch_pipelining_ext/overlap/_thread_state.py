"""The calling thread's state the backward thread of an overlapped action runs under.

See [Note: thread state of the backward thread].
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from torch_pipelining_ext.overlap._settings import SETTINGS


__all__: list[str] = []

# [Note: thread state of the backward thread]
# torch keeps per thread (at::ThreadLocalState, and Python state beside it)
# what changes the result of an op; a new thread starts from defaults.  The
# backward thread of an overlapped action gets the calling thread's, read
# when the action starts and entered around the backward sub-action, then
# left (the thread serves the next action of the step).  Python cannot copy
# at::ThreadLocalState as a whole, so each item is read and set with the
# getter and setter torch has for it (all present on 2.9 - 2.15):
#
#   item                          read with                                   set with
#   grad mode                     torch.is_grad_enabled                       torch.set_grad_enabled
#   inference mode                torch.is_inference_mode_enabled             torch.inference_mode
#   forward-AD grad mode          torch._C._is_fwd_grad_enabled               torch._C._set_fwd_grad_enabled
#   autocast (per device type)    torch.is_autocast_enabled(t), get_autocast_dtype(t),
#                                 torch.is_autocast_cache_enabled             torch.autocast(t, dtype, cache_enabled)
#   TorchFunctionMode stack       torch.overrides._get_current_function_mode_stack
#     (the default device:        (torch.set_default_device and ``with        torch._C._push_on_torch_function_stack /
#      torch.device contexts)      torch.device(...)`` are such modes)          _pop_torch_function_stack
#   TorchDispatchMode stack       torch.utils._python_dispatch._get_current_dispatch_mode_stack
#                                                                             ..._python_dispatch._push_mode / _pop_mode
#   saved-tensor hooks default    torch._C._autograd._top_saved_tensors_default_hooks
#                                                                             torch.autograd.graph.saved_tensors_hooks
#   saved-tensor hooks disabled   torch._C._autograd._saved_tensors_hooks_is_enabled and
#                                 ..._get_disabled_error_message              torch.autograd.graph.disable_saved_tensors_hooks
#   view replay                   torch._C._is_view_replay_enabled            torch.autograd._force_original_view_tracking
#   autograd multithreading       torch._C._is_multithreading_enabled         torch.autograd.set_multithreading_enabled
#   accelerator device            torch.accelerator.current_device_index      torch.accelerator.set_device_index
#   intra-op threads (OpenMP)     torch.get_num_threads                       torch.set_num_threads
#   contextvars                   contextvars.copy_context                    Context.run
#   other libraries' state        overlap.register_thread_state's capture     its apply
#
# The modes on the two stacks are the caller's objects, now on both threads:
# a mode set around step() sees the ops of both sides, from two threads.
# Not carried, because a new thread already sees them (process-wide): the
# default dtype, deterministic algorithms, anomaly mode, the profiler's
# state.  Not carried, because Python cannot reach them: functorch
# transforms (vmap, grad) active around the step, the JIT tracer.


@dataclasses.dataclass(frozen=True)
class _ThreadState:
    """The calling thread's state that the worker thread must run under."""

    grad_enabled: bool
    inference: bool
    fwd_grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) enabled
    autocast_cache: bool
    function_modes: tuple[Any, ...]
    dispatch_modes: tuple[Any, ...]
    saved_tensors_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None
    saved_tensors_hooks_disabled: str | None  # the error message, when disabled
    view_replay: bool
    multithreading: bool
    device_index: int | None  # current accelerator device
    profiling: bool
    num_threads: int
    context: contextvars.Context  # a copy of the caller's contextvars
    # other libraries' thread-local state: (apply, captured value), see
    # overlap.register_thread_state
    registered: tuple[tuple[Callable[[Any], Any], Any], ...]

    @staticmethod
    def capture() -> _ThreadState:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        autograd = torch._C._autograd
        # not in torch's stubs (torch's own callers ignore it too)
        hooks_enabled = autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
        return _ThreadState(
            grad_enabled=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            fwd_grad_enabled=torch._C._is_fwd_grad_enabled(),
            autocast=_autocast_state(),
            autocast_cache=torch.is_autocast_cache_enabled(),
            function_modes=tuple(_get_current_function_mode_stack()),
            dispatch_modes=tuple(_get_current_dispatch_mode_stack()),
            saved_tensors_hooks=autograd._top_saved_tensors_default_hooks(False),
            saved_tensors_hooks_disabled=None
            if hooks_enabled
            else autograd._saved_tensors_hooks_get_disabled_error_message(),
            view_replay=torch._C._is_view_replay_enabled(),
            multithreading=torch._C._is_multithreading_enabled(),
            device_index=_device_index(),
            profiling=torch.autograd.profiler._is_profiler_enabled,
            num_threads=torch.get_num_threads(),
            context=contextvars.copy_context(),
            registered=tuple(
                (apply, capture())
                for capture, apply in SETTINGS.thread_state_hooks.values()
            ),
        )

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block on this thread under the captured state, then restore its own."""
        with contextlib.ExitStack() as stack:
            if self.device_index is not None:
                torch.accelerator.set_device_index(self.device_index)
            if torch.get_num_threads() != self.num_threads:
                torch.set_num_threads(self.num_threads)
            for manager in self._autograd_modes():
                stack.enter_context(manager)
            for device_type, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, cache_enabled=self.autocast_cache
                    )
                )
            stack.enter_context(_modes_pushed(self.function_modes, self.dispatch_modes))
            for apply, value in self.registered:
                stack.enter_context(apply(value))
            yield

    def call_applied(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under :meth:`applied`."""
        with self.applied():
            return fn(*args)

    def _autograd_modes(self) -> list[AbstractContextManager[Any]]:
        managers: list[AbstractContextManager[Any]] = [
            torch.set_grad_enabled(self.grad_enabled),
            _fwd_grad_enabled(self.fwd_grad_enabled),
            torch.autograd._force_original_view_tracking(self.view_replay),
            torch.autograd.set_multithreading_enabled(self.multithreading),
        ]
        if self.inference:
            managers.append(torch.inference_mode(True))
        if self.saved_tensors_hooks is not None:
            managers.append(
                torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks)
            )
        if self.saved_tensors_hooks_disabled is not None:
            managers.append(
                torch.autograd.graph.disable_saved_tensors_hooks(
                    self.saved_tensors_hooks_disabled
                )
            )
        return managers


def _accelerator_available() -> bool:
    return hasattr(torch, "accelerator") and torch.accelerator.is_available()


def _device_index() -> int | None:
    return (
        torch.accelerator.current_device_index() if _accelerator_available() else None
    )


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    device_types = ["cpu"]
    if _accelerator_available():
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None  # an accelerator is available
        device_types.append(accelerator.type)
    return tuple(
        (dt, torch.get_autocast_dtype(dt))
        for dt in device_types
        if torch.is_autocast_enabled(dt)
    )


@contextlib.contextmanager
def _fwd_grad_enabled(enabled: bool) -> Iterator[None]:
    previous = torch._C._is_fwd_grad_enabled()
    torch._C._set_fwd_grad_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_fwd_grad_enabled(previous)


@contextlib.contextmanager
def _modes_pushed(
    function_modes: tuple[Any, ...], dispatch_modes: tuple[Any, ...]
) -> Iterator[None]:
    """This thread's mode stacks hold these modes (bottom first) until exit.

    The modes are pushed, not entered: ``__enter__`` of a mode is the
    caller's, done once.
    """
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    pushed_f = pushed_d = 0
    try:
        for mode in function_modes:
            torch._C._push_on_torch_function_stack(mode)
            pushed_f += 1
        for mode in dispatch_modes:
            _push_mode(mode)
            pushed_d += 1
        yield
    finally:
        for _ in range(pushed_d):
            _pop_mode()
        for _ in range(pushed_f):
            torch._C._pop_torch_function_stack()
