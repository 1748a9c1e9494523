"""Expert parallelism for the fused experts of Hugging Face MoE stages.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF expert
parallelism]``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable
from typing import Any, cast, Protocol, TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_pipelining_ext import overlap
from torch_pipelining_ext.hf._arrival import group_device
from torch_pipelining_ext.hf._routing import fused_experts_problem
from torch_pipelining_ext.hf._selfcheck import tiny_config


if TYPE_CHECKING:
    from torch_pipelining_ext.hf._stage import HFCausalLMStage


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF expert parallelism]
# transformers 5.x holds a MoE layer's routed experts in one module with 3-D
# parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) whose
# forward takes the tokens [T, H], their top-k expert indices and weights
# [T, k]: the router, shared experts and everything else are computed before
# and after it by the model's own code.  That forward is the seam: with an
# expert-parallel group of size ep, each rank keeps experts
# [r * E/ep, (r + 1) * E/ep) (slices of the fused parameters, the only ones
# read from the checkpoint) and the module's forward becomes
#   1. sort the T*k (token, expert) slots by expert (stable, so deterministic);
#   2. dispatch region: exchange the per-expert slot counts (all_to_all of E
#      integers: the one host synchronisation, for the split sizes), then the
#      slots' tokens (all_to_all with those splits);
#   3. the local experts on what arrived (grouped by source rank, then local
#      expert), with the model's own formula act(x W_g) * (x W_u) W_d;
#   4. combine region: the reverse all_to_all;
#   5. weight by the routing weights and add each slot into its token.
# The regions are marked with the overlap's marks, so inside an overlapped
# OVERLAP_F_B the other sub-action computes while this one communicates, and
# autograd mirrors the marks in backward.  EP ranks see different tokens
# (expert parallelism carved out of data parallelism).


# [Note: HF expert-parallel transport]
# Every all-to-all of the expert-parallel forward and backward goes through
# one ExpertParallelTransport: ``counts`` (the per-expert slot counts, once
# per MoE layer and microbatch, forward only) and ``tokens`` (dispatch and
# combine, forward and backward).  The default calls
# ``torch.distributed.all_to_all_single``; a subclass installed with
# ``set_expert_parallel_transport`` can instrument the exchange (count, time
# it), add to it or carry it another way.  The transport is called on the
# thread that runs the exchange (with the concurrent OVERLAP_F_B, either of
# two), so it must be thread-safe, and it must keep the collective's
# semantics: the same calls in the same order on every rank of the group.


class ExpertParallelTransport:
    """How the expert-parallel exchange moves data between the ranks of its
    group (see ``[Note: HF expert-parallel transport]``).  The default sends
    with :func:`torch.distributed.all_to_all_single`; subclass it and install
    it with :func:`torch_pipelining_ext.hf.set_expert_parallel_transport`."""

    def counts(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        """Exchange the per-expert slot counts (equal splits, one block per rank)."""
        dist.all_to_all_single(output, input, group=group)

    def tokens(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: dist.ProcessGroup,
    ) -> None:
        """Exchange token rows (dispatch or combine, forward or backward) with
        the given split sizes; ``input`` is contiguous."""
        dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group
        )


class _TransportSlot:
    """The installed transport (one per process, like a process group)."""

    def __init__(self) -> None:
        self.transport = ExpertParallelTransport()


_slot = _TransportSlot()


def set_transport(transport: ExpertParallelTransport | None) -> ExpertParallelTransport:
    """Install ``transport`` (``None``: the default); returns the one it replaces."""
    if transport is not None and not isinstance(transport, ExpertParallelTransport):
        raise TypeError(
            f"transport must be an ExpertParallelTransport or None, got {type(transport).__name__}"
        )
    previous = _slot.transport
    _slot.transport = transport if transport is not None else ExpertParallelTransport()
    return previous


def _exchange(
    out: torch.Tensor,
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
) -> None:
    _slot.transport.tokens(out, x.contiguous(), out_splits, in_splits, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _exchange(out, x, out_splits, in_splits, overlap.side_group(group))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        # the backward's side's communicator, looked up now
        _exchange(grad_in, grad, in_splits, out_splits, overlap.side_group(ctx.group))
        return grad_in, None, None, None


class _FusedExperts(Protocol):
    """What this expert parallelism reads of a fused experts module (one
    that ``fused_experts_problem`` accepts)."""

    gate_up_proj: torch.Tensor  # [E, 2I, H]
    down_proj: torch.Tensor  # [E, H, I]
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class ExpertShard:
    """This rank's share of one fused experts module: experts
    ``[start, stop)`` of ``num_experts``, exchanged over ``group``.

    Its gradients' reduction state (``[Note: HF expert gradient state]`` in
    ``_training.py``): ``grads_pending`` (a backward added to them since the
    last reduction), ``needs_reduction`` (a reduction call is due after each
    step) and ``divided_by_hook`` (a tensor hook already divides them by the
    data-parallel size)."""

    def __init__(self, fqn: str, group: Any, num_experts: int) -> None:
        self.fqn = fqn
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(
                f"{fqn}: {num_experts} experts cannot be split over an expert-parallel group of {self.size} ranks "
                f"(rank {dist.get_rank()}): the number of experts must be divisible by the group size"
            )
        self.num_experts = num_experts
        self.local = num_experts // self.size
        self.start = self.rank * self.local
        self.stop = self.start + self.local
        self.param_names: tuple[str, ...] = ()
        self.grads_pending = False
        self.needs_reduction = True
        self.divided_by_hook = False
        self._mesh: Any = None

    @property
    def mesh(self) -> Any:
        """The expert-parallel group as a 1-D ``DeviceMesh`` (made on first
        use, without a collective), over which a checkpoint sees the experts
        as ``Shard(0)`` of the whole tensor (``[Note: HF expert checkpoints]``)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(
                self.group, group_device(self.group).type
            )
        return self._mesh

    def __deepcopy__(self, memo: dict) -> ExpertShard:
        return self  # holds a process group


