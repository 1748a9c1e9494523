# Owner(s): ["oncall: distributed"]
"""The trainer's run-directory lock (``[Note: the run-directory lock]``).

* A second run on a locked run directory is refused with exit status 2 and a
  message naming the lock, before the slow checks of ``make_plan`` run, and
  before any other check could refuse it (also as a command of its own, the
  lock held by another process).
* A refused command creates nothing: neither the run directory nor a missing
  parent of it, whether a flag, a later check of the model or the data, or
  the last check (after the data was written) refuses it.
* A refused run removes only what it created: a run directory that existed
  keeps its files (and a lock file that existed stays).
* Under torchrun no rank takes the lock (``[Note: torchrun and the
  run-directory lock]``).

Every case calls ``train.main`` with the launcher mocked (no rank starts),
except the command that is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from typing import Any
from unittest import mock

from common_pipelining import local_ranks_env, REPO
from test_train import _NEEDS, _TINY, _TINY_MODEL, HAS_FUSED, text_flags
from torch.testing._internal.common_utils import run_tests, TestCase

from torch_pipelining_ext import launcher


try:
    from torch_pipelining_ext import train
    from torch_pipelining_ext.train import _checkpoints
except ImportError:
    pass

_TIMEOUT_S = 300


def _tree(directory: str) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``directory``: (size, mtime) of files."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), directory) + "/"] = (0, 0)
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), directory)] = (
                st.st_size,
                st.st_mtime_ns,
            )
    return out


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainRunDirTest(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="train_rundir_test_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def argv(self, run_dir: str, *extra: str) -> list[str]:
        return [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL,
            "--ep", "2", "--steps", "2", "--run-dir", run_dir, *extra,
        ]  # fmt: skip

    def main(
        self, argv: list[str], environ: dict[str, str] | None = None
    ) -> tuple[int, str, Any, Any]:
        """``train.main`` with the launcher and ``make_plan`` watched (the
        launcher mocked): (status, stderr, launch mock, make_plan mock)."""
        err = io.StringIO()
        with (
            mock.patch.object(launcher, "launch", return_value=None) as launch,
            mock.patch.object(train, "make_plan", wraps=train.make_plan) as plan,
            contextlib.redirect_stderr(err),
        ):
            rc = train.main(argv, environ=environ or {})
        return rc, err.getvalue(), launch, plan

    def hold(self, run_dir: str) -> Any:
        """The run directory's lock, held by "another job"."""
        lock = _checkpoints.lock_run_dir(run_dir)
        self.assertIsNotNone(lock)
        self.addCleanup(lock.close)
        return lock

    def test_locked_directory_refused_first(self) -> None:
        """Exit 2 naming the lock, before make_plan's checks: even a command
        that a later check would refuse (missing data) is refused for the
        lock; the holder's directory is untouched."""
        run_dir = os.path.join(self.root, "run")
        self.hold(run_dir)
        before = _tree(run_dir)
        for extra in ([], ["--data", os.path.join(self.root, "missing.jsonl")]):
            rc, err, launch, plan = self.main(self.argv(run_dir, *extra))
            self.assertEqual(rc, 2, err)
            self.assertIn(f"another run uses --run-dir {run_dir}", err)
            self.assertIn(os.path.join(run_dir, ".lock"), err)
            plan.assert_not_called()
            launch.assert_not_called()
            self.assertEqual(_tree(run_dir), before)

    def test_locked_directory_refused_as_a_command(self) -> None:
        """``python -m torch_pipelining_ext.train`` on a directory whose lock
        another process holds: exit 2 and the message, nothing written."""
        run_dir = os.path.join(self.root, "run")
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, ".lock"), "w") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            done = subprocess.run(
                [sys.executable, "-m", "torch_pipelining_ext.train", *self.argv(run_dir)],
                cwd=REPO, env=local_ranks_env(), capture_output=True, text=True,
                timeout=_TIMEOUT_S,
            )  # fmt: skip
        self.assertEqual(done.returncode, 2, done.stderr[-3000:])
        self.assertIn(f"error: another run uses --run-dir {run_dir}", done.stderr)
        self.assertEqual(os.listdir(run_dir), [".lock"])

    def test_refused_command_creates_nothing(self) -> None:
        """A run directory under a missing parent: a bad flag, a check of
        make_plan (experts, missing data) and the last check (data too
        short for one batch, after the data was written) leave no trace; the
        lock is free again."""
        run_dir = os.path.join(self.root, "a", "b", "run")
        for extra, message in (
            (["--nproc", "3"], "not divisible by --pp 1 x --ep 2"),
            (["--experts", "6", "--ep", "4"], "6 experts are not divisible by --ep 4"),
            (["--data", os.path.join(self.root, "missing.jsonl")], "missing.jsonl"),
            (["--batch-size", "100000"], "fewer than one step's"),
        ):
            rc, err, launch, _ = self.main(self.argv(run_dir, *extra))
            self.assertEqual(rc, 2, err)
            self.assertIn(message, err)
            launch.assert_not_called()
            self.assertEqual(os.listdir(self.root), [], f"{extra}: {err}")
        lock = _checkpoints.lock_run_dir(run_dir)
        self.assertIsNotNone(lock)
        lock.discard()
        self.assertEqual(os.listdir(self.root), [])

    def test_refused_run_removes_only_what_it_created(self) -> None:
        """A run directory that existed keeps every file (its lock file too,
        when it had one); one this run created is removed, its parent kept."""
        existing = os.path.join(self.root, "existing")
        os.makedirs(os.path.join(existing, "checkpoints"))
        with open(os.path.join(existing, "metrics.jsonl"), "w") as f:
            f.write('{"step": 1, "loss": 1.0}\n')
        bad = ["--batch-size", "100000"]  # refused last
        for with_lock in (False, True):
            if with_lock:  # a run that ended left its lock file
                open(os.path.join(existing, ".lock"), "w").close()
            before = _tree(existing)
            rc, err, _, plan = self.main(self.argv(existing, *bad))
            self.assertEqual(rc, 2, err)
            plan.assert_called_once()  # refused by the last check, not the lock
            self.assertEqual(_tree(existing), before)
        parent = os.path.join(self.root, "parent")
        os.makedirs(parent)
        rc, err, _, _ = self.main(self.argv(os.path.join(parent, "run"), *bad))
        self.assertEqual(rc, 2, err)
        self.assertEqual(os.listdir(parent), [])

    def test_lock_released_and_file_kept_after_a_run(self) -> None:
        """A run that passed its checks releases the lock when it ends and
        leaves the lock file (the next run locks the same file)."""
        run_dir = os.path.join(self.root, "run")
        rc, err, launch, _ = self.main(self.argv(run_dir))
        self.assertEqual(rc, 0, err)
        launch.assert_called_once()
        self.assertTrue(os.path.isfile(os.path.join(run_dir, ".lock")))
        self.hold(run_dir)

    def test_discarded_lock_file_is_not_locked_by_a_late_opener(self) -> None:
        """A run that opened the lock file just before a refused run removed
        it does not lock the removed file: it locks the path's new file."""
        run_dir = os.path.join(self.root, "run")
        first = _checkpoints.lock_run_dir(run_dir)
        self.assertIsNotNone(first)
        real_open, opened = open, []

        def late_open(path: str, *args: Any, **kwargs: Any) -> Any:
            f = real_open(path, *args, **kwargs)
            if not opened:  # the first attempt: the holder is refused meanwhile
                opened.append(path)
                first.discard()
                os.makedirs(run_dir, exist_ok=True)
            return f

        with mock.patch("builtins.open", late_open):
            second = _checkpoints.lock_run_dir(run_dir)
        self.assertIsNotNone(second)
        self.addCleanup(second.close)
        assert second.file is not None
        self.assertTrue(
            os.path.samestat(
                os.fstat(second.file.fileno()),
                os.stat(os.path.join(run_dir, ".lock")),
            )
        )
        self.assertIsNone(_checkpoints.lock_run_dir(run_dir))

    def test_no_lock_under_torchrun(self) -> None:
        """Under torchrun the lock is not taken (a directory another job
        holds is not refused; the lock is the scheduler's business)."""
        run_dir = os.path.join(self.root, "run")
        self.hold(run_dir)
        torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        rc, err, launch, _ = self.main(self.argv(run_dir), environ=torchrun)
        self.assertEqual(rc, 0, err)
        launch.assert_called_once()


if __name__ == "__main__":
    run_tests()
