"""The context custom functions receive, and the computation types they may replace.

``_PipelineContext`` is upstream's (``schedules.py``, 2.10 cycle), provided
here for torch 2.9 and installed by the patch table where a probe finds it
missing; the rest names computation types as far as the installed torch has
them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TYPE_CHECKING

from torch.distributed.pipelining import schedules as _schedules


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


__all__: list[str] = []


@dataclasses.dataclass
class _PipelineContext:
    """Context passed to custom functions during pipeline execution.

    Same fields as upstream's ``schedules._PipelineContext`` (2.10 cycle);
    installed into ``torch.distributed.pipelining.schedules`` where missing.
    """

    schedule_ref: Any
    arg_mbs: list[tuple] | None = None
    kwarg_mbs: list[dict] | None = None
    target_mbs: list | None = None
    losses: list | None = None


class _CustomFunctionProtocol(Protocol):  # noqa: PYI046  (used by the runtime modules)
    def __call__(self, action: _Action, ctx: _PipelineContext) -> None: ...


def _computation_type(name: str) -> Any:
    """``_ComputationType.<name>``, or ``None`` where this torch lacks it."""
    return getattr(_schedules._ComputationType, name, None)


def _reduce_grad_type() -> Any:
    return _computation_type("REDUCE_GRAD")


def _compute_types() -> tuple[Any, ...]:
    """The actions :func:`prepare_compute_action` handles."""
    return (
        _schedules.FORWARD,
        _schedules.FULL_BACKWARD,
        _schedules.BACKWARD_INPUT,
        _schedules.BACKWARD_WEIGHT,
    )


_CUSTOMIZABLE_TYPES = (
    "FORWARD",
    "FULL_BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "OVERLAP_F_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
    "WAIT_REDUCE_GRAD",
)


def _customizable_types() -> list[Any]:
    """The computation types custom functions may replace, as far as this torch has them."""
    return [t for t in map(_computation_type, _CUSTOMIZABLE_TYPES) if t is not None]
