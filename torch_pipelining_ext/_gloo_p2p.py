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
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


__all__: list[str] = []


def _make_get_init_p2p_neighbors_ops(original: Callable[..., Any]) -> Callable[..., Any]:
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
    def _batch_p2p(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> list[dist.Work]:
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
            if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
                raise RuntimeError(
                    f"[rank {rank}] send to own rank of {send.tensor.dtype}{list(send.tensor.shape)} "
                    f"does not match the receive buffer {recv.tensor.dtype}{list(recv.tensor.shape)}"
                )
            with torch.no_grad():  # receive buffers of activations are leaves that require grad
                recv.tensor.copy_(send.tensor)
        return original([op for op in p2p_ops if op.peer != rank], *args, **kwargs)

    return _batch_p2p


class _ProbeOp:
    """Stands in for a ``dist.P2POp`` in :func:`_probe_self_p2p`."""

    def __init__(self, op: str, peer: int) -> None:
        self.op, self.peer, self.group_peer = op, peer, peer
        self.tensor = torch.zeros(1)
        self.group = types.SimpleNamespace(group_name="probe")
        self.tag = 0


def _probe_self_p2p() -> tuple[str, str]:
    """Run torch's ``_batch_p2p``, with a recording ``dist``, on a batch that
    sends to and receives from the calling rank (rank 0 here): does it hand
    those ops to the backend?"""
    from torch.distributed.pipelining import schedules

    from torch_pipelining_ext._patching import AlreadyUpstream, PatchNeeded

    fn = schedules._batch_p2p
    issued: list[Any] = []
    fake_dist = types.SimpleNamespace(
        isend="isend",
        irecv="irecv",
        batch_isend_irecv=lambda ops: issued.extend(ops) or [],
        get_rank=lambda *args, **kwargs: 0,
    )
    isolated = types.FunctionType(
        fn.__code__, {**fn.__globals__, "dist": fake_dist}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    isolated([_ProbeOp("isend", 0), _ProbeOp("irecv", 0)])
    if not issued:
        return AlreadyUpstream, "_batch_p2p keeps sends to the own rank away from the backend"
    return PatchNeeded, "_batch_p2p hands sends to the own rank to the backend (gloo: 'Pair is not connected')"


class _RecordedP2POp:
    """Stands in for ``dist.P2POp`` in the probe: records the op, talks to nobody."""

    recorded: list[tuple[torch.dtype, Any]]

    def __init__(self, op: Any, tensor: torch.Tensor, *args: Any, group_peer: Any = None, **kwargs: Any) -> None:
        self.recorded.append((tensor.dtype, group_peer))


class _ProbeStage:
    """The inputs of the handshake builder for a V-schedule middle stage.

    Stage 1 of three, on group rank 1 with stage 2 (the V's turn), stage 0 on
    group rank 0.  The attributes set here decide which ops are built; any
    other attribute the builder reads (the process groups, which torch 2.14
    keeps per direction) is only handed to ``P2POp`` and reads as ``None``.
    """

    stage_index = 1
    stage_index_to_group_rank = {0: 0, 1: 1, 2: 1}
    group_rank = 1
    is_first = False
    is_last = False
    device = torch.device("cpu")

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _recorded_handshake() -> list[tuple[torch.dtype, Any]] | None:
    """The (dtype, peer) of each op torch's handshake builder makes for a middle
    stage whose next stage is on the same rank (V-schedule); None without a handshake."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    fn = getattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", None)
    if fn is None:
        return None
    recorder = type("_Recorder", (_RecordedP2POp,), {"recorded": []})
    fake_dist = types.SimpleNamespace(P2POp=recorder, isend="isend", irecv="irecv")
    isolated = types.FunctionType(
        fn.__code__, {**fn.__globals__, "dist": fake_dist}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    isolated(_ProbeStage())
    if not recorder.recorded:
        raise RuntimeError("_get_init_p2p_neighbors_ops built no P2P ops for a middle stage")
    return recorder.recorded


def _probe_init_p2p_handshake() -> tuple[str, str]:
    """Run torch's handshake builder, with a recording ``P2POp``, for a middle
    stage whose next stage is on the same rank (V-schedule)."""
    from torch_pipelining_ext._patching import AlreadyUpstream, PatchNeeded

    recorded = _recorded_handshake()
    if recorded is None:
        return AlreadyUpstream, "not applicable: torch has no stage-init P2P handshake"
    stage = _ProbeStage()
    problems = []
    dtypes = {dtype for dtype, _ in recorded}
    if len(dtypes) > 1:
        problems.append(f"mixes {sorted(str(d) for d in dtypes)}")
    if any(peer == stage.group_rank for _, peer in recorded):
        problems.append("sends to its own rank")
    if not problems:
        return AlreadyUpstream, "handshake uses one dtype and skips same-rank neighbours"
    return PatchNeeded, f"stage init handshake {' and '.join(problems)}; gloo aborts"
