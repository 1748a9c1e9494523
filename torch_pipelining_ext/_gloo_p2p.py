"""Pipeline P2P on gloo.

Upstream files: ``torch/distributed/pipelining/stage.py``
(``_PipelineStageBase._get_init_p2p_neighbors_ops``) and
``torch/distributed/pipelining/schedules.py`` (``_batch_p2p``).

Pipelining was run on NCCL; on gloo it fails in two places: torch 2.9's
stage handshake, and a rank's send to itself on every release.

The stage initialisation handshake
----------------------------------

Before the first step, schedules (on torch 2.9 single-stage ones too)
exchange one dummy tensor with each neighbouring stage so that the P2P
communicators exist.  On gloo this handshake fails twice over on torch 2.9:

* it sends ``torch.tensor(stage_index)`` -- int64 -- into a float32 receive
  buffer.  NCCL moves bytes and does not notice; gloo checks sizes and aborts
  with "Received data size doesn't match expected size".  Upstream sends
  float32 since 2.10.
* a V-schedule (``ScheduleDualPipeV``, ``ScheduleZBVZeroBubble``) has two
  neighbouring stages on one rank, and the handshake sends from the rank to
  itself; gloo has no connection to itself ("Pair is not connected").  The
  runtime never sends between such stages (they hand tensors over locally),
  so the handshake need not either.  torch 2.10 and 2.11 run the handshake
  for every stage; 2.12 - 2.14 warm up ``PipelineStage`` with a vote protocol
  and keep the handshake for other stage types (those ``pipeline()`` builds);
  2.15 has no handshake, and the patch does not apply there.

:func:`_make_get_init_p2p_neighbors_ops` converts the handshake tensors to
float32 and drops the ops whose peer is the calling rank.

Send/receive between two stages of one rank
-------------------------------------------
The generic ``PipelineScheduleMulti`` loop (torch 2.9's
``ScheduleZBVZeroBubble``, and on every release the custom schedules built on
it, such as upstream's ``test_non_symmetric_stage_ids`` with stages 1 and 2
on one rank) exchanges activations and gradients between a rank's two
adjacent stages with a send and a receive to itself in one batch.  NCCL
copies; gloo fails ("Pair is not connected").  :func:`_make_batch_p2p` does
what NCCL does: within a batch, each send to the calling rank is copied into
the matching receive from it.  ``_PipelineScheduleRuntime`` hands such tensors
over locally and never builds these ops.  The probe runs torch's
``_batch_p2p`` on such a batch with a recording ``dist``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


__all__: list[str] = []


def _make_get_init_p2p_neighbors_ops(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    """Wrap ``_get_init_p2p_neighbors_ops``: float32 tensors, no op to the calling rank."""

    @functools.wraps(original)
    def _get_init_p2p_neighbors_ops(self: Any) -> Any:
        ops = [op for op in original(self) if op.group_peer != self.group_rank]
        for op in ops:
            if op.tensor.dtype != torch.float32:
                op.tensor = op.tensor.to(torch.float32)
        return ops

    return _get_init_p2p_neighbors_ops


def _make_batch_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``schedules._batch_p2p``: sends to the calling rank are copied into its receives."""

    @functools.wraps(original)
    def _batch_p2p(
        p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any
    ) -> list[dist.Work]:
        if not p2p_ops:
            return original(p2p_ops, *args, **kwargs)
        rank = dist.get_rank()
        to_self = [op for op in p2p_ops if op.peer == rank]
        if not to_self:
            return original(p2p_ops, *args, **kwargs)
        sends = [op for op in to_self if op.op is dist.isend]
        recvs = [op for op in to_self if op.op is dist.irecv]
        if len(sends) != len(recvs) or len(sends) + len(recvs) != len(to_self):
            raise RuntimeError(
                f"[rank {rank}] a P2P batch has {len(sends)} sends and {len(recvs)} receives with its "
                "own rank; they can only be matched within one batch"
            )
        for send, recv in zip(sends, recvs):
            if (
                send.tensor.shape != recv.tensor.shape
                or send.tensor.dtype != recv.tensor.dtype
            ):
                raise RuntimeError(
                    f"[rank {rank}] send to own rank of {send.tensor.dtype}{list(send.tensor.shape)} "
                    f"does not match the receive buffer {recv.tensor.dtype}{list(recv.tensor.shape)}"
                )
            with (
                torch.no_grad()
            ):  # receive buffers of activations are leaves that require grad
                recv.tensor.copy_(send.tensor)
        return original([op for op in p2p_ops if op.peer != rank], *args, **kwargs)

    return _batch_p2p
