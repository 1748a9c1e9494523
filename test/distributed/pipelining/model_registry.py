"""Toy models shared by the pipelining tests (mirrors upstream's ``model_registry.py``).

Sections are grouped by the feature that introduced them; every model is small
enough for four gloo ranks on two CPU cores.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class MLPStage(nn.Module):
    """A stack of Linear+ReLU blocks; the unit pipeline stage used by schedule tests."""

    def __init__(self, d_hid: int, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d_hid, d_hid) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


# ---------------------------------------------------------------------------
# Stage split (LLM-shaped toys)
# ---------------------------------------------------------------------------
# Used by test_stage_split*.py.  Every forward tolerates the modules a stage
# split removes (see torch_pipelining_ext.stage_split): a removed module is
# None (``call_if_present``), a container holds only the stage's layers under
# their original keys, so the same forward runs the whole model and any stage.

from torch_pipelining_ext.stage_split import call_if_present  # noqa: E402


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim // 2)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class ToyAttention(nn.Module):
    """Causal multi-head self-attention with rotary position embedding."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope  # required: a stage missing its rotary tables fails loudly
        q, k, v = (w(x).unflatten(-1, (self.n_heads, -1)) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).flatten(-2))


class ToyFeedForward(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ToyMoE(nn.Module):
    """Token-choice top-k MoE with local experts and one shared expert."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(ToyFeedForward(dim, hidden) for _ in range(n_experts))
        self.shared_expert = ToyFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = self.shared_expert(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class ToyBlock(nn.Module):
    """Pre-norm transformer block; dense or MoE feed-forward."""

    def __init__(self, dim: int, n_heads: int, moe: bool = False, n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = ToyAttention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = ToyMoE(dim, 2 * dim, n_experts, top_k) if moe else ToyFeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


def _present_layers(layers: nn.Module) -> list[nn.Module]:
    # ModuleDict iterates keys; ModuleList/Sequential iterate modules.
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


class ToyLLM(nn.Module):
    """Flat LLM laid out like torchtitan's: ``tok_embeddings``, ``layers``
    (``nn.ModuleDict`` with string keys, or ``nn.ModuleList``), ``norm``,
    ``output``; rotary tables are non-persistent buffers of the root.

    Layers listed in ``moe_layers`` use :class:`ToyMoE` (local experts).
    """

    def __init__(
        self,
        vocab_size: int = 32,
        dim: int = 16,
        n_layers: int = 4,
        n_heads: int = 2,
        container: str = "dict",
        moe_layers: tuple[int, ...] = (),
        n_experts: int = 4,
        top_k: int = 2,
        max_seq_len: int = 16,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        blocks = [ToyBlock(dim, n_heads, moe=i in moe_layers, n_experts=n_experts, top_k=top_k) for i in range(n_layers)]
        if container == "dict":
            self.layers: nn.Module = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        elif container == "list":
            self.layers = nn.ModuleList(blocks)
        else:
            raise ValueError(f"container must be 'dict' or 'list', got {container!r}")
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = _rope_tables(dim // n_heads, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = call_if_present(self.tok_embeddings, tokens_or_hidden)
        seq = h.shape[1]
        rope = (self.rope_cos[:seq], self.rope_sin[:seq])
        for layer in _present_layers(self.layers):
            h = layer(h, rope)
        h = call_if_present(self.norm, h)
        return call_if_present(self.output, h)


def toy_moe_llm(n_layers: int = 6, n_dense: int = 2, **kwargs) -> ToyLLM:
    """A :class:`ToyLLM` with ``n_dense`` dense layers followed by MoE layers."""
    return ToyLLM(n_layers=n_layers, moe_layers=tuple(range(n_dense, n_layers)), **kwargs)


class ToyRotaryEmbedding(nn.Module):
    """Parameter-free rotary embedding (only a non-persistent buffer): every
    stage that runs layers needs it, so it is listed in several stages."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(torch.arange(h.shape[1], dtype=torch.float32, device=h.device), self.inv_freq)
        return angles.cos(), angles.sin()


class ToyDecoder(nn.Module):
    """The ``model`` part of :class:`NestedToyLLM`."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(ToyBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.rotary_emb = ToyRotaryEmbedding(dim // n_heads)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = call_if_present(self.embed_tokens, tokens_or_hidden)
        rope = self.rotary_emb(h) if self.rotary_emb is not None else None
        for layer in self.layers:
            h = layer(h, rope)
        return call_if_present(self.norm, h)


class NestedToyLLM(nn.Module):
    """LLM laid out like Hugging Face decoders: ``model.embed_tokens``,
    ``model.layers.N``, ``model.norm``, ``model.rotary_emb`` and ``lm_head``."""

    def __init__(self, vocab_size: int = 32, dim: int = 16, n_layers: int = 4, n_heads: int = 2) -> None:
        super().__init__()
        self.model = ToyDecoder(vocab_size, dim, n_layers, n_heads)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = call_if_present(self.model, tokens_or_hidden)
        return call_if_present(self.lm_head, h)


# ---------------------------------------------------------------------------
# FSDP2 x pipeline stages
# ---------------------------------------------------------------------------
# Used by test_schedule_fsdp.py: a stage with ``fully_shard`` on each layer and
# on the stage root, including a layer whose weight gradient needs the weight's
# values (so a weight pass on freed, resharded storage would be wrong).


class SquaredWeightLinear(nn.Module):
    """``y = x @ (w * w).T + b``: the gradient of ``w`` is ``2 * w * dW_eff`` and reads ``w``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim).uniform_(-1.0, 1.0) / dim**0.5)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.weight, self.bias)


class FSDPMLPStage(nn.Module):
    """Linear+ReLU blocks, a :class:`SquaredWeightLinear` and a gain owned by the stage root.

    Meant to be wrapped with :func:`fully_shard_stage`: every layer is its own
    FSDP module (resharded after forward), the root owns ``gain``.
    """

    def __init__(self, dim: int, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.squared = SquaredWeightLinear(dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.squared(x) * self.gain


def fully_shard_stage(stage: FSDPMLPStage, mesh: object) -> FSDPMLPStage:
    """``fully_shard`` each layer of ``stage`` and then the stage root (the usual FSDP2 recipe)."""
    from torch.distributed.fsdp import fully_shard

    for layer in (*stage.layers, stage.squared):
        fully_shard(layer, mesh=mesh)
    fully_shard(stage, mesh=mesh)
    return stage
