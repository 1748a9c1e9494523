"""The context custom functions receive, the action type, and the computation types.

``PipelineContext`` is upstream patch 0011's public name for the context that
``schedules.py`` calls ``_PipelineContext`` (2.10 cycle; its step options
``return_outputs`` / ``loss_kwargs`` are patch 0004's), and ``PipelineAction``
0011's public name for the schedule IR's ``_Action``.  The patch table
installs both names, and ``_PipelineContext`` as an alias of the same class,
into ``torch.distributed.pipelining.schedules`` where a probe finds them
missing (``runtime_public_names``).  The rest names computation types as far
as the installed torch has them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

from torch.distributed.pipelining import schedules as _schedules


__all__: list[str] = []

# The names patch 0011 adds to ``schedules.__all__``
_PUBLIC_NAMES = ("PipelineAction", "PipelineContext")


# The schedule IR's action (stage index, computation type, microbatch index,
# sub-actions of OVERLAP_F_B), under the public name 0011 gives it.
PipelineAction = _schedules._Action


@dataclasses.dataclass
class PipelineContext:
    """The running step, as custom functions receive it.

    A function registered with ``schedule.register_custom_function`` is
    called as ``fn(action, ctx)`` with the step's one context: the schedule
    (``schedule_ref``), the step's microbatches, targets and losses, and the
    arguments of the running ``step()`` (``return_outputs``, ``loss_kwargs``).
    The same object is passed to every custom function of the step: a
    function keeps what later actions of the step need in ``state`` (a dict
    for the custom functions' own use, empty when the step starts; the next
    step gets a new context).  To run an action the built-in way, pass it
    with this context to ``ctx.schedule_ref.perform_action(action, ctx)``, or
    to ``ctx.schedule_ref.prepare_compute_action(action, ctx)`` to separate a
    compute action's in-order bookkeeping from its compute (what a custom
    OVERLAP_F_B needs).

    Threads: the schedule, its stages, FSDP's state and the step's losses
    are not thread safe.  Only the compute returned by
    ``prepare_compute_action`` may run on another thread, and only while no
    other thread runs the same stage; every other call (``perform_action``,
    ``prepare_compute_action`` itself) belongs on the thread running the step.
    """

    schedule_ref: Any
    arg_mbs: list[tuple] | None = None
    kwarg_mbs: list[dict] | None = None
    target_mbs: list | None = None
    losses: list | None = None
    return_outputs: bool = True
    loss_kwargs: dict[str, Any] | None = None
    state: dict[str, Any] = dataclasses.field(default_factory=dict)


# The name custom functions were written against before PipelineContext
_PipelineContext = PipelineContext


class _CustomFunctionProtocol(Protocol):  # noqa: PYI046  (used by the runtime modules)
    def __call__(self, action: PipelineAction, ctx: PipelineContext) -> None: ...


def _make_all(original: list[str]) -> list[str]:
    """``schedules.__all__`` with 0011's public names added."""
    return [*original, *(name for name in _PUBLIC_NAMES if name not in original)]


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

# The communication actions: no custom function may replace them, the step
# loop runs them with perform_action.  WAIT_SEND_F / WAIT_SEND_B: torch 2.15+.
_COMMUNICATION_TYPES = (
    "SEND_F",
    "SEND_B",
    "RECV_F",
    "RECV_B",
    "WAIT_SEND_F",
    "WAIT_SEND_B",
)


def _customizable_types() -> list[Any]:
    """The computation types custom functions may replace, as far as this torch has them."""
    return [t for t in map(_computation_type, _CUSTOMIZABLE_TYPES) if t is not None]


@functools.cache
def _communication_types() -> frozenset[Any]:
    """The communication computation types, as far as this torch has them."""
    return frozenset(
        t for t in map(_computation_type, _COMMUNICATION_TYPES) if t is not None
    )
