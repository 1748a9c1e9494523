"""Per-action costs for the schedule simulator, and how to derive them from a model and a machine.

Every number here is an input to a *prediction*: :mod:`torch_pipelining_ext.sim`
turns it into a step time, it measures nothing.

* :class:`StageCost` -- what one action of one stage costs: forward (F),
  backward for inputs (I), backward for weights (W), the expert-parallel
  all-to-alls inside F and I, the activation bytes a microbatch keeps alive
  and the bytes a stage sends to its neighbour.
* :class:`LinkCost` -- pipeline send/recv latency and bandwidth.
* :class:`OverlapModel` -- how an OVERLAP_F_B action runs (see
  [Note: the OVERLAP_F_B model] in ``_engine.py``).
* :class:`LayerCost` and :func:`stage_costs_from_layers` -- per-layer costs
  summed by a stage split.
* :class:`Hardware`, :data:`HARDWARE_PRESETS`, :class:`ModelShape` and
  :func:`layer_costs` -- per-layer costs from a Hugging Face config and a
  hardware description (a roofline-style estimate: FLOPs over achieved
  throughput, all-to-all bytes over bandwidth).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch_pipelining_ext.overlap.policy import HAND_OVER_MIN_REGION_S, Order


Segments = tuple[float, ...]


def check_number(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    allow_inf: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` and ``value`` unless ``value`` is a real number
    ``>= 0`` (``> 0`` if ``positive``), finite unless ``allow_inf``, an ``int`` if ``integer``."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and not integer:
        ok = not math.isnan(value) and (allow_inf or not math.isinf(value))
    if ok:
        ok = value > 0 if positive else value >= 0
    if not ok:
        what = "an integer" if integer else "a number"
        bound = "> 0" if positive else ">= 0"
        finite = "" if integer or allow_inf else ", finite"
        raise ValueError(f"{name} must be {what} {bound}{finite}, got {value!r}")


def _as_segments(value: float | Sequence[float], name: str) -> Segments:
    """``value`` as alternating compute/communication times: ``(c0, r1, c1, ..., rn, cn)``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, Sequence)):
        raise ValueError(f"{name} must be a time or a sequence of times, got {value!r}")
    seg = (value,) if isinstance(value, (int, float)) else tuple(value)
    if len(seg) % 2 != 1:
        raise ValueError(
            f"{name} must be one compute time or an odd-length sequence (compute, comm, compute, ...), got {seg}"
        )
    for i, v in enumerate(seg):
        check_number(f"{name}[{i}]" if len(seg) > 1 else name, v)
    return tuple(float(v) for v in seg)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """Costs of one pipeline stage, per microbatch, in seconds and bytes.

    ``forward`` and ``backward_input`` are either a compute time or a sequence
    ``(compute, comm, compute, comm, ..., compute)``: the expert-parallel
    communication regions (the ``overlap`` marks) between compute
    segments.  ``backward_weight`` (W) has no communication.  A full backward
    (B) is I's segments with W's compute spread over I's compute segments in
    proportion (``full_backward`` overrides it).

    Args:
        forward: F.
        backward_input: I (the input-gradient half of the backward).
        backward_weight: W (the weight-gradient half).
        full_backward: B, if it is not I + W.
        activation_bytes: bytes one microbatch keeps alive on this stage from
            the start of its F until its backward has finished (its W, when
            the backward is split).
        send_bytes: bytes of the stage's output (and of the gradient sent
            back), per microbatch.
    """

    forward: Segments | float = 0.0
    backward_input: Segments | float = 0.0
    backward_weight: float = 0.0
    full_backward: Segments | float | None = None
    activation_bytes: float = 0.0
    send_bytes: float = 0.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "forward", _as_segments(self.forward, "StageCost.forward"))
        set_(
            self,
            "backward_input",
            _as_segments(self.backward_input, "StageCost.backward_input"),
        )
        for name in ("backward_weight", "activation_bytes", "send_bytes"):
            check_number(f"StageCost.{name}", getattr(self, name))
        if self.full_backward is None:
            set_(
                self,
                "full_backward",
                _merge_weight(self.backward_input, self.backward_weight),
            )
        else:
            set_(
                self,
                "full_backward",
                _as_segments(self.full_backward, "StageCost.full_backward"),
            )

    def segments(self, computation: str) -> Segments:
        """The segments of one action: ``computation`` is ``"F"``, ``"I"``, ``"W"`` or ``"B"``."""
        if computation == "F":
            return self.forward  # type: ignore[return-value]
        if computation == "I":
            return self.backward_input  # type: ignore[return-value]
        if computation == "W":
            return (self.backward_weight,)
        if computation == "B":
            return self.full_backward  # type: ignore[return-value]
        raise ValueError(f"no cost for computation {computation!r}")

    def total(self, computation: str) -> float:
        """Compute plus communication time of one action run alone."""
        return sum(self.segments(computation))


