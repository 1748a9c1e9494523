"""Per-layer costs and the stage split that sums them into stage costs.

* :class:`LayerCost` -- one transformer layer's F, I and W compute and its
  expert-parallel all-to-alls, per microbatch.
* :func:`stage_costs_from_layers` -- the :class:`StageCost` of each stage of
  a contiguous split; :func:`even_layer_split` -- the planner's split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch_pipelining_ext.sim._inputs import check_number, Segments, StageCost


__all__ = ["LayerCost", "even_layer_split", "stage_costs_from_layers"]


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One transformer layer, per microbatch (seconds, bytes).

    An MoE layer's forward is ``attention (1 - expert_fraction) * forward``,
    the dispatch all-to-all, ``experts expert_fraction * forward``, the
    combine all-to-all; its input backward runs the mirror image (combine's
    backward first).  ``dispatch = combine = 0`` is a dense layer.
    """

    forward: float  # compute of F
    backward_input: float  # compute of I
    backward_weight: float  # compute of W
    dispatch: float = 0.0  # the dispatch all-to-all (and its backward)
    combine: float = 0.0  # the combine all-to-all (and its backward)
    expert_fraction: float = 0.5  # the experts' share of forward and backward_input
    activation_bytes: float = 0.0  # kept alive per microbatch until its backward
    output_bytes: float = 0.0  # the layer's output (what a stage ending here sends)
    # the experts' share of backward_input (None: expert_fraction)
    backward_expert_fraction: float | None = None
    # the backward's all-to-alls (None: as long as the forward's one they mirror):
    # combine's backward comes first in the backward, dispatch's backward second
    backward_combine: float | None = None
    backward_dispatch: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("backward_") and value is None:
                continue
            check_number(f"LayerCost.{f.name}", value)
            if f.name.endswith("expert_fraction") and value > 1:
                raise ValueError(f"LayerCost.{f.name} must be in [0, 1], got {value!r}")

    @property
    def has_comm(self) -> bool:
        """Whether the layer has expert-parallel all-to-alls (an MoE layer)."""
        return self.dispatch > 0 or self.combine > 0


def _layer_segments(layer: LayerCost, compute: float, backward: bool) -> list[float]:
    if not layer.has_comm:
        return [compute]
    fraction = layer.expert_fraction
    if backward and layer.backward_expert_fraction is not None:
        fraction = layer.backward_expert_fraction
    attn, experts = compute * (1 - fraction), compute * fraction
    if backward:
        combine, dispatch = layer.backward_combine, layer.backward_dispatch
        return [
            0.0,
            layer.combine if combine is None else combine,
            experts,
            layer.dispatch if dispatch is None else dispatch,
            attn,
        ]
    return [attn, layer.dispatch, experts, layer.combine, 0.0]


def _join(parts: Sequence[list[float]]) -> Segments:
    out: list[float] = [0.0]
    for part in parts:
        out[-1] += part[0]
        out.extend(part[1:])
    return tuple(out)


def stage_costs_from_layers(
    layers: Sequence[LayerCost],
    layers_per_stage: Sequence[int],
    *,
    first_extra: StageCost | None = None,
    last_extra: StageCost | None = None,
) -> list[StageCost]:
    """Sum per-layer costs by a contiguous stage split.

    Args:
        layers: every layer of the model in order.
        layers_per_stage: how many consecutive layers each stage holds (a
            stage may hold none, e.g. only the embedding or the head).
        first_extra: compute added to stage 0 (embedding).
        last_extra: compute added to the last stage (norm, head and loss).
    """
    if sum(layers_per_stage) != len(layers):
        raise ValueError(
            f"layers_per_stage {list(layers_per_stage)} does not sum to {len(layers)} layers"
        )
    out: list[StageCost] = []
    start = 0
    n = len(layers_per_stage)
    for s, count in enumerate(layers_per_stage):
        mine = layers[start : start + count]
        start += count
        extras = [
            e
            for e, on in ((first_extra, s == 0), (last_extra, s == n - 1))
            if on and e is not None
        ]
        fwd = [_layer_segments(layer, layer.forward, False) for layer in mine]
        # backward runs the layers in reverse order
        bwd = [
            _layer_segments(layer, layer.backward_input, True)
            for layer in reversed(mine)
        ]
        weight = sum(layer.backward_weight for layer in mine)
        act = sum(layer.activation_bytes for layer in mine)
        send = (
            mine[-1].output_bytes
            if mine
            else (layers[start - 1].output_bytes if start else 0.0)
        )
        for e in extras:
            fwd.append([e.total("F")])
            bwd.insert(0, [e.total("I")])
            weight += e.backward_weight
            act += e.activation_bytes
        out.append(
            StageCost(
                forward=_join(fwd),
                backward_input=_join(bwd),
                backward_weight=weight,
                activation_bytes=act,
                send_bytes=send,
            )
        )
    return out


def even_layer_split(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as even as possible: the first stage holds the embedding, the last the head,
    so the remainder goes to the middle stages."""
    base, extra = divmod(n_layers, n_stages)
    order = sorted(
        range(n_stages),
        key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)),
    )
    out = [base] * n_stages
    for s in order[:extra]:
        out[s] += 1
    return out
