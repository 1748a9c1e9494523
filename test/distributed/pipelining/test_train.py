# Owner(s): ["oncall: distributed"]
"""``python -m torch_pipelining_ext.train``: a Hugging Face MoE trained on
real text (Python's own docstrings, a tokenizer trained here by
``tools/prepare_text.py``; nothing downloaded), gloo ranks on this machine.

* Every run is compared with the unsplit Hugging Face model trained on the
  same global batches with the same AdamW, learning-rate schedule and
  clipping, written independently here: each step's loss, and the exported
  weights (``from_pretrained``) after the run.
* Default run (``TrainRunTest``): PP=1 x EP=2, tiny Qwen3-MoE, three steps
  with a checkpoint, export checked against the last checkpoint bitwise;
  the run directory's layout.
* ``TrainSlowTest`` (``PYTORCH_TEST_WITH_SLOW=1``): Qwen3-MoE and
  DeepSeek-V3 in PP=1 x EP=2, PP=2 x EP=2 (ScheduleDualPipeV, concurrent
  OVERLAP_F_B) and PP=1 x DP=2 x EP=2 (FSDP2); the loss falling over twenty
  steps of real text; a rank killed with SIGKILL at a random step and the
  same command started again: the same losses bitwise and the same final
  weights as a run never interrupted (a model with dropout, so that the
  random number generators matter); a checkpoint resumed in another layout.
* Bad input (``TrainArgumentsTest``): exit status 2 with a message, before
  any process starts; a checkpoint of another model is refused and nothing
  of the run directory changes.
* Pieces (``TrainPartsTest``): documents packed with EOS, the order and
  sharding of sequences, checkpoint directories, the learning-rate schedule,
  the trainer built from public names only.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import torch
from common_pipelining import local_ranks_env, REPO, slow_only
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)
from torch_pipelining_ext import launcher


try:
    import transformers

    from torch_pipelining_ext import hf, train
    from torch_pipelining_ext.train import _checkpoints, _data, _model, _state
    from torch_pipelining_ext.train._options import check_options
    from torch_pipelining_ext.train._plan import make_plan

    HAS_FUSED = hf.has_fused_experts()
except ImportError:
    HAS_FUSED = False

_NEEDS = "needs transformers 5.x (fused experts)"
_TIMEOUT_S = 600
# small: a step takes a few hundred milliseconds on two cores
_TINY = [
    "--seq-len", "32", "--batch-size", "16",
    "--microbatches", "2", "--lr", "3e-3", "--min-lr", "3e-4",
    "--warmup-steps", "2", "--no-progress",
]  # fmt: skip
_TINY_MODEL = ["--hidden-size", "64"]  # --model-type's config
# the reference trains without balancing: the runs compared with it turn off
# the tiny recipes' default (test_train_balance.py compares the default)
_NO_BALANCING = ["--router-aux-loss", "none", "--expert-bias-rate", "0"]
# AdamW normalises every update: the float noise of another reduction order
# in a gradient element near zero becomes up to ~1e-4 in the weights after a
# few steps; a wrong moment or weight shows as ~lr = 3e-3
_LAYOUTS = {
    "pp1_ep2": ["--ep", "2"],
    "pp2_ep2": ["--pp", "2", "--ep", "2", "--microbatches", "4"],  # DualPipeV: 4 stages
    "pp1_dp2_ep2": ["--dp", "2", "--ep", "2"],  # FSDP2 over dp x ep
}
_WEIGHT_TOLERANCE = dict(atol=1e-3, rtol=1e-3)
_LOSS_TOLERANCE = dict(atol=2e-5, rtol=2e-5)


def _prepare_text_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "prepare_text", os.path.join(REPO, "tools", "prepare_text.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CORPUS: dict[str, str] = {}


def corpus() -> str:
    """A directory with ``docs.jsonl`` and ``tokenizer/`` (made once per process)."""
    if "dir" not in _CORPUS:
        directory = tempfile.mkdtemp(prefix="train_corpus_")
        _prepare_text_tool().prepare(directory, vocab_size=512, max_docs=400)
        _CORPUS["dir"] = directory
        import atexit

        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return _CORPUS["dir"]


def text_flags() -> list[str]:
    c = corpus()
    return [
        "--tokenizer", os.path.join(c, "tokenizer"),
        "--data", os.path.join(c, "docs.jsonl"),
    ]  # fmt: skip


def run_main(*argv: str) -> tuple[int, str]:
    """``train.main(argv)`` in this process (its ranks forked from it); the
    exit status and what this process printed to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = train.main(list(argv), environ={})
    return rc, err.getvalue()


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


