"""The rule the two sides of an overlapped OVERLAP_F_B action follow.

Pure functions of what each side has done so far -- no threads, no clock, no
torch -- so that the runtime's coordinator (``overlap/_turns.py``) and the
schedule simulator (``torch_pipelining_ext.sim``) apply one rule.  See [Note:
the overlap rule].
"""

from __future__ import annotations

import enum


__all__ = [
    "HAND_OVER_MIN_REGION_S",
    "Order",
    "Side",
    "hands_over",
    "may_compute_on",
    "may_start",
    "may_take_turn",
    "order_of",
]


class Side(enum.IntEnum):
    """The two sides of an overlapped action."""

    FORWARD = 0
    BACKWARD = 1

    @property
    def other(self) -> Side:
        return _OTHER[self]

    @property
    def thread_name(self) -> str:
        return "forward" if self is Side.FORWARD else "backward"


_OTHER = {Side.FORWARD: Side.BACKWARD, Side.BACKWARD: Side.FORWARD}


class Order(enum.Enum):
    """How one collective of an overlapped action is ordered against the other side's.

    * ``STRICT``: the collective uses a communicator both sides may use.  Such
      collectives take turns, the backward side first, identically on every
      rank (see :func:`may_take_turn`).
    * ``FREE``: the collective uses the side's own communicator (the twin of
      an expert-parallel group, ``overlap.side_group``) on a backend where
      two communicators may be used at once in any order (gloo).  It waits for
      nobody.
    """

    STRICT = "strict"
    FREE = "free"


# [Note: the overlap rule]
# Collectives.  Every collective either side issues during an overlapped
# action (marked or not) has an Order.  STRICT collectives of the two sides
# take turns: a side holds the turn from its first STRICT collective to the
# end of the region that contains it (a marked region, or the implicit region
# around one unmarked collective); turns alternate, the backward side first,
# and only a side that is done gives up its turns -- a side waiting for its
# input keeps them, so that the order of the STRICT collectives is the same
# on every rank whatever the timing.  FREE collectives run on the side's own
# communicator and wait for nobody: each side's collectives are in program
# order there, the two sides need no common order.
#
# Compute.  On CPU the two threads share the processor, so compute is handed
# over at region boundaries instead of competed for (the phase pattern of
# DualPipe: one side computes while the other communicates):
# * may_start: the backward side computes first; the forward side starts
#   once the backward side has opened a region, is done, or waits for its
#   input (long enough to hand over, see hands_over);
# * hands_over / may_compute_on: a side that leaves a region at least
#   HAND_OVER_MIN_REGION_S long lets the other side's compute run to its next
#   boundary: it computes on only once the other side has opened a region
#   since, or is not computing (inside a region, parked, waiting for its
#   input, done).  A shorter region is not handed over: waking the other
#   thread costs tens to hundreds of microseconds, more than a shorter region
#   can hide.
# Hand-overs change when each side computes, never the order of the STRICT
# collectives.
HAND_OVER_MIN_REGION_S = 0.5e-3


def order_of(own_communicator: bool, free_order_backend: bool) -> Order:
    """The order of a collective on its side's own communicator or on a shared one.

    Args:
        own_communicator: the collective uses the communicator that belongs
            to the issuing side alone during the action.
        free_order_backend: the communicator's backend may run collectives
            of two communicators in any order (gloo; not NCCL until shown).
    """
    return Order.FREE if own_communicator and free_order_backend else Order.STRICT


def may_take_turn(has_turn: bool, other_holds_turn: bool, other_done: bool) -> bool:
    """Whether a side may issue a STRICT collective now (take the turn).

    ``other_done`` means finished (or failed), never "waiting for its input".
    """
    return not other_holds_turn and (has_turn or other_done)


def may_start(first: bool, other_regions: int, other_away: bool) -> bool:
    """Whether a side may compute for the first time in its sub-action.

    Args:
        first: the side computes first (the backward side).
        other_regions: regions the other side has opened so far.
        other_away: the other side is done, or waits for its input.
    """
    return first or other_away or other_regions > 0


def hands_over(region_s: float, min_region_s: float = HAND_OVER_MIN_REGION_S) -> bool:
    """Whether a side that left a region of ``region_s`` seconds waits for the other.

    (Before computing on: see :func:`may_compute_on`.)
    """
    return region_s >= min_region_s


def may_compute_on(
    other_regions: int, other_regions_at_hand_over: int, other_computing: bool
) -> bool:
    """Whether a side that handed over may compute on.

    It may once the other side has opened a region since, or is not
    computing: inside a region, parked (blocked), waiting for its input or
    done.
    """
    return not other_computing or other_regions > other_regions_at_hand_over