def _merge_weight(input_seg: Segments, weight: float) -> Segments:
    compute = sum(input_seg[0::2])
    if compute <= 0:
        return input_seg[:-1] + (input_seg[-1] + weight,)
    # W spread in proportion: v + weight * v / compute (v / compute <= 1, so a
    # subnormal compute total cannot overflow)
    return tuple(
        v + weight * (v / compute) if i % 2 == 0 else v for i, v in enumerate(input_seg)
    )


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Pipeline-parallel send/recv: a message of ``n`` bytes takes ``latency + n / bandwidth`` seconds.

    A transfer starts once both its send and its receive are posted (the
    rendezvous of NCCL point-to-point); links are not shared between
    messages (no contention is modelled).  ``post_overhead`` is the time
    posting one send or receive keeps its rank busy (a kernel launch with
    NCCL; milliseconds for gloo's ``batch_isend_irecv`` on a loaded CPU).
    """

    latency: float = 0.0
    bandwidth: float = math.inf  # bytes per second
    post_overhead: float = 0.0

    def __post_init__(self) -> None:
        check_number("LinkCost.latency", self.latency)
        check_number(
            "LinkCost.bandwidth", self.bandwidth, positive=True, allow_inf=True
        )
        check_number("LinkCost.post_overhead", self.post_overhead)

    def time(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` bytes takes once it has started."""
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


@dataclasses.dataclass(frozen=True)
class OverlapModel:
    """How OVERLAP_F_B actions run in the simulation.

    Args:
        enabled: run the two sub-actions under the package's coordinator
            (False: one after the other, as torch's own handler does).
        streams: True on accelerators (each stage has its own stream, a pair
            without marks stays concurrent); False on CPU, where a stage pair
            whose concurrent run passed no mark runs sequentially for the rest
            of the step (the unmarked-pair rule of ``overlap/_handler.py``).
        handover: seconds a thread needs to resume computing after waiting
            for the other (0 on a device; tens of microseconds on CPU).
        min_region: a region shorter than this does not make its side wait for
            the other's next region before computing on (default: the
            coordinator's threshold, see [Note: the overlap rule]).
        order: how the two sides' all-to-alls are ordered: ``Order.STRICT``
            (one communicator: they take turns; what runs on NCCL and on
            groups without a twin) or ``Order.FREE`` (each side its own twin
            communicator, gloo); see [Note: the OVERLAP_F_B model].
    """

    enabled: bool = True
    streams: bool = True
    handover: float = 0.0
    min_region: float = HAND_OVER_MIN_REGION_S
    order: Order = Order.STRICT

    def __post_init__(self) -> None:
        if not isinstance(self.order, Order):
            raise ValueError(
                f"OverlapModel.order must be an overlap.policy.Order, got {self.order!r}"
            )
        for name in ("enabled", "streams"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"OverlapModel.{name} must be a bool, got {getattr(self, name)!r}"
                )
        check_number("OverlapModel.handover", self.handover)
        check_number("OverlapModel.min_region", self.min_region)


# --------------------------------------------------------------------------- #
# Per-layer costs and the stage split                                          #
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# Cost model from a model shape and a machine                                  #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A GPU and its network, as the cost model sees them.  Every field may be overridden.

    Args:
        name: for messages.
        bf16_tflops: dense bf16 tensor-core peak (TFLOP/s, datasheet, no sparsity).
        achieved_fraction: fraction of the peak a training step's matmuls reach.
        hbm_bytes: device memory.
        intra_node_a2a_gbps: all-to-all bandwidth per GPU inside a node (GB/s, one direction).
        inter_node_a2a_gbps: all-to-all bandwidth per GPU across nodes (GB/s, one direction).
        gpus_per_node: GPUs sharing the intra-node fabric.
        p2p_latency: pipeline send/recv latency (s).
        a2a_latency: fixed cost of one all-to-all (s).
        fp8_tflops: dense FP8 tensor-core peak (TFLOP/s, datasheet; 0: no FP8).
    """

    name: str
    bf16_tflops: float
    achieved_fraction: float
    hbm_bytes: float
    intra_node_a2a_gbps: float
    inter_node_a2a_gbps: float
    gpus_per_node: int = 8
    p2p_latency: float = 20e-6
    a2a_latency: float = 30e-6
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (0: none)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"Hardware.name must be a str, got {self.name!r}")
        for name in (
            "bf16_tflops",
            "achieved_fraction",
            "hbm_bytes",
            "intra_node_a2a_gbps",
            "inter_node_a2a_gbps",
        ):
            check_number(f"Hardware.{name}", getattr(self, name), positive=True)
        if self.achieved_fraction > 1:
            raise ValueError(
                f"Hardware.achieved_fraction must be in (0, 1], got {self.achieved_fraction!r}"
            )
        check_number(
            "Hardware.gpus_per_node", self.gpus_per_node, positive=True, integer=True
        )
        check_number("Hardware.p2p_latency", self.p2p_latency)
        check_number("Hardware.a2a_latency", self.a2a_latency)
        check_number("Hardware.fp8_tflops", self.fp8_tflops)

    def with_overrides(self, **overrides: Any) -> Hardware:
        """A copy with the fields in ``overrides`` replaced."""
        return dataclasses.replace(self, **overrides)


# [Note: hardware presets]
# Datasheet numbers (dense bf16 without sparsity, HBM capacity, NVLink per-GPU
# one-direction bandwidth = half of the bidirectional figure, one 400 Gb/s NIC
# per GPU = 50 GB/s for H100/H200, 800 Gb/s = 100 GB/s for B200).  H800 is the
# export H100 with NVLink cut to 400 GB/s bidirectional (200 GB/s one way);
# the DeepSeek-V3 report uses 400 Gb/s InfiniBand per GPU on it.  Dense FP8 is
# twice dense bf16.  The achieved fraction of H100, H200 and B200 (0.4) is a
# typical MFU of large MoE training, not a measured value; override it with
# your own.  H800's (0.31) is calibrated on one public trace, DeepSeek's
# profile of a DualPipe chunk pair of DeepSeek-V3 with FP8 GEMMs
# (``tools/calibrate_trace.py --fit``: the fraction that makes the predicted
# attention and MLP compute equal the measured kernel time; docs/simulator.md
# has the table).  That run's matmuls are FP8; the same fraction is assumed
# for bf16.
HARDWARE_PRESETS: Mapping[str, Hardware] = {
    "H100": Hardware("H100", 989.0, 0.4, 80e9, 450.0, 50.0, fp8_tflops=1979.0),
    "H800": Hardware("H800", 989.0, 0.31, 80e9, 200.0, 50.0, fp8_tflops=1979.0),
    "H200": Hardware("H200", 989.0, 0.4, 141e9, 450.0, 50.0, fp8_tflops=1979.0),
    "B200": Hardware("B200", 2250.0, 0.4, 180e9, 900.0, 100.0, fp8_tflops=4500.0),
}


_POSITIVE_SHAPE_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "moe_layer_freq",
    }
)


def _field(get: Any, *names: str) -> Any:
    """The first of ``names`` the config sets; ``ValueError`` naming them all if none is."""
    for name in names:
        value = get(name)
        if value is not None:
            return value
    raise ValueError(f"the model config sets none of {', '.join(names)}")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder-only (dense or MoE) config the cost model needs.

    Build it with :meth:`from_hf_config` from a ``transformers`` config (or a
    plain dict of its fields).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width
    vocab_size: int
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0  # leading dense layers of an MoE model
    moe_layer_freq: int = 1
    # multi-head latent attention (DeepSeek-V2/V3); 0 = plain GQA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            positive = f.name in _POSITIVE_SHAPE_FIELDS
            check_number(
                f"ModelShape.{f.name}",
                getattr(self, f.name),
                positive=positive,
                integer=True,
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"ModelShape.top_k must be in 1..num_experts={self.num_experts}, got {self.top_k!r}"
            )
        if self.num_experts:
            check_number(
                "ModelShape.moe_intermediate_size",
                self.moe_intermediate_size,
                positive=True,
                integer=True,
            )

    @staticmethod
    def from_hf_config(config: Any) -> ModelShape:
        """The shape of a ``transformers`` config, or of a dict of its fields (``config.json``)."""
        get = (
            (lambda k, d=None: config.get(k, d))
            if isinstance(config, Mapping)
            else (lambda k, d=None: getattr(config, k, d))
        )
        hidden = int(_field(get, "hidden_size", "n_embd"))
        heads = int(_field(get, "num_attention_heads", "n_head"))
        n_experts = int(
            get("n_routed_experts")
            or get("num_local_experts")
            or get("num_experts")
            or 0
        )
        if get(
            "kv_lora_rank"
        ):  # multi-head latent attention: the query/key head is nope + rope
            head_dim = int(get("qk_nope_head_dim") or 0) + int(
                get("qk_rope_head_dim") or 0
            )
        else:
            head_dim = get("head_dim") or hidden // heads
        return ModelShape(
            num_layers=int(_field(get, "num_hidden_layers", "n_layer")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(
                get("intermediate_size") or get("n_inner") or 4 * hidden
            ),
            vocab_size=int(_field(get, "vocab_size")),
            num_experts=n_experts,
            top_k=int(get("num_experts_per_tok") or 0) if n_experts else 0,
            moe_intermediate_size=int(
                get("moe_intermediate_size") or get("intermediate_size") or 0
            )
            if n_experts
            else 0,
            shared_experts=int(get("n_shared_experts") or 0),
            first_dense_layers=int(get("first_k_dense_replace") or 0)
            + (len(get("mlp_only_layers") or ()) if n_experts else 0),
            moe_layer_freq=int(
                get("moe_layer_freq") or get("decoder_sparse_step") or 1
            ),
            q_lora_rank=int(get("q_lora_rank") or 0),
            kv_lora_rank=int(get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(get("qk_rope_head_dim") or 0),
            v_head_dim=int(get("v_head_dim") or 0),
        )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has routed experts."""
        return (
            self.num_experts > 0
            and index >= self.first_dense_layers
            and (index % self.moe_layer_freq) == 0
        )

    def attention_params(self) -> float:
        """Parameters of one layer's attention."""
        h = self.hidden_size
        if self.kv_lora_rank:
            q = (
                h * self.q_lora_rank + self.q_lora_rank * self.num_heads * self.head_dim
                if self.q_lora_rank
                else (h * self.num_heads * self.head_dim)
            )
            kv = h * (
                self.kv_lora_rank + self.qk_rope_head_dim
            ) + self.kv_lora_rank * self.num_heads * (
                self.head_dim - self.qk_rope_head_dim + self.v_head_dim
            )
            return q + kv + self.num_heads * self.v_head_dim * h
        return h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    def up_projection_params(self) -> float:
        """Parameters of multi-head latent attention's up-projections (query, key and value; 0 without MLA)."""
        if not self.kv_lora_rank:
            return 0.0
        q = self.q_lora_rank * self.num_heads * self.head_dim
        kv = (
            self.kv_lora_rank
            * self.num_heads
            * (self.head_dim - self.qk_rope_head_dim + self.v_head_dim)
        )
        return q + kv

    def mlp_active_params(self, index: int) -> float:
        """Parameters of layer ``index``'s MLP that one token uses (routed top-k and shared experts)."""
        if self.is_moe_layer(index):
            return (
                3
                * self.hidden_size
                * self.moe_intermediate_size
                * (self.top_k + self.shared_experts)
            )
        return 3 * self.hidden_size * self.intermediate_size

    def active_params(self) -> float:
        """Active parameters per token (embedding and head counted once each)."""
        layers = sum(
            self.attention_params() + self.mlp_active_params(i)
            for i in range(self.num_layers)
        )
        return layers + 2 * self.vocab_size * self.hidden_size


_RECOMPUTE = ("none", "full", "deepseek")

# [Note: DeepSeek-V3 options of the cost model]
# What the DeepSeek-V3 report's training run used, each an option of
# layer_costs (the defaults are the plain bf16 model):
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


def _recompute_mode(recompute: bool | str) -> str:
    if recompute is True or recompute is False:
        return "full" if recompute else "none"
    if recompute not in _RECOMPUTE:
        raise ValueError(
            f"recompute must be a bool or one of {', '.join(_RECOMPUTE)}, got {recompute!r}"
        )
    return recompute


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
    recompute: bool | str = False,
) -> dict[str, float]:
    """Compute seconds of layer ``index``'s phases for one microbatch of ``tokens`` tokens.

    Keys ``"attn(F)"``, ``"mlp(F)"``, ``"attn(B)"``, ``"mlp(B)"`` (input
    backward), ``"attn(W)"``, ``"mlp(W)"`` (weight backward), the phase names
    of DeepSeek's published profile.  FLOPs: ``2 * params * tokens`` per weight
    matmul in each of F, B and W, plus causal attention scores ``2 * tokens *
    seq_len * heads * head_dim`` in F and twice that in B.  See
    [Note: DeepSeek-V3 options of the cost model] for the options.
    """
    if fp8_gemms and not hardware.fp8_tflops:
        raise ValueError(f"fp8_gemms: Hardware {hardware.name!r} has no fp8_tflops")
    check_number("routing_imbalance", routing_imbalance, positive=True)
    if routing_imbalance < 1:
        raise ValueError(f"routing_imbalance must be >= 1, got {routing_imbalance!r}")
    mode = _recompute_mode(recompute)
    bf16 = hardware.bf16_tflops * 1e12 * hardware.achieved_fraction * tp
    gemm = (
        (hardware.fp8_tflops * 1e12 * hardware.achieved_fraction * tp)
        if fp8_gemms
        else bf16
    )
    proj = 2 * shape.attention_params() * tokens / gemm
    core = 2 * tokens * seq_len * shape.num_heads * shape.head_dim / bf16
    mlp = 2 * shape.mlp_active_params(index) * tokens / gemm
    if shape.is_moe_layer(index) and routing_imbalance != 1:
        routed = shape.top_k / (shape.top_k + shape.shared_experts)
        mlp *= 1 + routed * (routing_imbalance - 1)
    out = {
        "attn(F)": proj + core,
        "mlp(F)": mlp,
        "attn(B)": proj + 2 * core,
        "mlp(B)": mlp,
        "attn(W)": proj,
        "mlp(W)": mlp,
    }
    if mode == "full":
        out["attn(B)"] += out["attn(F)"]
        out["mlp(B)"] += out["mlp(F)"]
    elif mode == "deepseek":
        out["attn(B)"] += 2 * shape.up_projection_params() * tokens / gemm
    return out


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


