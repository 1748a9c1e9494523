# Owner(s): ["oncall: distributed"]
"""``torch_pipelining_ext.launcher``: local ranks as one group, torchrun's world."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
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
