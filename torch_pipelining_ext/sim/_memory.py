"""Parameters and static memory of a stage split on one GPU."""

from __future__ import annotations

from collections.abc import Sequence

from torch_pipelining_ext.sim._shape import ModelShape


__all__ = ["stage_params", "static_memory_bytes"]


def stage_params(
    shape: ModelShape, layers_per_stage: Sequence[int], ep: int
) -> list[tuple[float, float]]:
    """(dense, expert) parameters each stage holds on one GPU; experts are sharded over ``ep``."""
    out, start = [], 0
    for s, count in enumerate(layers_per_stage):
        dense = experts = 0.0
        for i in range(start, start + count):
            dense += shape.attention_params()
            if shape.is_moe_layer(i):
                dense += (
                    3
                    * shape.hidden_size
                    * shape.moe_intermediate_size
                    * shape.shared_experts
                )
                experts += (
                    3
                    * shape.hidden_size
                    * shape.moe_intermediate_size
                    * shape.num_experts
                    / ep
                )
            else:
                dense += 3 * shape.hidden_size * shape.intermediate_size
        if s == 0 or s == len(layers_per_stage) - 1:
            dense += shape.vocab_size * shape.hidden_size
        out.append((dense, experts))
        start += count
    return out


def static_memory_bytes(
    params: Sequence[tuple[float, float]], dp: int, ep: int
) -> float:
    """Bytes one GPU keeps for the (dense, expert) parameters of its stages, activations aside.

    bf16 weights and fp32 gradients; fp32 master weights and Adam moments
    sharded (ZeRO-1) over the data-parallel ranks holding the same copy: DP
    for dense parameters, DP / EP for experts.
    """
    dense = sum(d for d, _ in params)
    experts = sum(e for _, e in params)
    return (dense + experts) * (2 + 4) + dense * 12 / dp + experts * 12 / (dp // ep)
