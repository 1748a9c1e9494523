"""The simulation engine: a runtime schedule's actions, per-action costs in, a timeline out.

Each rank runs its action list in order, as ``_PipelineScheduleRuntime``
does: a compute action starts when the rank is free and its inputs are there;
``SEND_*``/``RECV_*`` post a transfer and keep the rank busy for
``LinkCost.post_overhead``; a transfer starts when both its send and its
receive are posted and takes ``LinkCost.time(bytes)``; stages on one rank hand
activations over directly.  ``WAIT_SEND_*`` (newer torch) blocks the rank
until that transfer has arrived.  ``UNSHARD``, ``RESHARD`` and
``REDUCE_GRAD`` take no time.  Nothing here is measured: it is a prediction
from the costs given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence

from torch_pipelining_ext.overlap.policy import (
    hands_over,
    may_compute_on,
    may_start,
    may_take_turn,
    Order,
    Side,
)
from torch_pipelining_ext.sim._inputs import LinkCost, OverlapModel, Segments, StageCost
from torch_pipelining_ext.sim._schedule import Action, kind


logger = logging.getLogger(__name__)

_COMPUTE = ("F", "I", "W", "B")
_SENDS = {"SEND_F": "F", "SEND_B": "B"}
_RECVS = {"RECV_F": "F", "RECV_B": "B"}
_WAIT_SENDS = {"WAIT_SEND_F": "F", "WAIT_SEND_B": "B"}


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    """One compute action in the simulated timeline.

    ``intervals`` are ``(start, end, kind)`` with kind ``"compute"`` or
    ``"comm"`` (an expert-parallel all-to-all region); ``lane`` is 0 for a
    plain action and the forward sub-action of an OVERLAP_F_B, 1 for its
    backward sub-action.
    """

    rank: int
    action: str
    stage: int
    computation: str
    microbatch: int
    start: float
    end: float
    intervals: tuple[tuple[float, float, str], ...]
    lane: int = 0
    overlapped: bool = False


@dataclasses.dataclass(frozen=True)
class RankSummary:
    """Per-rank totals of a simulated step (seconds, bytes)."""

    rank: int
    busy: float  # time some compute runs on the rank
    exposed_comm: float  # time an all-to-all runs and no compute does
    hidden_comm: float  # all-to-all time during which the other sub-action computes
    posting: float  # time posting sends and receives (LinkCost.post_overhead each)
    bubble: float  # step time with none of these: waiting for a peer, or done early
    bubble_fraction: float
    action_sum: float  # the rank's actions' durations, each run alone (sequential sum)
    peak_activation_bytes: float


@dataclasses.dataclass
class SimulationResult:
    """A predicted step: its time, per-rank totals, memory and the timeline."""

    step_time: float
    ranks: list[RankSummary]
    peak_live_activations: dict[int, int]  # stage -> most microbatches alive at once
    records: list[ActionRecord]
    stage_to_rank: dict[int, int]
    transfers: list[
        tuple[str, int, int, float, float]
    ]  # (what, src rank, dst rank, start, arrival)

    @property
    def bubble_fraction(self) -> float:
        """The mean of the ranks' bubble fractions."""
        return sum(r.bubble_fraction for r in self.ranks) / len(self.ranks)

    @property
    def exposed_comm(self) -> float:
        """The largest exposed all-to-all time of any rank."""
        return max(r.exposed_comm for r in self.ranks)

    @property
    def peak_activation_bytes(self) -> float:
        """The most activation bytes alive at once on any rank."""
        return max(r.peak_activation_bytes for r in self.ranks)

    def summary(self) -> str:
        """A few lines for a person: the step time and each rank's totals."""
        lines = [
            f"predicted step time {self.step_time:.6g} s, mean bubble {self.bubble_fraction:.1%}"
        ]
        for r in self.ranks:
            lines.append(
                f"  rank {r.rank}: busy {r.busy:.6g} s, bubble {r.bubble_fraction:.1%}, "
                f"exposed comm {r.exposed_comm:.6g} s, peak activations {r.peak_activation_bytes / 2**30:.3f} GiB"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------- #
# One OVERLAP_F_B pair under the coordinator                                  #
# --------------------------------------------------------------------------- #

# [Note: the OVERLAP_F_B model]
# The pair runs as the runtime's coordinator (overlap/_turns.py) makes it run:
# when a side may start, issue a collective or compute on after a region is
# the rule of ``overlap.policy`` ([Note: the overlap rule]), asked with the
# modelled region lengths.  Each communication segment is one region whose
# collectives have the model's Order:
# * STRICT (a communicator both sides use; NCCL; a group without a twin):
#   regions take turns, the backward side first; a side keeps its turn while
#   its input is not there yet (so a late gradient holds the forward back);
# * FREE (each side its own communicator): a region waits for nobody, and the
#   two sides' regions may run at once.
# The model adds:
# * compute is exclusive: at most one side computes at a time (on CPU the
#   hand-overs enforce it; on a device two streams share the SMs, which this
#   approximates as taking turns);
# * a side that had to wait before computing pays ``handover`` seconds;
# * each side starts when its own input is there (``ready``): the backward
#   side waits for its gradient, the forward side for its activation, not
#   for both.  Until then the side neither starts nor gives up its turns.
# With no regions at all the forward side waits for the whole backward: the
# pair takes the sequential time, plus one hand-over.


def overlap_pair(
    fwd: Segments,
    bwd: Segments,
    model: OverlapModel,
    ready: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float, list[tuple[Side, float, float, str]]]:
    """Run one forward/backward pair under the coordinator model, from time 0.

    ``ready`` is when the forward's and the backward's input arrive (each side
    starts then, see [Note: the OVERLAP_F_B model]).  Returns the end time of
    the forward side, of the backward side, and the intervals ``(side, start,
    end, kind)``.
    """
    if any(not math.isfinite(r) or r < 0 for r in ready):
        raise ValueError(f"ready times must be finite and >= 0, got {ready}")
    arrive = {Side.FORWARD: float(ready[0]), Side.BACKWARD: float(ready[1])}
    pair = _Pair({Side.FORWARD: fwd, Side.BACKWARD: bwd}, model, arrive)
    while not all(pair.done.values()):
        pair.start_what_may_start()
        if not all(pair.done.values()):
            pair.finish_next()
    return pair.end_time[Side.FORWARD], pair.end_time[Side.BACKWARD], pair.out


class _Pair:
    """State of one simulated OVERLAP_F_B pair: each side's position, regions and hand-over."""

    def __init__(
        self,
        segs: Mapping[Side, Segments],
        model: OverlapModel,
        arrive: Mapping[Side, float],
    ) -> None:
        self.segs = segs
        self.model = model
        self.strict = model.order is Order.STRICT
        self.arrive = dict(arrive)  # when each side's input is there
        self.t = 0.0
        self.turn = Side.BACKWARD  # the coordinator's first turn
        self.pos = dict.fromkeys(Side, 0)
        self.running: dict[Side, tuple[str, float] | None] = dict.fromkeys(Side)
        self.free_since = dict(self.arrive)  # a side is not waiting before its input
        self.regions = dict.fromkeys(Side, 0)
        self.started = dict.fromkeys(Side, False)
        self.done = dict.fromkeys(Side, False)
        self.end_time = dict.fromkeys(Side, 0.0)
        # the other side's regions when this side handed over (None: computes freely)
        self.handed_over_at: dict[Side, int | None] = dict.fromkeys(Side)
        self.out: list[tuple[Side, float, float, str]] = []

    def _running(self, side: Side, what: str) -> bool:
        running = self.running[side]
        return running is not None and running[0] == what

    def _absent(self, side: Side) -> bool:
        """Whether ``side`` is done or its input is not there yet."""
        return self.done[side] or self.t < self.arrive[side]

    def _policy_allows(self, side: Side) -> bool:
        """Whether the rule lets ``side`` run its next segment now (compute aside)."""
        other = side.other
        if not self.started[side] and not may_start(
            side is Side.BACKWARD, self.regions[other], self._absent(other)
        ):
            return False
        if self.pos[side] % 2 == 0:  # compute
            at = self.handed_over_at[side]
            return at is None or may_compute_on(
                self.regions[other], at, self._running(other, "compute")
            )
        return not self.strict or may_take_turn(
            self.turn == side, self._running(other, "comm"), self.done[other]
        )

    def _try_start(self, side: Side) -> bool:
        """Start ``side``'s next segment (or finish the side) if the policy lets it; True if it did."""
        other, t = side.other, self.t
        if t < self.arrive[side]:
            return False
        if self.pos[side] == len(self.segs[side]):
            self.done[side], self.end_time[side] = True, t
            return True
        if not self._policy_allows(side):
            return False
        self.started[side] = True
        dur = self.segs[side][self.pos[side]]
        if self.pos[side] % 2 == 0:  # compute
            if self._running(other, "compute"):
                return False
            self.handed_over_at[side] = None
            begin = t + (self.model.handover if t > self.free_since[side] else 0.0)
            self.running[side] = ("compute", begin + dur)
            if dur > 0:
                self.out.append((side, begin, begin + dur, "compute"))
        else:  # communication region
            self.regions[side] += 1
            self.running[side] = ("comm", t + dur)
            if dur > 0:
                self.out.append((side, t, t + dur, "comm"))
        return True

    def start_what_may_start(self) -> None:
        """At the current time, start every segment that may start, until none can."""
        progress = True
        while progress:
            progress = False
            for side in (Side.BACKWARD, Side.FORWARD):
                if (
                    self.running[side] is None
                    and not self.done[side]
                    and self._try_start(side)
                ):
                    progress = True

    def finish_next(self) -> None:
        """Advance to the next event: the end of the running segment that ends first
        (the backward side's on a tie), or a side's input arriving before it."""
        busy = [
            (running[1], s)
            for s in (Side.BACKWARD, Side.FORWARD)
            if (running := self.running[s]) is not None
        ]
        arrivals = [a for a in self.arrive.values() if a > self.t]
        if arrivals and (not busy or min(arrivals) < min(e for e, _ in busy)):
            self.t = min(arrivals)
            return
        if not busy:  # cannot happen under the policy; guard against a silent hang
            raise RuntimeError(
                f"OVERLAP_F_B model stalled at t={self.t}: positions {self.pos}, regions {self.regions}"
            )
        self.t, side = min(busy, key=lambda x: (x[0], x[1] != Side.BACKWARD))
        what, _ = self.running[side]  # type: ignore[misc]
        dur = self.segs[side][self.pos[side]]
        self.running[side] = None
        self.pos[side] += 1
        self.free_since[side] = self.t
        if what == "comm":
            if self.strict:
                self.turn = side.other
            if hands_over(dur, self.model.min_region):
                self.handed_over_at[side] = self.regions[side.other]


# --------------------------------------------------------------------------- #
# The whole schedule                                                           #
# --------------------------------------------------------------------------- #


def _microbatch(a: Action) -> int:
    """The microbatch of ``a``, a compute or transfer action (which always has one)."""
    if a.microbatch_index is None:
        raise ValueError(f"action {a} has no microbatch index")
    return a.microbatch_index


class _Blocked(Exception):
    """The rank's next action waits for something another rank has not produced yet."""


@dataclasses.dataclass
class _RankState:
    rank: int
    actions: list[Action]
    pos: int = 0
    time: float = 0.0
    posting: float = 0.0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.actions)


