"""The parts of a decoder-only model's config the cost model needs, and the
parameter counts it derives from them."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch_pipelining_ext.hf import _families
from torch_pipelining_ext.sim._inputs import check_number


__all__ = ["ModelShape"]


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


def _field(config: object, *names: str) -> Any:
    """The first of ``names`` the config sets; ``ValueError`` naming them all if none is."""
    for name in names:
        value = _families.config_value(config, name)
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
    def from_hf_config(config: object) -> ModelShape:
        """The shape of a ``transformers`` config, or of a dict of its fields (``config.json``)."""
        get = functools.partial(_families.config_value, config)
        hidden = int(_field(config, "hidden_size", "n_embd"))
        heads = int(_field(config, "num_attention_heads", "n_head"))
        n_experts = _families.num_routed_experts(config)
        if get("kv_lora_rank"):
            # multi-head latent attention: the query/key head is nope + rope
            head_dim = int(get("qk_nope_head_dim") or 0) + int(
                get("qk_rope_head_dim") or 0
            )
        else:
            head_dim = get("head_dim") or hidden // heads
        return ModelShape(
            num_layers=int(_field(config, "num_hidden_layers", "n_layer")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(
                get("intermediate_size") or get("n_inner") or 4 * hidden
            ),
            vocab_size=int(_field(config, "vocab_size")),
            num_experts=n_experts,
            top_k=int(get("num_experts_per_tok") or 0) if n_experts else 0,
            moe_intermediate_size=int(
                get("moe_intermediate_size") or get("intermediate_size") or 0
            )
            if n_experts
            else 0,
            shared_experts=int(get("n_shared_experts") or 0),
            first_dense_layers=_families.first_dense_layers(config),
            moe_layer_freq=_families.moe_layer_step(config),
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
