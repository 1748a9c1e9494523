"""Runtime schedules as the simulator reads them: torch's own generated action lists.

Nothing here writes a schedule: the orders come from torch's schedule classes
(built with placeholder stages: a schedule computes every rank's order in its
constructor and never touches a stage's module there), from a CSV in torch's
format (parsed by ``_Action.from_str``), or from a ``pipeline_order`` dict;
compute-only orders are lowered to send/recv actions by torch's own
``_add_send_recv``.  Attributes are probed, never torch versions.
"""

from __future__ import annotations

import copy
import csv
import os
from collections.abc import Mapping, Sequence
import torch
from torch.distributed.pipelining import schedules as _schedules


Action = _schedules._Action
"""An action of torch's schedules (``1F0``, ``0SEND_F1``, an ``OVERLAP_F_B``
pair); ``None`` in a compute-only order is an idle slot."""

Order = dict[int, list[Action | None]]
"""Every rank's actions in the order it runs them."""

# The short names of torch's computation types, from the module's own
# constants (their enum values differ between releases: ints on 2.9, strings later).
_KIND = {
    getattr(_schedules, name): short
    for name, short in (
        ("FORWARD", "F"),
        ("BACKWARD_INPUT", "I"),
        ("BACKWARD_WEIGHT", "W"),
        ("FULL_BACKWARD", "B"),
        ("OVERLAP_F_B", "OVERLAP_F_B"),
        ("SEND_F", "SEND_F"),
        ("RECV_F", "RECV_F"),
        ("SEND_B", "SEND_B"),
        ("RECV_B", "RECV_B"),
        ("UNSHARD", "UNSHARD"),
        ("RESHARD", "RESHARD"),
        ("REDUCE_GRAD", "REDUCE_GRAD"),
        (
            "WAIT_SEND_F",
            "WAIT_SEND_F",
        ),  # newer torch: block until an earlier send has completed
        ("WAIT_SEND_B", "WAIT_SEND_B"),
        ("WAIT_REDUCE_GRAD", "WAIT_REDUCE_GRAD"),
    )
    if hasattr(_schedules, name)
}


def kind(action: Action) -> str:
    """The short name of a torch ``_Action``'s computation type: ``"F"``, ``"I"``, ``"W"``, ``"B"``, ``"SEND_F"``, ...

    The same on every torch release (the enum's values are not).

    Raises:
        ValueError: the simulator has no model for this computation type.
    """
    try:
        return _KIND[action.computation_type]
    except KeyError:
        raise ValueError(
            f"action {action}: the simulator has no model for computation type {action.computation_type!r}"
        ) from None


class _PlaceholderStage:
    """What a schedule's constructor reads from its stages, and nothing else."""

    def __init__(
        self, stage_index: int, num_stages: int, group_size: int, group_rank: int
    ) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = torch.nn.Module()
        self.stage_index_to_group_rank: dict[int, int] = {}


def _schedule_class(schedule: str | type) -> type:
    if isinstance(schedule, str):
        return _schedules.get_schedule_class(schedule)
    if not isinstance(schedule, type) or not issubclass(
        schedule, _schedules._PipelineSchedule
    ):
        raise ValueError(
            f"schedule must be a torch schedule class or its name, got {schedule!r}"
        )
    return schedule


def _is_single(cls: type) -> bool:
    return issubclass(cls, _schedules.PipelineScheduleSingle)


