# Owner(s): ["oncall: distributed"]
"""``torch_pipelining_ext.launcher``: local ranks as one group, torchrun's world."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from common_pipelining import local_ranks_env
from torch.testing._internal.common_utils import run_tests, TestCase

from torch_pipelining_ext import launcher


def _sum_of_ranks(rank: int, scale: int) -> tuple[int, int, int]:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), int(t.item())


def _rank_one_raises(rank: int) -> None:
    if rank == 1:
        raise KeyError("rank one's failure")
    dist.barrier()  # the peer never arrives: this rank must be stopped


def _rank_one_is_killed(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class LauncherTest(TestCase):
    def test_returns_rank_zero_result(self) -> None:
        self.assertEqual(launcher.launch(_sum_of_ranks, 3, 10), (0, 3, 30))

    def test_exception_on_one_rank_stops_the_others(self) -> None:
        with self.assertRaisesRegex(launcher.RankFailedError, "rank 1 raised") as cm:
            launcher.launch(_rank_one_raises, 2, timeout=timedelta(minutes=10))
        self.assertIn("rank one's failure", str(cm.exception))
        self.assertEqual(cm.exception.rank, 1)

    def test_killed_rank_stops_the_others(self) -> None:
        with self.assertRaisesRegex(
            launcher.RankFailedError, "rank 1 was killed by signal SIGKILL"
        ) as cm:
            launcher.launch(_rank_one_is_killed, 2, timeout=timedelta(minutes=10))
        self.assertEqual(cm.exception.exit_code, -signal.SIGKILL)

    def test_large_result_and_traceback(self) -> None:
        """Rank 0's result and a failed rank's message far beyond a pipe's
        64 KiB, tensors included, reach the launcher (a child process with a
        timeout, so that a regression fails instead of hanging), and nothing
        is left in TMPDIR."""
        code = (
            "import torch; from torch_pipelining_ext import launcher\n"
            "def big(rank):\n"
            "    return {'bytes': b'x' * (1 << 20), 't': torch.arange(1 << 18) * rank + 1}\n"
            "out = launcher.launch(big, 2)\n"
            "assert out['bytes'] == b'x' * (1 << 20)\n"
            "assert torch.equal(out['t'], torch.ones(1 << 18, dtype=torch.long))\n"
            "def fails(rank):\n"
            "    if rank == 1:\n"
            "        raise ValueError('y' * (1 << 18))\n"
            "    torch.distributed.barrier()\n"
            "try:\n"
            "    launcher.launch(fails, 2)\n"
            "except launcher.RankFailedError as e:\n"
            "    assert e.rank == 1 and 'y' * (1 << 18) in str(e), str(e)[:200]\n"
            "    print('ok')\n"
        )
        with tempfile.TemporaryDirectory() as job_tmp:
            proc = subprocess.run(
                [sys.executable, "-c", code],
                env={**local_ranks_env(), "TMPDIR": job_tmp},
                timeout=300,
                capture_output=True,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            # the last line: some torch releases print notices of their own
            self.assertEqual(proc.stdout.strip().splitlines()[-1], b"ok", proc.stdout)
            self.assertEqual(os.listdir(job_tmp), [])

    def test_store_starts_after_every_rank_is_forked(self) -> None:
        """No thread of the launcher's TCPStore runs while it forks: a rank
        could inherit the resolver lock that thread holds and hang in its own
        connect (seen once in CI's slow tests)."""
        events: list[str] = []
        start_processes, tcp_store = launcher.mp.start_processes, launcher.dist.TCPStore

        def started(*args, **kwargs):
            events.append("fork")
            return start_processes(*args, **kwargs)

        def store(*args, **kwargs):
            events.append("store")
            return tcp_store(*args, **kwargs)

        with (
            mock.patch.object(launcher.mp, "start_processes", started),
            mock.patch.object(launcher.dist, "TCPStore", store),
        ):
            self.assertEqual(launcher.launch(_sum_of_ranks, 2, 1), (0, 2, 1))
        self.assertEqual(events, ["fork", "store"])

    def test_inherited_process_group_garbage(self) -> None:
        """A destroyed gloo group left in a reference cycle in the launching
        process: the forked ranks never collect it (its destructor would join
        a thread the fork did not copy, and hang).  A child process with a
        timeout, so that a regression fails instead of hanging."""
        code = (
            "import gc, torch, torch.distributed as dist\n"
            "from torch_pipelining_ext import launcher\n"
            "def garbage():\n"
            "    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "    cycle = [dist.group.WORLD]\n"
            "    cycle.append(cycle)\n"
            "    dist.destroy_process_group()\n"
            "def fn(rank):\n"
            "    gc.collect()  # what a rank's collector may do at any allocation\n"
            "    t = torch.ones(1)\n"
            "    dist.all_reduce(t)\n"
            "    return int(t.item())\n"
            "gc.disable()  # the cycle stays until launch() collects it\n"
            "garbage()\n"
            "print(launcher.launch(fn, 2), gc.get_freeze_count())\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=local_ranks_env(),
            timeout=120,
            capture_output=True,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        # both ranks joined the all-reduce; nothing stays frozen in the launcher
        self.assertEqual(proc.stdout.strip().splitlines()[-1], b"2 0", proc.stdout)

    @unittest.skipUnless(sys.platform == "linux", "PR_SET_PDEATHSIG is Linux's")
    def test_ranks_die_with_the_launching_process(self) -> None:
        """SIGKILL to the process that called launch() (it cannot stop its
        ranks): its ranks, busy for minutes, are killed too, and the job
        leaves nothing in TMPDIR.

        torch 2.9 itself makes a folder in TMPDIR when torch.distributed is
        imported (``torch.distributed.nn.jit.instantiator._TEMP_DIR``, removed
        only at a clean exit); the launching process prints that folder's name
        and it alone is excepted."""
        with (
            tempfile.TemporaryDirectory() as tmp,
            tempfile.TemporaryDirectory() as job_tmp,
        ):
            code = (
                "import os, sys, time; from torch_pipelining_ext import launcher\n"
                "torch_own = sys.modules.get('torch.distributed.nn.jit.instantiator')\n"
                "print('torch-own:', getattr(getattr(torch_own, '_TEMP_DIR', None), 'name', ''), flush=True)\n"
                "def fn(rank, tmp):\n"
                "    open(os.path.join(tmp, f'{rank}.pid.partial'), 'w').write(str(os.getpid()))\n"
                "    os.rename(os.path.join(tmp, f'{rank}.pid.partial'), os.path.join(tmp, f'{rank}.pid'))\n"
                "    if rank == 1:\n"
                "        while not os.path.exists(os.path.join(tmp, '0.pid')):\n"
                "            time.sleep(0.01)\n"
                "        os.kill(os.getppid(), 9)  # the launching process dies\n"
                "    time.sleep(600)  # a rank left alone would live on\n"
                f"launcher.launch(fn, 2, {tmp!r})\n"
            )
            proc = subprocess.run(
                [sys.executable, "-c", code],
                env={**local_ranks_env(), "TMPDIR": job_tmp},
                timeout=300,
                capture_output=True,
            )
            self.assertEqual(proc.returncode, -signal.SIGKILL, proc.stderr[-2000:])
            pids = []
            for r in range(2):
                with open(os.path.join(tmp, f"{r}.pid")) as f:
                    pids.append(int(f.read()))
            deadline = time.monotonic() + 60
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(
                    0.05
                )  # polls the processes' end; the result does not depend on it
            self.assertEqual([pid for pid in pids if _alive(pid)], [])
            torch_own = [
                os.path.basename(line.split(b":", 1)[1].strip().decode())
                for line in proc.stdout.splitlines()
                if line.startswith(b"torch-own:")
            ]
            self.assertEqual(len(torch_own), 1, proc.stdout)
            left = [name for name in os.listdir(job_tmp) if name not in torch_own]
            self.assertEqual(left, [])

    def test_torchrun_world_size_must_match(self) -> None:
        env = {"RANK": "0", "WORLD_SIZE": "4"}
        with mock.patch.dict(os.environ, env):
            self.assertTrue(launcher.under_torchrun())
            with self.assertRaisesRegex(ValueError, "torchrun started 4 .* needs 2"):
                launcher.launch(_sum_of_ranks, 2, 1)

    def test_bad_world_size(self) -> None:
        with self.assertRaisesRegex(ValueError, "at least one rank"):
            launcher.launch(_sum_of_ranks, 0, 1)

    def test_layout_problem(self) -> None:
        # (device_mesh and data_parallel_mesh: test_hf_training_state_multiproc.py)
        self.assertIsNone(launcher.layout_problem(8, pp=2, dp=2, ep=2))
        self.assertEqual(
            launcher.layout_problem(4, pp=2, ep=4),
            "the layout pp=2 x dp=1 x ep=4 needs 8 ranks, but the job has 4",
        )
        self.assertIn("got ep=0", launcher.layout_problem(4, ep=0))


if __name__ == "__main__":
    run_tests()