def _check_layer_args(
    counts: dict[str, int], element_bytes: dict[str, float | None]
) -> None:
    """``ValueError`` naming the first argument of :func:`layer_costs` that is not valid."""
    for name, value in counts.items():
        check_number(name, value, positive=True, integer=True)
    for name, value in element_bytes.items():
        if value is not None:
            check_number(name, value, positive=True)


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
    recompute: bool | str = False,
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
    _check_layer_args(
        {"tokens": tokens, "seq_len": seq_len, "ep": ep, "tp": tp},
        {
            "dtype_bytes": dtype_bytes,
            "a2a_dtype_bytes": a2a_dtype_bytes,
            "combine_dtype_bytes": combine_dtype_bytes,
        },
    )
    compute = dict(
        tp=tp,
        fp8_gemms=fp8_gemms,
        routing_imbalance=routing_imbalance,
        recompute=_recompute_mode(recompute),
    )
    h = shape.hidden_size
    dispatch_bytes = (a2a_dtype_bytes or dtype_bytes) * routing_imbalance
    combine_bytes = (
        combine_dtype_bytes or a2a_dtype_bytes or dtype_bytes
    ) * routing_imbalance
    dispatch = _a2a_time(shape, hardware, tokens, ep, dispatch_bytes)
    combine = _a2a_time(shape, hardware, tokens, ep, combine_bytes)
    act = (
        {"none": 34, "full": 2, "deepseek": 24}[compute["recompute"]] * tokens * h / tp
    )
    out: list[LayerCost] = []
    for i in range(shape.num_layers):
        moe = shape.is_moe_layer(i)
        ph = layer_phase_times(
            shape, hardware, i, tokens=tokens, seq_len=seq_len, **compute
        )
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


# --------------------------------------------------------------------------- #
# Parameters and static memory                                                 #
# --------------------------------------------------------------------------- #


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
