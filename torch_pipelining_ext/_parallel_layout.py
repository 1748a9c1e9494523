"""A job's parallel layout: its mesh and process groups, read once.

:class:`ParallelLayout` plays the part of FSDP2's ``DataParallelMeshInfo``
for pipeline, data and expert parallelism together: it is made once, from
``(pp, dp, ep)`` (:meth:`ParallelLayout.build`) or from what a caller passed
(:meth:`ParallelLayout.of`: a ``DeviceMesh``, a ``ProcessGroup``), and the
code that builds stages, exchanges tokens and reduces gradients reads its
fields instead of parsing a mesh again.  Public as
:class:`torch_pipelining_ext.launcher.ParallelLayout`; see
``[Note: job layout]``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_pipelining_ext import overlap


__all__ = ["MESH_DIM_NAMES", "ParallelLayout", "layout_problem"]

logger = logging.getLogger(__name__)

MESH_DIM_NAMES = ("pp", "dp", "ep")
"""The dimensions of a job's mesh, outermost first."""

# [Note: job layout]
# A job's ranks form a pp x dp x ep grid, expert parallelism innermost: the
# ranks of one expert-parallel group are neighbours (one node, where the
# all-to-alls are cheapest), the pipeline outermost.  Rank
# r = (i_pp * dp + i_dp) * ep + i_ep.  The data-parallel ranks of the loss and
# of FSDP are dp x ep (expert parallelism is carved out of data parallelism:
# every rank of an ep group trains on other tokens); the experts are sharded
# over ep and replicated over dp.  A mesh may leave a dimension out (the demo
# builds ("pp", "ep")); a dimension left out, or of one rank, has no group.


