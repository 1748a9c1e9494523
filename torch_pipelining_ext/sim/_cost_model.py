"""The cost model: per-layer costs of a :class:`ModelShape` on a :class:`Hardware`.

A roofline-style estimate: FLOPs over achieved throughput, all-to-all bytes
over bandwidth.  :class:`CostOptions` holds how the model is trained
(precision, recomputation, routing balance, tensor parallelism);
:func:`layer_costs` and :func:`layer_phase_times` are its entry points.
"""

from __future__ import annotations

import dataclasses
from typing import cast, Literal

from torch_pipelining_ext.sim._hardware import Hardware
from torch_pipelining_ext.sim._inputs import check_number, StageCost
from torch_pipelining_ext.sim._layers import LayerCost
from torch_pipelining_ext.sim._shape import ModelShape


__all__ = ["CostOptions", "layer_costs", "layer_phase_times"]


Recompute = Literal["none", "full", "deepseek"]

# bytes per token and hidden unit one layer keeps alive until its backward,
# by recompute mode (see layer_costs)
_KEPT_ACTIVATIONS: dict[str, int] = {"none": 34, "full": 2, "deepseek": 24}

# [Note: DeepSeek-V3 options of the cost model]
# What the DeepSeek-V3 report's training run used, each a field of
# CostOptions (the defaults are the plain bf16 model):
# * fp8_gemms: every weight matmul (attention projections, experts, dense MLP)
#   runs at Hardware.fp8_tflops x achieved_fraction; the attention scores and
#   the head stay bf16 (FlashAttention in bf16).
# * a2a_dtype_bytes=1, combine_dtype_bytes=2: FP8 dispatch, BF16 combine.  In
#   the backward, combine's backward sends the activation gradients to the
#   experts the way the dispatch sends activations, in FP8 (the report
#   quantizes the gradient before the down-projection), and dispatch's
#   backward returns them the way the combine does, in BF16.
# * routing_imbalance: the busiest GPU's routed tokens over the mean; 1.0 is
#   balanced routing (DeepSeek's published profile simulates it).  It scales
#   the routed experts' compute and the all-to-all bytes.
# * recompute="deepseek": recompute RMSNorm and the MLA up-projections in the
#   backward instead of keeping their outputs: per layer the two norm outputs
#   (4 * tokens * hidden bytes) and the up-projected query, key and value
#   (6 * tokens * hidden) are not kept, 24 * tokens * hidden of the 34 remain,
#   and the input backward re-runs the up-projections.  No full recompute.


