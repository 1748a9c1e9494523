"""The overlap's process-wide settings, in one object: :data:`SETTINGS`.

And :class:`Registration`, a hook the process registers at most once.

The public functions of ``overlap`` (``set_wait_timeout``,
``observe_actions``, ``register_thread_state``) change it; the coordinator
and the handler read it when an action starts.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch.utils.hooks import RemovableHandle

from torch_pipelining_ext.overlap.policy import HAND_OVER_MIN_REGION_S


__all__: list[str] = []

TIMEOUT_ENV = "TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT"
DEFAULT_WAIT_TIMEOUT_S = 600.0

_Capture = Callable[[], Any]
_Apply = Callable[[Any], AbstractContextManager[Any]]


def check_timeout(value: object, source: str) -> float:
    """``value`` as a timeout in seconds: a positive number, ``math.inf`` for none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{source}: the timeout must be a number of seconds, got "
            f"{type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(
            f"{source}: the timeout must be a positive number of seconds "
            f"(inf: no limit), got {value!r}"
        )
    return seconds


class _OverlapSettings:
    """Everything about the overlap that holds for the whole process.

    Attributes:
        wait_timeout_s: set by ``overlap.set_wait_timeout`` (``None``: the
            environment variable, else :data:`DEFAULT_WAIT_TIMEOUT_S`).
        observer: the ``overlap.ActionObserver`` of ``observe_actions``
            (``None``: nothing is timed).
        thread_state_hooks: handle id -> (capture, apply) of
            ``overlap.register_thread_state``, in registration order.
        hand_over_min_region_s: regions shorter than this are not handed
            over (see [Note: the overlap rule]).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wait_timeout_s: float | None = None
        self.observer: Any = None
        self.thread_state_hooks: OrderedDict[int, tuple[_Capture, _Apply]] = (
            OrderedDict()
        )
        self.hand_over_min_region_s = HAND_OVER_MIN_REGION_S

    def set_wait_timeout(self, seconds: float | None) -> None:
        self.wait_timeout_s = (
            None if seconds is None else check_timeout(seconds, "set_wait_timeout")
        )

    def wait_timeout(self) -> float:
        """The timeout in effect, in seconds (``math.inf``: none)."""
        if self.wait_timeout_s is not None:
            return self.wait_timeout_s
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        if not env:
            return DEFAULT_WAIT_TIMEOUT_S
        try:
            value = float(env)
        except ValueError:
            raise ValueError(
                f"${TIMEOUT_ENV}={env!r} is not a number of seconds (inf: no limit)"
            ) from None
        try:
            return check_timeout(value, f"${TIMEOUT_ENV}={env!r}")
        except ValueError as e:
            raise ValueError(str(e)) from None

    def swap_observer(self, observer: Any) -> Any:
        """Make ``observer`` the one later actions report to; returns the previous one."""
        with self.lock:
            previous, self.observer = self.observer, observer
        return previous


SETTINGS = _OverlapSettings()


class Registration:
    """A hook registered at most once per process, until :meth:`remove`.

    Args:
        register: registers the hook and returns its handle (``None``:
            nothing registered, :meth:`register` asks again next time).
    """

    def __init__(self, register: Callable[[], RemovableHandle | None]) -> None:
        self._register = register
        self._lock = threading.Lock()
        self.handle: RemovableHandle | None = None

    def register(self) -> RemovableHandle | None:
        """Register the hook unless it is registered; its handle."""
        with self._lock:
            if self.handle is None:
                self.handle = self._register()
            return self.handle

    def remove(self) -> None:
        with self._lock:
            handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()