def shard_experts(
    part: HFCausalLMStage, group: Any, config: Any, layers_prefix: str
) -> list[str]:
    """Give every fused experts module of ``part`` this rank's experts and
    the expert-parallel forward; returns their FQNs.  Records each sharded
    parameter's expert range in ``part.expert_ranges`` (what the loader
    reads)."""
    hidden_size = config.hidden_size
    done = []
    for fqn, module in list(part.named_modules()):
        if fqn.rsplit(".", 1)[-1] != "experts" or not fqn.startswith(
            layers_prefix + "."
        ):
            continue
        if isinstance(module, nn.ModuleList):
            raise ValueError(
                f"{fqn} holds its experts as separate modules (transformers 4.x): expert parallelism needs the fused "
                "experts of transformers 5.x"
            )
        problem = fused_experts_problem(module, hidden_size) or formula_problem(
            module, config
        )
        if problem is not None:
            raise ValueError(
                f"{fqn} ({type(module).__name__}) cannot be expert-parallel: {problem}"
            )
        shard = ExpertShard(
            fqn, group, cast(_FusedExperts, module).gate_up_proj.shape[0]
        )
        shard.param_names = ("gate_up_proj", "down_proj")
        for name in shard.param_names:
            old = getattr(module, name)
            if old.is_meta:
                new = torch.empty(
                    (shard.local, *old.shape[1:]), dtype=old.dtype, device="meta"
                )
            else:
                new = old.detach()[shard.start : shard.stop].clone()
            setattr(module, name, nn.Parameter(new, requires_grad=old.requires_grad))
            part.expert_ranges[f"{fqn}.{name}"] = (shard.start, shard.stop)
        module._expert_shard = shard
        module.forward = types.MethodType(_expert_parallel_forward, module)
        done.append(fqn)
    logger.debug(
        "expert-parallel experts %s: rank %d of %d",
        done,
        dist.get_rank(group),
        dist.get_world_size(group),
    )
    return done


