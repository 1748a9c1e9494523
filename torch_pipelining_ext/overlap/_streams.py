"""Accelerator streams of an overlapped OVERLAP_F_B action.

See [Note: streams of an overlapped action].  On CPU (gloo) there are no
streams and the plan is ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


__all__: list[str] = []

# [Note: streams of an overlapped action]
# With a single stream, a collective issued by one thread would be queued
# behind the kernels the other thread queued before it, so one thread's
# communication would wait for the other's compute.  So, through the
# device-neutral torch.accelerator / torch.Stream API:
# * One stream per thread, chosen by stage: the thread running a sub-action of
#   stage s makes the stage's own stream current (one stream per stage and
#   schedule, created once).  By stage rather than by thread because autograd
#   runs each backward kernel on the stream of its forward kernel: a backward
#   is only off the forward thread's stream if its forward ran on another
#   stream, and the two sub-actions of an OVERLAP_F_B are on different stages
#   in every built-in schedule (a CSV pair on one stage shares the stream:
#   correct, not overlapped on the device).
# * Joined to the caller's stream at both ends: before either thread starts,
#   both streams wait for the caller's current stream; before the action
#   returns, the caller's stream waits for both, so everything after the
#   action (sends, plain actions, the optimizer) is ordered after it.
# * Allocator safety: the caching allocator hands a freed block to the next
#   allocation on the stream it was allocated on.  Within an action each pool
#   is allocated from by one thread only, and the caller's stream not at all,
#   so a block freed during the action cannot be reused under a kernel still
#   reading it.  Tensors handed locally between the two stages of a
#   V-schedule rank are used later on the consumer stage's stream, so they
#   are record_stream-ed on it.
# * Collectives issued inside a sub-action queue behind that thread's own
#   kernels only; the communication marks keep two threads from issuing
#   collectives at once.


class _StreamPlan:
    """The streams of one overlapped action: the caller's, and one per side.

    Args:
        caller: the calling thread's current stream.
        stage_streams: stage index -> that stage's stream, for every local stage.
        fwd_stage: stage of the forward sub-action.
        bwd_stage: stage of the backward sub-action.
        set_stream: makes a stream current on the calling thread.
    """

    def __init__(
        self,
        caller: Any,
        stage_streams: dict[int, Any],
        fwd_stage: int,
        bwd_stage: int,
        set_stream: Callable[[Any], None],
    ) -> None:
        self.caller = caller
        self.stage_streams = stage_streams
        self.side_streams = (stage_streams[fwd_stage], stage_streams[bwd_stage])
        self._set_stream = set_stream

    @classmethod
    def for_action(
        cls, state: Any, stages: dict[int, Any], fwd: _Action, bwd: _Action
    ) -> _StreamPlan | None:
        """The plan for this action, or None on CPU.

        ``state.stage_streams`` keeps the streams of the schedule's stages.
        """
        device = getattr(stages[fwd.stage_index], "device", None)
        # a stage may hold "cuda:0" as given
        device = None if device is None else torch.device(device)
        if device is None or device.type == "cpu":
            return None
        if not torch.accelerator.is_available():
            return None
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None  # an accelerator is available
        if accelerator.type != device.type:
            return None
        if state.stage_streams is None:  # one stream per stage, created once
            state.stage_streams = {idx: torch.Stream(device=device) for idx in stages}
        return cls(
            torch.accelerator.current_stream(device),
            state.stage_streams,
            fwd.stage_index,
            bwd.stage_index,
            torch.accelerator.set_stream,
        )

    def start(self) -> None:
        """Both side streams wait for the work queued on the caller's stream."""
        for s in self.side_streams:
            s.wait_stream(self.caller)

    @contextlib.contextmanager
    def current(self, side: int) -> Iterator[None]:
        """Make ``side``'s stream current on this thread."""
        self._set_stream(self.side_streams[side])
        try:
            yield
        finally:
            self._set_stream(self.caller)

    def join(self) -> None:
        """The caller's stream waits for everything both sides queued."""
        for s in self.side_streams:
            self.caller.wait_stream(s)

    def record_handoffs(
        self, stages: dict[int, Any], fwd: _Action, bwd: _Action
    ) -> None:
        """``record_stream`` tensors handed to a local neighbour, on its stream."""
        handoffs = (
            (fwd.stage_index + 1, "args_recv_info", fwd.microbatch_index),
            (bwd.stage_index - 1, "grad_recv_info", bwd.microbatch_index),
        )
        for consumer_idx, infos_attr, mb in handoffs:
            consumer = stages.get(consumer_idx)
            if consumer is None:
                continue
            stream = self.stage_streams.get(consumer_idx, self.caller)
            for info in getattr(consumer, infos_attr, {}).get(mb, ()):
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor) and buffer.device.type != "cpu":
                    buffer.record_stream(stream)