@dataclasses.dataclass(frozen=True)
class CostOptions:
    """How the model is trained, as the cost model prices it; the defaults
    are the plain bf16 model.  See [Note: DeepSeek-V3 options of the cost model].

    Args:
        tp: tensor-parallel degree: divides compute and activations (no
            communication is charged for it).
        dtype_bytes: bytes per element of the activations and the stage outputs.
        a2a_dtype_bytes: of the dispatch all-to-all (``None``: ``dtype_bytes``).
        combine_dtype_bytes: of the combine (``None``: the dispatch's).
        recompute: ``"none"``, ``"full"`` (only each layer's input is kept) or
            ``"deepseek"`` (RMSNorm and the MLA up-projections); ``True`` and
            ``False`` stand for ``"full"`` and ``"none"`` and are stored as them.
        fp8_gemms: weight matmuls at the hardware's FP8 peak.
        routing_imbalance: the busiest GPU's routed tokens over the mean (>= 1).
    """

    tp: int = 1
    dtype_bytes: int = 2
    a2a_dtype_bytes: int | None = None
    combine_dtype_bytes: int | None = None
    recompute: Recompute | bool = "none"
    fp8_gemms: bool = False
    routing_imbalance: float = 1.0

    def __post_init__(self) -> None:
        check_number("CostOptions.tp", self.tp, positive=True, integer=True)
        for name in ("dtype_bytes", "a2a_dtype_bytes", "combine_dtype_bytes"):
            if getattr(self, name) is not None:
                check_number(f"CostOptions.{name}", getattr(self, name), positive=True)
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        elif self.recompute not in _KEPT_ACTIVATIONS:
            raise ValueError(
                f"CostOptions.recompute must be a bool or one of {', '.join(_KEPT_ACTIVATIONS)}, "
                f"got {self.recompute!r}"
            )
        if not isinstance(self.fp8_gemms, bool):
            raise ValueError(
                f"CostOptions.fp8_gemms must be a bool, got {self.fp8_gemms!r}"
            )
        check_number(
            "CostOptions.routing_imbalance", self.routing_imbalance, positive=True
        )
        if self.routing_imbalance < 1:
            raise ValueError(
                f"CostOptions.routing_imbalance must be >= 1, got {self.routing_imbalance!r}"
            )

    def phase_times(
        self,
        shape: ModelShape,
        hardware: Hardware,
        index: int,
        *,
        tokens: int,
        seq_len: int,
    ) -> dict[str, float]:
        """See :func:`layer_phase_times`."""
        if self.fp8_gemms and not hardware.fp8_tflops:
            raise ValueError(f"fp8_gemms: Hardware {hardware.name!r} has no fp8_tflops")
        tp, imbalance = self.tp, self.routing_imbalance
        bf16 = hardware.bf16_tflops * 1e12 * hardware.achieved_fraction * tp
        gemm = (
            (hardware.fp8_tflops * 1e12 * hardware.achieved_fraction * tp)
            if self.fp8_gemms
            else bf16
        )
        proj = 2 * shape.attention_params() * tokens / gemm
        core = 2 * tokens * seq_len * shape.num_heads * shape.head_dim / bf16
        mlp = 2 * shape.mlp_active_params(index) * tokens / gemm
        if shape.is_moe_layer(index) and imbalance != 1:
            routed = shape.top_k / (shape.top_k + shape.shared_experts)
            mlp *= 1 + routed * (imbalance - 1)
        out = {
            "attn(F)": proj + core,
            "mlp(F)": mlp,
            "attn(B)": proj + 2 * core,
            "mlp(B)": mlp,
            "attn(W)": proj,
            "mlp(W)": mlp,
        }
        if self.recompute == "full":
            out["attn(B)"] += out["attn(F)"]
            out["mlp(B)"] += out["mlp(F)"]
        elif self.recompute == "deepseek":
            out["attn(B)"] += 2 * shape.up_projection_params() * tokens / gemm
        return out

    def layer_costs(
        self,
        shape: ModelShape,
        hardware: Hardware,
        *,
        tokens: int,
        seq_len: int,
        ep: int = 1,
    ) -> tuple[list[LayerCost], StageCost, StageCost]:
        """See :func:`layer_costs`."""
        for name, value in (("tokens", tokens), ("seq_len", seq_len), ("ep", ep)):
            check_number(name, value, positive=True, integer=True)
        h, tp, dtype_bytes = shape.hidden_size, self.tp, self.dtype_bytes
        a2a_bytes = self.a2a_dtype_bytes or dtype_bytes
        dispatch_bytes = a2a_bytes * self.routing_imbalance
        combine_bytes = (self.combine_dtype_bytes or a2a_bytes) * self.routing_imbalance
        dispatch = _a2a_time(shape, hardware, tokens, ep, dispatch_bytes)
        combine = _a2a_time(shape, hardware, tokens, ep, combine_bytes)
        # (__post_init__ has spelled a bool out)
        kept = _KEPT_ACTIVATIONS[cast(Recompute, self.recompute)]
        act = kept * tokens * h / tp
        out: list[LayerCost] = []
        for i in range(shape.num_layers):
            moe = shape.is_moe_layer(i)
            ph = self.phase_times(shape, hardware, i, tokens=tokens, seq_len=seq_len)
            fwd, dgrad = ph["attn(F)"] + ph["mlp(F)"], ph["attn(B)"] + ph["mlp(B)"]
            out.append(
                LayerCost(
                    forward=fwd,
                    backward_input=dgrad,
                    backward_weight=ph["attn(W)"] + ph["mlp(W)"],
                    dispatch=dispatch if moe else 0.0,
                    combine=combine if moe else 0.0,
                    # combine's backward sends gradients to the experts as the dispatch
                    # does, at its precision; dispatch's backward returns them as the combine
                    backward_combine=dispatch if moe else None,
                    backward_dispatch=combine if moe else None,
                    expert_fraction=ph["mlp(F)"] / fwd if moe else 0.5,
                    backward_expert_fraction=ph["mlp(B)"] / dgrad if moe else None,
                    activation_bytes=act,
                    output_bytes=tokens * h * dtype_bytes,
                )
            )
        embed, head = _embed_and_head(shape, hardware, tokens, tp, dtype_bytes)
        return out, embed, head


