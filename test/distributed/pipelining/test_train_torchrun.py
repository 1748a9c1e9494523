# Owner(s): ["oncall: distributed"]
"""``python -m torch_pipelining_ext.train`` under ``torchrun``: two nodes on
this machine (two torchrun agents, c10d rendezvous on 127.0.0.1).

* ``TrainTorchrunSlowTest`` (``PYTORCH_TEST_WITH_SLOW=1``: each case starts
  two agents and their ranks, about a minute on two busy cores):

  - PP=1 x EP=2 (one rank per node) and PP=2 x EP=2 (two per node,
    DualPipeV with the concurrent OVERLAP_F_B): the same run started by the
    package's launcher trains the same losses and gradient norms bitwise and
    writes the same final checkpoint bitwise.  torchrun gives each rank
    ``OMP_NUM_THREADS`` intra-op threads (1 unless set), the launcher the
    cores divided among its ranks: the test sets ``OMP_NUM_THREADS`` to the
    launcher's number, and with the same threads the runs are bitwise equal.
  - A rank killed with SIGKILL: both agents exit with a non-zero status
    (the agents and their ranks are waited for with a timeout, and killed
    if it passes), no rank is left, and the agent of the killed rank's node
    names the rank and the signal; the other agent reports only its own
    ranks.

* ``TrainTorchrunCommandTest`` (default): the cluster command of
  ``docs/train.md`` passes torchrun the flags this test passes it.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import torch
from common_pipelining import local_ranks_env, REPO, slow_only
from test_train import (
    _LAYOUTS,
    _NEEDS,
    _TINY,
    _TINY_MODEL,
    checkpoint_model,
    HAS_FUSED,
    text_flags,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_pipelining_ext import launcher


try:
    from torch_pipelining_ext import train
except ImportError:
    pass

_NODES = 2
_TIMEOUT_S = 300  # one run: start, training and exit
# from a rank's SIGKILL until both agents exited (seconds here): bounds a hang
_AFTER_KILL_S = 120
_DOCS = os.path.join(REPO, "docs", "train.md")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_flags(
    nnodes: int, nproc_per_node: int, endpoint: str, run_id: str
) -> list[str]:
    """torchrun's flags of a job of ``nnodes`` agents (the cluster command of
    docs/train.md passes the same: :class:`TrainTorchrunCommandTest`).
    ``--node-rank`` is left out: the c10d rendezvous numbers the nodes itself
    (torchrun ignores the flag, with a warning)."""
    return [
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
    ]  # fmt: skip


def _processes_of(run_id: str) -> list[int]:
    """Every process of this user whose environment has torchrun's run id
    ``run_id`` (the agents' ranks, found without psutil)."""
    found = []
    needle = f"TORCHELASTIC_RUN_ID={run_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[len(b"RANK=") :])
    except OSError:
        pass
    return None


class TorchrunJob:
    """Two torchrun agents on this machine, each a ``python -m
    torch.distributed.run`` child of the test, their output in files."""

    def __init__(self, directory: str, nproc_per_node: int, argv: list[str]) -> None:
        self.run_id = f"train-test-{uuid.uuid4().hex[:12]}"
        endpoint = f"127.0.0.1:{_free_port()}"
        command = [
            sys.executable, "-m", "torch.distributed.run",
            *torchrun_flags(_NODES, nproc_per_node, endpoint, self.run_id),
            "-m", "torch_pipelining_ext.train", *argv,
        ]  # fmt: skip
        env = local_ranks_env()
        # the launcher's intra-op threads, which torchrun takes from here
        env["OMP_NUM_THREADS"] = str(_launcher_threads(nproc_per_node * _NODES))
        # torchrun keeps its logs in a directory of TMPDIR that it never removes
        env["TMPDIR"] = directory
        self.logs = [os.path.join(directory, f"agent{i}.log") for i in range(_NODES)]
        self.agents: list[subprocess.Popen[bytes]] = []
        for log in self.logs:
            with open(log, "wb") as out:
                self.agents.append(
                    subprocess.Popen(
                        command,
                        cwd=REPO,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )

    def ranks(self) -> dict[int, tuple[int, int]]:
        """rank -> (its process id, the index of its agent)."""
        out = {}
        for i, agent in enumerate(self.agents):
            for task in os.listdir(f"/proc/{agent.pid}/task"):
                with open(f"/proc/{agent.pid}/task/{task}/children") as f:
                    for pid in map(int, f.read().split()):
                        rank = _rank_of(pid)
                        if rank is not None:
                            out[rank] = (pid, i)
        return out

    def wait(self, timeout: float) -> list[int]:
        """Both agents' exit statuses; kills everything if one is still
        running after ``timeout`` seconds, and raises."""
        deadline = time.monotonic() + timeout
        codes = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"the torchrun agents did not exit within {timeout:.0f} s:\n"
                    + self.output()[-6000:]
                ) from None
        return codes

    def kill(self) -> None:
        """SIGKILL the agents and every rank of the job (the ranks run in
        sessions of their own: found by the job's run id)."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for pid in _processes_of(self.run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in self.agents:
            agent.wait(timeout=60)

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def output(self) -> str:
        return "".join(
            f"--- agent {i} ---\n{self.log(i)}" for i in range(len(self.agents))
        )


def _launcher_threads(world: int) -> int:
    """The intra-op threads ``launcher.launch`` gives each of ``world`` local ranks."""
    return max(1, launcher.cpu_cores() // world)


def _records(run_dir: str) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train.read_metrics(run_dir)]


@unittest.skipUnless(HAS_FUSED, _NEEDS)
@slow_only("slow: PYTORCH_TEST_WITH_SLOW=1")
@instantiate_parametrized_tests
class TrainTorchrunSlowTest(TestCase):
    def setUp(self) -> None:
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="train_torchrun_test_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def argv(self, run_dir: str, layout: str, steps: int) -> list[str]:
        return [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL,
            *_LAYOUTS[layout], "--steps", str(steps), "--run-dir", run_dir,
        ]  # fmt: skip

    def start(self, name: str, nproc_per_node: int, argv: list[str]) -> TorchrunJob:
        """The job's agents, their logs in ``root/name``; killed at cleanup."""
        directory = os.path.join(self.root, name)
        os.makedirs(directory, exist_ok=True)
        job = TorchrunJob(directory, nproc_per_node, argv)
        self.addCleanup(job.kill)  # nothing is left, whatever happens
        return job

    @parametrize("layout", ["pp1_ep2", "pp2_ep2"])
    def test_same_run_as_the_launcher(self, layout: str) -> None:
        """Every step's loss and gradient norm, and the final checkpoint,
        bitwise those of the launcher's run (with the same threads)."""
        nproc = {"pp1_ep2": 1, "pp2_ep2": 2}[layout]
        world = nproc * _NODES
        runs = {}
        local = os.path.join(self.root, "launcher", "run")
        env = local_ranks_env()
        env["OMP_NUM_THREADS"] = str(_launcher_threads(world))
        done = subprocess.run(
            [sys.executable, "-m", "torch_pipelining_ext.train", *self.argv(local, layout, 3)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S,
        )  # fmt: skip
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        runs["launcher"] = local
        remote = os.path.join(self.root, "torchrun", "run")
        job = self.start("torchrun", nproc, self.argv(remote, layout, 3))
        self.assertEqual(job.wait(_TIMEOUT_S), [0, 0], job.output()[-6000:])
        self.assertEqual(sum("done: 3 steps" in job.log(i) for i in range(_NODES)), 1)
        runs["torchrun"] = remote
        got, want = _records(runs["torchrun"]), _records(runs["launcher"])
        self.assertEqual([r[0] for r in want], [1, 2, 3])
        self.assertEqual(got, want)  # bitwise: the same threads per rank
        (a,) = glob.glob(os.path.join(local, "checkpoints", "step-*"))
        (b,) = glob.glob(os.path.join(remote, "checkpoints", "step-*"))
        self.assertEqual(os.path.basename(a), os.path.basename(b))
        mine, theirs = checkpoint_model(a), checkpoint_model(b)
        self.assertEqual(set(mine), set(theirs))
        for key, value in mine.items():
            self.assertTrue(torch.equal(theirs[key], value), key)

    def test_killed_rank_ends_both_agents(self) -> None:
        """SIGKILL to a random rank of PP=2 x EP=2 after its second step:
        both agents exit non-zero, no rank is left; the killed rank's agent
        names it (rank, exit code -9, SIGKILL)."""
        seed = random.randrange(1 << 30)
        victim = random.Random(seed).randrange(4)
        msg = f"random seed {seed}: killed rank {victim}"
        run_dir = os.path.join(self.root, "job", "run")
        job = self.start("job", 2, self.argv(run_dir, "pp2_ep2", 1000))
        deadline = time.monotonic() + _TIMEOUT_S
        while len(train.read_metrics(run_dir)) < 2:
            if (
                any(a.poll() is not None for a in job.agents)
                or time.monotonic() > deadline
            ):
                job.kill()
                self.fail(
                    f"the run ended or stalled before step 2: {job.output()[-6000:]}"
                )
            time.sleep(
                0.05
            )  # polls the run's progress; the result does not depend on it
        ranks = job.ranks()
        self.assertEqual(sorted(ranks), [0, 1, 2, 3], msg)
        pid, agent = ranks[victim]
        os.kill(pid, signal.SIGKILL)
        codes = job.wait(_AFTER_KILL_S)
        self.assertTrue(all(code != 0 for code in codes), f"{codes}; {msg}")
        self.assertEqual(_processes_of(job.run_id), [], msg)
        log = job.log(agent)
        self.assertRegex(
            log,
            rf"rank\s*:\s*{victim} \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*-9 ",
            msg,
        )
        self.assertIn(f"Signal 9 (SIGKILL) received by PID {pid}", log, msg)
        other = job.log(1 - agent)
        self.assertNotRegex(other, rf"rank\s*:\s*{victim} \(local_rank", msg)


class TrainTorchrunCommandTest(TestCase):
    def test_docs_cluster_command(self) -> None:
        """docs/train.md's torchrun command passes torchrun this test's flags
        (other sizes), then ``-m torch_pipelining_ext.train``."""
        with open(_DOCS) as f:
            text = f.read()
        blocks = re.findall(r"```bash\n(torchrun .*?)```", text, re.DOTALL)
        self.assertEqual(len(blocks), 1, blocks)
        words = shlex.split(blocks[0].replace("\\\n", " "))
        self.assertEqual(words[0], "torchrun")
        module = words.index("-m")
        self.assertEqual(words[module + 1], "torch_pipelining_ext.train")
        flags = words[1:module]
        ours = torchrun_flags(2, 1, "127.0.0.1:1", "id")
        self.assertEqual(flags[::2], ours[::2])  # the same flags, in order
        self.assertEqual(flags[5], ours[5])  # c10d


if __name__ == "__main__":
    run_tests()
