"""A bounded check that every rank of a group has reached the same call, and
the device a group's collectives take their tensors on.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF
collective arrival]``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
import torch
import torch.distributed as dist


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: HF collective arrival]
# ``CausalLMLoss.set_labels(labels, group=ep)`` is a collective over the
# expert-parallel group.  A rank that skips it does not fail: it goes on into
# the schedule, whose collectives pair up with the all-reduce of the ranks
# that did call it, and every rank waits until the process group's timeout.
# Before its all-reduce each rank therefore announces the call in the
# default store (``<prefix>/<group>/<call number>/<rank>``) and waits, for
# a bounded time, for the other ranks' keys; on timeout it raises, naming the
# ranks that did not arrive, without having issued any collective, so the
# process group stays usable.  The torch launcher then stops the other
# ranks.  Each rank deletes its key of two calls ago: by then every rank has
# passed the wait that read it.  The call numbers are per process and group
# (like the group's own collective sequence), not per loss object: a new
# CausalLMLoss on the same group must not meet its predecessors' keys.


class GroupArrival:
    """Counts this process's calls of ``what`` per group and checks, before
    each, that every rank of the group makes the same call (see ``[Note: HF
    collective arrival]``).  One per collective call site, at module level."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.calls: dict[str, int] = {}

    def wait(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        store = dist.distributed_c10d._get_default_store()
        name = group.group_name
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        prefix = f"torch_pipelining_ext/{self.what}/{name}"
        store.set(f"{prefix}/{call}/{me}", "1")
        if call >= 2:
            store.delete_key(f"{prefix}/{call - 2}/{me}")
        others = [r for r in ranks if r != me]
        keys = [f"{prefix}/{call}/{r}" for r in others]
        try:
            store.wait(keys, timeout)
        except Exception as error:  # the store's timeout error (DistStoreError)
            missing = [r for r, k in zip(others, keys) if not store.check([k])]
            if not missing:
                raise
            store.delete_key(f"{prefix}/{call}/{me}")
            self.calls[name] = (
                call  # as if not called: the ranks' call numbers stay aligned
            )
            raise RuntimeError(
                f"rank {me}: {self.what} is a collective over the process group of ranks {ranks}, "
                f"but ranks {missing} did not call it within {timeout.total_seconds():g} s (call {call} "
                "on this rank): call it on every rank of the group before each step"
            ) from error
        logger.debug(
            "rank %d: %s call %d, ranks %s arrived", me, self.what, call, ranks
        )


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device of the tensors that ``group``'s collectives take: the
    current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
