"""Random-number generator windows of an overlapped OVERLAP_F_B action.

The turn-taking (``_ep_turns._CommCoordinator``) decides *when* the generators
move between the two sides; this module keeps *what* moves.  See [Note:
random numbers in an overlapped action].
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: random numbers in an overlapped action]
# Under the sequential handler the forward sub-action draws from the process's
# generators (CPU and accelerator) and the backward draws nothing, except
# inside activation-checkpointing recomputation, which torch.utils.checkpoint
# runs inside torch.random.fork_rng: it installs the states saved in the
# original forward and puts the previous ones back afterwards.  Run
# concurrently, the two threads would share one generator: the forward would
# draw from the recomputation's states and the recomputation's exit would
# discard the forward's draws.
#
# So fork_rng on the backward side opens an "RNG window" (a fork_rng hook,
# see [Note: fork_rng hooks] in torch/random.py).  Outside windows the forward
# side owns the generators.  Inside one, exactly one side may compute at a
# time -- the owner -- and ownership moves only while the other side is
# parked: blocked in the coordinator, inside a communication region (marked
# communication draws no random numbers), or finished.  Each move saves the
# generator states of the side that stops and installs those of the side that
# resumes, so each side draws its own sequence, as it would alone.  The
# outermost window's exit installs the forward side's current states.  Windows
# cannot deadlock the turn-taking: every wait of the coordinator parks its
# side, and a side that starts waiting wakes the other if that one waits too
# (it may be waiting for exactly this side to park).  A window with RNG
# preservation off (checkpoint(..., preserve_rng_state=False)) has no states
# to replay; if its recomputation draws numbers, the numbers the sequential
# handler would draw are not known yet, so it raises instead of giving other
# results.


class _RNGState(NamedTuple):
    """The random-number generator states one side of an action draws from."""

    cpu: torch.Tensor
    device_states: tuple[torch.Tensor, ...]


class _RNGDevices(NamedTuple):
    """The generators an RNG window covers: CPU's, ``devices`` of ``device_type``."""

    device_type: str | None
    devices: tuple[int, ...]

    def capture(self) -> _RNGState:
        states: tuple[torch.Tensor, ...] = ()
        if self.devices:
            module = torch.get_device_module(self.device_type)
            states = tuple(module.get_rng_state(d) for d in self.devices)
        return _RNGState(torch.get_rng_state(), states)

    def install(self, state: _RNGState) -> None:
        torch.set_rng_state(state.cpu)
        if self.devices:
            module = torch.get_device_module(self.device_type)
            for d, s in zip(self.devices, state.device_states):
                module.set_rng_state(s, d)

    def drew_since(self, start: _RNGState) -> bool:
        """Whether the generators moved on from ``start``."""
        now = self.capture()
        return not torch.equal(now.cpu, start.cpu) or any(
            not torch.equal(a, b)
            for a, b in zip(now.device_states, start.device_states)
        )


def _rng_devices(
    devices: Iterable[int | str | torch.device] | None, device_type: str | None
) -> _RNGDevices:
    """The generators ``fork_rng(devices, device_type=...)`` forks, found as it does."""
    if device_type == "meta":
        return _RNGDevices(None, ())
    if device_type is None:
        accelerator = torch.accelerator.current_accelerator()
        device_type = accelerator.type if accelerator is not None else "cuda"
    module = torch.get_device_module(device_type)
    if devices is None:
        devices = range(module.device_count())
    indices = tuple(
        d if isinstance(d, int) else (torch.device(d).index or 0) for d in devices
    )
    return _RNGDevices(device_type, indices)


class _RNGWindowState(enum.Enum):
    """Whose generator states are installed (sides as in ``_ep_turns._Side``)."""

    CLOSED = "no window: the forward side's"
    WINDOW_OWNER = "in a window: the side that opened it"
    OTHER = "in a window: the other side's"


class _RNGWindows:
    """The RNG windows of one side of one action (nested ``fork_rng`` calls).

    Not thread-safe: the coordinator calls it with its lock held, and only
    once the side that gives the generators up is parked.

    Args:
        side: the side whose ``fork_rng`` calls open windows (the backward side).
        other: the side that owns the generators outside windows.
    """

    def __init__(self, side: int, other: int) -> None:
        self.side, self.other = side, other
        self.state = _RNGWindowState.CLOSED
        # the side's region depth when each open window began
        self.depths: list[int] = []
        self._devices = _RNGDevices(None, ())
        # the states of the side that does not own the generators
        self._saved: dict[int, _RNGState] = {}

    @property
    def is_open(self) -> bool:
        return bool(self.depths)

    def owner(self) -> int:
        if self.state is _RNGWindowState.WINDOW_OWNER:
            return self.side
        return self.other

    def begin(self, devices: _RNGDevices, region_depth: int) -> bool:
        """Open a window at ``region_depth``; the outermost one takes the generators.

        Returns whether it is the outermost.
        """
        outermost = not self.depths
        if outermost:
            self._devices = devices
            self._saved = {self.other: devices.capture()}
            self.state = _RNGWindowState.WINDOW_OWNER
        self.depths.append(region_depth)
        return outermost

    def end(self) -> None:
        """Close the innermost window; the outermost one gives the generators back."""
        self.depths.pop()
        if self.depths:
            return
        saved = self._saved.get(self.other)
        if saved is not None:
            self._devices.install(saved)
        self._saved = {}
        self.state = _RNGWindowState.CLOSED

    def hand_to(self, side: int) -> None:
        """Inside a window: save the owner's states and install ``side``'s."""
        if not self.depths or self.owner() == side:
            return
        self._saved[self.owner()] = self._devices.capture()
        saved = self._saved.pop(side, None)
        if saved is not None:
            self._devices.install(saved)
        self.state = (
            _RNGWindowState.WINDOW_OWNER if side == self.side else _RNGWindowState.OTHER
        )
        logger.debug("overlap: random-number generators handed to side %d", side)

    def saved_state_of_other(self) -> _RNGState | None:
        """The other side's states when the outermost window began."""
        return self._saved.get(self.other)

    def drew_since(self, start: _RNGState) -> bool:
        return self._devices.drew_since(start)
