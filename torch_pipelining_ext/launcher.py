"""Start the ranks of a job: under ``torchrun``, or as local processes.

:func:`launch` runs a function on every rank of a process group.  Started by
``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment), it joins that
rendezvous and runs the function on this process's rank; otherwise it starts
the ranks itself on this machine (forked on Linux, as PyTorch's own
multi-process tests are), gives each a process group over a store in a
temporary directory, and returns rank 0's result::

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

:func:`device_mesh` lays the ranks of a job out as one ``("pp", "dp", "ep")``
mesh, the same way wherever a job is started (the trainer, the demo, the
tools and the tests)::

    mesh = launcher.device_mesh(pp=2, dp=2, ep=2)  # 8 ranks
    stages, parts = hf.pipeline_hf_causal_lm(config, mesh, ScheduleDualPipeV, device)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist


__all__ = [
    "DEFAULT_TIMEOUT",
    "MESH_DIM_NAMES",
    "RankFailedError",
    "cpu_cores",
    "data_parallel_mesh",
    "device_mesh",
    "launch",
    "layout_problem",
    "under_torchrun",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""How long a collective of a launched rank may wait for its peers."""

MESH_DIM_NAMES = ("pp", "dp", "ep")
"""The dimensions of :func:`device_mesh`, outermost first."""


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
        *args: further arguments of ``fn`` (with local processes on Linux,
            they reach the ranks by ``fork``, unpickled).
        backend: the process group's backend (``"gloo"``: CPU).
        timeout: how long each collective may wait for its peers.
        threads_per_rank: intra-op threads of each rank
            (``torch.set_num_threads``); default: the cores divided among
            local ranks, untouched under ``torchrun``.

    Raises:
        ValueError: ``nprocs`` is not positive, or differs from torchrun's
            world size.
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
    import torch.multiprocessing as mp

    # forked, as PyTorch's multi-process tests do: no rank imports torch again
    method = "fork" if sys.platform == "linux" else "spawn"
    store_dir = tempfile.mkdtemp(prefix="tpe-launch-")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    try:
        context = mp.start_processes(
            _local_rank,
            args=(
                fn,
                nprocs,
                init_method,
                backend,
                timeout,
                threads,
                args,
                store_dir,
                os.getpid(),
            ),
            nprocs=nprocs,
            join=False,
            start_method=method,
        )
        _join(context, store_dir)
        path = os.path.join(store_dir, _RESULT)
        if not os.path.exists(path):
            raise RuntimeError("rank 0 finished without handing back a result")
        return torch.load(path, weights_only=False)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


# [Note: what the ranks hand back]
# Rank 0's result and every failed rank's traceback reach the launcher as
# files in the job's temporary directory, not through a pipe: a pipe holds
# about 64 KiB, and a rank writing more than that would wait for a reader
# that only reads once every rank has exited.  The result is written with
# torch.save (tensors are copied into the file, not shared with a process
# that is about to exit) under a temporary name and renamed when complete.
_RESULT = "result.pt"


def _failures(store_dir: str) -> list[tuple[float, int, str]]:
    """(time, rank, traceback) of every rank that raised, earliest first."""
    found = []
    for name in os.listdir(store_dir):
        if name.startswith("failed-") and name.endswith(".json"):
            with open(os.path.join(store_dir, name)) as f:
                item = json.load(f)
            found.append((item["time"], item["rank"], item["traceback"]))
    return sorted(found)


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    write(path + ".partial")
    os.replace(path + ".partial", path)


# [Note: the first failed rank]
# When a rank raises, the others fail soon after (its sockets close under
# their collectives) and may exit first; torch's ProcessContext.join reports
# whichever exit it notices first.  So every rank that raises writes the time
# and its traceback for the launcher before the exception leaves it,
# and the launcher names the rank that raised first; a rank that a signal
# ended (other than the SIGTERM that stops the remaining ranks) is named
# before any rank that raised, as the others' errors follow from its death.


def _join(context: Any, store_dir: str) -> None:
    """Wait for every rank; on the first failure stop the others and raise
    :class:`RankFailedError` naming the rank that failed first (see
    ``[Note: the first failed rank]``).  (``ProcessContext.join`` terminates
    the remaining processes before it raises.)"""
    import torch.multiprocessing as mp

    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as e:
        killed = _killed_by_a_signal(context)
        if killed is not None:
            _raise_exited(killed, context.processes[killed].exitcode)
        failures = _failures(store_dir)
        rank, message = (
            (failures[0][1], failures[0][2]) if failures else (e.error_index, str(e))
        )
        raise RankFailedError(
            f"rank {rank} raised an exception; the other ranks were stopped.\n{message}",
            rank,
            1,
        ) from None
    except mp.ProcessExitedException as e:
        _raise_exited(e.error_index, e.exit_code)


def _killed_by_a_signal(context: Any) -> int | None:
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            return rank
    return None


def _raise_exited(rank: int, exit_code: int) -> None:
    if exit_code < 0:
        how = f"was killed by signal {signal.Signals(-exit_code).name}"
    else:
        how = f"exited with status {exit_code}"
    raise RankFailedError(
        f"rank {rank} {how}; the other ranks were stopped", rank, exit_code
    ) from None