def _slots(
    top_k_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order of the token-expert slots sorted by expert, token of each
    sorted slot, slots per expert)."""
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    return (
        order,
        order // top_k_index.shape[-1],
        torch.bincount(flat, minlength=num_experts),
    )


def _add_slots(
    hidden_states: torch.Tensor,
    out: torch.Tensor,
    order: torch.Tensor,
    token_of_slot: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add(
        0, token_of_slot, weighted.to(hidden_states.dtype)
    )


def _expert_parallel_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """See ``[Note: HF expert parallelism]``."""
    shard = cast(ExpertShard, self._expert_shard)
    if hidden_states.is_meta:  # shape inference: no routing, no collective
        return torch.zeros_like(hidden_states)
    order, token_of_slot, counts = _slots(top_k_index, shard.num_experts)

    routed = overlap.dispatch_begin(hidden_states.index_select(0, token_of_slot))
    recv_counts = torch.empty_like(counts)
    _slot.transport.counts(recv_counts, counts, overlap.side_group(shard.group))
    send = counts.view(shard.size, shard.local).sum(dim=1).tolist()
    recv_counts = recv_counts.view(shard.size, shard.local)
    recv = recv_counts.sum(dim=1).tolist()
    received = overlap.dispatch_end(_AllToAll.apply(routed, recv, send, shard.group))

    out = local_experts(self, received, recv_counts)

    back = overlap.combine_end(
        _AllToAll.apply(overlap.combine_begin(out), send, recv, shard.group)
    )
    return _add_slots(hidden_states, back, order, token_of_slot, top_k_weights)


_formula_checked: dict[type, str | None] = {}


def formula_problem(module: nn.Module, config: Any) -> str | None:
    """Whether the expert-parallel forward computes what ``module``'s own
    forward computes: both run on a tiny module of the same class (tiny
    config of the same type, random weights and routing, every expert local),
    once per class.  ``None`` when they agree, else what differs."""
    cls = type(module)
    if cls not in _formula_checked:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            tiny = cls(tiny_config(config)).float()
            for p in tiny.parameters():
                nn.init.normal_(p, std=0.1)
            gate_up_proj = cast(_FusedExperts, tiny).gate_up_proj
            num_experts, hidden = gate_up_proj.shape[0], gate_up_proj.shape[2]
            top_k = min(2, num_experts)
            h = torch.randn(16, hidden)
            idx = torch.rand(16, num_experts).argsort(dim=-1)[:, :top_k]
            w = torch.rand(16, top_k)
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # a standalone experts module: transformers says it runs its eager forward
        try:
            with torch.no_grad():
                want = cls.forward(tiny, h, idx, w)
        finally:
            hf_logging.set_verbosity(verbosity)
        with torch.no_grad():
            order, token_of_slot, counts = _slots(idx, num_experts)
            out = local_experts(
                tiny, h.index_select(0, token_of_slot), counts.view(1, num_experts)
            )
            got = _add_slots(h, out, order, token_of_slot, w)
        diff = (got - want).abs().max().item()
        ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        _formula_checked[cls] = (
            None
            if ok
            else f"its forward computes something else (max |difference| {diff:.3g})"
        )
    return _formula_checked[cls]


def local_experts(
    module: nn.Module, tokens: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The local experts on ``tokens`` (grouped by source rank, then local
    expert; ``counts`` [sources, local experts]), in the same order."""
    experts = cast(_FusedExperts, module)
    local = counts.shape[1]
    expert_of_row = torch.arange(local, device=tokens.device).repeat(counts.shape[0])
    expert_of_row = expert_of_row.repeat_interleave(counts.flatten())
    order = expert_of_row.argsort(stable=True)
    grouped = tokens.index_select(0, order).split(counts.sum(dim=0).tolist())
    outs = []
    for e, x in enumerate(grouped):
        gate, up = nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(
            nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
        )
    y = torch.cat(outs) if outs else tokens
    return y.index_select(0, order.argsort())


def is_expert_parameter(part: nn.Module, fqn: str) -> bool:
    """Whether ``fqn`` of ``part`` is a sharded expert parameter (different
    on every rank of the expert-parallel group)."""
    return fqn in getattr(part, "expert_ranges", {})


def expert_parameters(part: nn.Module) -> dict[str, ExpertShard]:
    """FQN of every sharded expert parameter of ``part`` -> its shard."""
    return {
        f"{shard.fqn}.{name}": shard
        for _, shard in sharded_experts([part])
        for name in shard.param_names
    }


def sharded_experts(parts: Iterable[nn.Module]) -> list[tuple[nn.Module, ExpertShard]]:
    """Every experts module of ``parts`` that :func:`shard_experts` sharded, with its shard."""
    return [
        (m, cast(ExpertShard, m._expert_shard))
        for part in parts
        for m in part.modules()
        if hasattr(m, "_expert_shard")
    ]
