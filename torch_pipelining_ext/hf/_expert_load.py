"""Expert-load statistics of Hugging Face MoE stages and DeepSeek-V3's
auxiliary-loss-free bias update.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF expert
load]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_pipelining_ext.hf import _families
from torch_pipelining_ext.hf._arrival import group_device


if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from transformers import PretrainedConfig


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF expert load]
# Every stage of a MoE model counts, per MoE layer, the (token, expert) slots
# its experts were given (``[Note: HF routing records]``: once per layer and
# microbatch, never in a recomputation), split into slots of real tokens and
# of padding tokens (the attention mask travels with the stages only with an
# auxiliary loss; without it every token counts as real).  A stage that
# pipeline_hf_causal_lm wrapped in a PipelineStage counts only the forwards
# that PipelineStage runs for a microbatch (``forward_maybe_with_nosync``,
# the one call of every torch release's forward_one_chunk): torch 2.13 and
# newer also run the stage once on uninitialised tensors of the right shapes
# to infer the stages' metadata, on the first step, which must not count.  A
# stage used on its own counts every forward.  The counts accumulate on the
# stages' device by ``scatter_add`` (no host synchronisation).  ``expert_load(parts, group)`` packs them into one int64
# tensor ``[num_hidden_layers, 2 (E + 1) + 1]`` (real slots per expert,
# padding slots per expert, the last column of each set for slots routed to
# no expert -- transformers' index ``E`` -- and one column counting the ranks
# that hold the layer), sums it over ``group`` in one all-reduce and starts
# the next step's counts from zero.  Over the expert-parallel (and
# data-parallel) group the counts are those of the global batch; over the
# whole pipeline as well, every rank receives every layer (pipeline ranks
# hold disjoint layers).  DeepSeek-V3's bias update then needs no further
# communication: every replica of a layer holds the same counts and adds the
# same ``rate * sign(mean_i load_i - load_i)`` to ``e_score_correction_bias``,
# compared in integers (``sum_j load_j - E * load_i``), so replicas stay
# bitwise equal.


class _MoEStage(Protocol):
    """What the statistics and the bias update read of a MoE model's stage
    (an ``HFCausalLMStage`` that holds a :class:`LoadCounter`)."""

    config: PretrainedConfig
    _routers: dict[int, nn.Module]


class LoadCounter:
    """The expert-load counts of one stage: per MoE layer of ``layers`` (model
    indices), real and padding slots per expert (``E + 1`` columns: the last
    for slots routed to no expert), and the forwards run since the last read."""

    def __init__(self, layers: Sequence[int], num_experts: int) -> None:
        self.layers = list(layers)
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None
        self.forwards = 0
        self.schedule_forwards_only = False
        self._in_schedule_forward = threading.local()

    @contextlib.contextmanager
    def schedule_forward(self) -> Iterator[None]:
        """The block is a forward its PipelineStage runs for a microbatch."""
        depth = getattr(self._in_schedule_forward, "depth", 0)
        self._in_schedule_forward.depth = depth + 1
        try:
            yield
        finally:
            self._in_schedule_forward.depth = depth

    def counting(self, x: torch.Tensor) -> bool:
        """Whether the forward of ``x`` running on this thread counts."""
        if x.is_meta:
            return False
        return not self.schedule_forwards_only or bool(
            getattr(self._in_schedule_forward, "depth", 0)
        )

    def add(self, layer: int, indices: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Count one MoE layer's top-k ``indices`` ``[T, k]`` (``mask``: ``[b, s]``, 1 for real tokens)."""
        e1 = self.num_experts + 1
        if self.counts is None:
            self.counts = torch.zeros(
                len(self.layers), 2, e1, dtype=torch.int64, device=indices.device
            )
        flat = indices.reshape(-1)
        k = indices.shape[-1]
        slots = torch.zeros(e1, dtype=torch.int64, device=flat.device)
        slots.scatter_add_(0, flat, torch.ones_like(flat))
        row = self.counts[self.layers.index(layer)]
        if mask is None:
            row[0].add_(slots)
            return
        real = torch.zeros(e1, dtype=torch.int64, device=flat.device)
        weights = mask.detach().reshape(-1).to(torch.int64).repeat_interleave(k)
        real.scatter_add_(0, flat, weights)
        row[0].add_(real)
        row[1].add_(slots - real)

    def clear(self) -> None:
        if self.counts is not None:
            self.counts.zero_()
        self.forwards = 0