# ---------------------------------------------------------------------------
# The reference: the unsplit model, written independently of the trainer
# ---------------------------------------------------------------------------


def lr_at(step: int, steps: int, warmup: int, lr: float, min_lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def global_batch(run_dir: str, argv: list[str], step: int) -> torch.Tensor:
    """The sequences of the whole step ``step`` (0-based): the token file the
    trainer wrote, cut into sequences, in the order of its seed."""
    (path,) = glob.glob(os.path.join(run_dir, "data", "tokens-*.bin"))
    dtype = np.uint16 if ".uint16." in path else np.uint32
    ids = np.fromfile(path, dtype=dtype).astype(np.int64)
    seq_len, batch = int(flag(argv, "--seq-len")), int(flag(argv, "--batch-size"))
    n = len(ids) // seq_len
    seqs = torch.from_numpy(ids[: n * seq_len]).view(n, seq_len)
    out = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, within = divmod(position, n)
        gen = torch.Generator().manual_seed(
            int(flag(argv, "--seed", "0")) * 1_000_003 + epoch
        )
        out.append(seqs[torch.randperm(n, generator=gen)[within]])
    return torch.stack(out)


def reference_run(
    config: Any,
    run_dir: str,
    argv: list[str],
    steps: int,
    loss_of: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[float], Any]:
    """The unsplit model trained as the trainer trains it: each step's loss
    and the model after ``steps`` steps.  ``loss_of(model, ids)``: a step's
    loss (default: the model's own cross entropy)."""
    model = _model.initial_model(config, int(flag(argv, "--seed", "0")))
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    lr, min_lr = float(flag(argv, "--lr")), float(flag(argv, "--min-lr"))
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )  # fmt: skip
    total, warmup = int(flag(argv, "--steps")), int(flag(argv, "--warmup-steps"))
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, warmup, lr, min_lr)
        optimizer.zero_grad()
        ids = global_batch(run_dir, argv, step)
        if loss_of is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = loss_of(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def exported(path: str) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


def checkpoint_model(path: str) -> dict[str, torch.Tensor]:
    """The model tensors of a distributed checkpoint, whole, read here."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    whole = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.items()
        if k.startswith("model.") and hasattr(md, "size")
    }
    with mock.patch("warnings.warn"):
        dcp.load(whole, checkpoint_id=path, no_dist=True)
    return {k[len("model.") :]: v for k, v in whole.items()}


def losses_of(run_dir: str) -> list[float]:
    return [r["loss"] for r in train.read_metrics(run_dir)]


class _RunDirTest(TestCase):
    def run_dir(self, name: str = "run") -> str:
        root = tempfile.mkdtemp(prefix="train_test_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        return os.path.join(root, name)

    def check_against_reference(
        self, run_dir: str, argv: list[str], config: Any, export: str | None
    ) -> list[float]:
        """Every logged loss equals the unsplit model's, and the export its
        weights; returns the losses."""
        losses = losses_of(run_dir)
        steps = int(flag(argv, "--steps"))
        self.assertEqual(
            [r["step"] for r in train.read_metrics(run_dir)], list(range(1, steps + 1))
        )
        want, model = reference_run(config, run_dir, argv, steps)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want), **_LOSS_TOLERANCE
        )
        if export is not None:
            got = exported(export)
            ref = model.state_dict()
            self.assertEqual(set(got), set(ref))
            for key in ref:
                torch.testing.assert_close(
                    got[key], ref[key], msg=key, **_WEIGHT_TOLERANCE
                )
        return losses


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainRunTest(_RunDirTest):
    def test_run_checkpoint_export(self) -> None:
        """PP=1 x EP=2: losses and exported weights of the unsplit model, the
        run directory's files, the export equal to the last checkpoint."""
        run_dir = self.run_dir()
        export = os.path.join(os.path.dirname(run_dir), "export")
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", "3", "--checkpoint-every", "2", "--run-dir", run_dir, "--export", export,
            *_NO_BALANCING,
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        config = train.tiny_config("qwen3_moe", vocab_size=512, hidden_size=64)
        self.check_against_reference(run_dir, argv, config, export)
        names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        self.assertEqual(names, ["step-00000002", "step-00000003"])
        self.assertTrue(os.path.isfile(os.path.join(run_dir, "training.png")))
        self.assertFalse(os.path.exists(export + ".partial"))
        last = checkpoint_model(os.path.join(run_dir, "checkpoints", "step-00000003"))
        got = exported(export)
        self.assertEqual(set(got), set(last))
        for key, value in last.items():
            self.assertTrue(torch.equal(got[key], value), key)
        record = train.read_metrics(run_dir)[-1]
        self.assertEqual(record["data_position"], 3 * 16)
        self.assertEqual(record["tokens"], 16 * 32)
        self.assertGreater(record["imbalance"], 1.0)


@unittest.skipUnless(HAS_FUSED, _NEEDS)
@slow_only("slow: PYTORCH_TEST_WITH_SLOW=1")
@instantiate_parametrized_tests
class TrainSlowTest(_RunDirTest):
    @parametrize("model", ["qwen3_moe", "deepseek_v3"])
    @parametrize("layout", ["pp1_ep2", "pp2_ep2", "pp1_dp2_ep2"])
    def test_layout(self, model: str, layout: str) -> None:
        """Every step's loss and the exported weights are the unsplit model's
        (DualPipeV, its OVERLAP_F_B concurrent; FSDP2 over dp x ep)."""
        run_dir = self.run_dir()
        export = os.path.join(os.path.dirname(run_dir), "export")
        learn = (
            model == "qwen3_moe" and layout == "pp1_ep2"
        )  # the loss falls on real text
        argv = [
            "--model-type", model, *text_flags(), *_TINY, *_TINY_MODEL, "--layers", "4",
            "--steps", "20" if learn else "3", "--run-dir", run_dir, "--export", export,
            *_LAYOUTS[layout], *_NO_BALANCING,
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        config = train.tiny_config(model, vocab_size=512, hidden_size=64)
        losses = self.check_against_reference(run_dir, argv, config, export)
        if learn:
            self.assertLess(sum(losses[-3:]) / 3, losses[0] - 0.5, losses)

    def test_overlap_and_checkpointing_change_nothing(self) -> None:
        """PP=2 x EP=2: the sequential OVERLAP_F_B (--no-overlap), full and
        selective activation checkpointing (under DualPipeV's split backward)
        train bitwise as the concurrent overlap."""
        results = []
        for extra in (
            [],
            ["--no-overlap"],
            ["--activation-checkpointing", "full"],
            ["--activation-checkpointing", "selective"],
        ):
            run_dir = self.run_dir()
            export = os.path.join(os.path.dirname(run_dir), "export")
            argv = [
                "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL,
                *_LAYOUTS["pp2_ep2"], "--steps", "3", "--run-dir", run_dir, "--export", export, *extra,
            ]  # fmt: skip
            rc, err = run_main(*argv)
            self.assertEqual(rc, 0, err)
            results.append((losses_of(run_dir), exported(export)))
        for losses, weights in results[1:]:
            self.assertEqual(losses, results[0][0])
            for key, value in results[0][1].items():
                self.assertTrue(torch.equal(weights[key], value), key)

    def test_bfloat16(self) -> None:
        """--dtype bfloat16 computes in bfloat16 (autocast) with float32
        weights: losses near the float32 reference, float32 export."""
        run_dir = self.run_dir()
        export = os.path.join(os.path.dirname(run_dir), "export")
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", "3", "--dtype", "bfloat16", "--run-dir", run_dir, "--export", export,
            *_NO_BALANCING,
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        config = train.tiny_config("qwen3_moe", vocab_size=512, hidden_size=64)
        want, model = reference_run(config, run_dir, argv, 3)
        got = losses_of(run_dir)
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want), atol=3e-2, rtol=0
        )
        self.assertNotEqual(got, want)  # bfloat16 arithmetic did run
        weights = exported(export)
        self.assertTrue(all(v.dtype == torch.float32 for v in weights.values()))
        for key, value in model.state_dict().items():
            torch.testing.assert_close(weights[key], value, atol=2e-2, rtol=0, msg=key)

    def test_balancing_deepseek_v3(self) -> None:
        """DeepSeek-V3 with its sequence-wise auxiliary loss and the
        auxiliary-loss-free bias update (PP=2 x EP=2): the biases move, every
        step logs the expert-load imbalance."""
        run_dir = self.run_dir()
        export = os.path.join(os.path.dirname(run_dir), "export")
        argv = [
            "--model-type", "deepseek_v3", *text_flags(), *_TINY, *_TINY_MODEL, *_LAYOUTS["pp2_ep2"],
            "--router-aux-loss", "sequence", "--router-aux-loss-coef", "1e-4",
            "--expert-bias-rate", "1e-3", "--steps", "3", "--run-dir", run_dir, "--export", export,
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        records = train.read_metrics(run_dir)
        self.assertTrue(all(r["imbalance"] >= 1.0 for r in records), records)
        biases = {
            k: v
            for k, v in exported(export).items()
            if k.endswith("e_score_correction_bias")
        }
        self.assertEqual(len(biases), 3)  # the MoE layers after the dense first one
        for key, bias in biases.items():
            # three updates of -rate, 0 or +rate per expert, not all zero
            steps = bias / 1e-3
            torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0, msg=key)
            self.assertLessEqual(steps.abs().max().item(), 3 + 1e-4, key)
            self.assertGreater(steps.abs().max().item(), 0.5, key)

    def test_killed_rank_resumes_bitwise(self) -> None:
        """SIGKILL to a random rank at a random step, the same command again:
        the losses bitwise and the final weights those of a run never
        interrupted (PP=2 x EP=2, DualPipeV overlapped, attention dropout)."""
        model_dir = self._model_with_dropout()
        rng = random.Random()
        seed = rng.randrange(1 << 30)
        rng = random.Random(seed)
        # after step 3 is logged, the checkpoint of step 2 is complete: the
        # rerun resumes a checkpoint (the kill may land while one is written)
        kill_after, victim = rng.randrange(3, 7), rng.randrange(4)
        runs = {}
        for name in ("whole", "killed"):
            run_dir = self.run_dir(name)
            export = os.path.join(os.path.dirname(run_dir), "export")
            argv = [
                "--model", model_dir, *text_flags(), *_TINY, *_LAYOUTS["pp2_ep2"],
                "--steps", "7", "--checkpoint-every", "2", "--run-dir", run_dir, "--export", export,
            ]  # fmt: skip
            if name == "killed":
                first = self._run_and_kill(argv, run_dir, kill_after, victim)
                self.assertEqual(first.returncode, 1, first.stderr[-3000:])
                self.assertIn(
                    f"rank {victim} was killed by signal SIGKILL", first.stderr
                )
            done = self._command(argv)
            self.assertEqual(done.returncode, 0, done.stderr[-3000:])
            if name == "killed":
                self.assertIn("resumed from", done.stdout)
            runs[name] = (losses_of(run_dir), exported(export))
        msg = f"random seed {seed}: killed rank {victim} after step {kill_after}"
        self.assertEqual(runs["killed"][0], runs["whole"][0], msg)
        self.assertEqual(len(runs["whole"][0]), 7)
        for key, value in runs["whole"][1].items():
            self.assertTrue(torch.equal(runs["killed"][1][key], value), f"{key}; {msg}")

    def test_resume_in_another_layout(self) -> None:
        """A checkpoint of PP=1 x EP=2 resumes in PP=2 x EP=2 (and DP=2 x EP=2):
        training goes on from the same state (losses within float tolerance).
        Without balancing: an auxiliary loss is the mean of the microbatches'
        terms, which differ where the layouts cut the batch differently."""
        run_dir = self.run_dir()
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", "4", "--checkpoint-every", "2", "--keep", "3", "--run-dir", run_dir,
            *_NO_BALANCING,
        ]  # fmt: skip
        self.assertEqual(run_main(*argv)[0], 0)
        whole = losses_of(run_dir)
        for layout in (_LAYOUTS["pp2_ep2"], _LAYOUTS["pp1_dp2_ep2"]):
            shutil.rmtree(
                os.path.join(run_dir, "checkpoints", "step-00000004"),
                ignore_errors=True,
            )
            rc, err = run_main(*argv, *layout)
            self.assertEqual(rc, 0, err)
            resumed = losses_of(run_dir)
            self.assertEqual(resumed[:2], whole[:2])  # kept from before the checkpoint
            torch.testing.assert_close(
                torch.tensor(resumed), torch.tensor(whole), **_LOSS_TOLERANCE
            )

    def _model_with_dropout(self) -> str:
        """A tiny Qwen3-MoE Hugging Face directory whose attention drops out."""
        config = train.tiny_config("qwen3_moe", vocab_size=512, hidden_size=64)
        config.attention_dropout = 0.1
        model = _model.initial_model(config, 0)
        path = os.path.join(os.path.dirname(self.run_dir()), "model")
        model.save_pretrained(path)
        return path

    def _command(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch_pipelining_ext.train", *argv],
            cwd=REPO, env=local_ranks_env(), capture_output=True, text=True, timeout=_TIMEOUT_S,
        )  # fmt: skip

    def _run_and_kill(
        self, argv: list[str], run_dir: str, after: int, victim: int
    ) -> subprocess.CompletedProcess:
        """Start the run; once ``after`` steps are logged, SIGKILL rank
        ``victim`` (a child of the launching process)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch_pipelining_ext.train", *argv],
            cwd=REPO, env=local_ranks_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + _TIMEOUT_S
        while len(train.read_metrics(run_dir)) < after:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                self.fail(
                    f"the run ended or stalled before step {after}: {err[-3000:]}"
                )
            time.sleep(
                0.05
            )  # polls the run's progress; the result does not depend on it
        ranks = _children(proc.pid)
        self.assertEqual(len(ranks), 4, ranks)
        os.kill(ranks[victim], signal.SIGKILL)
        out, err = proc.communicate(timeout=_TIMEOUT_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``, oldest first (the local ranks, by rank)."""
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return sorted(kids)