def _local_rank(
    rank: int,
    fn: Callable[..., Any],
    nprocs: int,
    init_method: str,
    backend: str,
    timeout: timedelta,
    threads: int,
    args: tuple[Any, ...],
    store_dir: str,
    parent: int,
) -> None:
    def failed() -> None:  # [Note: the first failed rank]
        item = {
            "time": time.monotonic(),
            "rank": rank,
            "traceback": traceback.format_exc(),
        }

        def write(path: str) -> None:
            with open(path, "w") as f:
                json.dump(item, f)

        _write_atomically(os.path.join(store_dir, f"failed-{rank}.json"), write)

    _die_with_parent(parent)
    result = _run_rank(
        fn, rank, nprocs, init_method, backend, timeout, threads, args, failed
    )
    if rank == 0:  # [Note: what the ranks hand back]
        _write_atomically(
            os.path.join(store_dir, _RESULT), lambda path: torch.save(result, path)
        )


# [Note: ranks die with their launcher]
# The local ranks are the launching process's children.  If it dies without
# stopping them (SIGKILL, an OOM kill), they would go on training on their
# own: a rerun of the same job would then share its run directory with them.
# On Linux each rank asks the kernel for SIGKILL when its parent exits
# (prctl PR_SET_PDEATHSIG), and exits at once if the parent is already gone.


def _die_with_parent(parent: int) -> None:
    """See ``[Note: ranks die with their launcher]`` (Linux only)."""
    if sys.platform != "linux":
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug(
            "prctl(PR_SET_PDEATHSIG) unavailable: ranks may outlive the launcher"
        )
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _run_rank(
    fn: Callable[..., T],
    rank: int,
    world: int,
    init_method: str,
    backend: str,
    timeout: timedelta,
    threads: int | None,
    args: tuple[Any, ...],
    failed: Callable[[], None] | None = None,
) -> T:
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
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


# [Note: job layout]
# A job's ranks form a pp x dp x ep grid, expert parallelism innermost: the
# ranks of one expert-parallel group are neighbours (one node, where the
# all-to-alls are cheapest), the pipeline outermost.  Rank
# r = (i_pp * dp + i_dp) * ep + i_ep.  The data-parallel ranks of the loss and
# of FSDP are dp x ep (expert parallelism is carved out of data parallelism:
# every rank of an ep group trains on other tokens); the experts are sharded
# over ep and replicated over dp.


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


def device_mesh(
    pp: int = 1, dp: int = 1, ep: int = 1, *, device_type: str | None = None
) -> Any:
    """The job's ``("pp", "dp", "ep")`` :class:`~torch.distributed.device_mesh.DeviceMesh`
    (see ``[Note: job layout]``); a collective over the default process group.

    ``mesh["pp"]``, ``mesh["dp"]`` and ``mesh["ep"]`` are this rank's pipeline,
    data-parallel and expert-parallel dimensions.  Pass the mesh to
    :func:`torch_pipelining_ext.hf.pipeline_hf_causal_lm` and the training
    functions of :mod:`torch_pipelining_ext.hf`, which take what they need
    from it.

    Args:
        pp, dp, ep: the sizes; their product is the world size.
        device_type: ``"cuda"`` or ``"cpu"``; default: ``"cuda"`` when the
            default process group is NCCL's, else ``"cpu"``.

    Raises:
        ValueError: the layout does not fit the world (see :func:`layout_problem`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    problem = layout_problem(dist.get_world_size(), pp, dp, ep)
    if problem is not None:
        raise ValueError(problem)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (pp, dp, ep), mesh_dim_names=MESH_DIM_NAMES)
    data_parallel_mesh(mesh)  # its groups made here, on every rank at once
    logger.debug(
        "rank %d: mesh pp=%d x dp=%d x ep=%d, coordinates %s",
        dist.get_rank(),
        pp,
        dp,
        ep,
        mesh.get_coordinate(),
    )
    return mesh


def data_parallel_mesh(mesh: Any) -> Any:
    """The ranks of ``mesh`` that train on different data, as one 1-D mesh:
    its ``"dp"`` and ``"ep"`` dimensions flattened (``"dp_ep"``), or the one
    of them it has.  Pass its group to ``CausalLMLoss.set_labels`` and
    ``hf.expert_load``.

    The first call for a mesh with both dimensions is a collective over the
    default process group (it makes the flattened dimension's groups;
    :func:`device_mesh` does it for its meshes); later calls return the same
    mesh.

    Raises:
        ValueError: ``mesh`` has neither a ``"dp"`` nor an ``"ep"`` dimension.
    """
    names = [n for n in ("dp", "ep") if n in (mesh.mesh_dim_names or ())]
    if not names:
        raise ValueError(
            f"the mesh has no 'dp' or 'ep' dimension (its dimensions: {mesh.mesh_dim_names})"
        )
    if len(names) == 1:
        return mesh[names[0]]
    return mesh["dp", "ep"]._flatten("dp_ep")
