"""Selective activation checkpointing under a split backward.

Upstream file: ``torch/utils/checkpoint.py`` (``_CachedTorchDispatchMode``).

Schedules that split a stage's backward (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, CSV schedules with I/W)
run two ``torch.autograd.grad`` calls over one graph: the input pass, which
keeps the graph, and the weight pass.  Non-reentrant checkpointing recomputes
a region once per graph task that unpacks its saved tensors, so a region whose
weights need its activations is recomputed twice.  Selective checkpointing
(``create_selective_checkpoint_contexts``) hands each cached op output to the
first recompute only; the second raises "Trying to backward an extra time".
:func:`_make_cached_mode_enter` lets every recompute of a region see the
forward's cache; see [Note: selective checkpoint cache lifetime].

The weight pass itself (``torch/distributed/pipelining/_backward.py``,
``stage_backward_weight``) runs one ``torch.autograd.grad`` per parameter
group, each a graph task of its own, so it recomputed every checkpointed
region once per group and kept each recompute's unused tensors until the
graph was freed; :func:`_make_stage_backward_weight` runs the groups as one
recompute (see [Note: one recompute per weight pass]).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils import checkpoint as _checkpoint


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: selective checkpoint cache lifetime]
#
# ``create_selective_checkpoint_contexts`` returns a caching mode, run under
# the region's forward, and a cached mode, run under each recompute; both hold
# one ``storage``: op -> the outputs the policy chose to keep, in call order.
# The cached mode takes each output out of ``storage`` as the recompute
# replays its op (torch 2.9 pops it from a list, later releases mark it
# consumed), so a second recompute of the region finds nothing and raises.
#
# A recompute replays the region's forward from its first op.  So the first
# time the cached mode is entered (the forward has finished: recomputation
# only runs in a backward) it copies ``storage``'s per-op containers, and each
# later entry restores them, with the per-op call counters at zero where the
# release has them.  The copies share the cached tensors, they do not copy
# them.
#
# Lifetime: the copies are attributes of the cached mode, which only the
# checkpoint frame's recompute function references, and the frame only the
# unpack hooks of the region's saved tensors.  When the graph frees the
# region's last saved tensor (the node that used it ran in a backward that
# does not retain the graph: the weight pass of a split backward, the single
# pass of an ordinary one), frame, mode and cache go with it.  The cached
# outputs live as long as the region's saved tensors would have without
# checkpointing, and no longer; nothing is kept in a module-level table.
# Within the region's last pass an output is released when the region's last
# node has run rather than when the recompute takes it: a region's cached
# outputs at most, which its backward held at its start anyway.
#
# Releases whose cached mode asks the policy again at each recompute
# (``is_recompute=True``; later ones replay the forward's decisions by call
# index) would let a stateful policy (torchtitan's, which saves every other
# ``mm`` by counting them) decide differently in the second recompute and
# take another op's output from the cache.  There the first recompute's
# decisions are recorded and replayed by the later ones (:class:`_Decisions`).


_CachedMode = _checkpoint._CachedTorchDispatchMode
_Policy = Callable[..., object]


class _Decisions:
    """A policy's decisions in a region's first recompute, replayed by the later ones.

    State: ``replay is None`` while recording (the first recompute), an
    iterator over the recorded ``(op, decision)`` pairs after :meth:`rewind`.
    """

    def __init__(self, policy: _Policy) -> None:
        self.policy = policy
        self.recorded: list[tuple[object, object]] = []
        self.replay: Iterator[tuple[object, object]] | None = None

    def rewind(self) -> None:
        self.replay = iter(self.recorded)

    def __call__(
        self, ctx: object, op: object, *args: object, **kwargs: object
    ) -> object:
        if self.replay is None:
            decision = self.policy(ctx, op, *args, **kwargs)
            self.recorded.append((op, decision))
            return decision
        recorded_op, decision = next(self.replay, (None, None))
        if recorded_op is not op:
            raise RuntimeError(
                f"selective checkpoint: a region's recompute ran {op} where its "
                f"first recompute ran {recorded_op}; the region must run the same "
                "ops each time it is recomputed"
            )
        return decision


def _make_cached_mode_enter(
    original: Callable[[_CachedMode], _CachedMode] | None,
) -> Callable[[_CachedMode], _CachedMode]:
    """``_CachedTorchDispatchMode.__enter__`` that replays the forward's cache.

    ``original`` is the class's own ``__enter__`` (None where it inherits
    ``TorchDispatchMode``'s).
    """

    def __enter__(self: _CachedMode) -> _CachedMode:
        storage = self.storage
        forward_cache = self.__dict__.get("_forward_cache")
        if forward_cache is None:
            # the patch's own attribute, on torch's mode object (freed with it)
            self._forward_cache = {op: copy.copy(out) for op, out in storage.items()}  # type: ignore[attr-defined]
            policy = getattr(self, "policy_fn", None)
            if callable(policy):  # a release that asks the policy at recompute
                self.policy_fn = _Decisions(policy)  # type: ignore[attr-defined]
        else:
            logger.debug(
                "selective checkpoint: recomputing a region again, %d cached ops",
                len(forward_cache),
            )
            storage.update((op, copy.copy(out)) for op, out in forward_cache.items())
            func_counter = getattr(self, "func_counter", None)
            if func_counter is not None:
                func_counter.clear()
            if isinstance(self.__dict__.get("policy_fn"), _Decisions):
                self.policy_fn.rewind()  # type: ignore[attr-defined]
        if original is None:
            return super(_CachedMode, self).__enter__()
        return original(self)

    return __enter__


# [Note: one recompute per weight pass]
#
# Non-reentrant checkpointing recomputes a region once per graph task that
# unpacks its saved tensors, and keeps each recompute's tensors until that
# task unpacks them or the graph is freed.  ``stage_backward_weight`` runs one
# ``torch.autograd.grad`` per parameter group (the weights behind one set of
# intermediates), so a region whose weights fall into k groups was recomputed
# k times in the weight pass, and the tensors a group did not unpack (those of
# the other groups, those of the input gradient) stayed alive, k copies of
# them.  One DeepSeek-style MoE block (2 x 512 tokens, dim 128) under full
# checkpointing peaked at 105 MiB in its weight pass against 36 MiB without
# checkpointing; under DualPipeV (tools/bench_checkpoint_memory.py, peak per
# rank) full checkpointing took 168 MiB against 115 MiB, and 63 MiB with one
# recompute per weight pass.
# ``torch.utils.checkpoint.GraphExecGroup`` exists for this: the backward
# calls under one group share a recompute of each region.  The groups of a
# weight pass reach disjoint parts of the graph, as the group requires.  A
# caller already inside a group keeps its own.


def _make_stage_backward_weight(
    original: Callable[..., tuple[Any, ...]],
) -> Callable[..., tuple[Any, ...]]:
    """``stage_backward_weight`` whose parameter groups share one recompute per region."""

    @functools.wraps(original)
    def stage_backward_weight(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        if _checkpoint.GraphExecGroup._get_current_group() is not None:
            return original(*args, **kwargs)
        with _checkpoint.GraphExecGroup():
            return original(*args, **kwargs)

    return stage_backward_weight
