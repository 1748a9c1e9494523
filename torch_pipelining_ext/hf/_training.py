"""What a training step of Hugging Face stages needs around the schedule.

Private helper of :mod:`torch_pipelining_ext.hf`: the last stage's loss,
the gradients of weights tied across stages, and the gradients of the
parameters replicated over the expert-parallel group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from torch_pipelining_ext._ep_gradients import all_reduce_divided, reduce_gradients
from torch_pipelining_ext._parallel_layout import ParallelLayout
from torch_pipelining_ext.hf._arrival import group_device, GroupArrival
from torch_pipelining_ext.hf._expert_parallel import (
    expert_parameters,
    is_expert_parameter,
    sharded_experts,
)
from torch_pipelining_ext.hf._mesh import layout_of, MeshOrGroup


if TYPE_CHECKING:
    from torch_pipelining_ext.hf._stage import HFCausalLMStage


__all__: list[str] = []

# [Note: HF collective arrival]
_set_labels_arrival = GroupArrival("CausalLMLoss.set_labels")


class CausalLMLoss:
    """Loss for the last stage: Hugging Face's causal-LM loss, split so that
    the microbatch losses add up to the loss of the whole batch.

    Labels are shifted (token ``t`` predicts label ``t + 1``) and
    ``ignore_index`` labels are skipped, as in transformers'
    ``ForCausalLMLoss``.  Each microbatch returns its summed cross entropy
    divided by the number of predicted tokens of the *whole* batch, so the
    sum over microbatches equals Hugging Face's mean over the batch even when
    microbatches hold different numbers of labelled tokens.  Hence:

    * call :meth:`set_labels` with the whole step's labels before each
      ``schedule.step``;
    * build the schedule with ``scale_grads=False`` (the division is already
      in the loss);
    * with expert parallelism, ``set_labels(labels, group=ep_group)`` is a
      collective over that group: every rank of it calls it, each step.

    With a router auxiliary loss (``config.output_router_logits``: Hugging
    Face's; or ``pipeline_hf_causal_lm(router_aux_loss=...)``: "pooled",
    "per_layer", DeepSeek-V3's "sequence") the last stage returns
    ``(logits, coef * aux)`` and each microbatch's loss adds
    ``coef * aux / n_microbatches``: build it with ``n_microbatches`` (the
    schedule's), feed the first stage ``(input_ids, attention_mask)`` with
    the padding on the right.  The step loss is then the token-mean LM loss
    plus the *plain mean* over microbatches (and EP ranks) of the
    microbatches' auxiliary terms: neither the auxiliary loss of the whole
    batch nor Hugging Face's gradient accumulation (which adds the terms);
    see ``[Note: HF router auxiliary loss]``.  A form the model does not
    have (Hugging Face's on DeepSeek-V3, any on a dense model) and
    ``router_jitter_noise > 0`` are refused when the stages are built.

    Example::

        loss_fn = CausalLMLoss()
        schedule = Schedule1F1B(
            stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False
        )
        loss_fn.set_labels(labels)
        schedule.step(input_ids, target=labels, losses=losses)
        step_loss = torch.stack(losses).sum()  # == model(input_ids, labels=labels).loss
    """

    def __init__(
        self, ignore_index: int = -100, *, n_microbatches: int | None = None
    ) -> None:
        if n_microbatches is not None and n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.ignore_index = ignore_index
        self.n_microbatches = n_microbatches
        self.num_items_in_batch: float | None = None

    def set_labels(
        self,
        labels: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        """Count the predicted tokens of the step's whole batch.

        With ``group`` (the expert-parallel group, whose ranks train on
        different data) the count is that of the global batch over the
        group's size: each rank's losses then average, over the group, to
        the global batch's loss (the data-parallel convention), so the
        gradients of replicated parameters are averaged over the group and
        those of the sharded experts divided by its size
        (:func:`reduce_expert_parallel_gradients`, :func:`fully_shard_replicated`).

        With ``group`` this is a collective: every rank of ``group`` must
        call it before each step, pipeline ranks without the last stage
        included.  A rank whose peers do not call it within ``timeout``
        raises ``RuntimeError`` naming them, before any collective (see
        ``[Note: HF collective arrival]``).
        """
        count = (labels[..., 1:] != self.ignore_index).sum()
        if group is not None:
            _set_labels_arrival.wait(group, timeout)
            count = count.to(group_device(group))
            dist.all_reduce(count, group=group)
            if int(count) == 0:
                raise ValueError(
                    f"labels hold no token to predict on any rank (all but the first are {self.ignore_index})"
                )
            self.num_items_in_batch = int(count) / dist.get_world_size(group)
            return
        n = int(count)
        if n == 0:
            raise ValueError(
                f"labels hold no token to predict (all but the first are {self.ignore_index})"
            )
        self.num_items_in_batch = n

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        if self.num_items_in_batch is None:
            raise RuntimeError(
                "CausalLMLoss: call set_labels(labels) with the whole batch's labels before the step"
            )
        aux = None
        if isinstance(output, tuple):  # [Note: HF router auxiliary loss]
            logits, aux = output
            if self.n_microbatches is None:
                raise RuntimeError(
                    "CausalLMLoss: the last stage returns the router auxiliary loss "
                    "(config.output_router_logits): build CausalLMLoss(n_microbatches=...) with the "
                    "schedule's number of microbatches"
                )
        else:
            logits = output
        shifted = nn.functional.pad(labels, (0, 1), value=self.ignore_index)[..., 1:]
        loss = nn.functional.cross_entropy(
            logits.float().flatten(0, -2),
            shifted.reshape(-1).to(logits.device),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        loss = loss / self.num_items_in_batch
        return loss if aux is None else loss + aux.reshape(()) / self.n_microbatches


def sync_tied_gradients(
    parts: Sequence[HFCausalLMStage], group: dist.ProcessGroup | None = None
) -> None:
    """See :func:`torch_pipelining_ext.hf.sync_tied_gradients`."""
    if not parts:
        return
    for names, shape, _ in parts[0].tied_groups:
        holders = []
        for part in parts:
            params = dict(part.named_parameters(remove_duplicate=False))
            seen: set[int] = set()
            for n in names:
                p = params.get(n)
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    holders.append(p)
        if group is None and len(holders) < 2:
            continue
        if holders:
            device = holders[0].device
        else:  # no copy here: only with a group (skipped above without one)
            assert group is not None
            device = group_device(group)
        # float32 on every rank: ranks holding no copy do not know the loaded dtype
        total = torch.zeros(shape, dtype=torch.float32, device=device)
        for p in holders:
            if p.grad is not None:  # FSDP2's shards gathered over their mesh
                total += _whole(p.grad).float()
        if group is not None:
            dist.all_reduce(total, group=group)
        for p in holders:
            if p.grad is None:
                p.grad = _like(total.to(p.dtype), p)
            else:
                p.grad.copy_(_like(total, p.grad))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, gathered where it is a DTensor (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(total: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``total`` laid out as ``like`` (a DTensor's shard of
    it: a redistribution from replicated, without communication)."""
    if not isinstance(like, DTensor):
        return total
    mesh = like.device_mesh
    whole = DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, like.placements)


# [Note: HF expert gradient state]
# Data-parallel ranks (dp x ep) train on different tokens; each rank's loss
# is its share of the global batch times the number of data ranks
# (CausalLMLoss.set_labels(labels, group=<the dp x ep group>)).  The global
# gradient of a parameter every data rank holds is then the ranks' average;
# an expert's gradient on one rank already sums the contributions of its
# expert-parallel group (the all-to-all's backward brings them back), so its
# global gradient is the sum over its dp replicas divided by dp x ep.
# Without FSDP reduce_expert_parallel_gradients does both after each step.
# fully_shard_replicated leaves the averaging of the other parameters to
# FSDP's reduce-scatter and divides the experts' gradients by dp x ep with a
# tensor hook; with dp > 1 the experts' replicas still need their sum over
# dp, which reduce_expert_parallel_gradients adds.  Every experts module's
# ExpertShard records whether a backward added to its gradients since the
# last reduction (grads_pending, set by a post-accumulate-grad hook) and
# whether a reduction is due after each step (needs_reduction), so that
# clip_grad_norm_ refuses gradients nobody reduced instead of clipping by a
# wrong norm.


def track_expert_gradients(part: nn.Module) -> None:
    """Mark each sharded experts module's gradients pending whenever a
    backward adds to them (see ``[Note: HF expert gradient state]``)."""
    for module, shard in sharded_experts([part]):
        for name in shard.param_names:
            getattr(module, name).register_post_accumulate_grad_hook(
                functools.partial(_mark_pending, shard)
            )


def _mark_pending(shard: Any, param: torch.Tensor) -> None:
    shard.grads_pending = True


def check_reduced(parts: Sequence[HFCausalLMStage]) -> None:
    """Refuse expert gradients that a step added to and nothing reduced."""
    pending = [
        s.fqn
        for _, s in sharded_experts(parts)
        if s.needs_reduction and s.grads_pending
    ]
    if pending:
        raise RuntimeError(
            f"the gradients of the expert-parallel experts {pending[:3]} are not reduced yet: call "
            "hf.reduce_expert_parallel_gradients(parts, mesh) after schedule.step() (with fully_shard_replicated "
            "and a 'dp' dimension too), before clipping and the optimizer step"
        )


def reduce_expert_parallel_gradients(
    parts: Sequence[HFCausalLMStage], mesh_or_group: MeshOrGroup
) -> None:
    """See :func:`torch_pipelining_ext.hf.reduce_expert_parallel_gradients`."""
    layout = layout_of(mesh_or_group, parts)  # checks the experts' sharding
    experts = [
        (part.get_parameter(name), shard)
        for part in parts
        for name, shard in expert_parameters(part).items()
    ]
    # experts whose gradients a hook divided by dp x ep already: summed over dp only
    hooked = [p for p, shard in experts if shard.divided_by_hook]
    reduce_gradients(
        parts,
        layout,
        sharded=[p for p, shard in experts if not shard.divided_by_hook],
        ignore=hooked,
    )
    all_reduce_divided(hooked, layout.dp, 1)
    for _, shard in experts:
        shard.grads_pending = False


def fully_shard_replicated(
    parts: Sequence[HFCausalLMStage],
    mesh: ParallelLayout | DeviceMesh,
    **fsdp_kwargs: Any,
) -> None:
    """See :func:`torch_pipelining_ext.hf.fully_shard_replicated`."""
    if not isinstance(mesh, (ParallelLayout, DeviceMesh)):
        raise TypeError(
            "mesh must be the job's layout or a DeviceMesh (the job's mesh, or its 'ep' "
            f"dimension), got {type(mesh).__name__}"
        )
    layout = layout_of(mesh, parts)
    if layout.data_mesh is None:
        raise ValueError(
            "the layout has no data-parallel mesh for FSDP: pass the job's mesh, or a "
            "layout built from one"
        )
    size = layout.data_size
    for part in parts:
        experts = [
            p for name, p in part.named_parameters() if is_expert_parameter(part, name)
        ]
        fully_shard(
            part, mesh=layout.data_mesh, ignored_params=set(experts), **fsdp_kwargs
        )
        for p in experts:
            p.register_hook(functools.partial(_divided, size))
    for _, shard in sharded_experts(parts):
        shard.divided_by_hook = True
        shard.needs_reduction = layout.dp is not None


def _divided(size: int, grad: torch.Tensor) -> torch.Tensor:
    return grad / size
