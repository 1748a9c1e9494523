# mypy: allow-untyped-defs
"""The process groups the training functions of :mod:`torch_pipelining_ext.hf`
reduce over, read from the job's mesh or from the stages.

Private helper of :mod:`torch_pipelining_ext.hf`; the layout is
``[Note: job layout]`` in :mod:`torch_pipelining_ext.launcher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from torch_pipelining_ext import _ep_gradients
from torch_pipelining_ext._ep_gradients import _group_of, DataGroups
from torch_pipelining_ext.hf._expert_parallel import sharded_experts


__all__: list[str] = []


def data_groups(mesh_or_ep_group: Any, parts: Sequence[nn.Module] = ()) -> DataGroups:
    """The data-parallel groups of a mesh with ``"dp"``/``"ep"`` dimensions,
    a 1-D mesh, or an expert-parallel group alone (a ``ProcessGroup``: no
    ``dp``), checked against how ``parts``' experts are sharded."""
    groups = _ep_gradients.data_groups(mesh_or_ep_group)
    _check_shards(parts, groups.ep)
    return groups


def _check_shards(parts: Sequence[nn.Module], ep: Any) -> None:
    """The stages' experts are sharded over ``ep`` (or not at all without it)."""
    shards = [s for _, s in sharded_experts(parts)]
    if not shards:
        return
    size = 1 if ep is None else dist.get_world_size(ep)
    ranks = None if ep is None else dist.get_process_group_ranks(ep)
    for shard in shards:
        if shard.size != size or (
            ranks is not None and dist.get_process_group_ranks(shard.group) != ranks
        ):
            raise ValueError(
                f"{shard.fqn} is sharded over the expert-parallel ranks {dist.get_process_group_ranks(shard.group)}, "
                f"but the expert-parallel group given has the ranks {ranks or [dist.get_rank()]}: pass the mesh (or "
                "the 'ep' group) the stages were built with"
            )


def pipeline_group(mesh: Any, pp_group: Any, parts: Sequence[nn.Module]) -> Any:
    """The pipeline group (``None``: every stage is on this rank)."""
    if mesh is not None and pp_group is not None:
        raise ValueError("pass either mesh or pp_group, not both")
    if mesh is not None:
        if "pp" not in (mesh.mesh_dim_names or ()):
            return None
        return _group_of(mesh, "pp")
    if pp_group is not None:
        return pp_group if dist.get_world_size(pp_group) > 1 else None
    stages = {getattr(p, "stage_index", None) for p in parts}
    num_stages = getattr(parts[0], "num_stages", None) if parts else None
    if num_stages is not None and stages != set(range(num_stages)):
        raise ValueError(
            f"this rank holds stages {sorted(stages)} of {num_stages}: pass mesh= (or pp_group=), the pipeline "
            "ranks hold the other stages"
        )
    return None