def count_schedule_forwards(stage: PipelineStage, part: nn.Module) -> None:
    """Count only the microbatch forwards ``stage`` (the PipelineStage of
    ``part``) runs; see ``[Note: HF expert load]``."""
    counter: LoadCounter | None = getattr(part, "_expert_load", None)
    if counter is None:
        return

    # a weak reference: a closure holding the stage, stored on the stage, would
    # keep it (and its process group) alive until a garbage collection, which
    # may then run in a forked child, where the group's destructor hangs
    stage_ref = weakref.ref(stage)

    def forward_maybe_with_nosync(*args: object, **kwargs: object) -> object:
        owner = stage_ref()
        assert owner is not None, "the stage calls this method of its own"
        with counter.schedule_forward():
            return type(owner).forward_maybe_with_nosync(owner, *args, **kwargs)

    stage.forward_maybe_with_nosync = forward_maybe_with_nosync  # type: ignore[method-assign]
    counter.schedule_forwards_only = True


@dataclass(frozen=True, eq=False)
class ExpertLoad:
    """The expert load of one step, per MoE layer: what
    :func:`torch_pipelining_ext.hf.expert_load` returns.

    Attributes:
        layers: the model indices of the MoE layers covered (those of the
            ranks the counts were summed over).
        tokens_per_expert: ``[len(layers), E]`` int64: the (token, expert)
            slots of real tokens routed to each expert (each token fills
            ``top_k`` slots).
        padding_slots: ``[len(layers)]`` int64: slots filled by padding
            tokens (the experts compute them too; known only where the
            stages carry the attention mask, i.e. with an auxiliary loss,
            else 0 and the padding counts as real tokens).
        dropped_slots: ``[len(layers)]`` int64: slots routed to no expert
            (transformers' index ``E``).  Neither the fused experts nor the
            expert-parallel exchange have a capacity, so nothing else is
            dropped.
        replicas: ``[len(layers)]`` int64: how many ranks of the group hold
            each layer (its expert-parallel and data-parallel replicas).
    """

    layers: tuple[int, ...]
    tokens_per_expert: torch.Tensor
    padding_slots: torch.Tensor
    dropped_slots: torch.Tensor
    replicas: torch.Tensor

    def max_load(self) -> torch.Tensor:
        """``[len(layers)]``: the busiest expert's slots."""
        return self.tokens_per_expert.max(dim=-1).values

    def mean_load(self) -> torch.Tensor:
        """``[len(layers)]`` float64: the slots per expert on average."""
        return self.tokens_per_expert.double().mean(dim=-1)

    def imbalance(self) -> torch.Tensor:
        """``[len(layers)]`` float64: max / mean load (1 is perfectly balanced)."""
        return self.max_load().double() / self.mean_load().clamp(min=1e-12)

    def padded_fraction(self) -> torch.Tensor:
        """``[len(layers)]`` float64: the fraction of slots filled by padding."""
        total = self.tokens_per_expert.sum(dim=-1) + self.padding_slots
        return self.padding_slots.double() / total.double().clamp(min=1)

    def summary(self) -> str:
        """One line: max/mean load per layer, padding and dropped slots."""
        if not self.layers:
            return "expert load: no MoE layer"
        ratios = self.imbalance().tolist()
        per_layer = ", ".join(f"{i}: {r:.2f}" for i, r in zip(self.layers, ratios))
        padded = float(self.padded_fraction().mean())
        dropped = int(self.dropped_slots.sum())
        return (
            f"expert load max/mean per MoE layer (1.00 = balanced): {per_layer}; "
            f"padding {100 * padded:.1f}% of slots, {dropped} dropped"
        )


