"""Pipeline P2P on gloo (torch 2.9).

Upstream files: ``torch/distributed/pipelining/stage.py``
(``_PipelineStageBase._get_init_p2p_neighbors_ops``) and
``torch/distributed/pipelining/schedules.py`` (``_batch_p2p``).

torch 2.9's multi-stage schedules were run on NCCL only; on gloo they fail in
two places, which keeps a CPU test suite from running any of them.

The stage initialisation handshake
----------------------------------

Before the first step, multi-stage schedules exchange one dummy tensor with
each neighbouring stage so that the P2P communicators exist.  On gloo this
handshake fails twice over on torch 2.9:

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
torch 2.9 runs ``ScheduleZBVZeroBubble`` (a V-schedule) with the generic
``PipelineScheduleMulti`` loop, which exchanges activations and gradients
between the rank's two adjacent stages with a send and a receive to itself in
one batch.  NCCL copies; gloo fails as above.  :func:`_make_batch_p2p` does
what NCCL does: within a batch, each send to the calling rank is copied into
the matching receive from it.  torch 2.10+ runs every multi-stage schedule on
``_PipelineScheduleRuntime``, which hands such tensors over locally.
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


def _probe_self_p2p() -> tuple[str, str]:
    """Does a V-schedule still run on the generic loop that sends to its own rank?"""
    from torch.distributed.pipelining import schedules

    from torch_pipelining_ext._patching import AlreadyUpstream, PatchNeeded

    if issubclass(schedules.ScheduleZBVZeroBubble, schedules._PipelineScheduleRuntime):
        return AlreadyUpstream, "V-schedules run on _PipelineScheduleRuntime, which hands tensors over locally"
    if not issubclass(schedules.ScheduleZBVZeroBubble, schedules.PipelineScheduleMulti):
        raise RuntimeError("unrecognised ScheduleZBVZeroBubble base classes")
    return PatchNeeded, "ScheduleZBVZeroBubble's loop sends to its own rank between its two stages"


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