class _Simulation:
    """State of one simulated step: per-rank positions, produced results, posted transfers."""

    def __init__(
        self,
        order: Mapping[int, Sequence[Action | None]],
        stage_to_rank: Mapping[int, int],
        costs: Sequence[StageCost],
        link: LinkCost,
        overlap: OverlapModel,
    ) -> None:
        self.stage_to_rank = dict(stage_to_rank)
        self.n_stages = len(self.stage_to_rank)
        if len(costs) != self.n_stages:
            raise ValueError(
                f"got costs for {len(costs)} stages, the schedule has {self.n_stages}"
            )
        self.costs = costs
        self.link = link
        self.overlap = overlap
        self.ranks = {
            r: _RankState(r, [a for a in acts if a is not None])
            for r, acts in sorted(order.items())
        }
        self.end: dict[
            tuple[int, str, int], float
        ] = {}  # (stage, F/I/B/W, mb) -> end time
        self.start: dict[tuple[int, str, int], float] = {}
        self.posted_send: dict[
            tuple[str, int, int], float
        ] = {}  # (F/B, receiving stage, mb)
        self.posted_recv: dict[tuple[str, int, int], float] = {}
        self.transfers: list[tuple[str, int, int, float, float]] = []
        self.records: list[ActionRecord] = []
        self.unmarked_pairs: set[tuple[int, int]] = set()

    # -- dependencies -------------------------------------------------------

    def _arrival(self, direction: str, stage: int, mb: int) -> float:
        key = (direction, stage, mb)
        if key not in self.posted_send or key not in self.posted_recv:
            raise _Blocked(
                f"{'activation' if direction == 'F' else 'gradient'} of microbatch {mb} for stage {stage}"
            )
        begin = max(self.posted_send[key], self.posted_recv[key])
        src = stage - 1 if direction == "F" else stage + 1
        nbytes = self.costs[src].send_bytes
        return begin + self.link.time(nbytes)

    def _produced(self, key: tuple[int, str, int]) -> float:
        if key not in self.end:
            raise _Blocked(f"{key[0]}{key[1]}{key[2]}")
        return self.end[key]

    def _backward_done(self, stage: int, mb: int) -> float:
        for c in ("I", "B"):
            if (stage, c, mb) in self.end:
                return self.end[(stage, c, mb)]
        raise _Blocked(f"backward of stage {stage} microbatch {mb}")

    def ready_time(self, stage: int, comp: str, mb: int) -> float:
        """When the inputs of ``stage comp mb`` are available on its rank."""
        rank = self.stage_to_rank[stage]
        if comp == "F":
            if stage == 0:
                return 0.0
            if self.stage_to_rank[stage - 1] == rank:
                return self._produced((stage - 1, "F", mb))
            return self._arrival("F", stage, mb)
        if comp in ("I", "B"):
            t = self._produced((stage, "F", mb))
            if stage == self.n_stages - 1:
                return t
            if self.stage_to_rank[stage + 1] == rank:
                return max(t, self._backward_done(stage + 1, mb))
            return max(t, self._arrival("B", stage, mb))
        if comp == "W":
            return self._produced((stage, "I", mb))
        raise ValueError(f"unsupported computation {comp}")

    # -- running actions ----------------------------------------------------

    def _record(
        self,
        a: Action,
        start: float,
        end: float,
        intervals: list[tuple[float, float, str]],
        lane: Side | None = None,
    ) -> None:
        """Record compute action ``a``; ``lane``: its side of an OVERLAP_F_B pair."""
        rank = self.stage_to_rank[a.stage_index]
        comp = kind(a)
        key = (a.stage_index, comp, _microbatch(a))
        if key in self.end:
            raise ValueError(f"rank {rank}: action {a} appears twice in the schedule")
        self.start[key] = start
        self.end[key] = end
        self.records.append(
            ActionRecord(
                rank,
                str(a),
                a.stage_index,
                comp,
                _microbatch(a),
                start,
                end,
                tuple(intervals),
                0 if lane is None else int(lane),
                lane is not None,
            )
        )

    def _rollback(self, n_records: int) -> None:
        """Forget the records after the first ``n_records`` (a pair whose second sub-action is blocked)."""
        for r in self.records[n_records:]:
            key = (r.stage, r.computation, r.microbatch)
            del self.start[key], self.end[key]
        del self.records[n_records:]

    def _plain(self, rank: int, a: Action, t0: float) -> float:
        comp = kind(a)
        segs = self.costs[a.stage_index].segments(comp)
        t, intervals = t0, []
        for i, d in enumerate(segs):
            if d > 0:
                intervals.append((t, t + d, "compute" if i % 2 == 0 else "comm"))
            t += d
        self._record(a, t0, t, intervals)
        return t

    def step_rank(self, st: _RankState) -> None:
        """Run ``st``'s next action; raises :class:`_Blocked` if it must wait."""
        a = st.actions[st.pos]
        ctype = kind(a)
        if a.sub_actions is not None:
            st.time = self._overlap_f_b(st, a.sub_actions)
        elif ctype in _COMPUTE:
            ready = self.ready_time(a.stage_index, ctype, _microbatch(a))
            st.time = self._plain(st.rank, a, max(st.time, ready))
        elif ctype in _SENDS:
            direction = _SENDS[ctype]
            comp_done = (
                self._produced((a.stage_index, "F", _microbatch(a)))
                if direction == "F"
                else (self._backward_done(a.stage_index, _microbatch(a)))
            )
            dst = a.stage_index + 1 if direction == "F" else a.stage_index - 1
            st.time = max(st.time, comp_done) + self.link.post_overhead
            st.posting += self.link.post_overhead
            self.posted_send[(direction, dst, _microbatch(a))] = st.time
        elif ctype in _RECVS:
            st.time += self.link.post_overhead
            st.posting += self.link.post_overhead
            self.posted_recv[(_RECVS[ctype], a.stage_index, _microbatch(a))] = st.time
        elif ctype in _WAIT_SENDS:
            # the send is complete once its transfer has arrived
            direction = _WAIT_SENDS[ctype]
            dst = a.stage_index + 1 if direction == "F" else a.stage_index - 1
            st.time = max(st.time, self._arrival(direction, dst, _microbatch(a)))
        # UNSHARD / RESHARD / REDUCE_GRAD: no time in this model
        st.pos += 1

    def _overlap_f_b(self, st: _RankState, subs: Sequence[Action]) -> float:
        kinds = [kind(s) for s in subs]
        fwd_i = next((i for i, k in enumerate(kinds) if k == "F"), None)
        bwd_i = next((i for i, k in enumerate(kinds) if k in ("B", "I")), None)
        if (
            self.overlap.enabled
            and len(subs) == 2
            and fwd_i is not None
            and bwd_i is not None
        ):
            f, b = subs[fwd_i], subs[bwd_i]
            if (f.stage_index, b.stage_index) not in self.unmarked_pairs:
                return self._concurrent_f_b(st, f, b, kinds[bwd_i])
        # torch's handler: the sub-actions one after the other, each waiting for its own inputs
        n_records = len(self.records)
        t = st.time
        try:
            for s in subs:
                ready = self.ready_time(s.stage_index, kind(s), _microbatch(s))
                t = self._plain(st.rank, s, max(t, ready))
        except _Blocked:
            self._rollback(n_records)
            raise
        return t

    def _concurrent_f_b(
        self, st: _RankState, f: Action, b: Action, b_kind: str
    ) -> float:
        """Run the forward ``f`` and the backward ``b`` (of kind ``b_kind``) of
        an OVERLAP_F_B pair concurrently."""
        # each side starts when its own input is there (see [Note: the OVERLAP_F_B model])
        t0 = st.time
        ready = (
            max(0.0, self.ready_time(f.stage_index, "F", _microbatch(f)) - t0),
            max(0.0, self.ready_time(b.stage_index, b_kind, _microbatch(b)) - t0),
        )
        fseg = self.costs[f.stage_index].segments("F")
        bseg = self.costs[b.stage_index].segments(b_kind)
        f_end, b_end, intervals = overlap_pair(fseg, bseg, self.overlap, ready)
        marked = len(fseg) > 1 or len(bseg) > 1
        if not marked and not self.overlap.streams:
            self.unmarked_pairs.add((f.stage_index, b.stage_index))
        for side, sub, end in ((Side.FORWARD, f, f_end), (Side.BACKWARD, b, b_end)):
            iv = [(t0 + s, t0 + e, k) for sd, s, e, k in intervals if sd == side]
            start = min((s for s, _, _ in iv), default=t0 + end)
            self._record(sub, start, t0 + end, iv, lane=side)
        return t0 + max(f_end, b_end)

    def run(self) -> None:
        while not all(st.done for st in self.ranks.values()):
            progress = False
            for st in self.ranks.values():
                while not st.done:
                    try:
                        self.step_rank(st)
                    except _Blocked:
                        break
                    progress = True
            if not progress:
                stuck = []
                for st in self.ranks.values():
                    if st.done:
                        continue
                    try:
                        self.step_rank(st)
                    except _Blocked as e:
                        stuck.append(
                            f"rank {st.rank} at action {st.actions[st.pos]} waits for {e}"
                        )
                raise RuntimeError("simulated schedule deadlocks: " + "; ".join(stuck))
        for key, arrive in self._transfer_list():
            self.transfers.append(key + arrive)

    def _transfer_list(
        self,
    ) -> Iterator[tuple[tuple[str, int, int], tuple[float, float]]]:
        for (direction, stage, mb), recv_t in sorted(self.posted_recv.items()):
            src = stage - 1 if direction == "F" else stage + 1
            begin = max(self.posted_send.get((direction, stage, mb), recv_t), recv_t)
            what = f"{direction}{mb} {src}->{stage}"
            yield (
                (what, self.stage_to_rank[src], self.stage_to_rank[stage]),
                (
                    begin,
                    begin + self.link.time(self.costs[src].send_bytes),
                ),
            )


