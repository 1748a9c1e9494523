"""The whole model's gradient norm, and clipping by it, over PP x DP x EP.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF global
gradient norm]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch_pipelining_ext._parallel_layout import ParallelLayout
from torch_pipelining_ext.hf._arrival import group_device
from torch_pipelining_ext.hf._expert_parallel import expert_parameters, sharded_experts
from torch_pipelining_ext.hf._mesh import layout_of, MeshOrGroup, pipeline_group
from torch_pipelining_ext.hf._training import check_reduced


if TYPE_CHECKING:
    from torch_pipelining_ext.hf._stage import HFCausalLMStage


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF global gradient norm]
# torch.nn.utils.clip_grad_norm_ over a rank's stages sees only those stages
# and its slice of the experts, and counts what every data-parallel rank
# holds once per rank: every rank would clip by another, wrong norm.  The
# norm of the whole model's gradient is a sum over the pieces of the
# gradient, each counted once (for norm_type inf, a max).  A rank adds the
# pieces it *owns*:
#   * a parameter replicated over the data ranks (dp x ep): owned by the
#     rank at dp = 0, ep = 0 of its stage;
#   * a sharded expert tensor (different on every ep rank, replicated over
#     dp): owned by the rank at dp = 0;
#   * an FSDP2 (DTensor) gradient: its local shard, owned where the rank's
#     coordinate is 0 on every mesh dimension the DTensor replicates over,
#     and on the data dimensions its mesh does not cover;
#   * a weight tied across stages (GPT-2's embedding and head, kept equal by
#     sync_tied_gradients): only under its first name.
# The owned sums are then added over the ep group, the dp group and the
# pipeline group: one all-reduce of one float64 number per group kind (none
# for a dimension of one rank), after which every rank holds the same total
# and scales every gradient it holds (replicas and shards alike) by the same
# factor, as torch.nn.utils.clip_grad_norm_ does: max_norm / (total + 1e-6),
# at most 1.  A non-finite total raises on every rank with
# error_if_nonfinite, else scales by it as torch does.


def clip_grad_norm_(
    parts: Sequence[HFCausalLMStage],
    max_norm: float,
    norm_type: float | str,
    mesh: MeshOrGroup,
    pp_group: dist.ProcessGroup | None,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """See :func:`torch_pipelining_ext.hf.clip_grad_norm_`."""
    total = total_grad_norm(parts, norm_type, mesh, pp_group, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: the total norm of order {float(norm_type)} "
            "of the whole model's gradients is non-finite, so it cannot be clipped. To disable this error and "
            "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [
        _local(p.grad)
        for part in parts
        for p in part.parameters()
        if p.grad is not None
    ]
    _scale(grads, coef, foreach)
    return total


def total_grad_norm(
    parts: Sequence[HFCausalLMStage],
    norm_type: float | str,
    mesh: MeshOrGroup,
    pp_group: dist.ProcessGroup | None,
    foreach: bool | None,
) -> torch.Tensor:
    """The norm of the whole model's gradient (the same on every rank)."""
    if not parts:
        raise ValueError("parts is empty: pass this rank's stage modules")
    p_norm = float(norm_type)
    if not p_norm > 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    check_reduced(parts)
    layout = layout_of(mesh if mesh is not None else _shards_group(parts), parts)
    pp = pipeline_group(layout if mesh is not None else None, pp_group, parts)
    owned = _owned_gradients(parts, layout)
    if owned:
        device = owned[0].device
    elif dist.is_initialized():
        any_group = layout.ep or pp or dist.group.WORLD
        assert any_group is not None  # WORLD, once initialized
        device = group_device(any_group)
    else:  # one process, nothing to count
        device = torch.device("cpu")
    if owned:
        local = torch.nn.utils.get_total_norm(owned, p_norm, False, foreach).double()
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
    inf = math.isinf(p_norm)
    value = local if inf else local**p_norm
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for group in (layout.ep, layout.dp, pp):
        if group is not None:
            value = value.to(group_device(group))
            dist.all_reduce(value, op=op, group=group)
    total = value if inf else value ** (1.0 / p_norm)
    dtype = owned[0].dtype if owned else torch.float32
    logger.debug(
        "rank %s: owned %d gradients, total norm %s", _rank(), len(owned), total.item()
    )
    return total.to(dtype)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _shards_group(parts: Sequence[nn.Module]) -> dist.ProcessGroup | None:
    """The expert-parallel group the stages' experts are sharded over (``None``: no experts)."""
    shards = sharded_experts(parts)
    return shards[0][1].group if shards else None


def _coordinate(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _owned_gradients(
    parts: Sequence[nn.Module], layout: ParallelLayout
) -> list[torch.Tensor]:
    """The (local) gradients this rank counts (see ``[Note: HF global gradient norm]``)."""
    on_first_dp = _coordinate(layout.dp) == 0
    on_first_data = on_first_dp and _coordinate(layout.ep) == 0
    owned = []
    for part in parts:
        experts = expert_parameters(part)
        later_names = {
            n for names, _, _ in getattr(part, "tied_groups", ()) for n in names[1:]
        }
        for name, p in part.named_parameters():
            if p.grad is None or name in later_names:
                continue
            if isinstance(p.grad, DTensor):
                if _owns_dtensor(p.grad, layout):
                    owned.append(p.grad.to_local())
            elif on_first_dp if name in experts else on_first_data:
                owned.append(p.grad)
    return owned


def _owns_dtensor(grad: Any, layout: ParallelLayout) -> bool:
    """Whether this rank counts its shard of ``grad``: coordinate 0 on every
    dimension the DTensor replicates over and on every data dimension its
    mesh does not cover."""
    mesh = grad.device_mesh
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate) and mesh.get_local_rank(dim) != 0:
            return False
    covered = set(mesh.mesh.flatten().tolist())
    for group in (layout.ep, layout.dp):
        if (
            group is not None
            and not set(dist.get_process_group_ranks(group)) <= covered
        ):
            if dist.get_rank(group) != 0:
                return False
    return True


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _scale(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Multiply every gradient by ``coef`` in place (``torch._foreach_mul_`` per
    device and dtype, as torch's clipping does, unless ``foreach=False``)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), tensors in by_kind.items():
        factor = coef.to(device=device, dtype=dtype)
        if foreach is False or device.type not in ("cpu", "cuda"):
            for g in tensors:
                g.mul_(factor)
        else:
            torch._foreach_mul_(tensors, factor)