def build_schedule(
    schedule: str | type,
    pp: int,
    n_microbatches: int,
    stages_per_rank: int | None = None,
    **kwargs: object,
) -> _schedules._PipelineSchedule:
    """Build torch's schedule ``schedule`` for ``pp`` ranks with placeholder stages (rank 0's view).

    Args:
        schedule: a schedule class or a name ``get_schedule_class`` knows
            ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", ...).
        pp: pipeline ranks.
        n_microbatches: microbatches per step.
        stages_per_rank: stages per rank of a multi-stage schedule (default 2).
        kwargs: passed to the constructor (e.g. ``defer_pp_recv``).
    """
    for name, value in (("pp", pp), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if stages_per_rank is not None and (
        isinstance(stages_per_rank, bool)
        or not isinstance(stages_per_rank, int)
        or stages_per_rank < 1
    ):
        raise ValueError(
            f"stages_per_rank must be an integer >= 1 or None, got {stages_per_rank!r}"
        )
    cls = _schedule_class(schedule)
    loss_fn = kwargs.pop(
        "loss_fn", lambda output, target: output
    )  # a schedule with a loss has a backward
    if _is_single(cls):
        if stages_per_rank not in (None, 1):
            raise ValueError(
                f"{cls.__name__} runs one stage per rank, got stages_per_rank={stages_per_rank}"
            )
        return cls(
            _PlaceholderStage(0, pp, pp, 0), n_microbatches, loss_fn=loss_fn, **kwargs
        )
    v = 2 if stages_per_rank is None else stages_per_rank
    n = pp * v
    # rank 0's stage ids in loop order; the constructor computes every rank's
    # order from the rank count and the number of local stages only.
    stages = [_PlaceholderStage(i * pp, n, pp, 0) for i in range(v)]
    return cls(stages, n_microbatches, loss_fn=loss_fn, **kwargs)


def _infer_stage_to_rank(
    order: Mapping[int, Sequence[Action | None]],
) -> dict[int, int]:
    out: dict[int, int] = {}
    for rank, actions in order.items():
        for a in actions:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                if (
                    kind(sub) in ("RECV_F", "RECV_B", "SEND_F", "SEND_B")
                    and sub.stage_index in out
                ):
                    continue
                prev = out.setdefault(sub.stage_index, rank)
                if prev != rank and sub.is_compute_op:
                    raise ValueError(
                        f"stage {sub.stage_index} has compute actions on ranks {prev} and {rank}"
                    )
    if sorted(out) != list(range(len(out))):
        raise ValueError(f"the schedule's stages are not 0..N-1: {sorted(out)}")
    return out


def _compute_actions(order: Mapping[int, Sequence[Action | None]]) -> dict[tuple, int]:
    """(stage, F/I/W/B, microbatch) -> rank of every compute action, sub-actions included."""
    out: dict[tuple, int] = {}
    for rank, actions in order.items():
        for a in actions:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                if kind(sub) in ("F", "I", "W", "B"):
                    out[(sub.stage_index, kind(sub), sub.microbatch_index)] = rank
    return out


def _missing_actions(have: Mapping[tuple, int], n_stages: int) -> list[tuple]:
    """What a complete step lacks: (stage, computation, microbatch)."""
    mbs = {mb for _, _, mb in have}
    n_mb = max(mbs) + 1 if mbs else 0
    backward = any(c != "F" for _, c, _ in have)
    missing = []
    for stage in range(n_stages):
        for mb in range(n_mb):
            missing += [(stage, "F", mb)] if (stage, "F", mb) not in have else []
            if not backward:
                continue
            full, inp = (stage, "B", mb) in have, (stage, "I", mb) in have
            weight = (stage, "W", mb) in have
            if not (full or inp):
                missing.append((stage, "I" if weight else "B", mb))
            elif inp and not weight:
                missing.append((stage, "W", mb))
    return missing


def check_complete(
    order: Mapping[int, Sequence[Action | None]],
    stage_to_rank: Mapping[int, int],
    what: str,
) -> None:
    """Raise ``ValueError`` naming every missing compute action and its rank.

    A step runs F of every stage and microbatch ``0..M-1`` and, if it has any
    backward, a full backward (B) or an input backward (I) with its weight
    backward (W) for each.
    """
    have = _compute_actions(order)
    if not have:
        raise ValueError(f"{what} has no compute actions; nothing was simulated")
    both = sorted((s, mb) for s, c, mb in have if c == "B" and (s, "I", mb) in have)
    if both:
        s, mb = both[0]
        raise ValueError(
            f"{what} runs both {s}B{mb} and {s}I{mb} (stage {s}, microbatch {mb}); nothing was simulated"
        )
    missing = _missing_actions(have, len(stage_to_rank))
    if missing:
        named = ", ".join(
            f"{s}{c}{mb} on rank {stage_to_rank[s]}" for s, c, mb in missing[:8]
        )
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(
            f"{what} is missing {len(missing)} action(s): {named}{more}; nothing was simulated"
        )


def _needs(
    stage: int, comp: str, mb: int | None, n_stages: int
) -> list[tuple[int, str, int | None]]:
    """What compute action ``stage comp mb`` waits for ("I/B": either backward of that stage)."""
    if comp == "F":
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if comp in ("I", "B"):
        deps = [(stage, "F", mb)]
        return deps + ([(stage + 1, "I/B", mb)] if stage < n_stages - 1 else [])
    return [(stage, "I", mb)] if comp == "W" else []  # UNSHARD, REDUCE_GRAD, ...


def _name(stage: int, comp: str, mb: int | None) -> str:
    """An action's name as torch writes it (``1F0``); "I/B" is either backward."""
    if comp == "I/B":
        return f"{stage}I{mb} or {stage}B{mb}"
    return f"{stage}{comp}{mb}"


def check_progress(order: Mapping[int, Sequence[Action | None]], n_stages: int) -> None:
    """Raise ``ValueError`` naming each stuck rank if a compute-only ``order`` cannot finish.

    Every rank runs its actions in order; an action runs once what it needs
    has run on any rank (see :func:`_needs`).
    """
    done: set[tuple] = set()
    pos = dict.fromkeys(order, 0)
    acts = {r: [a for a in actions if a is not None] for r, actions in order.items()}

    def blocker(a: Action) -> tuple[int, str, int | None] | None:
        for sub in a.sub_actions or (a,):
            for need in _needs(
                sub.stage_index, kind(sub), sub.microbatch_index, n_stages
            ):
                s, c, mb = need
                names = ("I", "B") if c == "I/B" else (c,)
                if not any((s, n, mb) in done for n in names):
                    return need
        return None

    progress = True
    while progress:
        progress = False
        for r in acts:
            while pos[r] < len(acts[r]) and blocker(acts[r][pos[r]]) is None:
                a = acts[r][pos[r]]
                done.update(
                    (x.stage_index, kind(x), x.microbatch_index)
                    for x in a.sub_actions or (a,)
                )
                pos[r], progress = pos[r] + 1, True
    stuck = [
        f"rank {r} at action {a} waits for {_name(*need)}"
        for r in acts
        if pos[r] < len(acts[r]) and (need := blocker(a := acts[r][pos[r]])) is not None
    ]
    if stuck:
        raise ValueError("the schedule deadlocks: " + "; ".join(stuck))


def _has_comms(order: Mapping[int, Sequence[Action | None]]) -> bool:
    return any(
        a is not None and not a.is_compute_op for acts in order.values() for a in acts
    )


def _lower_compute_only(
    order: Mapping[int, Sequence[Action | None]], stage_to_rank: Mapping[int, int]
) -> Order:
    """Add torch's send/recv actions to a compute-only order (``_add_send_recv``)."""
    add_send_recv = getattr(_schedules, "_add_send_recv", None)
    if add_send_recv is None:
        raise RuntimeError(
            "this torch has no schedules._add_send_recv to lower a compute-only schedule"
        )
    compute = {
        r: list(acts) for r, acts in order.items() if any(a is not None for a in acts)
    }
    return add_send_recv(
        compute, stage_to_rank=lambda s: stage_to_rank[s], num_stages=len(stage_to_rank)
    )


def _validate(
    order: Mapping[int, Sequence[Action | None]],
    stage_to_rank: Mapping[int, int],
    what: str,
) -> None:
    """Check a compute-only order with torch's ``_validate_schedule`` (where this torch has it)."""
    validate = getattr(_schedules, "_validate_schedule", None)
    if validate is None:
        return
    mbs = [
        a.microbatch_index
        for acts in order.values()
        for a in acts
        if a is not None and a.microbatch_index is not None
    ]
    try:
        validate(
            dict(order), len(order), len(stage_to_rank), max(mbs) + 1 if mbs else 0
        )
    except AssertionError as e:
        first = str(e).strip().splitlines()[0]
        raise ValueError(
            f"{what} is not a valid schedule on this torch ({first}); nothing was simulated"
        ) from e


def schedule_order(
    schedule: _schedules._PipelineSchedule | Mapping[int, Sequence[Action | None]],
) -> tuple[Order, dict[int, int]]:
    """The action lists (with send/recv) of every rank and the stage -> rank map of ``schedule``.

    ``schedule`` is a torch schedule object (its ``pipeline_order_with_comms``
    when it has one, else its ``pipeline_order`` lowered by torch), or a dict
    rank -> actions (compute-only or with communication).
    """
    if isinstance(schedule, Mapping):
        order = {int(r): list(acts) for r, acts in schedule.items()}
        stage_to_rank = _infer_stage_to_rank(order)
        if not _has_comms(order):
            _validate(order, stage_to_rank, "the compute-only order")
        check_complete(order, stage_to_rank, "the order")
        if not _has_comms(order):
            check_progress(order, len(stage_to_rank))
            order = _lower_compute_only(order, stage_to_rank)
        return order, stage_to_rank
    with_comms = getattr(schedule, "pipeline_order_with_comms", None)
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    name = type(schedule).__name__
    if with_comms:
        order = {r: list(acts) for r, acts in with_comms.items()}
        stage_to_rank = dict(mapping) if mapping else _infer_stage_to_rank(order)
        check_complete(order, stage_to_rank, f"the order {name} generates")
        return order, stage_to_rank
    compute = getattr(schedule, "pipeline_order", None)
    if not compute:
        raise ValueError(
            f"{type(schedule).__name__} exposes no pipeline_order on this torch; pass its action lists "
            "(a dict rank -> actions or a CSV) instead"
        )
    compute = copy.copy(compute)
    stage_to_rank = dict(mapping) if mapping else _infer_stage_to_rank(compute)
    what = f"the pipeline_order that {name} generates"
    _validate(compute, stage_to_rank, what)
    check_complete(compute, stage_to_rank, what)
    check_progress(compute, len(stage_to_rank))
    return _lower_compute_only(compute, stage_to_rank), stage_to_rank


def order_from_csv(
    path: str | os.PathLike, format: str = "compute_only"
) -> tuple[Order, dict[int, int]]:
    """Read a schedule CSV in torch's format (one row per rank, one action per cell)."""
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(
            f'format must be "compute_only" or "compute_comms", got {format!r}'
        )
    with open(path, newline="") as f:
        order = {
            rank: [_schedules._Action.from_str(s) for s in row]
            for rank, row in enumerate(csv.reader(f))
        }
    if not any(a is not None for acts in order.values() for a in acts):
        raise ValueError(f"{path}: the CSV holds no actions; nothing was simulated")
    if format == "compute_comms":
        order = {r: [a for a in acts if a is not None] for r, acts in order.items()}
        stage_to_rank = _infer_stage_to_rank(order)
        check_complete(order, stage_to_rank, str(path))
        return order, stage_to_rank
    if _has_comms(order):
        raise ValueError(f"{path}: a compute_only CSV holds communication actions")
    return schedule_order(order)
