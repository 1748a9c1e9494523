# mypy: allow-untyped-defs
"""Hugging Face's router auxiliary (load-balancing) loss through the stages.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF router
auxiliary loss]``.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from torch_pipelining_ext.hf import _compat


__all__: list[str] = []

# [Note: HF router auxiliary loss]
# transformers' ``load_balancing_loss_func`` (Qwen3-MoE, Mixtral, OLMoE, ...)
# sums, over every MoE layer of one forward, the per-expert count of top-k
# assignments and the per-expert sum of router probabilities (both masked by
# the attention mask), divides both by the rows summed over the layers, and
# only then multiplies them: ``E * sum(counts / rows * probs / rows)``.  The
# layers' statistics meet in one product, so the stages carry running sums:
# with ``config.output_router_logits`` a stage takes and returns
# ``(hidden, prob_sums [E] float32, counts [E + 1] int64, mask [b, s] int64)``
# (``counts[E]`` holds the rows; the first stage takes ``input_ids`` and an
# optional attention mask) and adds its layers' sums, in layer order, as the
# unsplit forward does.  The last stage returns ``(logits, coef * aux)``
# (aux of shape [1], so that the schedule can concatenate the microbatches'
# outputs) and CausalLMLoss adds ``coef * aux / n_microbatches``: the step's
# loss is the token-mean LM loss plus the plain mean of the microbatches'
# auxiliary losses (neither HF's loss on the whole batch nor its gradient accumulation,
# which adds the terms).  Autograd carries the gradient back through the
# probability sums; the counts carry none.  Router logits are read with a
# forward hook on the model's router class (the OutputRecorder transformers
# itself uses), into a collector of the thread running this stage's forward:
# an activation-checkpointing recomputation, or the other side of an
# overlapped OVERLAP_F_B, records nothing.  The stage forward takes no
# attention mask, so the padding must be on the right.


@dataclass(frozen=True)
class RouterAuxLoss:
    """What the auxiliary loss of one model needs: its router class, the index
    of the logits in the router's output, ``E``, ``top_k`` and the coefficient."""

    router_cls: type
    index: int
    num_experts: int
    top_k: int
    coef: float


def router_aux_loss(model: nn.Module) -> RouterAuxLoss | None:
    """The auxiliary loss ``model``'s config asks for (``output_router_logits``),
    ``None`` if none; ``ValueError`` when it cannot be computed exactly."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    what = f"config.output_router_logits is set on a {type(model).__name__}"
    if not _compat.has_fused_experts():
        raise ValueError(
            f"{what}: the router auxiliary loss through pipeline stages needs transformers 5.x (routers apart "
            "from the experts); set it to False on this transformers"
        )
    modeling = sys.modules[type(model).__module__]
    base = model.get_submodule(model.base_model_prefix)
    recorder = getattr(base, "_can_record_outputs", None) or {}
    recorder = recorder.get("router_logits")
    names = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
    if (
        recorder is None
        or not hasattr(modeling, "load_balancing_loss_func")
        or not all(hasattr(model, n) for n in names)
    ):
        raise ValueError(
            f"{what}, but {config.model_type} has no router auxiliary loss in transformers "
            "(no load_balancing_loss_func on router logits); set it to False"
        )
    if getattr(config, "router_jitter_noise", 0):
        raise ValueError(
            f"{what} with router_jitter_noise={config.router_jitter_noise}: random routing in training, which "
            "overlapped and sequential runs could not reproduce; set router_jitter_noise=0"
        )
    return RouterAuxLoss(
        recorder.target_class,
        recorder.index,
        model.num_experts,
        model.num_experts_per_tok,
        float(model.router_aux_loss_coef),
    )


class _Collector(threading.local):
    logits: list[torch.Tensor] | None = None


_collector = _Collector()


def install_hooks(part: nn.Module, aux: RouterAuxLoss) -> int:
    """Record router logits of ``part`` into the current thread's collector;
    returns the number of routers."""

    def record(module, args, output):
        if _collector.logits is not None:
            _collector.logits.append(output[aux.index])

    routers = [m for m in part.modules() if isinstance(m, aux.router_cls)]
    for router in routers:
        router.register_forward_hook(record)
    return len(routers)


class RunningSums:
    """The running sums of one microbatch through one stage."""

    def __init__(self, aux: RouterAuxLoss, x: torch.Tensor, carried: tuple) -> None:
        self.aux = aux
        first = _is_ids(x)
        if (first and len(carried) > 1) or (not first and len(carried) != 3):
            takes = (
                "(input_ids[, attention_mask])"
                if first
                else "(hidden, prob_sums, counts, mask)"
            )
            raise ValueError(
                f"a stage with the router auxiliary loss takes {takes}, got {1 + len(carried)} tensors"
            )
        if first:
            mask = carried[0] if carried else torch.ones_like(x)
            check_mask(mask, x)
            e = aux.num_experts
            self.probs = torch.zeros(e, dtype=torch.float32, device=x.device)
            self.counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
            self.mask = mask.to(torch.int64)
        else:
            self.probs, self.counts, self.mask = carried

    def record(self, layer_call):
        """Run ``layer_call()`` recording its routers' logits; add their sums."""
        _collector.logits = []
        try:
            out = layer_call()
            logits = _collector.logits
        finally:
            _collector.logits = None
        for layer_logits in logits:
            self.add(layer_logits)
        return out

    def add(self, router_logits: torch.Tensor) -> None:
        """One MoE layer's sums, as ``load_balancing_loss_func`` forms them."""
        top_k, e = self.aux.top_k, self.aux.num_experts
        weights = torch.nn.functional.softmax(router_logits, dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        flat = self.mask.reshape(-1)
        counts = torch.zeros(e, dtype=torch.int64, device=flat.device).scatter_add(
            0, selected.reshape(-1), flat.repeat_interleave(top_k)
        )
        rows = flat.sum().reshape(1)
        self.counts = self.counts + torch.cat([counts, rows])
        self.probs = self.probs + (weights.float() * flat.float().unsqueeze(-1)).sum(
            dim=0
        )

    def outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return h, self.probs, self.counts, self.mask

    def loss(self) -> torch.Tensor:
        """``coef * load_balancing_loss_func`` of the microbatch, shape ``[1]``
        (so that the schedule can concatenate the microbatches' outputs)."""
        rows = self.counts[-1].float()
        tokens_per_expert = self.counts[:-1].float() / rows
        probs_per_expert = self.probs / rows
        aux = torch.sum(tokens_per_expert * probs_per_expert.unsqueeze(0))
        return (self.aux.coef * (aux * self.aux.num_experts)).reshape(1)


def _is_ids(x: torch.Tensor) -> bool:
    return not x.is_floating_point()


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
