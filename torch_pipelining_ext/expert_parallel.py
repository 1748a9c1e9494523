"""Training helpers for a model of one's own with expert parallelism (public API).

With expert parallelism each rank holds some of every MoE layer's experts
and a copy of everything else (embedding, attention, routers, norms, head).
The schedule leaves each rank with the gradients of its own tokens' loss;
before clipping and the optimizer, the copies must agree again:
:func:`reduce_expert_parallel_gradients` averages the replicated weights'
gradients over the ranks that train on different data (``ep``, times ``dp``)
and sums each expert's over its data-parallel replicas (see
``[Note: expert-parallel gradient reduction]``)::

    mesh = launcher.parallel_layout(pp=2, ep=2)  # or its .mesh
    ...
    schedule.step(inputs, target=labels, losses=losses)
    expert_parallel.reduce_expert_parallel_gradients(
        parts, mesh, sharded=lambda name, p: ".experts." in name
    )
    optimizer.step()

It is what :func:`torch_pipelining_ext.hf.reduce_expert_parallel_gradients`
does for Hugging Face stages (which knows their experts); the repository's
``examples/custom_moe.py`` uses it for an MoE of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torch_pipelining_ext import _ep_gradients
from torch_pipelining_ext._parallel_layout import ParallelLayout


__all__ = ["reduce_expert_parallel_gradients"]


def reduce_expert_parallel_gradients(
    modules: nn.Module | Sequence[nn.Module],
    mesh_or_group: ParallelLayout | DeviceMesh | dist.ProcessGroup | None,
    *,
    sharded: Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter],
    ignore: Iterable[nn.Parameter] = (),
) -> None:
    """Reduce the gradients of an expert-parallel model after a step.

    Every rank with its own data (the ``dp x ep`` ranks of ``mesh_or_group``)
    calls it after ``schedule.step`` and before clipping and the optimizer.
    It assumes that each rank's loss is the mean over its own tokens and that
    the ranks' batches have one size (the global loss is the mean of the
    ranks' losses); then every gradient afterwards is the global loss's:

    * parameters not in ``sharded`` (replicated on every data rank) are
      averaged over the ``dp x ep`` ranks;
    * parameters in ``sharded`` (this rank's experts, which already received
      the gradients of the EP peers' tokens through the all-to-all's
      backward) are summed over the ``dp`` ranks and divided by ``dp x ep``.

    Parameters that do not require gradients, DTensor parameters (FSDP2
    reduces its own) and those in ``ignore`` are left alone; a parameter without a gradient counts
    as zeros (it gets one), so every rank issues the same collectives: one
    all-reduce per group, over one float32 buffer.

    Args:
        modules: this rank's stage modules (or one module).
        mesh_or_group: the job's layout
            (:func:`torch_pipelining_ext.launcher.parallel_layout`) or mesh
            (its ``("pp", "dp", "ep")`` ``mesh``, or ``("pp",
            "ep")``), a 1-D ``"ep"`` or ``"dp"`` mesh, or the expert-parallel
            ``ProcessGroup`` alone (no ``dp``); ``None``: one rank, nothing
            to do.
        sharded: which parameters are sharded over the EP ranks: a predicate
            ``sharded(name, param)`` (``name`` as in ``named_parameters()``
            of the module holding it), or the parameters themselves.
        ignore: parameters to leave alone (reduced some other way).

    Raises:
        TypeError: ``mesh_or_group`` or ``modules`` is of another type.
        ValueError: a parameter in ``sharded`` or ``ignore`` is not one of
            ``modules``', or the mesh's dimensions are not named from
            ``("pp", "dp", "ep")``.
    """
    layout = ParallelLayout.of(mesh_or_group)
    _ep_gradients.reduce_gradients(modules, layout, sharded, ignore)