def expert_load(
    parts: Sequence[nn.Module], group: dist.ProcessGroup | None = None
) -> ExpertLoad:
    """See :func:`torch_pipelining_ext.hf.expert_load`."""
    counters = _counters(parts, "expert_load")
    if not any(counter.forwards for _, counter in counters):
        raise RuntimeError(
            "expert_load: no forward ran through these stages since the last call (statistics requested "
            "before a step): call it after schedule.step()"
        )
    num_layers = counters[0][0].config.num_hidden_layers
    e1 = counters[0][1].num_experts + 1
    packed = torch.zeros(
        num_layers, 2 * e1 + 1, dtype=torch.int64, device=_device(counters, group)
    )
    for _, counter in counters:
        for slot, layer in enumerate(counter.layers):
            packed[layer, -1] += 1
            if counter.counts is not None:
                packed[layer, :-1] += counter.counts[slot].reshape(-1).to(packed.device)
        counter.clear()
    if group is not None:
        dist.all_reduce(packed, group=group)
    layers = tuple((packed[:, -1] > 0).nonzero().flatten().tolist())
    rows = packed[list(layers)]
    logger.debug("expert load of layers %s over group %s", layers, group)
    return ExpertLoad(
        layers=layers,
        tokens_per_expert=rows[:, : e1 - 1],
        padding_slots=rows[:, e1 : 2 * e1 - 1].sum(dim=-1),
        dropped_slots=rows[:, e1 - 1] + rows[:, 2 * e1 - 1],
        replicas=rows[:, -1],
    )


def _counters(
    parts: Sequence[nn.Module], what: str
) -> list[tuple[_MoEStage, LoadCounter]]:
    """(stage, its LoadCounter) of every stage of ``parts`` of a MoE model."""
    counters = []
    for part in parts:
        counter: LoadCounter | None = getattr(part, "_expert_load", None)
        if counter is not None:
            counters.append((cast(_MoEStage, part), counter))
    if not counters:
        raise ValueError(
            f"{what}: none of these stages holds a MoE model's layers (fused experts of transformers 5.x); "
            "pass the model_parts pipeline_hf_causal_lm returned for a MoE model"
        )
    return counters


def _device(
    counters: list[tuple[_MoEStage, LoadCounter]], group: dist.ProcessGroup | None
) -> torch.device:
    for _, counter in counters:
        if counter.counts is not None:
            return counter.counts.device
    if group is not None:
        return group_device(group)
    return torch.device("cpu")


def update_expert_bias(
    parts: Sequence[nn.Module], load: ExpertLoad, rate: float
) -> None:
    """See :func:`torch_pipelining_ext.hf.update_expert_bias`."""
    routers = [
        (layer, router)
        for part, _ in _counters(parts, "update_expert_bias")
        for layer, router in part._routers.items()
    ]
    biased = [(i, r) for i, r in routers if _families.has_expert_bias(r)]
    if not biased:
        kind = {
            getattr(getattr(p, "config", None), "model_type", type(p).__name__)
            for p in parts
        }
        raise ValueError(
            f"update_expert_bias: the routers of these stages ({', '.join(sorted(kind))}) have no "
            f"{_families.EXPERT_BIAS_BUFFER}: "
            "the auxiliary-loss-free bias update is DeepSeek-V3's (and GLM-4-MoE's); balance other MoEs with "
            "router_aux_loss"
        )
    if not isinstance(load, ExpertLoad):
        raise TypeError(
            f"load must be the ExpertLoad of expert_load(parts, group), got {type(load).__name__}"
        )
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(f"rate must be a number, got {type(rate).__name__}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be finite and > 0, got {rate}")
    with torch.no_grad():
        for layer, router in biased:
            if layer not in load.layers:
                raise ValueError(
                    f"update_expert_bias: the load has no layer {layer} (it covers {list(load.layers)}): pass "
                    "the ExpertLoad of these stages' step, summed over a group that includes this rank"
                )
            tokens = load.tokens_per_expert[load.layers.index(layer)]
            bias = getattr(router, _families.EXPERT_BIAS_BUFFER)
            # sign(mean - load_i) in integers: sign(sum - E * load_i)
            below = tokens.sum() - tokens.numel() * tokens
            step = torch.sign(below).to(device=bias.device, dtype=bias.dtype)
            bias.add_(step, alpha=rate)
