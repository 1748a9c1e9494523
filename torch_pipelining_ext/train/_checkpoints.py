"""A run directory's checkpoints: complete ones, the one being written,
the ones being removed.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: checkpoint
directories]``.  Only rank 0 changes the directory (:meth:`begin`,
:meth:`commit`, :meth:`prune`, :meth:`clear`); every rank writes into the
partial checkpoint :meth:`begin` made, with ``hf.save_checkpoint``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import IO


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: checkpoint directories]
# checkpoints/step-00000100 is a complete checkpoint: a directory of that
# name exists only after every rank's files and DCP's .metadata were written
# into checkpoints/.step-00000100.partial and rank 0 renamed it (one atomic
# rename on one file system).  A crash while writing leaves a .partial
# directory, never taken for a checkpoint and removed at the next start.  A
# checkpoint is removed (--keep) by renaming it to .step-...removing first,
# so a crash while deleting its files never leaves a step-... directory with
# files missing.  The latest complete checkpoint is the one with the highest
# step.

_COMPLETE = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(partial|removing)$")
METADATA = ".metadata"  # torch.distributed.checkpoint's, written last


class CheckpointState(enum.Enum):
    """What a directory under ``checkpoints/`` is."""

    PARTIAL = "partial"  # being written (or a crash left it)
    COMPLETE = "complete"
    REMOVING = "removing"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    state: CheckpointState


class RunCheckpoints:
    """The ``checkpoints/`` directory of a run (``[Note: checkpoint directories]``)."""

    def __init__(self, run_dir: str) -> None:
        self.root = os.path.join(run_dir, "checkpoints")

    def path(self, step: int, state: CheckpointState) -> str:
        name = f"step-{step:08d}"
        if state is not CheckpointState.COMPLETE:
            name = f".{name}.{state.value}"
        return os.path.join(self.root, name)

    def entries(self) -> list[Checkpoint]:
        """Every checkpoint directory, by step."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if m := _COMPLETE.match(name):
                state = CheckpointState.COMPLETE
            elif m := _LEFTOVER.match(name):
                state = CheckpointState(m.group(2))
            else:
                continue
            found.append(Checkpoint(int(m.group(1)), path, state))
        return sorted(found, key=lambda c: (c.step, c.state.value))

    def complete(self) -> list[Checkpoint]:
        return [
            c
            for c in self.entries()
            if c.state is CheckpointState.COMPLETE
            and os.path.isfile(os.path.join(c.path, METADATA))
        ]

    def latest(self) -> Checkpoint | None:
        """The complete checkpoint of the highest step, if any."""
        done = self.complete()
        return done[-1] if done else None

    def begin(self, step: int) -> str:
        """An empty partial directory for the checkpoint of ``step`` (rank 0)."""
        path = self.path(step, CheckpointState.PARTIAL)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def commit(self, step: int) -> str:
        """Make the partial checkpoint of ``step`` complete (rank 0, after
        every rank wrote it)."""
        partial = self.path(step, CheckpointState.PARTIAL)
        if not os.path.isfile(os.path.join(partial, METADATA)):
            raise RuntimeError(f"checkpoint {partial} has no {METADATA}: not committed")
        final = self.path(step, CheckpointState.COMPLETE)
        if os.path.exists(final):  # a rerun wrote this step again
            self._remove(Checkpoint(step, final, CheckpointState.COMPLETE))
        os.replace(partial, final)
        _sync_directory(self.root)
        logger.debug("checkpoint %s complete", final)
        return final

    def prune(self, keep: int) -> list[int]:
        """Remove all but the ``keep`` latest complete checkpoints and every
        leftover (rank 0); returns the steps removed."""
        removed = []
        for c in self.entries():
            if c.state is not CheckpointState.COMPLETE:
                self._remove(c)
        complete = self.complete()
        for c in complete[: max(0, len(complete) - keep)]:
            self._remove(c)
            removed.append(c.step)
        return removed

    def clear(self) -> None:
        """Remove every checkpoint (rank 0; a run started afresh)."""
        for c in self.entries():
            self._remove(c)

    def _remove(self, c: Checkpoint) -> None:
        path = c.path
        if c.state is CheckpointState.COMPLETE:
            path = self.path(c.step, CheckpointState.REMOVING)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(c.path, path)
        shutil.rmtree(path, ignore_errors=True)


# [Note: the run-directory lock]
# A training run started by the package's launcher holds run_dir/.lock (an
# exclusive flock on one open file description, which the forked ranks
# inherit: the kernel releases it when the launching process and every rank
# have exited, also after SIGKILL).  It is taken first, right after the
# flags are checked (nothing read or written yet) and before the slow checks
# of _plan.make_plan (config, tokenizer, the meta model, the checkpoint to
# resume: over ten seconds), so that a second run on the same directory is
# refused at once, and before any other check could refuse it for another
# reason.  To lock the directory it must exist: acquire creates it (and any
# missing parent) and remembers the topmost directory it created and whether
# it created the lock file; a run that is then refused by a later check calls
# discard(), which removes exactly those, so a refused command leaves the
# file system as it found it (a directory or .lock that existed before stays).
# The lock file is unlinked while it is still locked, so a run that opened the
# old file in the meantime could lock an unlinked file while a third locks a
# new one: acquire therefore checks, once it holds the lock, that the path
# still names the file it locked, and starts over otherwise.
LOCK_FILE = ".lock"


class RunDirLock:
    """This job's hold on ``run_dir/.lock`` (``[Note: the run-directory lock]``)."""

    def __init__(
        self, run_dir: str, file: IO[str], created: str | None, created_file: bool
    ) -> None:
        self.run_dir = run_dir
        self.file: IO[str] | None = file
        self.created = created  # the topmost directory acquire created
        self.created_file = created_file

    @classmethod
    def acquire(cls, run_dir: str) -> RunDirLock | None:
        """Create ``run_dir`` if needed and hold its lock; ``None`` if another
        job holds it (then nothing was created)."""
        import fcntl

        created = first_missing(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, LOCK_FILE)
        while True:
            created_file = not os.path.exists(path)
            f = open(path, "a")  # noqa: SIM115  (held for the run)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                return None  # the holder made the directory and file: keep them
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                logger.debug("locked %s (created %s)", path, created)
                return cls(run_dir, f, created, created_file)
            f.close()  # a refused run removed the file we opened: again

    def close(self) -> None:
        """Release the lock (the file stays, for the next run)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def discard(self) -> None:
        """Release the lock and remove what :meth:`acquire` created (the run
        was refused): the directories it made, else the lock file it made."""
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
        elif self.created_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.run_dir, LOCK_FILE))
        self.close()


def lock_run_dir(run_dir: str) -> RunDirLock | None:
    """Hold ``run_dir/.lock`` for this job (:meth:`RunDirLock.acquire`);
    ``None`` if another job holds it."""
    return RunDirLock.acquire(run_dir)


def first_missing(path: str) -> str | None:
    """The topmost directory of ``path`` that does not exist (``None``: it does)."""
    path = os.path.abspath(path)
    missing = None
    while not os.path.exists(path):
        missing, path = path, os.path.dirname(path)
    return missing


def _sync_directory(path: str) -> None:
    """Make a rename in ``path`` durable (where the OS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
