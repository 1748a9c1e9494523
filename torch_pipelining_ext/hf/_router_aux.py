"""Router auxiliary (load-balancing) losses through the stages.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF router
auxiliary loss]`` and ``[Note: HF carried router tensors]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torch_pipelining_ext.hf import _compat
from torch_pipelining_ext.hf._routing import LayerRecord, Routing


if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__: list[str] = []

# [Note: HF router auxiliary loss]
# Three forms, each the microbatch's term; the step's loss adds
# ``term / n_microbatches`` per microbatch (CausalLMLoss), i.e. the plain
# mean over the microbatches (and, through the gradient averaging, over the
# EP ranks) -- neither the loss of the whole batch nor Hugging Face's gradient
# accumulation, which adds the terms.
#
# * "pooled" (Hugging Face's own, ``config.output_router_logits``):
#   transformers' ``load_balancing_loss_func`` sums, over every MoE layer,
#   the per-expert count of top-k assignments and the per-expert sum of
#   softmax probabilities (both masked by the attention mask), divides both
#   by the rows summed over the layers, and only then multiplies them:
#   ``coef * E * sum_i(counts_i / rows * probs_i / rows)``.  The layers meet
#   in one product, so the stages carry the running sums and the last stage
#   evaluates it.
# * "per_layer" (the Switch Transformer / Megatron-Core form): that function
#   on each MoE layer alone, summed over the layers; each stage adds its
#   layers' terms to a running sum.
# * "sequence" (DeepSeek-V3's complementary sequence-wise loss): per MoE layer
#   and sequence of T real tokens, ``f_i = E / (k T) * #tokens routed to i``
#   (the experts the layer really routes to: DeepSeek-V3's group-limited
#   top-k of sigmoid scores plus ``e_score_correction_bias``) and
#   ``P_i = mean_t s'_{t,i}`` with ``s'`` the token's affinities normalised
#   to sum 1 (sigmoid scores, or softmax probabilities for softmax routers);
#   the layer's term is ``coef * mean over sequences of sum_i f_i P_i``
#   (sequences without a real token left out), summed over the layers.
#
# Counts carry no gradient; probabilities and affinities do, and autograd
# carries it back through the running sums.  The first stage takes
# ``(input_ids[, attention_mask])`` (no mask: no padding); the stage forward
# takes no attention mask, so the padding must be on the right.


# [Note: HF carried router tensors]
# With an auxiliary loss a stage takes and returns ``(hidden, *sums, mask)``:
# "pooled" carries ``prob_sums [E] float32`` and ``counts [E + 1] float64``
# (``counts[E]``: the rows; float64 holds integers exactly), the others a
# running loss ``[1] float32``; ``mask [b, s] float32`` is the attention
# mask.  The last stage returns ``(logits, term [1])`` (shape [1], so that
# the schedule can concatenate the microbatches' outputs).  Three rules keep
# this within what every supported torch's PipelineStage runs:
#   * every carried tensor is floating point: torch 2.9 makes every received
#     tensor require grad, which an integer tensor cannot;
#   * every carried tensor gets a gradient: torch 2.9 sends one back for
#     every received tensor, so the last stage adds ``(t * 0).sum()`` of
#     the tensors that carry none (the counts, the mask: zero, exactly);
#   * no stage returns a tensor it received: torch 2.9's input backward
#     detaches the stage's outputs in place, which would detach the receive
#     buffer itself, so tensors passed on unchanged are cloned.

_MODES = ("pooled", "per_layer", "sequence")


@dataclass(frozen=True)
class RouterAuxLoss:
    """The auxiliary loss of one model: its form (``"pooled"``,
    ``"per_layer"`` or ``"sequence"``), routing and coefficient."""

    mode: str
    routing: Routing
    coef: float

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    @property
    def top_k(self) -> int:
        return self.routing.top_k


def router_aux_loss(
    model: PreTrainedModel,
    routing: Routing | None,
    mode: str | None = None,
    coef: float | None = None,
) -> RouterAuxLoss | None:
    """The auxiliary loss asked for by ``mode`` (default: Hugging Face's,
    "pooled", where ``config.output_router_logits`` is set) and ``coef``
    (default: ``config.router_aux_loss_coef``; required for "sequence");
    ``None`` if none; ``ValueError`` when it cannot be computed exactly."""
    config = model.config
    if mode is None:
        if not getattr(config, "output_router_logits", False):
            if coef is not None:
                raise ValueError(
                    f"router_aux_loss_coef={coef} but no auxiliary loss is asked for: pass router_aux_loss "
                    "('pooled', 'per_layer' or 'sequence') or set config.output_router_logits=True"
                )
            return None
        mode, what = "pooled", "config.output_router_logits is set"
    else:
        what = f"router_aux_loss={mode!r}"
    if mode not in _MODES:
        raise ValueError(
            f"router_aux_loss must be one of {_MODES} or None, got {mode!r}"
        )
    what = f"{what} on a {type(model).__name__}"
    _check_routing(model, routing, mode, what)
    assert routing is not None
    if getattr(config, "router_jitter_noise", 0):
        raise ValueError(
            f"{what} with router_jitter_noise={config.router_jitter_noise}: random routing in training, which "
            "overlapped and sequential runs could not reproduce; set router_jitter_noise=0"
        )
    return RouterAuxLoss(mode, routing, _coefficient(model, mode, coef, what))


def _check_routing(
    model: PreTrainedModel, routing: Routing | None, mode: str, what: str
) -> None:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if not _compat.has_fused_experts():
        raise ValueError(
            f"{what}: the router auxiliary loss through pipeline stages needs transformers 5.x (routers apart "
            "from the experts); set it to False on this transformers"
        )
    if routing is None or routing.router_cls is None:
        raise ValueError(
            f"{what}, but {model_type} has no router whose logits transformers records (no fused MoE "
            "experts): a router auxiliary loss needs a MoE model; leave it off"
        )
    if mode in ("pooled", "per_layer") and not routing.has_balancing_loss:
        raise ValueError(
            f"{what}, but {model_type} has no router auxiliary loss in transformers (no "
            "load_balancing_loss_func on router logits): it balances with e_score_correction_bias "
            "(hf.update_expert_bias); for DeepSeek-V3's sequence-wise loss pass router_aux_loss='sequence' "
            "and router_aux_loss_coef"
        )
    if mode == "sequence" and routing.score is None:
        raise ValueError(
            f"{what}, but the score function of {model_type}'s router is not known here (softmax routers "
            "with load_balancing_loss_func, DeepSeek-V3 and GLM-4-MoE are)"
        )


def _coefficient(
    model: PreTrainedModel, mode: str, coef: float | None, what: str
) -> float:
    if coef is None:
        if mode == "sequence":
            raise ValueError(
                f"{what} needs router_aux_loss_coef (DeepSeek-V3's alpha, e.g. 1e-4): transformers' config "
                "has no coefficient for this loss"
            )
        coef = getattr(model.config, "router_aux_loss_coef", None)
        if coef is None:
            raise ValueError(
                f"{what}: the config has no router_aux_loss_coef; pass router_aux_loss_coef"
            )
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise ValueError(
            f"router_aux_loss_coef must be a number, got {type(coef).__name__}"
        )
    if not (math.isfinite(coef) and coef >= 0):
        raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {coef}")
    return float(coef)


class RunningSums:
    """The carried router tensors of one microbatch through one stage (see
    ``[Note: HF carried router tensors]``)."""

    def __init__(
        self, aux: RouterAuxLoss, x: torch.Tensor, carried: tuple[torch.Tensor, ...]
    ) -> None:
        self.aux = aux
        first = not x.is_floating_point()
        width = 2 if aux.mode == "pooled" else 1
        if (first and len(carried) > 1) or (not first and len(carried) != width + 1):
            raise ValueError(
                f"a stage with the router auxiliary loss ({aux.mode}) takes "
                f"{self._signature(first)}, got {1 + len(carried)} tensors"
            )
        if first:
            mask = carried[0] if carried else torch.ones_like(x)
            check_mask(mask, x)
            self.mask = mask.to(torch.float32)
            self.sums = self._zeros(x.device)
        else:
            *sums, self.mask = carried
            self.sums = list(sums)

    def _signature(self, first: bool) -> str:
        if first:
            return "(input_ids[, attention_mask])"
        if self.aux.mode == "pooled":
            return "(hidden, prob_sums, counts, mask)"
        return "(hidden, loss, mask)"

    def _zeros(self, device: torch.device) -> list[torch.Tensor]:
        if self.aux.mode != "pooled":
            return [torch.zeros(1, dtype=torch.float32, device=device)]
        e = self.aux.num_experts
        return [
            torch.zeros(e, dtype=torch.float32, device=device),
            torch.zeros(e + 1, dtype=torch.float64, device=device),
        ]

    def add(self, record: LayerRecord) -> None:
        """Add one MoE layer's terms."""
        if record.logits is None or record.indices is None:
            raise RuntimeError(
                "a MoE layer ran without a recorded router call: the auxiliary loss cannot be computed"
            )
        mask = self.mask.detach()
        if self.aux.mode == "pooled":
            probs, counts = self.sums
            p, c = _switch_sums(record.logits, mask, self.aux.top_k)
            self.sums = [probs + p, counts + c.double()]
            return
        if self.aux.mode == "per_layer":
            p, c = _switch_sums(record.logits, mask, self.aux.top_k)
            term = _switch_product(p, c, self.aux.num_experts)
        else:
            term = _sequence_term(record.logits, record.indices, mask, self.aux)
        self.sums = [self.sums[0] + self.aux.coef * term.reshape(1)]

    def outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a stage other than the last returns (no received tensor
        returned itself: [Note: HF carried router tensors])."""
        return (h, *(t.clone() for t in self.sums), self.mask.clone())

    def loss(self) -> torch.Tensor:
        """The microbatch's term, shape ``[1]``."""
        if self.aux.mode == "pooled":
            probs, counts = self.sums
            term = self.aux.coef * _switch_product(
                probs, counts.detach().float(), self.aux.num_experts
            )
            no_grad = [counts, self.mask]
        else:
            term, no_grad = self.sums[0], [self.mask]
        for t in no_grad:
            term = term + (t * 0).sum().to(term.dtype)
        return term.reshape(1)


