# mypy: allow-untyped-defs
"""The process groups the training functions of :mod:`torch_pipelining_ext.hf`
reduce over, read from the job's mesh or from the stages.

Private helper of :mod:`torch_pipelining_ext.hf`; the layout is
``[Note: job layout]`` in :mod:`torch_pipelining_ext.launcher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from torch_pipelining_ext import launcher
from torch_pipelining_ext.hf._expert_parallel import sharded_experts


__all__: list[str] = []


@dataclass(frozen=True)
class DataGroups:
    """The ranks that hold the same stages and train on different data:
    ``ep`` (the experts' group: experts differ between its ranks), ``dp``
    (the experts' replicas), ``data`` (all of them, ``dp x ep``) and its
    ``data_mesh`` (for FSDP); a dimension of one rank is ``None``."""

    ep: Any = None
    dp: Any = None
    data: Any = None
    data_mesh: Any = None

    @property
    def data_size(self) -> int:
        return 1 if self.data is None else dist.get_world_size(self.data)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else dist.get_world_size(self.dp)


def _is_mesh(x: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(x, DeviceMesh)


def _group_of(mesh: Any, name: str) -> Any:
    """The group of ``mesh``'s dimension ``name``, or ``None`` where it is
    missing or of one rank."""
    if name not in (mesh.mesh_dim_names or ()):
        return None
    sub = mesh[name]
    return sub.get_group() if sub.size() > 1 else None


def data_groups(mesh_or_ep_group: Any, parts: Sequence[nn.Module] = ()) -> DataGroups:
    """The data-parallel groups of a mesh with ``"dp"``/``"ep"`` dimensions,
    or of an expert-parallel group alone (a ``ProcessGroup`` or 1-D mesh:
    no ``dp``)."""
    if _is_mesh(mesh_or_ep_group) and mesh_or_ep_group.ndim > 1:
        mesh = mesh_or_ep_group
        names = mesh.mesh_dim_names or ()
        if "ep" not in names and "dp" not in names:
            raise ValueError(
                f"the mesh has neither an 'ep' nor a 'dp' dimension (its dimensions: {names})"
            )
        data_mesh = launcher.data_parallel_mesh(mesh)
        ep, dp = _group_of(mesh, "ep"), _group_of(mesh, "dp")
        _check_shards(parts, ep)
        data = data_mesh.get_group() if data_mesh.size() > 1 else None
        return DataGroups(ep=ep, dp=dp, data=data, data_mesh=data_mesh)
    if _is_mesh(mesh_or_ep_group):
        mesh = mesh_or_ep_group
        name = (mesh.mesh_dim_names or (None,))[0]
        group = mesh.get_group() if mesh.size() > 1 else None
        if name == "pp":  # a pipeline alone: no data-parallel ranks
            _check_shards(parts, None)
            return DataGroups()
        if name == "dp":  # data parallelism alone: experts (if any) are not sharded
            _check_shards(parts, None)
            return DataGroups(dp=group, data=group, data_mesh=mesh)
        _check_shards(parts, group)
        return DataGroups(ep=group, data=group, data_mesh=mesh)
    group = mesh_or_ep_group
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    _check_shards(parts, group)
    return DataGroups(ep=group, data=group)


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
