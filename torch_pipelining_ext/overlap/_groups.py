"""Per-side communicators of overlapped actions: twin process groups.

See [Note: twin groups].  ``overlap.create_twin_group`` and
``overlap.side_group`` are the public face.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import torch.distributed as dist

from torch_pipelining_ext.overlap.policy import Order, order_of, Side


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: twin groups]
# Both sides of an overlapped action may communicate over one group (the
# expert-parallel group).  With one communicator the two sides' collectives
# must be issued in one order on every rank, so they take turns (the strict
# rule of [Note: the overlap rule]) and a side waiting for its input holds
# the other back.  A twin is a second process group over the same ranks,
# created once, collectively, at set-up.  During an overlapped action the
# forward side uses the group itself and the backward side its twin; outside
# overlapped actions everything uses the group.  Each communicator then sees
# one side's collectives, in that side's program order, identically on every
# rank, and the two sides need no common order (where the backend allows:
# gloo; NCCL keeps the strict rule until shown safe, see overlap/__init__.py).
# Code must look the communicator up when it issues a collective
# (overlap.side_group), never reuse one captured earlier: the forward of a
# layer and its backward (or its recomputation) run on different sides.  A
# collective on the other side's communicator is refused: it would race with
# that side's collectives, which take no turns.

# Backends whose collectives on two communicators may be issued in any
# relative order without deadlock (each communicator progresses on its own).
_FREE_ORDER_BACKENDS = frozenset({"gloo"})


class _Twin(NamedTuple):
    group: dist.ProcessGroup  # the forward side's (and every plain action's)
    twin: dist.ProcessGroup  # the backward side's


class _TwinRegistry:
    """Twins by group name, both ways; one per process (``_REGISTRY``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, tuple[_Twin, Side]] = {}

    def add(self, twin: _Twin) -> None:
        with self._lock:
            self._by_name[twin.group.group_name] = (twin, Side.FORWARD)
            self._by_name[twin.twin.group_name] = (twin, Side.BACKWARD)

    def lookup(self, group: dist.ProcessGroup) -> tuple[_Twin, Side] | None:
        """The twin pair ``group`` belongs to, and the side it serves (None: none)."""
        if not self._by_name:
            return None
        return self._by_name.get(group.group_name)

    def clear(self) -> None:
        with self._lock:
            self._by_name.clear()


_REGISTRY = _TwinRegistry()


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"expected a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    return group


def twin_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The twin of ``group`` (``None``: it has none)."""
    found = _REGISTRY.lookup(_resolve(group))
    return None if found is None else found[0].twin


def group_for(group: dist.ProcessGroup | None, side: Side | None) -> dist.ProcessGroup:
    """The communicator ``side`` uses for ``group`` (``None``: not in an action)."""
    group = _resolve(group)
    found = _REGISTRY.lookup(group)
    if found is None:
        return group
    twin, _ = found
    return twin.twin if side is Side.BACKWARD else twin.group


def free_order_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s collectives may be ordered freely against another communicator's."""
    return str(dist.get_backend(group)) in _FREE_ORDER_BACKENDS


def communicator_owner(group: dist.ProcessGroup) -> Side | None:
    """The side that owns ``group`` during an action, if it is half of a twin pair."""
    found = _REGISTRY.lookup(group)
    return None if found is None else found[1]


def create_twin(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The body of ``overlap.create_twin_group``: a collective over the default group."""
    group = _resolve(group)
    existing = twin_of(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    backend = str(dist.get_backend(group))
    # Every rank learns every rank's group (twins are created by every rank of
    # the default group, in one order); a rank whose group already has a twin
    # still takes part.
    everyone: list[tuple[tuple[int, ...], str, bool] | None] = [None] * (
        dist.get_world_size()
    )
    dist.all_gather_object(everyone, (ranks, backend, existing is not None))
    wanted = sorted({(r, b) for r, b, has in everyone if not has})  # type: ignore[misc]
    for other_ranks, other_backend in wanted:
        same = {(b, has) for r, b, has in everyone if r == other_ranks}  # type: ignore[misc]
        if len(same) != 1:
            raise ValueError(
                f"create_twin_group: the ranks {list(other_ranks)} passed one "
                "group with different backends, or a group some of them had "
                f"already twinned ({sorted(same)}): every rank of a group must "
                "call create_twin_group for it at the same time"
            )
        made = dist.new_group(list(other_ranks), backend=other_backend)
        if other_ranks == ranks and existing is None:
            existing = made
            _REGISTRY.add(_Twin(group, made))
            logger.debug(
                "overlap: twin %s of group %s (ranks %s, %s)",
                made.group_name,
                group.group_name,
                list(ranks),
                backend,
            )
    assert existing is not None
    return existing


class CollectiveOrderError(RuntimeError):
    """A collective of an overlapped action was issued on the other side's communicator."""


def describe(group: dist.ProcessGroup) -> str:
    """``group``'s name for messages (with its description, where it has one)."""
    desc = getattr(group, "group_desc", "") or ""
    return group.group_name + (f" ({desc})" if desc else "")


def order_for(op_name: str, group: dist.ProcessGroup, side: Side, where: str) -> Order:
    """How ``side``'s collective ``op_name`` on ``group`` is ordered.

    Raises:
        CollectiveOrderError: ``group`` is the other side's own communicator.
    """
    owner = communicator_owner(group)
    if owner is None:  # no twin: a communicator both sides may use
        return Order.STRICT
    free_backend = free_order_backend(group)
    if owner is not side and free_backend:
        mine = group_for(group, side)
        raise CollectiveOrderError(
            f"{where}: the {side.thread_name} side issued {op_name} on group "
            f"{describe(group)}, the {owner.thread_name} side's communicator of "
            f"a twin pair (overlap.create_twin_group); the {side.thread_name} "
            f"side must use {describe(mine)}. Look the group up with "
            "overlap.side_group(group) when the collective is issued (a "
            "backward must not reuse the group its forward captured)."
        )
    return order_of(owner is side, free_backend)