# ---------------------------------------------------------------------------
# Bad input: exit status 2 before any process group
# ---------------------------------------------------------------------------


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainArgumentsTest(_RunDirTest):
    def refused(self, *argv: str, environ: dict[str, str] | None = None) -> str:
        """Exit status 2 without starting a rank, and a run directory that
        did not exist is not created; returns the message."""
        run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else None
        existed = run_dir is not None and os.path.exists(run_dir)
        err = io.StringIO()
        with (
            mock.patch.object(launcher, "launch") as launch,
            contextlib.redirect_stderr(err),
        ):
            rc = train.main(list(argv), environ=environ or {})
        self.assertEqual(rc, 2, err.getvalue())
        launch.assert_not_called()
        if run_dir is not None and not existed:
            self.assertFalse(os.path.exists(run_dir), err.getvalue())
        return err.getvalue()

    def base(self, *extra: str) -> list[str]:
        return [
            "--model-type",
            "qwen3_moe",
            *text_flags(),
            *_TINY,
            *_TINY_MODEL,
            "--run-dir",
            self.run_dir(),
            *extra,
        ]

    def test_layout_does_not_fit_the_world(self) -> None:
        self.assertIn(
            "not divisible by --pp 1 x --ep 2",
            self.refused(*self.base("--ep", "2", "--nproc", "3")),
        )
        self.assertIn(
            "needs 4 ranks, but the job has 2",
            self.refused(*self.base("--pp", "2", "--dp", "2", "--nproc", "2")),
        )
        torchrun = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
        self.assertIn(
            "not divisible", self.refused(*self.base("--ep", "2"), environ=torchrun)
        )

    def test_experts_not_divisible_by_ep(self) -> None:
        message = self.refused(*self.base("--experts", "6", "--ep", "4"))
        self.assertIn("6 experts are not divisible by --ep 4", message)

    def test_sequence_beyond_positions(self) -> None:
        self.assertIn(
            "beyond the model's 2048 positions",
            self.refused(*self.base("--seq-len", "4096")),
        )

    def test_empty_or_unreadable_data(self) -> None:
        directory = os.path.dirname(self.run_dir())
        empty = os.path.join(directory, "empty.jsonl")
        open(empty, "w").close()
        bad = os.path.join(directory, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"text": "fine"}\nnot json\n')
        tok = os.path.join(corpus(), "tokenizer")
        common = [
            "--model-type",
            "qwen3_moe",
            "--tokenizer",
            tok,
            "--run-dir",
            self.run_dir(),
        ]
        self.assertIn("holds no document", self.refused(*common, "--data", empty))
        self.assertIn(
            "no such file",
            self.refused(*common, "--data", os.path.join(directory, "missing.jsonl")),
        )
        self.assertIn(
            "bad.jsonl:2: not a JSON object", self.refused(*common, "--data", bad)
        )
        tokens = os.path.join(directory, "tokens.bin")
        open(tokens, "wb").close()
        self.assertIn(
            "is empty",
            self.refused(
                "--model-type",
                "qwen3_moe",
                "--data",
                tokens,
                "--run-dir",
                self.run_dir(),
            ),
        )
        with open(tokens, "wb") as f:
            f.write(b"\x01\x02\x03")
        self.assertIn(
            "not a whole number of uint16",
            self.refused(
                "--model-type",
                "qwen3_moe",
                "--data",
                tokens,
                "--run-dir",
                self.run_dir(),
            ),
        )
        if os.geteuid() != 0:  # root reads anything
            os.chmod(bad, 0)
            self.assertIn("cannot be read", self.refused(*common, "--data", bad))

    def test_vocabulary_too_small(self) -> None:
        message = self.refused(*self.base("--vocab-size", "100"))
        self.assertIn(
            "has 512 tokens, more than the model's vocabulary of 100", message
        )
        tokens = os.path.join(os.path.dirname(self.run_dir()), "tokens.bin")
        np.arange(1000, dtype=np.uint16).tofile(tokens)
        message = self.refused(
            "--model-type",
            "qwen3_moe",
            "--data",
            tokens,
            "--vocab-size",
            "500",
            "--run-dir",
            self.run_dir(),
        )
        self.assertIn(
            "holds token id 999, beyond the model's vocabulary of 500", message
        )

    def test_export_directory_in_use(self) -> None:
        export = os.path.join(os.path.dirname(self.run_dir()), "export")
        os.makedirs(export)
        open(os.path.join(export, "config.json"), "w").close()
        self.assertIn(
            "--overwrite-export", self.refused(*self.base("--export", export))
        )

    def test_checkpoint_of_another_model(self) -> None:
        """Refused, naming the keys, and nothing of the run directory changes."""
        import torch.distributed.checkpoint as dcp

        run_dir = self.run_dir()
        other = train.tiny_config("qwen3_moe", vocab_size=512, hidden_size=64, layers=3)
        model = _model.initial_model(other, 0)
        path = os.path.join(run_dir, "checkpoints", "step-00000002")
        with mock.patch("warnings.warn"):
            dcp.save({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n")
        before = _snapshot(run_dir)
        message = self.refused(*self.base()[:-2], "--run-dir", run_dir)
        self.assertIn("keys of the model missing from the checkpoint", message)
        self.assertIn("model.layers.3.mlp.experts.gate_up_proj", message)
        self.assertIn("--no-resume", message)
        self.assertEqual(_snapshot(run_dir), before)

    def test_conflicting_flags(self) -> None:
        self.assertIn(
            "give the model", self.refused(*text_flags(), "--run-dir", self.run_dir())
        )
        self.assertIn("--run-dir DIR is required", self.refused(*self.base()[:-2]))
        self.assertIn(
            "give the data",
            self.refused(*self.base("--synthetic-data")),
        )
        dense = self.refused(
            "--model-type",
            "llama",
            *text_flags(),
            "--ep",
            "2",
            "--run-dir",
            self.run_dir(),
        )
        self.assertIn("--ep 2: expert parallelism needs a MoE model", dense)
        self.assertIn(
            "needs --router-aux-loss-coef",
            self.refused(*self.base("--router-aux-loss", "sequence")),
        )
        self.assertIn(
            "e_score_correction_bias",
            self.refused(*self.base("--expert-bias-rate", "0.001")),
        )
        self.assertIn(
            "cannot be cut into --microbatches 3",
            self.refused(*self.base("--microbatches", "3")),
        )
        # refused after the text was tokenized into the run directory: it goes again
        self.assertIn(
            "fewer than one step's --batch-size 1000000",
            self.refused(*self.base("--batch-size", "1000000")),
        )
        with tempfile.NamedTemporaryFile() as f:
            self.assertIn(
                "cannot create it or write there",
                self.refused(
                    *self.base()[:-2], "--run-dir", os.path.join(f.name, "run")
                ),
            )


def _snapshot(directory: str) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            st = os.stat(path)
            out[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainPartsTest(_RunDirTest):
    def test_documents_packed_with_eos(self) -> None:
        directory = os.path.dirname(self.run_dir())
        tok = transformers.AutoTokenizer.from_pretrained(
            os.path.join(corpus(), "tokenizer")
        )
        docs = ["first document", "the second one", "third"]
        jsonl = os.path.join(directory, "d.jsonl")
        with open(jsonl, "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n\n" for d in docs)
        texts = []
        for i, d in enumerate(docs):
            texts.append(os.path.join(directory, f"{i}.txt"))
            with open(texts[-1], "w") as f:
                f.write(d)
        want = [
            t
            for d in docs
            for t in (*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id)
        ]
        for paths in ([jsonl], texts):
            fingerprint = _data.files_fingerprint(
                paths, os.path.join(corpus(), "tokenizer"), "text"
            )
            stream = _data.tokenized_stream(
                _data.documents(paths, "text"), tok, fingerprint, directory
            )
            self.assertEqual(stream.open().tolist(), want)
            self.assertEqual(stream.dtype, "uint16")

    def test_sequences_order_and_shards(self) -> None:
        path = os.path.join(os.path.dirname(self.run_dir()), "t.bin")
        np.arange(100, dtype=np.uint32).tofile(path)
        stream = _data.binary_stream(path, "uint32")
        seqs = _data.Sequences(stream, seq_len=4, seed=3, shuffle=True)
        self.assertEqual(seqs.num_sequences, 25)
        # every epoch a permutation of all sequences, different epochs differently
        for epoch in range(2):
            order = [seqs.sequence_index(epoch * 25 + i) for i in range(25)]
            self.assertEqual(sorted(order), list(range(25)))
        self.assertNotEqual(
            [seqs.sequence_index(i) for i in range(25)],
            [seqs.sequence_index(25 + i) for i in range(25)],
        )
        # the data ranks' blocks are the global batch, in any layout; a batch across the epoch boundary
        for position in (0, 20):
            whole = seqs.batch(position, 8, 0, 1)
            for ranks in (2, 4):
                parts = [seqs.batch(position, 8, r, ranks) for r in range(ranks)]
                self.assertTrue(torch.equal(torch.cat(parts), whole))
            self.assertTrue(
                torch.equal(
                    whole[:, 1:] - whole[:, :-1], torch.ones(8, 3, dtype=torch.int64)
                )
            )
        again = _data.Sequences(stream, seq_len=4, seed=3, shuffle=True)
        self.assertTrue(torch.equal(again.batch(20, 8, 1, 2), seqs.batch(20, 8, 1, 2)))
        plain = _data.Sequences(stream, seq_len=4, seed=3, shuffle=False)
        self.assertEqual(
            plain.batch(26, 2, 0, 1).tolist(), [[4, 5, 6, 7], [8, 9, 10, 11]]
        )

    def test_checkpoint_directories(self) -> None:
        run_dir = self.run_dir()
        ckpts = _checkpoints.RunCheckpoints(run_dir)
        self.assertIsNone(ckpts.latest())

        def write(step: int) -> None:
            path = ckpts.begin(step)
            open(os.path.join(path, _checkpoints.METADATA), "w").close()

        write(2)
        self.assertIsNone(ckpts.latest())  # partial: not a checkpoint yet
        ckpts.commit(2)
        write(4)
        ckpts.commit(4)
        ckpts.begin(6)  # a crash while writing step 6
        removing = ckpts.path(8, _checkpoints.CheckpointState.REMOVING)
        os.makedirs(removing)
        open(os.path.join(removing, _checkpoints.METADATA), "w").close()
        os.makedirs(
            ckpts.path(5, _checkpoints.CheckpointState.COMPLETE)
        )  # no .metadata
        self.assertEqual(ckpts.latest().step, 4)
        self.assertEqual([c.step for c in ckpts.complete()], [2, 4])
        self.assertEqual(ckpts.prune(1), [2])
        self.assertEqual(
            sorted(os.listdir(ckpts.root)), ["step-00000004", "step-00000005"]
        )
        ckpts.begin(7)  # no rank wrote it
        with self.assertRaisesRegex(RuntimeError, "no .metadata"):
            ckpts.commit(7)
        ckpts.clear()
        self.assertEqual(os.listdir(ckpts.root), [])
        self.assertIsNotNone(lock := _checkpoints.lock_run_dir(run_dir))
        self.assertIsNone(_checkpoints.lock_run_dir(run_dir))  # another job
        lock.close()

    def test_check_checkpoint_without_process_group(self) -> None:
        """hf.check_checkpoint: a checkpoint of the whole model passes, one of
        another model is refused naming the keys and shapes."""
        import torch.distributed.checkpoint as dcp

        config = train.tiny_config("qwen3_moe", vocab_size=64, hidden_size=32, layers=2)
        path = os.path.join(os.path.dirname(self.run_dir()), "ckpt")
        with mock.patch("warnings.warn"):
            dcp.save(
                {"model": _model.initial_model(config, 0).state_dict()},
                checkpoint_id=path,
                no_dist=True,
            )
        hf.check_checkpoint(config, path)
        hf.check_checkpoint(hf.meta_causal_lm(config), path)
        config.num_experts = 4
        with self.assertRaisesRegex(
            ValueError,
            r"experts.gate_up_proj': saved \[8, 256, 32\], here \[4, 256, 32\]",
        ):
            hf.check_checkpoint(config, path)
        with self.assertRaises(FileNotFoundError):
            hf.check_checkpoint(config, os.path.join(path, "missing"))

    def test_synthetic_sequences(self) -> None:
        """--synthetic-data: every sequence follows one permutation of the
        vocabulary from its first id, and the file is the same for a seed."""
        directory = os.path.dirname(self.run_dir())
        stream = _data.synthetic_stream(64, 16, 40, 7, directory)
        ids = torch.from_numpy(stream.open().astype(np.int64)).view(40, 16)
        successor: dict[int, int] = {}
        for a, b in zip(ids[:, :-1].flatten().tolist(), ids[:, 1:].flatten().tolist()):
            self.assertEqual(successor.setdefault(a, b), b)
        self.assertEqual(len(set(successor.values())), len(successor))  # one-to-one
        self.assertGreater(len(set(ids[:, 0].tolist())), 1)
        again = _data.synthetic_stream(64, 16, 40, 7, os.path.join(directory, "again"))
        self.assertTrue(np.array_equal(again.open(), stream.open()))

    def test_learning_rate_schedule(self) -> None:
        factors = [
            _state.lr_factor(s, steps=10, warmup=2, min_ratio=0.1) for s in range(12)
        ]
        want = [lr_at(s, 10, 2, 1.0, 0.1) for s in range(12)]
        torch.testing.assert_close(torch.tensor(factors), torch.tensor(want))
        self.assertEqual(factors[1], 1.0)
        self.assertAlmostEqual(factors[10], 0.1)

    def test_built_from_public_names(self) -> None:
        """The trainer imports no private name of the package but its own."""
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from test_public_api import _imports, _private_parts

        offenders = []
        for path in glob.glob(
            os.path.join(REPO, "torch_pipelining_ext", "train", "*.py")
        ):
            with open(path) as f:
                for module, name in _imports(f.read()):
                    if module.startswith("torch_pipelining_ext.train"):
                        continue
                    if _private_parts(module, name):
                        offenders.append(f"{os.path.basename(path)}: {module}.{name}")
        self.assertEqual(offenders, [])

    @unittest.skipUnless(importlib.util.find_spec("datasets"), "datasets is optional")
    def test_local_dataset(self) -> None:
        import datasets

        directory = os.path.dirname(self.run_dir())
        with open(os.path.join(corpus(), "docs.jsonl")) as f:
            texts = [json.loads(line)["text"] for line in f]
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(
            os.path.join(directory, "ds")
        )
        plans = []
        for source in (
            ["--dataset", os.path.join(directory, "ds")],
            ["--data", os.path.join(corpus(), "docs.jsonl")],
        ):
            args = train.build_parser().parse_args(
                [
                    "--model-type",
                    "qwen3_moe",
                    "--tokenizer",
                    os.path.join(corpus(), "tokenizer"),
                    *source,
                    "--run-dir",
                    self.run_dir(),
                ]
            )
            plans.append(make_plan(args, check_options(args, {})))
        self.assertEqual(
            plans[0].stream.open().tolist(), plans[1].stream.open().tolist()
        )


if __name__ == "__main__":
    run_tests()
