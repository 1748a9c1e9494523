"""What the schedule simulator takes: the costs of one stage's actions, of a
pipeline send/recv and of an OVERLAP_F_B pair.

* :class:`StageCost` -- what one action of one stage costs: forward (F),
  backward for inputs (I), backward for weights (W), the expert-parallel
  all-to-alls inside F and I, the activation bytes a microbatch keeps alive
  and the bytes a stage sends to its neighbour.
* :class:`LinkCost` -- pipeline send/recv latency and bandwidth.
* :class:`OverlapModel` -- how an OVERLAP_F_B action runs (see
  [Note: the OVERLAP_F_B model] in ``_engine.py``).

Every number here is an input to a *prediction*: :mod:`torch_pipelining_ext.sim`
turns it into a step time, it measures nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch_pipelining_ext.overlap.policy import HAND_OVER_MIN_REGION_S, Order


__all__ = ["LinkCost", "OverlapModel", "Segments", "StageCost", "check_number"]

Segments = tuple[float, ...]


def check_number(
    name: str,
    value: object,
    *,
    positive: bool = False,
    allow_inf: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` is a real number
    ``>= 0`` (``> 0`` if ``positive``), finite unless ``allow_inf``, an ``int`` if ``integer``."""
    ok = False
    if isinstance(value, int if integer else (int, float)) and not isinstance(
        value, bool
    ):
        ok = integer or not math.isnan(value) and (allow_inf or not math.isinf(value))
        ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        what = "an integer" if integer else "a number"
        bound = "> 0" if positive else ">= 0"
        finite = "" if integer or allow_inf else ", finite"
        raise ValueError(f"{name} must be {what} {bound}{finite}, got {value!r}")


def _as_segments(value: float | Sequence[float], name: str) -> Segments:
    """``value`` as alternating compute/communication times: ``(c0, r1, c1, ..., rn, cn)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, Sequence)):
        raise ValueError(f"{name} must be a time or a sequence of times, got {value!r}")
    seg = (value,) if isinstance(value, (int, float)) else tuple(value)
    if len(seg) % 2 != 1:
        raise ValueError(
            f"{name} must be one compute time or an odd-length sequence (compute, comm, compute, ...), got {seg}"
        )
    for i, v in enumerate(seg):
        check_number(f"{name}[{i}]" if len(seg) > 1 else name, v)
    return tuple(float(v) for v in seg)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """Costs of one pipeline stage, per microbatch, in seconds and bytes.

    ``forward`` and ``backward_input`` are either a compute time or a sequence
    ``(compute, comm, compute, comm, ..., compute)``: the expert-parallel
    communication regions (the ``overlap`` marks) between compute
    segments.  ``backward_weight`` (W) has no communication.  A full backward
    (B) is I's segments with W's compute spread over I's compute segments in
    proportion (``full_backward`` overrides it).

    Args:
        forward: F.
        backward_input: I (the input-gradient half of the backward).
        backward_weight: W (the weight-gradient half).
        full_backward: B, if it is not I + W.
        activation_bytes: bytes one microbatch keeps alive on this stage from
            the start of its F until its backward has finished (its W, when
            the backward is split).
        send_bytes: bytes of the stage's output (and of the gradient sent
            back), per microbatch.
    """

    forward: Segments | float = 0.0
    backward_input: Segments | float = 0.0
    backward_weight: float = 0.0
    full_backward: Segments | float | None = None
    activation_bytes: float = 0.0
    send_bytes: float = 0.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "forward", _as_segments(self.forward, "StageCost.forward"))
        backward_input = _as_segments(self.backward_input, "StageCost.backward_input")
        set_(self, "backward_input", backward_input)
        for name in ("backward_weight", "activation_bytes", "send_bytes"):
            check_number(f"StageCost.{name}", getattr(self, name))
        if self.full_backward is None:
            set_(
                self,
                "full_backward",
                _merge_weight(backward_input, self.backward_weight),
            )
        else:
            set_(
                self,
                "full_backward",
                _as_segments(self.full_backward, "StageCost.full_backward"),
            )

    def segments(self, computation: str) -> Segments:
        """The segments of one action: ``computation`` is ``"F"``, ``"I"``, ``"W"`` or ``"B"``."""
        if computation == "F":
            return self.forward  # type: ignore[return-value]
        if computation == "I":
            return self.backward_input  # type: ignore[return-value]
        if computation == "W":
            return (self.backward_weight,)
        if computation == "B":
            return self.full_backward  # type: ignore[return-value]
        raise ValueError(f"no cost for computation {computation!r}")

    def total(self, computation: str) -> float:
        """Compute plus communication time of one action run alone."""
        return sum(self.segments(computation))


def _merge_weight(input_seg: Segments, weight: float) -> Segments:
    compute = sum(input_seg[0::2])
    if compute <= 0:
        return input_seg[:-1] + (input_seg[-1] + weight,)
    # W spread in proportion: v + weight * v / compute (v / compute <= 1, so a
    # subnormal compute total cannot overflow)
    return tuple(
        v + weight * (v / compute) if i % 2 == 0 else v for i, v in enumerate(input_seg)
    )


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Pipeline-parallel send/recv: a message of ``n`` bytes takes ``latency + n / bandwidth`` seconds.

    A transfer starts once both its send and its receive are posted (the
    rendezvous of NCCL point-to-point); links are not shared between
    messages (no contention is modelled).  ``post_overhead`` is the time
    posting one send or receive keeps its rank busy (a kernel launch with
    NCCL; milliseconds for gloo's ``batch_isend_irecv`` on a loaded CPU).
    """

    latency: float = 0.0
    bandwidth: float = math.inf  # bytes per second
    post_overhead: float = 0.0

    def __post_init__(self) -> None:
        check_number("LinkCost.latency", self.latency)
        check_number(
            "LinkCost.bandwidth", self.bandwidth, positive=True, allow_inf=True
        )
        check_number("LinkCost.post_overhead", self.post_overhead)

    def time(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` bytes takes once it has started."""
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


@dataclasses.dataclass(frozen=True)
class OverlapModel:
    """How OVERLAP_F_B actions run in the simulation.

    Args:
        enabled: run the two sub-actions under the package's coordinator
            (False: one after the other, as torch's own handler does).
        streams: True on accelerators (each stage has its own stream, a pair
            without marks stays concurrent); False on CPU, where a stage pair
            whose concurrent run passed no mark runs sequentially for the rest
            of the step (the unmarked-pair rule of ``overlap/_handler.py``).
        handover: seconds a thread needs to resume computing after waiting
            for the other (0 on a device; tens of microseconds on CPU).
        min_region: a region shorter than this does not make its side wait for
            the other's next region before computing on (default: the
            coordinator's threshold, see [Note: the overlap rule]).
        order: how the two sides' all-to-alls are ordered: ``Order.STRICT``
            (one communicator: they take turns; what runs on NCCL and on
            groups without a twin) or ``Order.FREE`` (each side its own twin
            communicator, gloo); see [Note: the OVERLAP_F_B model].
    """

    enabled: bool = True
    streams: bool = True
    handover: float = 0.0
    min_region: float = HAND_OVER_MIN_REGION_S
    order: Order = Order.STRICT

    def __post_init__(self) -> None:
        if not isinstance(self.order, Order):
            raise ValueError(
                f"OverlapModel.order must be an overlap.policy.Order, got {self.order!r}"
            )
        for name in ("enabled", "streams"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"OverlapModel.{name} must be a bool, got {getattr(self, name)!r}"
                )
        check_number("OverlapModel.handover", self.handover)
        check_number("OverlapModel.min_region", self.min_region)
