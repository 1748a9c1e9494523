"""Start the ranks of a job: under ``torchrun``, or as local processes.

:func:`launch` runs a function on every rank of a process group.  Started by
``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment), it joins that
rendezvous and runs the function on this process's rank; otherwise it starts
the ranks itself on this machine (forked, as PyTorch's own multi-process
tests are), gives each a process group over a TCPStore that this process
serves on the loopback interface, and returns rank 0's result::

    def train(rank: int, steps: int) -> float:
        ...  # the default process group is initialised
        return loss


    loss = launcher.launch(train, 4, 100)  # 4 gloo ranks, train(rank, 100) on each

The ranks started here form one group: when one of them fails (an
exception, a signal such as SIGKILL, a non-zero exit), the others are stopped
at once, so that none is left waiting in a collective for a peer that is gone,
and :func:`launch` raises :class:`RankFailedError` naming the rank and how it
ended.  The demo (``python -m torch_pipelining_ext.demo``), the trainer and the
tools start their ranks through it.

:func:`parallel_layout` lays the ranks of a job out as one ``("pp", "dp",
"ep")`` mesh with its groups (a :class:`ParallelLayout`), the same way
wherever a job is started (the trainer, the demo, the tools and the tests)::

    layout = launcher.parallel_layout(pp=2, dp=2, ep=2)  # 8 ranks
    stages, parts = hf.pipeline_hf_causal_lm(config, layout, ScheduleDualPipeV, device)

Every function of the package that takes the layout takes its ``mesh`` too.
:func:`device_mesh` and :func:`data_parallel_mesh` are deprecated:
``parallel_layout(...).mesh`` and ``ParallelLayout.of(mesh).data_mesh`` are
the same meshes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import struct
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, IO, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from torch_pipelining_ext._parallel_layout import (
    layout_problem,
    MESH_DIM_NAMES,
    ParallelLayout,
)


__all__ = [
    "DEFAULT_TIMEOUT",
    "MESH_DIM_NAMES",
    "ParallelLayout",
    "RankFailedError",
    "cpu_cores",
    "data_parallel_mesh",
    "device_mesh",
    "launch",
    "layout_problem",
    "parallel_layout",
    "under_torchrun",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long a collective of a launched rank may wait for its peers."""


