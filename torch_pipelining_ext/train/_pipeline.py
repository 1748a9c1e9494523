"""A rank's share of the model: its stages in the job's layout, their
schedule, optimizers and learning-rate schedules, and one training step.

Private helper of :mod:`torch_pipelining_ext.train`, built from the public
API of :mod:`torch_pipelining_ext.hf` and :mod:`torch_pipelining_ext.launcher`
only (the trainer is also the worked example of that API).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining.schedules import OVERLAP_F_B, PipelineScheduleSingle

from torch_pipelining_ext import hf
from torch_pipelining_ext.launcher import ParallelLayout
from torch_pipelining_ext.runtime import sequential_overlap_f_b
from torch_pipelining_ext.train import _model, _state
from torch_pipelining_ext.train._plan import RunPlan


if TYPE_CHECKING:
    from torch._ops import OpOverload


__all__: list[str] = []

logger = logging.getLogger(__name__)


_aten = torch.ops.aten
SELECTIVE_CHECKPOINTING_OPS = (
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,
)
"""What ``--activation-checkpointing selective`` keeps from the forward (the
rest is recomputed): the matrix products, the attention kernels and the
router's max, the save list torchtitan uses for DeepSeek-V3 (without its
every-other-matmul rule).  Runs under the split-backward schedules through
the package's ``checkpoint_split_backward`` patch."""

_CHECKPOINTING: dict[str, str | list[OpOverload] | None] = {
    "none": None,
    "full": "full",
    "selective": list(SELECTIVE_CHECKPOINTING_OPS),
}


class Pipeline:
    """This rank's stages of the model in the job's layout, their schedule,
    one AdamW per stage module and its learning-rate schedule."""

    def __init__(
        self,
        plan: RunPlan,
        parallel: ParallelLayout,
        device: torch.device,
        resuming: bool,
        *,
        overlap: bool | None = None,
    ) -> None:
        """``parallel``: the job's layout (:func:`launcher.parallel_layout`);
        ``overlap``: run OVERLAP_F_B concurrently (default: unless
        ``--no-overlap``)."""
        args = plan.args
        self.plan, self.parallel, self.device = plan, parallel, device
        assert parallel.data_mesh is not None  # a built layout has one
        self.data = parallel.data_mesh
        schedule_cls = getattr(pipelining, f"Schedule{args.schedule}")
        self.aux = args.router_aux_loss != "none"
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            *_model_source(plan, resuming), parallel, schedule_cls, device,
            activation_checkpointing=_CHECKPOINTING[args.activation_checkpointing],
            router_aux_loss=args.router_aux_loss if self.aux else None,
            router_aux_loss_coef=args.router_aux_loss_coef,
            **_weights_source(plan, resuming),
        )  # fmt: skip
        for part in self.parts:
            part.train()  # (a model read with from_pretrained is in eval mode)
        if plan.layout.data_ranks > 1 and not args.no_fsdp:
            hf.fully_shard_replicated(self.parts, parallel)  # FSDP2 over dp x ep
        self.loss_fn = hf.CausalLMLoss(n_microbatches=args.microbatches)
        single = issubclass(schedule_cls, PipelineScheduleSingle)
        self.schedule = schedule_cls(
            self.stages[0] if single else self.stages,
            n_microbatches=args.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )
        if overlap is None:
            overlap = not args.no_overlap
        if not overlap and not single:
            self.schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b)
        self.optimizers = [adamw(part, args) for part in self.parts]
        self.lr = _state.LRSchedules(
            [
                torch.optim.lr_scheduler.LambdaLR(o, lr_rule(args))
                for o in self.optimizers
            ]
        )
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.moe = plan.num_experts > 0

    def forward_backward(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The step's forward and backward on this data rank's ``ids``, the
        gradients reduced over the data-parallel ranks; returns the
        microbatch losses (ranks holding the last stage)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        self.run_schedule(self.schedule.step, ids, losses)
        if self.parts[0].tied_groups:
            hf.sync_tied_gradients(self.parts, self.parallel.pipeline)
        hf.reduce_expert_parallel_gradients(self.parts, self.parallel)
        return losses

    def run_schedule(
        self, run: Callable[..., Any], ids: torch.Tensor, losses: list[torch.Tensor]
    ) -> Any:
        """``run`` (the schedule's ``step`` or ``eval``) on this data rank's
        ``ids``: the loss's labels set, the inputs given to the first stage and
        the target to the last, under the run's autocast; returns what ``run``
        returns (the last stage's output)."""
        self.loss_fn.set_labels(ids, group=self.data.get_group())
        inputs = (
            (ids, torch.ones_like(ids)) if self.aux else (ids,)
        )  # packed: no padding
        with self.autocast():
            return run(
                *(inputs if self.has_first else ()),
                target=ids if self.has_last else None,
                losses=losses,
            )

    def global_loss(self, losses: list[torch.Tensor]) -> float:
        """The global batch's loss from :meth:`forward_backward`'s: the data
        ranks' losses averaged (each rank holding a last stage adds its
        microbatch losses); a collective over all ranks."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.has_last:
            total += torch.stack([loss.detach() for loss in losses]).sum().double()
        dist.all_reduce(total)
        return float(total) / self.plan.layout.data_ranks

    def update(self) -> tuple[float, float, Any]:
        """Clip, step the optimizers and the learning rate, balance the
        experts; returns the gradient norm (before clipping), the step's
        learning rate and the step's expert load (``None``: a dense model)."""
        args = self.plan.args
        max_norm = args.max_grad_norm or math.inf  # 0: the norm, no clipping
        norm = hf.clip_grad_norm_(self.parts, max_norm, mesh=self.parallel)
        lr = self.optimizers[0].param_groups[0]["lr"]
        for optimizer in self.optimizers:
            optimizer.step()
        self.lr.step()
        load = None
        if self.moe:  # every MoE layer on every rank: the same load everywhere
            load = hf.expert_load(self.parts, dist.group.WORLD)
            if args.expert_bias_rate > 0:
                hf.update_expert_bias(self.parts, load, args.expert_bias_rate)
        return float(norm), float(lr), load

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the stages compute in: bfloat16 autocast for ``--dtype bfloat16``."""
        if self.plan.args.dtype == "float32":
            return contextlib.nullcontext()
        # float32 weights (the master copy), gradients and their reductions
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def _model_source(plan: RunPlan, resuming: bool) -> tuple[Any]:
    """What pipeline_hf_causal_lm builds from: the config (on meta) when a
    checkpoint or the model directory provides the weights, else the tiny
    model's initial weights (the same in every layout)."""
    if resuming or plan.args.model is not None:
        return (plan.config,)
    return (_model.initial_model(plan.config, plan.args.seed),)


def _weights_source(plan: RunPlan, resuming: bool) -> dict[str, Any]:
    if resuming:
        return {"init_weights": True}  # overwritten by the checkpoint
    if plan.args.model is not None:
        return {"checkpoint": plan.args.model}
    return {}


def adamw(part: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for p in part.parameters():
        (decay if p.dim() >= 2 else rest).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas))


def lr_rule(args: Any) -> Callable[[int], float]:
    def factor(step: int) -> float:
        return _state.lr_factor(
            step,
            steps=args.steps,
            warmup=args.warmup_steps,
            min_ratio=args.min_lr / args.lr,
        )

    return factor
