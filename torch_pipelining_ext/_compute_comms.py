"""compute_comms schedules without REDUCE_GRAD: the missing actions are added.

Package only.  Upstream patch 0006 rejects such a schedule when it is loaded
if a local stage needs the missing action (an FSDP stage, or ``scale_grads``;
nothing is inserted); the package must run schedules written for torches
before REDUCE_GRAD unchanged, so
:func:`_make_prepare_comms` wraps
``_PipelineScheduleRuntime._prepare_schedule_with_comms`` and
:func:`_add_missing_reduce_grad` completes them first.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

from torch.distributed.pipelining import schedules as _schedules

from torch_pipelining_ext._pipeline_context import _computation_type


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


__all__: list[str] = []

# None on a torch without the action (the patch is applied only where torch
# has REDUCE_GRAD; WAIT_REDUCE_GRAD is 2.15's)
REDUCE_GRAD = _computation_type("REDUCE_GRAD")
WAIT_REDUCE_GRAD = _computation_type("WAIT_REDUCE_GRAD")


def _add_missing_reduce_grad(
    actions: list[_Action | None], n_microbatches: int
) -> list[_Action | None]:
    """Complete the gradient reduction of one rank's compute_comms actions.

    Inserts REDUCE_GRAD after each stage's last backward where ``actions`` has
    none, counting FULL_BACKWARD and BACKWARD_WEIGHT (also inside OVERLAP_F_B)
    per stage like ``_add_reduce_grad``; it goes after the sends that follow
    the last backward, so they are not delayed by it.  Each REDUCE_GRAD
    without a WAIT_REDUCE_GRAD gets one right after it, and a wait whose
    REDUCE_GRAD is missing is replaced by the added pair.  Anything else is
    left as it is, for the loader to validate.
    """
    reduce_grad, wait = REDUCE_GRAD, WAIT_REDUCE_GRAD
    present = [a for a in actions if a is not None]
    reduced = {a.stage_index for a in present if a.computation_type == reduce_grad}
    waited = {
        a.stage_index
        for a in present
        if wait is not None and a.computation_type == wait
    }

    def reduction(stage_idx: int) -> list[_Action]:
        pair = [_schedules._Action(stage_idx, reduce_grad, None)]
        if wait is not None:
            pair.append(_schedules._Action(stage_idx, wait, None))
        return pair

    counts: dict[int, int] = defaultdict(int)
    out: list[_Action | None] = []
    due: list[int] = []  # stages whose REDUCE_GRAD waits for the trailing sends
    for action in actions:
        ctype = action.computation_type if action is not None else None
        if due and ctype not in (_schedules.SEND_F, _schedules.SEND_B):
            out.extend(a for s in due for a in reduction(s))
            due.clear()
        if action is None:
            out.append(action)
            continue
        if wait is not None and ctype == wait and action.stage_index not in reduced:
            continue  # replaced by the pair added after the stage's last backward
        out.append(action)
        if (
            wait is not None
            and ctype == reduce_grad
            and action.stage_index not in waited
        ):
            out.append(_schedules._Action(action.stage_index, wait, None))
        for a in action.sub_actions if action.sub_actions is not None else (action,):
            if a.computation_type in (
                _schedules.FULL_BACKWARD,
                _schedules.BACKWARD_WEIGHT,
            ):
                counts[a.stage_index] += 1
                if (
                    counts[a.stage_index] == n_microbatches
                    and a.stage_index not in reduced
                ):
                    due.append(a.stage_index)
    out.extend(a for s in due for a in reduction(s))
    return out


def _make_prepare_comms(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_PipelineScheduleRuntime._prepare_schedule_with_comms``.

    A ``compute_comms`` schedule is taken as given, so one written before
    REDUCE_GRAD existed (or by hand) has none, and on torch 2.10+ -- where only
    REDUCE_GRAD runs FSDP's post-backward and scales gradients -- its
    gradients would be neither reduced nor scaled; on torch 2.15+ one written
    before WAIT_REDUCE_GRAD existed is rejected.  The missing actions are
    added before torch reads the schedule (:func:`_add_missing_reduce_grad`).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _prepare_schedule_with_comms(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["format"] == "compute_comms":
            bound.arguments["actions"] = {
                rank: _add_missing_reduce_grad(list(rank_actions), self._n_microbatches)
                for rank, rank_actions in bound.arguments["actions"].items()
            }
        return original(*bound.args, **bound.kwargs)

    return _prepare_schedule_with_comms