class RankFailedError(RuntimeError):
    """A rank started by :func:`launch` failed; the other ranks were stopped.

    Attributes:
        rank: the rank that failed first.
        exit_code: its exit code (negative: the signal that ended it, as
            :attr:`multiprocessing.Process.exitcode` has it); ``1`` for an
            exception.
    """

    def __init__(self, message: str, rank: int, exit_code: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) is that of a rank started
    by ``torchrun`` (it sets ``RANK`` and ``WORLD_SIZE``)."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launch(
    fn: Callable[..., T],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
    threads_per_rank: int | None = None,
) -> T:
    """Run ``fn(rank, *args)`` on every rank of a new default process group.

    Under ``torchrun`` this process is one rank: it joins the ``env://``
    rendezvous (``WORLD_SIZE`` must equal ``nprocs``) and returns its own
    result.  Otherwise ``nprocs`` local processes are started and rank 0's
    result is returned (it must be picklable); the other ranks' results are
    dropped.  Each rank destroys its process group when ``fn`` returns.

    Args:
        fn: the rank's work; it receives the rank, then ``args``.
        nprocs: the world size.
        *args: further arguments of ``fn`` (with local processes they reach
            the ranks by ``fork``, unpickled).
        backend: the process group's backend (``"gloo"``: CPU).
        timeout: how long each collective may wait for its peers.
        threads_per_rank: intra-op threads of each rank
            (``torch.set_num_threads``); default: the cores divided among
            local ranks, untouched under ``torchrun``.

    Raises:
        ValueError: ``nprocs`` is not positive, or differs from torchrun's
            world size.
        RuntimeError: local ranks are wanted on a platform without ``fork``.
        RankFailedError: a local rank failed; the others were stopped.
    """
    if nprocs < 1:
        raise ValueError(f"launch needs at least one rank, got nprocs={nprocs}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != nprocs:
            raise ValueError(
                f"torchrun started {world} processes but this job needs {nprocs}: "
                f"run torchrun --nproc-per-node {nprocs} (over all nodes), or change "
                "the layout"
            )
        rank = int(os.environ["RANK"])
        return _run_rank(
            fn, rank, nprocs, "env://", backend, timeout, threads_per_rank, args
        )
    if threads_per_rank is None:
        threads_per_rank = max(1, cpu_cores() // nprocs)
    return _launch_local(fn, nprocs, args, backend, timeout, threads_per_rank)


def _launch_local(
    fn: Callable[..., T],
    nprocs: int,
    args: tuple[Any, ...],
    backend: str,
    timeout: timedelta,
    threads: int,
) -> T:
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError(
            "launch starts local ranks by fork, which this platform lacks: start "
            f"the {nprocs} ranks with torchrun instead"
        )
    # [Note: what the ranks hand back]
    with tempfile.TemporaryFile() as result:
        # [Note: the launcher's store starts after the fork]
        port_reader, port_writer = os.pipe()
        try:
            try:
                with _no_inherited_garbage():
                    context = mp.start_processes(
                        _local_rank,
                        args=(
                            fn,
                            nprocs,
                            (port_reader, port_writer),
                            backend,
                            timeout,
                            threads,
                            args,
                            result,
                            os.getpid(),
                        ),
                        nprocs=nprocs,
                        join=False,
                        start_method="fork",  # as PyTorch's multi-process tests: no rank imports torch again
                    )
            finally:
                os.close(port_reader)
            store = dist.TCPStore(
                _HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout
            )
            # one write of at most PIPE_BUF bytes: each rank reads a whole port
            os.write(port_writer, struct.pack("!Q", store.port) * nprocs)
        finally:
            os.close(port_writer)  # a rank that reads nothing exits
        _join(context, store)
        result.seek(0)
        if not result.read(1):
            raise RuntimeError("rank 0 finished without handing back a result")
        result.seek(0)
        return torch.load(result, weights_only=False)


# [Note: the launcher's store starts after the fork]
# A forked rank inherits the launching process's memory, locks included, but
# only the thread that forked.  The TCPStore that the launcher serves runs a
# thread that takes glibc's resolver lock (getnameinfo, as it names each rank
# that connects); a rank forked while a rank forked before it was connecting
# could inherit that lock taken and wait on it forever in its own connect.
# So every rank is forked before the store starts, and each reads the store's
# port from a pipe; a rank whose launcher failed before writing it reads
# nothing and exits.


def _read_port(fds: tuple[int, int]) -> int | None:
    """The launcher's store port from the pipe ``fds`` (its read and write
    ends, this rank's copies), or None if the launcher wrote none."""
    reader, writer = fds
    os.close(writer)
    data = b""
    while len(data) < 8:
        chunk = os.read(reader, 8 - len(data))
        if not chunk:
            break
        data += chunk
    os.close(reader)
    return struct.unpack("!Q", data)[0] if len(data) == 8 else None


@contextlib.contextmanager
def _no_inherited_garbage() -> Iterator[None]:
    """Collect this process's garbage, then keep the ranks forked meanwhile
    from collecting what they inherit (``[Note: forked ranks collect no
    inherited garbage]``)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# [Note: forked ranks collect no inherited garbage]
# A forked rank inherits every object of the launching process but none of
# its threads.  An unreachable object whose destructor joins a thread -- a
# destroyed gloo ProcessGroup left in a reference cycle, for one -- would hang
# the rank forever when its garbage collector finds it (std::thread::join on a
# thread that does not exist in the child).  So the launcher collects its own
# garbage first, where those threads live, and freezes what is left
# (gc.freeze, as Python's documentation advises before a fork) so that the
# ranks never collect it; the launcher unfreezes once its ranks are started.
# test_launcher.py's test_inherited_process_group_garbage hung without it.


# [Note: what the ranks hand back]
# Nothing of a local job outlives the launching process, even one killed by
# SIGKILL: the ranks meet over a TCPStore that the launcher serves on the
# loopback interface (it closes with the launcher), and rank 0's result comes
# back in a file without a name (tempfile.TemporaryFile) that the launcher
# opened before the fork and that the kernel frees with its last descriptor.
# Not a pipe: a pipe holds about 64 KiB, and a rank writing more would wait
# for a reader that reads only once every rank has exited; not the store: it
# refuses values over 8 MiB (a traceback is cut to its last MiB).  The result is written with torch.save
# (tensors are copied into the file, not shared with a process about to exit).
# A rank that raises records its traceback in the store and exits with status
# 1 by SystemExit, not by the exception: torch's ProcessContext would keep the
# traceback in a file of its own in TMPDIR, which nobody removes.
_HOST = "127.0.0.1"
_FAILED = "launch/failed"  # the number of ranks that raised, and "<key>/<n>": the n-th
_TRACEBACK_CHARS = 1 << 20


def _first_failure(store: dist.Store) -> tuple[int, str] | None:
    """(rank, traceback) of the first rank that raised, if one did
    (``[Note: the first failed rank]``)."""
    key = f"{_FAILED}/1"
    if not store.check([key]):
        return None
    item = json.loads(store.get(key))
    return item["rank"], item["traceback"]


# [Note: the first failed rank]
# When a rank raises, the others fail soon after (its sockets close under
# their collectives) and may exit first; torch's ProcessContext.join reports
# whichever exit it notices first.  So every rank that raises numbers its
# failure in the store (an atomic add) and records its traceback under that
# number before the exception leaves it, and the launcher names the rank that
# raised first; a rank that a signal ended (other than the SIGTERM that stops
# the remaining ranks) is named before any rank that raised, as the others'
# errors follow from its death.


def _join(context: mp.ProcessContext, store: dist.Store) -> None:
    """Wait for every rank; on the first failure stop the others and raise
    :class:`RankFailedError` naming the rank that failed first (see
    ``[Note: the first failed rank]``).  (``ProcessContext.join`` terminates
    the remaining processes before it raises.)"""
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        killed = _killed_by_a_signal(context)
        failure = _first_failure(store)
        if killed is None and failure is not None:
            rank, message = failure
            raise RankFailedError(
                f"rank {rank} raised an exception; the other ranks were stopped.\n{message}",
                rank,
                1,
            ) from None
        rank, code = (e.error_index, e.exit_code) if killed is None else killed
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code < 0
            else f"exited with status {code}"
        )
        raise RankFailedError(
            f"rank {rank} {how}; the other ranks were stopped", rank, code
        ) from None


def _killed_by_a_signal(context: mp.ProcessContext) -> tuple[int, int] | None:
    """(rank, exit code) of a rank that a signal other than SIGTERM ended."""
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            return rank, code
    return None


def _local_rank(
    rank: int,
    fn: Callable[..., Any],
    nprocs: int,
    port_pipe: tuple[int, int],
    backend: str,
    timeout: timedelta,
    threads: int,
    args: tuple[Any, ...],
    result: IO[bytes],
    parent: int,
) -> None:
    # [Note: ranks die with their launcher]
    mp._prctl_pr_set_pdeathsig(signal.SIGKILL)  # type: ignore[attr-defined]
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
    port = _read_port(port_pipe)  # [Note: the launcher's store starts after the fork]
    if port is None:
        os._exit(1)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)

    def failed() -> None:  # [Note: the first failed rank]
        key = f"{_FAILED}/{store.add(_FAILED, 1)}"
        text = traceback.format_exc()[-_TRACEBACK_CHARS:]
        store.set(key, json.dumps({"rank": rank, "traceback": text}))
        store.check([key])  # a round trip: the launcher has it before this rank exits

    try:
        value = _run_rank(
            fn,
            rank,
            nprocs,
            dist.PrefixStore("pg", store),
            backend,
            timeout,
            threads,
            args,
            failed,
        )
    except Exception:
        sys.exit(1)  # [Note: what the ranks hand back]
    if rank == 0:
        torch.save(value, result)
        result.flush()


# [Note: ranks die with their launcher]
# The local ranks are the launching process's children.  If it dies without
# stopping them (SIGKILL, an OOM kill), they would go on training on their
# own: a rerun of the same job would then share its run directory with them.
# torch's multiprocessing asks the kernel to send its children SIGINT when
# their parent exits (PR_SET_PDEATHSIG), which a rank only notices between two
# Python bytecodes and may turn into a traceback; each rank asks for SIGKILL
# instead through the same wrapper, and exits at once if the parent is already
# gone (it was reparented).
#
# Measured against the FileStore version it replaces (a job of two ranks, one
# all-reduce, the whole process timed over five pairs on one machine): the
# same time, wall-clock ratio 1.00 (median; 0.90 to 1.32).


def _run_rank(
    fn: Callable[..., T],
    rank: int,
    world: int,
    rendezvous: str | dist.Store,
    backend: str,
    timeout: timedelta,
    threads: int | None,
    args: tuple[Any, ...],
    failed: Callable[[], None] | None = None,
) -> T:
    """``fn(rank, *args)`` in a default process group that meets at
    ``rendezvous`` (an ``init_method`` or a store)."""
    if threads is not None:
        torch.set_num_threads(threads)
    where: dict[str, Any] = (
        {"init_method": rendezvous}
        if isinstance(rendezvous, str)
        else {"store": rendezvous}
    )
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timeout, **where
    )
    logger.debug("rank %d of %d joined the %s process group", rank, world, backend)
    try:
        return fn(rank, *args)
    except BaseException:
        if failed is not None:  # before the process group closes under the others
            failed()
        raise
    finally:
        dist.destroy_process_group()


def parallel_layout(
    pp: int = 1, dp: int = 1, ep: int = 1, *, device_type: str | None = None
) -> ParallelLayout:
    """The job's layout: a ``("pp", "dp", "ep")`` mesh, its groups, the
    data-parallel mesh and the EP twin, made once (see ``[Note: job layout]``
    and :meth:`ParallelLayout.build`); a collective over the default process
    group.  Pass it (or its ``mesh``) to
    :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm` and the training
    functions, which read what they need from it.

    Raises:
        ValueError: the layout does not fit the world (see :func:`layout_problem`).
    """
    return ParallelLayout.build(pp, dp, ep, device_type=device_type)


def device_mesh(
    pp: int = 1, dp: int = 1, ep: int = 1, *, device_type: str | None = None
) -> DeviceMesh:
    """Deprecated: ``parallel_layout(pp, dp, ep, device_type=device_type).mesh``
    (see :func:`parallel_layout`), which this returns; pass the layout itself
    where a function takes the layout.

    Raises:
        ValueError: the layout does not fit the world (see :func:`layout_problem`).
    """
    warnings.warn(
        "torch_pipelining_ext.launcher.device_mesh is deprecated and will be removed: "
        "use launcher.parallel_layout(pp, dp, ep) (the layout; its .mesh is this mesh)",
        DeprecationWarning,
        stacklevel=2,
    )
    mesh = parallel_layout(pp, dp, ep, device_type=device_type).mesh
    assert mesh is not None
    return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Deprecated: ``ParallelLayout.of(mesh).data_mesh`` (or the ``data_mesh``
    of the layout :func:`parallel_layout` made), which this returns: the ranks
    of ``mesh`` that train on different data as one 1-D mesh.

    Raises:
        ValueError: ``mesh`` has neither a ``"dp"`` nor an ``"ep"`` dimension.
    """
    warnings.warn(
        "torch_pipelining_ext.launcher.data_parallel_mesh is deprecated and will be "
        "removed: use launcher.ParallelLayout.of(mesh).data_mesh (or the data_mesh of "
        "the layout launcher.parallel_layout made)",
        DeprecationWarning,
        stacklevel=2,
    )
    data_mesh = ParallelLayout.of(mesh).data_mesh
    if data_mesh is None:
        raise ValueError(
            f"the mesh has no 'dp' or 'ep' dimension (its dimensions: {mesh.mesh_dim_names})"
        )
    return data_mesh