def layout_problem(
    world_size: int, pp: int = 1, dp: int = 1, ep: int = 1
) -> str | None:
    """What is wrong with the layout ``pp x dp x ep`` on ``world_size`` ranks
    (``None``: nothing); no process group is needed to ask."""
    sizes = {"pp": pp, "dp": dp, "ep": ep}
    bad = [
        f"{name}={size}"
        for name, size in sizes.items()
        if not isinstance(size, int) or size < 1
    ]
    if bad:
        return f"every dimension of the layout must be a positive integer, got {', '.join(bad)}"
    if pp * dp * ep != world_size:
        return (
            f"the layout pp={pp} x dp={dp} x ep={ep} needs {pp * dp * ep} ranks, "
            f"but the job has {world_size}"
        )
    return None


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _several(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """``group``, or ``None`` for a group of one rank (nothing to exchange)."""
    return group if dist.get_world_size(group) > 1 else None


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in a job's ``pp x dp x ep`` layout.

    A group is ``None`` where its dimension is absent or has one rank, so that
    code communicates only where there is something to exchange.

    Attributes:
        mesh: the mesh it was read from (``None``: read from groups).
        pipeline: the pipeline group, of one rank included (``None``: no
            pipeline dimension given), as ``pipeline_module_split`` takes it.
        dp: the replicas of this rank's experts.
        ep: the expert-parallel group (experts differ between its ranks).
        data: every rank with its own data, ``dp x ep`` (the loss, FSDP).
        data_mesh: ``data`` as a 1-D mesh (``"dp_ep"``, or the one of the two
            dimensions the mesh has), for FSDP; ``None`` without a mesh.
    """

    mesh: DeviceMesh | None = None
    pipeline: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    data: dist.ProcessGroup | None = None
    data_mesh: DeviceMesh | None = None

    @property
    def pp(self) -> dist.ProcessGroup | None:
        """The pipeline group, ``None`` for a pipeline of one rank."""
        return None if self.pipeline is None else _several(self.pipeline)

    @property
    def ep_twin(self) -> dist.ProcessGroup | None:
        """The twin of ``ep`` (see [Note: twin groups]), over which the
        backward side of an overlapped OVERLAP_F_B communicates; ``None``
        until :meth:`make_ep_twin` (or :meth:`build`) made it."""
        return None if self.ep is None else overlap.twin_group(self.ep)

    @property
    def data_size(self) -> int:
        """The number of ranks with their own data (``dp x ep``)."""
        return _size(self.data)

    @classmethod
    def build(
        cls, pp: int = 1, dp: int = 1, ep: int = 1, *, device_type: str | None = None
    ) -> ParallelLayout:
        """The job's layout over a new ``("pp", "dp", "ep")`` mesh, with the
        flattened data-parallel mesh and the EP twin; a collective over the
        default process group.

        Args:
            pp, dp, ep: the sizes; their product is the world size.
            device_type: ``"cuda"`` or ``"cpu"``; default: ``"cuda"`` when the
                default process group is NCCL's, else ``"cpu"``.

        Raises:
            ValueError: the layout does not fit the world (see :func:`layout_problem`).
        """
        problem = layout_problem(dist.get_world_size(), pp, dp, ep)
        if problem is not None:
            raise ValueError(problem)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(
            device_type, (pp, dp, ep), mesh_dim_names=MESH_DIM_NAMES
        )
        layout = cls.of(mesh)
        layout.make_ep_twin()
        logger.debug(
            "rank %d: layout pp=%d x dp=%d x ep=%d, coordinates %s",
            dist.get_rank(),
            pp,
            dp,
            ep,
            mesh.get_coordinate(),
        )
        return layout

    @classmethod
    def of(
        cls,
        mesh_or_group: ParallelLayout | DeviceMesh | dist.ProcessGroup | None,
        *,
        alone: Literal["pp", "ep"] = "ep",
    ) -> ParallelLayout:
        """The layout of what a caller passed: a layout (returned as it is),
        a mesh whose dimensions are named from ``("pp", "dp", "ep")`` in that
        order, a 1-D mesh, a ``ProcessGroup``, or ``None`` (one rank).

        A group, or a 1-D mesh without a name, is the dimension ``alone``
        says.  The first call for a mesh with ``"dp"`` and ``"ep"`` is a
        collective over the default process group (it makes the flattened
        data dimension's groups); a mesh's layout is read once and kept.

        Raises:
            TypeError: ``mesh_or_group`` is of another type.
            ValueError: a mesh with other dimension names.
        """
        if mesh_or_group is None or isinstance(mesh_or_group, ParallelLayout):
            return mesh_or_group or cls()
        if isinstance(mesh_or_group, dist.ProcessGroup):
            if alone == "pp":
                return cls(pipeline=mesh_or_group)
            ep = _several(mesh_or_group)
            return cls(ep=ep, data=ep)
        if not isinstance(mesh_or_group, DeviceMesh):
            raise TypeError(
                "expected a DeviceMesh, a ProcessGroup or a ParallelLayout, got "
                f"{type(mesh_or_group).__name__}"
            )
        return _cache.get(mesh_or_group, alone)

    def make_ep_twin(self) -> None:
        """Give ``ep`` its twin (:func:`torch_pipelining_ext.overlap.create_twin_group`),
        unless it has one or there is no ``ep``; a collective over the
        default process group where ``ep`` has none yet."""
        if self.ep is not None and self.ep_twin is None:
            overlap.create_twin_group(self.ep)


def _read_mesh(mesh: DeviceMesh, alone: str) -> ParallelLayout:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1 and not names:
        names = (alone,)
    if not names or names != tuple(n for n in MESH_DIM_NAMES if n in names):
        raise ValueError(
            f"the mesh's dimensions must be named from {MESH_DIM_NAMES} in that order "
            f"(as torch_pipelining_ext.launcher.parallel_layout makes it), got {names or mesh.ndim}"
        )

    def dim(name: str) -> DeviceMesh | None:
        return (mesh if mesh.ndim == 1 else mesh[name]) if name in names else None

    pp, dp, ep = (dim(name) for name in MESH_DIM_NAMES)
    if dp is not None and ep is not None:
        data_mesh: DeviceMesh | None = mesh["dp", "ep"]._flatten("dp_ep")
    else:
        data_mesh = dp or ep
    return ParallelLayout(
        mesh=mesh,
        pipeline=None if pp is None else pp.get_group(),
        dp=None if dp is None else _several(dp.get_group()),
        ep=None if ep is None else _several(ep.get_group()),
        data=None if data_mesh is None else _several(data_mesh.get_group()),
        data_mesh=data_mesh,
    )


class _LayoutCache:
    """Layouts by mesh object, read once per mesh (not per step).

    Keyed by identity: two meshes over the same ranks compare equal but may
    hold different groups.  The meshes stay alive with their layouts, as they
    do in torch's own mesh registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_mesh: dict[tuple[int, str], ParallelLayout] = {}

    def get(self, mesh: DeviceMesh, alone: str) -> ParallelLayout:
        key = (id(mesh), alone if mesh.ndim == 1 else "")  # alone: see of()
        with self._lock:
            found = self._by_mesh.get(key)
        if found is None:
            found = _read_mesh(mesh, alone)
            with self._lock:
                self._by_mesh[key] = found
        return found


_cache = _LayoutCache()