# --------------------------------------------------------------------------- #
# Summaries                                                                    #
# --------------------------------------------------------------------------- #


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of ``a`` (a union) not covered by ``b`` (a union)."""
    total = 0.0
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def _summarise(sim: _Simulation) -> SimulationResult:
    step = max((st.time for st in sim.ranks.values()), default=0.0)
    step = max([step] + [r.end for r in sim.records])
    by_rank: dict[int, list[ActionRecord]] = defaultdict(list)
    for r in sim.records:
        by_rank[r.rank].append(r)
    # live microbatches per stage: from F's start to the end of the last backward piece (W if split)
    events: dict[int, list[tuple[float, int]]] = defaultdict(list)
    release: dict[tuple[int, int], float] = {}
    for (stage, comp, mb), end in sim.end.items():
        if comp in ("B", "W"):
            release[(stage, mb)] = max(release.get((stage, mb), 0.0), end)
        elif comp == "I" and (stage, "W", mb) not in sim.end:
            release[(stage, mb)] = max(release.get((stage, mb), 0.0), end)
    for (stage, comp, mb), start in sim.start.items():
        if comp == "F":
            events[stage].append((start, +1))
            events[stage].append((release.get((stage, mb), step), -1))
    peak_live: dict[int, int] = {}
    rank_events: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for stage in range(sim.n_stages):
        live = peak = 0
        for _, d in sorted(events[stage], key=lambda x: (x[0], x[1])):
            live += d
            peak = max(peak, live)
        peak_live[stage] = peak
        nbytes = sim.costs[stage].activation_bytes
        rank_events[sim.stage_to_rank[stage]].extend(
            (t, d * nbytes) for t, d in events[stage]
        )
    ranks: list[RankSummary] = []
    for rank in sorted(sim.ranks):
        recs = by_rank.get(rank, [])
        compute = _union(
            [(s, e) for r in recs for s, e, k in r.intervals if k == "compute"]
        )
        comm = _union([(s, e) for r in recs for s, e, k in r.intervals if k == "comm"])
        busy = _length(compute)
        exposed = _minus(comm, compute)
        hidden = _length(comm) - exposed
        action_sum = sum(sim.costs[r.stage].total(r.computation) for r in recs)
        mem = peak_mem = 0.0
        for _, nbytes_delta in sorted(rank_events[rank], key=lambda x: (x[0], x[1])):
            mem += nbytes_delta
            peak_mem = max(peak_mem, mem)
        posting = sim.ranks[rank].posting
        bubble = max(0.0, step - busy - exposed - posting)
        ranks.append(
            RankSummary(
                rank,
                busy,
                exposed,
                hidden,
                posting,
                bubble,
                bubble / step if step else 0.0,
                action_sum,
                peak_mem,
            )
        )
    return SimulationResult(
        step_time=step,
        ranks=ranks,
        peak_live_activations=peak_live,
        records=sorted(sim.records, key=lambda r: (r.rank, r.start, r.lane)),
        stage_to_rank=dict(sim.stage_to_rank),
        transfers=sim.transfers,
    )


def run_simulation(
    order: Mapping[int, Sequence[Action | None]],
    stage_to_rank: Mapping[int, int],
    costs: Sequence[StageCost],
    link: LinkCost = LinkCost(),
    overlap: OverlapModel = OverlapModel(),
) -> SimulationResult:
    """Simulate one step of ``order`` (a ``pipeline_order_with_comms``-style dict of rank -> actions)."""
    sim = _Simulation(order, stage_to_rank, costs, link, overlap)
    sim.run()
    logger.debug("simulated %d actions on %d ranks", len(sim.records), len(sim.ranks))
    return _summarise(sim)
