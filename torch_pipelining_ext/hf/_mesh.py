"""The job's layout as the functions of :mod:`torch_pipelining_ext.hf` read
it: what their callers pass, converted once into a
:class:`~torch_pipelining_ext.launcher.ParallelLayout` and checked against
the stages.

Private helper of :mod:`torch_pipelining_ext.hf`; the layout is
``[Note: job layout]`` in :mod:`torch_pipelining_ext._parallel_layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torch_pipelining_ext._parallel_layout import ParallelLayout
from torch_pipelining_ext.hf._expert_parallel import sharded_experts


__all__: list[str] = []

MeshOrGroup = ParallelLayout | DeviceMesh | dist.ProcessGroup | None
"""What the functions of :mod:`torch_pipelining_ext.hf` take for the layout."""


def layout_of(
    mesh_or_group: MeshOrGroup, parts: Sequence[nn.Module] = ()
) -> ParallelLayout:
    """The layout of ``mesh_or_group`` (a group or 1-D mesh alone: the
    expert-parallel one, no ``dp``), checked against how ``parts``' experts
    are sharded."""
    layout = ParallelLayout.of(mesh_or_group)
    _check_shards(parts, layout.ep)
    return layout


def stage_layout(
    pp_mesh_or_group: MeshOrGroup, ep_group: DeviceMesh | dist.ProcessGroup | None
) -> ParallelLayout:
    """The layout ``pipeline_hf_causal_lm`` builds stages for: a group or 1-D
    mesh alone is the pipeline's, ``ep_group`` its expert-parallel group."""
    layout = ParallelLayout.of(pp_mesh_or_group, alone="pp")
    # None: the default process group is the pipeline's (stage_split's rule)
    if layout.pipeline is None and pp_mesh_or_group is not None:
        raise ValueError(
            "the mesh has no 'pp' dimension (torch_pipelining_ext.launcher.parallel_layout's "
            f"has ('pp', 'dp', 'ep')): got {layout.mesh and layout.mesh.mesh_dim_names}"
        )
    if ep_group is None:
        return layout
    if layout.ep is not None or (layout.mesh is not None and layout.mesh.ndim > 1):
        raise ValueError(
            "ep_group given twice: as the 'ep' dimension of the mesh and as ep_group"
        )
    if isinstance(ep_group, DeviceMesh) and ep_group.ndim != 1:
        raise ValueError(f"ep_group must be a 1-D mesh, got {ep_group.ndim} dimensions")
    ep = ParallelLayout.of(ep_group)
    return dataclasses.replace(layout, ep=ep.ep, data=ep.data, data_mesh=ep.data_mesh)


def _check_shards(parts: Sequence[nn.Module], ep: dist.ProcessGroup | None) -> None:
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


def pipeline_group(
    layout: ParallelLayout | None,
    pp_group: dist.ProcessGroup | None,
    parts: Sequence[nn.Module],
) -> dist.ProcessGroup | None:
    """The pipeline group of ``layout`` or ``pp_group`` (``None``: every stage
    is on this rank)."""
    if layout is not None and pp_group is not None:
        raise ValueError("pass either mesh or pp_group, not both")
    if layout is not None:
        return layout.pp
    if pp_group is not None:
        return pp_group if dist.get_world_size(pp_group) > 1 else None
    stages: set[Any] = {getattr(p, "stage_index", None) for p in parts}
    num_stages = getattr(parts[0], "num_stages", None) if parts else None
    if num_stages is not None and stages != set(range(num_stages)):
        raise ValueError(
            f"this rank holds stages {sorted(stages)} of {num_stages}: pass mesh= (or pp_group=), the pipeline "
            "ranks hold the other stages"
        )
    return None