def layer_phase_times(
    shape: ModelShape,
    hardware: Hardware,
    index: int,
    *,
    tokens: int,
    seq_len: int,
    tp: int = 1,
    fp8_gemms: bool = False,
    routing_imbalance: float = 1.0,
    recompute: Recompute | bool = False,
) -> dict[str, float]:
    """Compute seconds of layer ``index``'s phases for one microbatch of ``tokens`` tokens.

    Keys ``"attn(F)"``, ``"mlp(F)"``, ``"attn(B)"``, ``"mlp(B)"`` (input
    backward), ``"attn(W)"``, ``"mlp(W)"`` (weight backward), the phase names
    of DeepSeek's published profile.  FLOPs: ``2 * params * tokens`` per weight
    matmul in each of F, B and W, plus causal attention scores ``2 * tokens *
    seq_len * heads * head_dim`` in F and twice that in B.  See
    [Note: DeepSeek-V3 options of the cost model] for the options.
    """
    options = CostOptions(
        tp=tp,
        fp8_gemms=fp8_gemms,
        routing_imbalance=routing_imbalance,
        recompute=recompute,
    )
    return options.phase_times(shape, hardware, index, tokens=tokens, seq_len=seq_len)


def layer_costs(
    shape: ModelShape,
    hardware: Hardware,
    *,
    tokens: int,
    seq_len: int,
    ep: int = 1,
    tp: int = 1,
    dtype_bytes: int = 2,
    a2a_dtype_bytes: int | None = None,
    combine_dtype_bytes: int | None = None,
    recompute: Recompute | bool = False,
    fp8_gemms: bool = False,
    routing_imbalance: float = 1.0,
) -> tuple[list[LayerCost], StageCost, StageCost]:
    """Per-layer costs of one microbatch of ``tokens`` tokens on ``hardware``; also the embedding and the head.

    Compute: :func:`layer_phase_times`.  Dispatch and combine each move
    ``tokens * top_k * hidden * bytes * (ep - 1) / ep`` bytes per GPU
    (``a2a_dtype_bytes``, default ``dtype_bytes``; the combine
    ``combine_dtype_bytes``, default the dispatch's) over the all-to-all
    bandwidth (intra-node when ``ep`` fits in a node, else inter-node).
    Activation bytes per layer: ``34 * tokens * hidden`` (the usual estimate
    for bf16 with flash attention); ``recompute=True`` (or ``"full"``): only
    the layer input, ``2 * tokens * hidden``; ``"deepseek"``: ``24 * tokens *
    hidden`` (see [Note: DeepSeek-V3 options of the cost model]).  Tensor
    parallelism divides compute and activations by ``tp`` and is not charged
    any communication.
    """
    options = CostOptions(
        tp=tp,
        dtype_bytes=dtype_bytes,
        a2a_dtype_bytes=a2a_dtype_bytes,
        combine_dtype_bytes=combine_dtype_bytes,
        recompute=recompute,
        fp8_gemms=fp8_gemms,
        routing_imbalance=routing_imbalance,
    )
    return options.layer_costs(shape, hardware, tokens=tokens, seq_len=seq_len, ep=ep)


def _a2a_time(
    shape: ModelShape, hardware: Hardware, tokens: int, ep: int, nbytes: float
) -> float:
    """One all-to-all of ``tokens * top_k`` hidden vectors of ``nbytes`` bytes per element over ``ep`` GPUs."""
    if ep <= 1:
        return 0.0
    bw = (
        hardware.intra_node_a2a_gbps
        if ep <= hardware.gpus_per_node
        else hardware.inter_node_a2a_gbps
    )
    volume = tokens * shape.top_k * shape.hidden_size * nbytes * (ep - 1) / ep
    return hardware.a2a_latency + volume / (bw * 1e9)


def _embed_and_head(
    shape: ModelShape, hardware: Hardware, tokens: int, tp: int, dtype_bytes: int
) -> tuple[StageCost, StageCost]:
    """The embedding's and the head's (with the loss) costs, bf16."""
    h = shape.hidden_size
    flops_per_s = hardware.bf16_tflops * 1e12 * hardware.achieved_fraction
    embed = StageCost(forward=0.0, activation_bytes=tokens * h * dtype_bytes)
    head_flops = 2 * shape.vocab_size * h * tokens / flops_per_s / tp
    # logits in fp32 for the loss: 4 bytes per vocabulary entry
    head = StageCost(
        forward=head_flops,
        backward_input=head_flops,
        backward_weight=head_flops,
        activation_bytes=tokens * shape.vocab_size * 4 / tp,
    )
    return embed, head
