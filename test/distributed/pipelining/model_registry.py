"""Toy models shared by the pipelining tests (mirrors upstream's ``model_registry.py``).

Sections are grouped by the feature that introduced them; every model is small
enough for four gloo ranks on two CPU cores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_pipelining_ext import overlap


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

from torch_pipelining_ext.stage_split import call_if_present


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim // 2)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _rope_tables(
    head_dim: int, seq_len: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    )
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

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        cos, sin = rope  # required: a stage missing its rotary tables fails loudly
        q, k, v = (
            w(x).unflatten(-1, (self.n_heads, -1)) for w in (self.wq, self.wk, self.wv)
        )
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
        self.experts = nn.ModuleList(
            ToyFeedForward(dim, hidden) for _ in range(n_experts)
        )
        self.shared_expert = ToyFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = self.shared_expert(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(
                    0, rows, expert(flat[rows]) * weights[rows, slot, None]
                )
        return out.view_as(x)


class ToyBlock(nn.Module):
    """Pre-norm transformer block; dense or MoE feed-forward."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        moe: bool = False,
        n_experts: int = 4,
        top_k: int = 2,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = ToyAttention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = (
            ToyMoE(dim, 2 * dim, n_experts, top_k)
            if moe
            else ToyFeedForward(dim, 2 * dim)
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
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
        blocks = [
            ToyBlock(
                dim, n_heads, moe=i in moe_layers, n_experts=n_experts, top_k=top_k
            )
            for i in range(n_layers)
        ]
        if container == "dict":
            self.layers: nn.Module = nn.ModuleDict(
                {str(i): b for i, b in enumerate(blocks)}
            )
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
    return ToyLLM(
        n_layers=n_layers, moe_layers=tuple(range(n_dense, n_layers)), **kwargs
    )


class ToyRotaryEmbedding(nn.Module):
    """Parameter-free rotary embedding (only a non-persistent buffer): every
    stage that runs layers needs it, so it is listed in several stages."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(
            torch.arange(h.shape[1], dtype=torch.float32, device=h.device),
            self.inv_freq,
        )
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

    def __init__(
        self, vocab_size: int = 32, dim: int = 16, n_layers: int = 4, n_heads: int = 2
    ) -> None:
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


# ---------------------------------------------------------------------------
# MoE transformer with expert-parallel all-to-all
# ---------------------------------------------------------------------------
# Used by test_schedule_overlap.py and test_schedule_single_rank.py: a small
# DeepSeek-style model (token embeddings, dense blocks, MoE blocks with a
# shared expert and top-k routed experts, norm, head) whose MoE layers
# exchange tokens with all_to_all_single inside the overlap's communication
# marks (MoEModelArgs.comm_boundaries=False: no marks).  Without an ep_group
# every expert is local: the same seed gives the single-process reference.
# Blocks live in ``layers`` (an nn.ModuleDict keyed by the global layer
# index), so stage_split.build_stage_module keeps the full model's names.


@dataclasses.dataclass
class MoEModelArgs:
    """Configuration of :class:`MoETransformer`.

    Attributes:
        vocab_size: vocabulary size.
        dim: model width.
        n_heads: attention heads (divides ``dim``).
        n_dense_layers: blocks with a dense feed-forward (first).
        n_moe_layers: blocks with a mixture of experts (after the dense ones).
        n_experts: routed experts per MoE layer (divisible by the EP size).
        top_k: experts per token.
        moe_hidden: hidden width of each routed and shared expert.
        n_shared_experts: width multiplier of the shared expert (0: none).
        dense_hidden: hidden width of the dense feed-forward.
        comm_boundaries: wrap ``dispatch``/``combine`` with the overlap's marks.
    """

    vocab_size: int = 64
    dim: int = 32
    n_heads: int = 2
    n_dense_layers: int = 1
    n_moe_layers: int = 3
    n_experts: int = 4
    top_k: int = 2
    moe_hidden: int = 32
    n_shared_experts: int = 1
    dense_hidden: int = 64
    comm_boundaries: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}"
            )

    @property
    def n_layers(self) -> int:
        return self.n_dense_layers + self.n_moe_layers


def is_expert_param(fqn: str) -> bool:
    """True for the routed experts' weights (sharded over the EP group), by parameter name."""
    return fqn.endswith((".ffn.w1", ".ffn.w2"))


class _EPAllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable split sizes; the backward is the reverse exchange.

    Both run on ``overlap.side_group(group)``, looked up when they run: the
    group's twin on the backward side of an overlapped OVERLAP_F_B, where the
    group has one.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(
            out,
            x.contiguous(),
            out_splits,
            in_splits,
            group=overlap.side_group(group),
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(
            grad_in,
            grad.contiguous(),
            in_splits,
            out_splits,
            group=overlap.side_group(ctx.group),
        )
        return grad_in, None, None, None


class _EPGroupRef:
    """Holds a process group through ``copy.deepcopy`` (stage splitting copies modules)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _EPGroupRef:
        return self


class EPAttention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            self.wqkv(x)
            .view(b, s, 3, self.n_heads, d // self.n_heads)
            .permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class EPFeedForward(nn.Module):
    """SwiGLU feed-forward (the dense layers' and the shared expert's)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EPMoE(nn.Module):
    """Top-k routed experts plus a shared expert, optionally expert-parallel.

    Parameters ``w1`` (fused gate and up projections, ``[local experts, dim,
    2 * moe_hidden]``) and ``w2`` (``[local experts, moe_hidden, dim]``) hold
    this rank's routed experts: experts ``ep_rank * n_local`` to
    ``(ep_rank + 1) * n_local - 1``, with the same values as in the unsharded
    model built from the same seed.
    """

    def __init__(
        self, args: MoEModelArgs, ep_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self._ep = _EPGroupRef(ep_group)
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if args.n_experts % ep_size:
            raise ValueError(
                f"n_experts={args.n_experts} is not divisible by the EP group size {ep_size}"
            )
        self.n_experts = args.n_experts
        self.n_local = args.n_experts // ep_size
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.shared_expert = (
            EPFeedForward(args.dim, args.moe_hidden * args.n_shared_experts)
            if args.n_shared_experts
            else None
        )
        # Every rank draws all experts' weights (same random stream as the
        # unsharded model) and keeps its own.
        w1 = torch.randn(args.n_experts, args.dim, 2 * args.moe_hidden) * args.dim**-0.5
        w2 = (
            torch.randn(args.n_experts, args.moe_hidden, args.dim)
            * args.moe_hidden**-0.5
        )
        local = slice(ep_rank * self.n_local, (ep_rank + 1) * self.n_local)
        self.w1 = nn.Parameter(w1[local].clone())
        self.w2 = nn.Parameter(w2[local].clone())

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self._ep.group

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of every token and their normalised weights, ``[tokens, top_k]`` each."""
        scores = self.router(tokens).float().softmax(dim=-1)
        weights, experts = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(tokens.dtype), experts

    def dispatch(
        self, routed: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int]] | None]:
        """Send each routed token (sorted by expert) to the rank that holds its expert.

        Args:
            routed: ``[tokens * top_k, dim]``, sorted by global expert index.
            counts: ``[n_experts]`` tokens per global expert.

        Returns:
            The received tokens (grouped by source rank, then local expert),
            the received counts ``[ep, n_local]``, and the split sizes
            ``(send, recv)`` that :meth:`combine` reverses (None without EP).
        """
        group = self.ep_group
        if group is None:
            return routed, counts.view(1, self.n_local), None
        ep = dist.get_world_size(group)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=overlap.side_group(group))
        send = counts.view(ep, self.n_local).sum(dim=1).tolist()
        recv_counts = recv_counts.view(ep, self.n_local)
        recv = recv_counts.sum(dim=1).tolist()
        return _EPAllToAll.apply(routed, recv, send, group), recv_counts, (send, recv)

    def combine(
        self, expert_out: torch.Tensor, splits: tuple[list[int], list[int]] | None
    ) -> torch.Tensor:
        """Send the expert outputs back to the ranks their tokens came from (reverses :meth:`dispatch`)."""
        group = self.ep_group
        if group is None:
            return expert_out
        send, recv = splits
        return _EPAllToAll.apply(expert_out, send, recv, group)

    def experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply the local experts; ``tokens`` grouped by source rank then expert, ``counts`` ``[src, n_local]``."""
        n_src = counts.shape[0]
        expert_of_token = torch.arange(self.n_local, device=tokens.device).repeat(n_src)
        expert_of_token = expert_of_token.repeat_interleave(counts.flatten())
        order = expert_of_token.argsort(stable=True)
        grouped = tokens.index_select(0, order).split(counts.sum(dim=0).tolist())
        outs = []
        for e, x in enumerate(grouped):
            gate, up = (x @ self.w1[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.w2[e])
        y = torch.cat(outs) if outs else tokens
        return y.index_select(0, order.argsort())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        shared = self.shared_expert(tokens) if self.shared_expert is not None else 0
        if tokens.is_meta:  # shape inference: routing is data-dependent
            return (tokens + shared).view(b, s, d)
        weights, experts = self.route(tokens)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token_of_slot = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        received, recv_counts, splits = self.dispatch(
            tokens.index_select(0, token_of_slot), counts
        )
        expert_out = self.experts(received, recv_counts)
        back = self.combine(expert_out, splits)
        routed = torch.zeros_like(tokens).index_add(
            0, token_of_slot, back * weights.flatten()[order].unsqueeze(-1)
        )
        return (routed + shared).view(b, s, d)


class EPBlock(nn.Module):
    def __init__(
        self, args: MoEModelArgs, moe: bool, ep_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = EPAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.ffn: nn.Module = (
            EPMoE(args, ep_group) if moe else EPFeedForward(args.dim, args.dense_hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """Embeddings, dense blocks, MoE blocks, norm, head: ``tokens [b, s] -> logits [b, s, vocab]``.

    Args:
        args: the configuration.
        ep_group: the expert-parallel process group; None for all experts local.
    """

    def __init__(
        self, args: MoEModelArgs, ep_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): EPBlock(args, i >= args.n_dense_layers, ep_group)
                for i in range(args.n_layers)
            }
        )
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.comm_boundaries and args.n_moe_layers:
            overlap.wrap_dispatch_combine(self)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        # Stages made by stage_split have None for the modules they do not keep.
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def expert_parameters(self) -> dict[str, Any]:
        """Name -> parameter of the routed experts (sharded over the EP group)."""
        return {n: p for n, p in self.named_parameters() if is_expert_param(n)}