def _switch_sums(
    logits: torch.Tensor, mask: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's masked probability sums ``[E]`` and top-k counts with the
    rows ``[E + 1]``, as ``load_balancing_loss_func`` forms them."""
    weights = torch.nn.functional.softmax(logits, dim=-1)
    _, selected = torch.topk(weights, top_k, dim=-1)
    flat = mask.reshape(-1)
    e = logits.shape[-1]
    counts = torch.zeros(e, dtype=torch.float32, device=flat.device).scatter_add(
        0, selected.reshape(-1), flat.repeat_interleave(top_k)
    )
    probs = (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
    return probs, torch.cat([counts, flat.sum().reshape(1)])


def _switch_product(
    probs: torch.Tensor, counts: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """``E * sum_i(counts_i / rows * probs_i / rows)``, ``rows = counts[E]``."""
    rows = counts[-1]
    return num_experts * torch.sum((counts[:-1] / rows) * (probs / rows))


def _sequence_term(
    logits: torch.Tensor, indices: torch.Tensor, mask: torch.Tensor, aux: RouterAuxLoss
) -> torch.Tensor:
    """One layer's sequence-wise term (without the coefficient), from its
    router ``logits`` and top-k ``indices``."""
    logits = logits.float()
    if aux.routing.score == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1)
    b, s = mask.shape
    e, k = aux.num_experts, aux.top_k
    affinity = (scores / scores.sum(dim=-1, keepdim=True)).view(b, s, e)
    routed = torch.zeros(b * s, e, dtype=torch.float32, device=mask.device)
    routed = routed.scatter_(1, indices.reshape(b * s, -1), 1.0).view(b, s, e)
    m = mask.unsqueeze(-1)
    tokens = mask.sum(dim=-1, keepdim=True)
    denom = tokens.clamp(min=1)
    f = (e / k) * (routed * m).sum(dim=1) / denom
    p = (affinity * m).sum(dim=1) / denom
    per_sequence = (f * p).sum(dim=-1)
    return per_sequence.sum() / (tokens > 0).sum().clamp(min=1)


def check_mask(mask: torch.Tensor, ids: torch.Tensor) -> None:
    """A 0/1 attention mask of ``ids``' shape, padded on the right."""
    if mask.shape != ids.shape or mask.is_floating_point():
        raise ValueError(
            f"attention_mask must be an integer or bool tensor of the input_ids' shape {list(ids.shape)}, "
            f"got {mask.dtype} {list(mask.shape)}"
        )
    if mask.is_meta:
        return
    m = mask.to(torch.int64)
    if bool(((m != 0) & (m != 1)).any()) or bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(
            "attention_mask must hold 0/1 with the padding on the right (the stage forward takes no mask: "
            "real tokens must not follow padding)"
        )
