"""A small DeepSeek-style MoE transformer with expert-parallel all-to-all.

Used by the overlap tests and ``tools/bench_overlap.py`` (the demo itself,
``python -m torch_pipelining_ext.demo``, trains a Hugging Face MoE).  The layout follows DeepSeek-V3 in miniature:
token embeddings, ``n_dense_layers`` transformer blocks with a dense
feed-forward, then ``n_moe_layers`` blocks whose feed-forward is a
mixture of experts (a softmax top-k router, one shared expert and
``n_experts`` routed experts), a final norm and the output head.

Expert parallelism: with an ``ep_group`` of size ``ep``, each rank holds
``n_experts / ep`` routed experts (the others' weights are not allocated) and
the MoE layer exchanges tokens with ``torch.distributed.all_to_all_single``:
``dispatch`` first exchanges the per-expert token counts, then the tokens with
variable split sizes; ``combine`` sends the expert outputs back.  Without an
``ep_group`` all experts are local and nothing is communicated, which makes
the same model (same seed, same weights) the single-process reference.

``dispatch`` and ``combine`` are plain methods; the constructor applies the
communication boundaries of :mod:`torch_pipelining_ext.ep_overlap` to them
with :func:`~torch_pipelining_ext.ep_overlap.wrap_dispatch_combine` (turn it
off with ``MoEModelArgs.comm_boundaries=False``), so the model needs no
overlap-specific code.

Pipeline splitting: blocks live in ``layers`` (an ``nn.ModuleDict`` keyed by
the global layer index) and ``forward`` tolerates removed modules, so
``stage_split.split_module(model, ["layers.2", "layers.3"])`` gives a stage
whose parameter names are the full model's.  Shape inference on the meta
device skips the data-dependent routing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_pipelining_ext import ep_overlap


__all__ = ["MoEModelArgs", "MoETransformer", "is_expert_param"]


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
        comm_boundaries: wrap ``dispatch``/``combine`` with the ep_overlap marks.
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
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")

    @property
    def n_layers(self) -> int:
        return self.n_dense_layers + self.n_moe_layers


def is_expert_param(fqn: str) -> bool:
    """True for the routed experts' weights (sharded over the EP group), by parameter name."""
    return fqn.endswith((".ffn.w1", ".ffn.w2"))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable split sizes; the backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


class _GroupRef:
    """Holds a process group through ``copy.deepcopy`` (stage splitting copies modules)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    """SwiGLU feed-forward (the dense layers' and the shared expert's)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts plus a shared expert, optionally expert-parallel.

    Parameters ``w1`` (fused gate and up projections, ``[local experts, dim,
    2 * moe_hidden]``) and ``w2`` (``[local experts, moe_hidden, dim]``) hold
    this rank's routed experts: experts ``ep_rank * n_local`` to
    ``(ep_rank + 1) * n_local - 1``, with the same values as in the unsharded
    model built from the same seed.
    """

    def __init__(self, args: MoEModelArgs, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self._ep = _GroupRef(ep_group)
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if args.n_experts % ep_size:
            raise ValueError(f"n_experts={args.n_experts} is not divisible by the EP group size {ep_size}")
        self.n_experts = args.n_experts
        self.n_local = args.n_experts // ep_size
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.shared_expert = (
            FeedForward(args.dim, args.moe_hidden * args.n_shared_experts) if args.n_shared_experts else None
        )
        # Every rank draws all experts' weights (same random stream as the
        # unsharded model) and keeps its own.
        w1 = torch.randn(args.n_experts, args.dim, 2 * args.moe_hidden) * args.dim**-0.5
        w2 = torch.randn(args.n_experts, args.moe_hidden, args.dim) * args.moe_hidden**-0.5
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
        dist.all_to_all_single(recv_counts, counts, group=group)
        send = counts.view(ep, self.n_local).sum(dim=1).tolist()
        recv_counts = recv_counts.view(ep, self.n_local)
        recv = recv_counts.sum(dim=1).tolist()
        return _AllToAll.apply(routed, recv, send, group), recv_counts, (send, recv)

    def combine(self, expert_out: torch.Tensor, splits: tuple[list[int], list[int]] | None) -> torch.Tensor:
        """Send the expert outputs back to the ranks their tokens came from (reverses :meth:`dispatch`)."""
        group = self.ep_group
        if group is None:
            return expert_out
        send, recv = splits
        return _AllToAll.apply(expert_out, send, recv, group)

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
        received, recv_counts, splits = self.dispatch(tokens.index_select(0, token_of_slot), counts)
        expert_out = self.experts(received, recv_counts)
        back = self.combine(expert_out, splits)
        routed = torch.zeros_like(tokens).index_add(0, token_of_slot, back * weights.flatten()[order].unsqueeze(-1))
        return (routed + shared).view(b, s, d)


class TransformerBlock(nn.Module):
    def __init__(self, args: MoEModelArgs, moe: bool, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.ffn: nn.Module = MoE(args, ep_group) if moe else FeedForward(args.dim, args.dense_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class MoETransformer(nn.Module):
    """Embeddings, dense blocks, MoE blocks, norm, head: ``tokens [b, s] -> logits [b, s, vocab]``.

    Args:
        args: the configuration.
        ep_group: the expert-parallel process group; None for all experts local.
    """

    def __init__(self, args: MoEModelArgs, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, i >= args.n_dense_layers, ep_group) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.comm_boundaries and args.n_moe_layers:
            ep_overlap.wrap_dispatch_combine(self)

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
