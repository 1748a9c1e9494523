"""When the two sides of an overlapped OVERLAP_F_B action communicate and compute.

The turn-taking policy of ``_ep_turns._CommCoordinator``, as pure functions of
what each side has done so far: no threads, no clock, no torch, so that a
model of the schedule can apply the rule the coordinator applies.  See [Note:
the hand-over policy].
"""

from __future__ import annotations


__all__ = [
    "HAND_OVER_MIN_REGION_S",
    "hands_over",
    "may_compute_on",
    "may_open",
    "may_start",
]

# [Note: the hand-over policy]
# The backward side has the first turn to communicate; turns alternate and a
# side that is done gives up its turns.  Compute is handed over at each
# boundary: while one side communicates the other computes (the phase pattern
# of DualPipe).
# * may_start: a side without the turn computes nothing before the other side
#   has opened its first region (or is done).
# * may_open: a side enters a region when the other side is outside one and
#   it is this side's turn (or the other side is done).
# * hands_over / may_compute_on: a side that leaves a region at least
#   HAND_OVER_MIN_REGION_S long computes on only once the other side has opened
#   its next region (or is done).  After a shorter region it computes on at
#   once: waking the other thread costs tens to hundreds of microseconds, more
#   than a shorter region can hide.
# Hand-overs change when each side computes, never the order of the regions.
HAND_OVER_MIN_REGION_S = 0.5e-3


def may_start(has_turn: bool, other_regions: int, other_done: bool) -> bool:
    """Whether a side may compute for the first time in its sub-action."""
    return has_turn or other_done or other_regions > 0


def may_open(has_turn: bool, other_communicating: bool, other_done: bool) -> bool:
    """Whether a side may enter its next communication region."""
    return not other_communicating and (has_turn or other_done)


def hands_over(region_s: float, min_region_s: float = HAND_OVER_MIN_REGION_S) -> bool:
    """Whether a side that left a region of ``region_s`` seconds waits for the other.

    (Before computing on: see :func:`may_compute_on`.)
    """
    return region_s >= min_region_s


def may_compute_on(
    other_regions: int, other_regions_at_hand_over: int, other_done: bool
) -> bool:
    """Whether a side that handed over may compute on.

    It may once the other side has opened a region since (or is done).
    """
    return other_done or other_regions > other_regions_at_hand_over
