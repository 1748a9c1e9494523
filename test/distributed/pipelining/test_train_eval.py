# Owner(s): ["oncall: distributed"]
"""``python -m torch_pipelining_ext.train``: evaluation on held-out data,
TensorBoard, peak memory and the run's configuration.

* Default run (``TrainEvalTest``): PP=1 x EP=2, a tiny Qwen3-MoE whose
  attention drops out, on real text; a run holding out one batch and one
  that also evaluates it every two steps train bitwise the same losses,
  gradient norms and expert loads; the evaluation loss equals the unsplit
  exported model's loss on the held-out sequences; the TensorBoard events
  are ``metrics.jsonl``'s scalars; each record has every rank's peak memory;
  ``config.json`` has the flags, the model config, the versions and the git
  revision; a resume with another split is refused.
* ``TrainEvalSlowTest`` (``PYTORCH_TEST_WITH_SLOW=1``): the same bitwise
  comparison in PP=2 x EP=2 (DualPipeV, concurrent OVERLAP_F_B) with
  DeepSeek-V3's bias update and a router auxiliary loss, and in PP=1 x DP=2
  x EP=2 (FSDP2); a run resumed from its checkpoint evaluates the same
  numbers bitwise as the uninterrupted one, its TensorBoard events purged
  after the checkpoint (one event per step and tag).
* Pieces (``TrainEvalPartsTest``): the held-out split, the flags' checks,
  TensorBoard's tags, the memory probe, the git revision, the plot.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import unittest
from typing import Any
from unittest import mock

import numpy as np
import torch
from common_pipelining import REPO, slow_only
from test_train import (
    _NEEDS,
    _TINY,
    _TINY_MODEL,
    flag,
    HAS_FUSED,
    run_main,
    text_flags,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext  # patches torch


try:
    import transformers

    from torch_pipelining_ext import train
    from torch_pipelining_ext.train import _data, _model, _options, _plot, _runlog
    from torch_pipelining_ext.train._options import build_parser, check_options
    from torch_pipelining_ext.train._options import UsageError
except ImportError:
    pass

try:
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    HAS_TENSORBOARD = True
except ImportError:
    HAS_TENSORBOARD = False


_LOSS_TOLERANCE = dict(atol=2e-5, rtol=2e-5)
# the fields a run with evaluation adds; everything else must be equal bitwise
_EVAL_FIELDS = ("eval_loss", "eval_perplexity")
_COMPARED = ("step", "loss", "lr", "grad_norm", "imbalance", "data_position")


def held_out_ids(run_dir: str, argv: list[str]) -> list[torch.Tensor]:
    """The held-out batches, read here from the token file: the stream's last
    ``--eval-batches x --batch-size`` sequences, in file order."""
    (path,) = glob.glob(os.path.join(run_dir, "data", "tokens-*.bin"))
    dtype = np.uint16 if ".uint16." in path else np.uint32
    ids = np.fromfile(path, dtype=dtype).astype(np.int64)
    seq_len, batch = int(flag(argv, "--seq-len")), int(flag(argv, "--batch-size"))
    k = int(flag(argv, "--eval-batches"))
    n = len(ids) // seq_len
    seqs = torch.from_numpy(ids[: n * seq_len]).view(n, seq_len)
    first = n - k * batch
    return [seqs[first + j * batch : first + (j + 1) * batch] for j in range(k)]


def metrics(run_dir: str) -> list[dict[str, Any]]:
    return train.read_metrics(run_dir)


class _RunDirTest(TestCase):
    def tmp(self) -> str:
        import tempfile

        root = tempfile.mkdtemp(prefix="train_eval_test_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        return root

    def model_with_dropout(self, root: str, model_type: str = "qwen3_moe") -> str:
        """A tiny Hugging Face directory whose attention drops out: random
        numbers matter, and evaluation (in eval mode) must not move them."""
        config = train.tiny_config(model_type, vocab_size=512, hidden_size=64)
        config.attention_dropout = 0.1
        path = os.path.join(root, f"model-{model_type}")
        _model.initial_model(config, 0).save_pretrained(path)
        return path

    def assert_same_training(
        self, without: list[dict[str, Any]], with_eval: list[dict[str, Any]]
    ) -> None:
        """Every training number of the two runs bitwise equal."""
        self.assertEqual(len(without), len(with_eval))
        for a, b in zip(without, with_eval):
            for key in _COMPARED:
                # repr: bitwise (TestCase.assertEqual compares floats with a tolerance)
                self.assertEqual(repr(a[key]), repr(b[key]), f"step {a['step']}: {key}")
            self.assertIsNone(a["eval_loss"])

    def check_tensorboard(self, tb: str, records: list[dict[str, Any]]) -> None:
        events = EventAccumulator(tb, size_guidance={"scalars": 0})
        events.Reload()
        want: dict[str, list[tuple[int, float]]] = {}
        for r in records:
            for tag, value in _runlog.scalars(r).items():
                want.setdefault(tag, []).append((r["step"], float(np.float32(value))))
        self.assertIn("loss", want)
        self.assertIn("eval_loss", want)
        self.assertIn("peak_rss_mib/1", want)
        self.assertEqual(sorted(events.Tags()["scalars"]), sorted(want))
        for tag, points in want.items():
            got = [(e.step, e.value) for e in events.Scalars(tag)]
            self.assertEqual(got, points, tag)

    def assert_eval_steps(
        self, records: list[dict[str, Any]], every: int, steps: int
    ) -> None:
        want = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
        got = [r["step"] for r in records if r["eval_loss"] is not None]
        self.assertEqual(got, want)
        for r in records:
            if r["eval_loss"] is not None:
                self.assertEqual(r["eval_perplexity"], math.exp(r["eval_loss"]))


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainEvalTest(_RunDirTest):
    def test_eval_tensorboard_memory_config(self) -> None:
        """PP=1 x EP=2: evaluation leaves training bitwise alone and equals
        the unsplit model's held-out loss; TensorBoard, memory, config."""
        root = self.tmp()
        model = self.model_with_dropout(root)
        base = ["--model", model, *text_flags(), *_TINY, "--ep", "2", "--steps", "3"]
        common = [*base, "--eval-batches", "1"]
        plain = os.path.join(root, "plain")
        rc, err = run_main(*common, "--run-dir", plain)
        self.assertEqual(rc, 0, err)
        run_dir, export = os.path.join(root, "eval"), os.path.join(root, "export")
        tb = os.path.join(root, "tb")
        argv = [
            *common, "--eval-every", "2", "--run-dir", run_dir, "--export", export,
            *(["--tensorboard", tb] if HAS_TENSORBOARD else []),
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        records = metrics(run_dir)
        self.assert_same_training(metrics(plain), records)
        self.assert_eval_steps(records, every=2, steps=3)

        # the last evaluation: the exported (unsplit) model on the held-out data
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            export, dtype=torch.float32
        )
        hf_model.eval()
        with torch.no_grad():
            want = [
                hf_model(input_ids=ids, labels=ids).loss.item()
                for ids in held_out_ids(run_dir, argv)
            ]
        torch.testing.assert_close(
            torch.tensor(records[-1]["eval_loss"]),
            torch.tensor(sum(want) / len(want)),
            **_LOSS_TOLERANCE,
        )
        # the held-out sequences were never trained on: the data position's
        # sequences all lie before them
        data = _data.Sequences(
            _data.binary_stream(
                glob.glob(os.path.join(run_dir, "data", "tokens-*.bin"))[0], "uint16"
            ),
            32,
            0,
            True,
            held_out=16,
        )
        used = {data.sequence_index(p) for p in range(records[-1]["data_position"])}
        self.assertLess(max(used), data.num_sequences)

        # every rank's peak memory, every step (CPU: no device memory)
        for r in records:
            self.assertEqual(len(r["peak_rss_mib"]), 2)
            self.assertTrue(all(v > 10 for v in r["peak_rss_mib"]), r)
            self.assertIsNone(r["peak_device_mib"])

        if HAS_TENSORBOARD:  # the test extra has it
            self.check_tensorboard(tb, records)
        self._check_config(run_dir, argv)
        self.assertTrue(os.path.isfile(os.path.join(run_dir, "training.png")))
        self.assertFalse(os.path.exists(os.path.join(plain, "tb")))

        # a resume with another split is refused (the training data would change)
        for split in (["--eval-batches", "2", "--eval-every", "2"], []):
            rc, err = run_main(*base, *split, "--steps", "4", "--run-dir", run_dir)
            self.assertEqual(rc, 2, err)
            self.assertIn("sequences held out for evaluation", err)
        self.assertEqual(metrics(run_dir), records)  # nothing of the run changed

    def _check_config(self, run_dir: str, argv: list[str]) -> None:
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
        args = config["args"]
        self.assertEqual(args["eval_every"], 2)
        self.assertEqual(args["eval_batches"], 1)
        self.assertEqual(args["lr"], float(flag(argv, "--lr")))
        self.assertEqual(args["warmup_steps"], 2)  # applied defaults are there too
        self.assertEqual(args["weight_decay"], 0.1)
        self.assertEqual(config["layout"]["ep"], 2)
        self.assertEqual(config["model_config"]["vocab_size"], 512)
        self.assertEqual(config["model_config"]["attention_dropout"], 0.1)
        self.assertEqual(config["data"]["held_out_sequences"], 16)
        versions = config["versions"]
        self.assertEqual(versions["torch"], torch.__version__)
        self.assertEqual(versions["transformers"], transformers.__version__)
        self.assertEqual(
            versions["torch_pipelining_ext"], torch_pipelining_ext.__version__
        )
        revision = _git_head(os.path.dirname(torch_pipelining_ext.__file__))
        if revision is None:
            self.assertIsNone(config["git"])
            self.assertIn("git", config["git_omitted"])
        else:
            self.assertEqual(config["git"]["revision"], revision)
            self.assertIsInstance(config["git"]["dirty"], bool)


def _git_head(directory: str) -> str | None:
    init = os.path.join(directory, "__init__.py")
    try:
        subprocess.run(
            ["git", "-C", directory, "ls-files", "--error-unmatch", init],
            capture_output=True,
            check=True,
        )
        return subprocess.run(
            ["git", "-C", directory, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


_SLOW_LAYOUTS = {
    # DualPipeV over 4 stages, its OVERLAP_F_B concurrent; the bias update and
    # an auxiliary loss (the evaluation loss leaves its term out)
    "pp2_ep2": [
        "--pp", "2", "--ep", "2", "--microbatches", "4",
        "--expert-bias-rate", "0.01", "--router-aux-loss", "sequence",
        "--router-aux-loss-coef", "0.001",
    ],
    "pp1_dp2_ep2": ["--dp", "2", "--ep", "2"],  # FSDP2 over dp x ep
}  # fmt: skip


@unittest.skipUnless(HAS_FUSED, _NEEDS)
@slow_only("slow: PYTORCH_TEST_WITH_SLOW=1")
@instantiate_parametrized_tests
class TrainEvalSlowTest(_RunDirTest):
    @parametrize("layout", list(_SLOW_LAYOUTS))
    def test_eval_leaves_training_alone(self, layout: str) -> None:
        root = self.tmp()
        model_type = "deepseek_v3" if layout == "pp2_ep2" else "qwen3_moe"
        model = self.model_with_dropout(root, model_type)
        common = [
            "--model", model, *text_flags(), *_TINY, *_SLOW_LAYOUTS[layout],
            "--steps", "4", "--eval-batches", "2",
        ]  # fmt: skip
        runs = {}
        for name, extra in (("plain", []), ("eval", ["--eval-every", "1"])):
            run_dir = os.path.join(root, name)
            rc, err = run_main(*common, *extra, "--run-dir", run_dir)
            self.assertEqual(rc, 0, err)
            runs[name] = metrics(run_dir)
        self.assert_same_training(runs["plain"], runs["eval"])
        self.assert_eval_steps(runs["eval"], every=1, steps=4)
        losses = [r["eval_loss"] for r in runs["eval"]]
        self.assertLess(losses[-1], losses[0])  # the held-out loss falls

    def test_resume_evaluates_the_same(self) -> None:
        """A run resumed from its step-2 checkpoint logs the uninterrupted
        run's losses and evaluation losses bitwise (PP=1 x EP=2)."""
        root = self.tmp()
        model = self.model_with_dropout(root)
        whole = os.path.join(root, "whole")
        argv = [
            "--model", model, *text_flags(), *_TINY, "--ep", "2", "--steps", "4",
            "--eval-batches", "1", "--eval-every", "2", "--checkpoint-every", "2",
        ]  # fmt: skip
        tb = ["--tensorboard", os.path.join(whole, "tb")] if HAS_TENSORBOARD else []
        rc, err = run_main(*argv, *tb, "--run-dir", whole)
        self.assertEqual(rc, 0, err)
        resumed = os.path.join(root, "resumed")
        shutil.copytree(whole, resumed)
        shutil.rmtree(os.path.join(resumed, "checkpoints", "step-00000004"))
        if tb:  # the copied events of steps 3 and 4 are purged on resume
            tb = ["--tensorboard", os.path.join(resumed, "tb")]
        rc, err = run_main(*argv, *tb, "--run-dir", resumed)
        self.assertEqual(rc, 0, err)
        a, b = metrics(whole), metrics(resumed)
        if tb:
            self.check_tensorboard(tb[1], b)
        self.assertEqual([r["step"] for r in b], [1, 2, 3, 4])
        for x, y in zip(a, b):
            for key in (*_COMPARED, *_EVAL_FIELDS):
                self.assertEqual(repr(x[key]), repr(y[key]), f"step {x['step']}: {key}")
        self.assertTrue(
            os.path.isfile(os.path.join(resumed, "config-resumed-step-00000002.json"))
        )


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainEvalPartsTest(_RunDirTest):
    def _stream(self, sequences: int, seq_len: int = 4) -> Any:
        path = os.path.join(self.tmp(), "t.bin")
        np.arange(sequences * seq_len, dtype=np.uint16).tofile(path)
        return _data.binary_stream(path, "uint16")

    def test_held_out_split(self) -> None:
        stream = self._stream(20)
        for shuffle in (False, True):
            plain = _data.Sequences(stream, 4, 3, shuffle)
            held = _data.Sequences(stream, 4, 3, shuffle, held_out=6)
            self.assertEqual((plain.num_sequences, held.num_sequences), (20, 14))
            # training reads only the first 14, over several epochs
            seen = {held.sequence_index(p) for p in range(3 * 14)}
            self.assertEqual(seen, set(range(14)))
            # held-out batches: the last sequences in file order, sharded as a
            # training batch is
            rows = [held.held_out_batch(j, 3, r, 3) for j in range(2) for r in range(3)]
            got = torch.cat(rows)[:, 0].div(4, rounding_mode="floor").tolist()
            self.assertEqual(got, list(range(14, 20)))
            with self.assertRaises(IndexError):
                held.held_out_batch(2, 3, 0, 1)

    def test_flags(self) -> None:
        base = [
            "--model-type", "qwen3_moe", "--synthetic-data", "--run-dir",
            os.path.join(self.tmp(), "run"),
        ]  # fmt: skip
        for extra, message in (
            (["--eval-every", "2"], "needs --eval-batches"),
            (["--eval-every", "0", "--eval-batches", "1"], "--eval-every must be"),
            (["--eval-batches", "0"], "--eval-batches must be"),
        ):
            args = build_parser().parse_args([*base, *extra])
            with self.assertRaisesRegex(UsageError, message):
                check_options(args, environ={})
        args = build_parser().parse_args(
            [*base, "--eval-every", "2", "--eval-batches", "1"]
        )
        check_options(args, environ={})
        # too much held out: exit status 2 before any rank starts
        run_dir = os.path.join(self.tmp(), "run")
        rc, err = run_main(
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL,
            "--eval-batches", "100000", "--run-dir", run_dir,
        )  # fmt: skip
        self.assertEqual(rc, 2, err)
        self.assertIn("fewer than one training batch", err)
        self.assertFalse(os.path.exists(run_dir))

    def test_tensorboard_missing(self) -> None:
        args = build_parser().parse_args(
            ["--model-type", "qwen3_moe", "--synthetic-data", "--tensorboard", "tb"]
        )
        with mock.patch("importlib.util.find_spec", return_value=None):
            self.assertIn("pip install", _options.check_tensorboard(args))

    def test_scalars(self) -> None:
        record = {
            "step": 3, "loss": 2.5, "imbalance": None, "eval_loss": None,
            "tokens": 512, "peak_rss_mib": [10.0, 12.5], "peak_device_mib": None,
            "flag": True,
        }  # fmt: skip
        self.assertEqual(
            _runlog.scalars(record),
            {
                "loss": 2.5,
                "tokens": 512.0,
                "peak_rss_mib/0": 10.0,
                "peak_rss_mib/1": 12.5,
            },
        )

    def test_memory_probe_resets_each_step(self) -> None:
        probe = _runlog.MemoryProbe(torch.device("cpu"))
        probe.start_step()
        before, device = probe.peaks()
        self.assertIsNone(device)
        block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
        during, _ = probe.peaks()
        self.assertGreaterEqual(during, before + 60)
        del block
        if not probe.resettable:
            self.skipTest("the peak resident set cannot be reset here")
        probe.start_step()
        after, _ = probe.peaks()
        self.assertLess(after, during - 60)

    def test_git_revision_omitted_outside_a_checkout(self) -> None:
        copy = os.path.join(self.tmp(), "torch_pipelining_ext")
        os.makedirs(copy)
        open(os.path.join(copy, "__init__.py"), "w").close()
        with mock.patch.object(
            torch_pipelining_ext, "__file__", os.path.join(copy, "__init__.py")
        ):
            git, why = _runlog.git_revision()
        self.assertIsNone(git)
        self.assertIsInstance(why, str)
        head = _git_head(os.path.join(REPO, "torch_pipelining_ext"))
        if head is not None and os.path.dirname(
            torch_pipelining_ext.__file__
        ) == os.path.join(REPO, "torch_pipelining_ext"):
            git, why = _runlog.git_revision()
            self.assertEqual(git["revision"], head)
            self.assertIsNone(why)

    def test_plot_with_evaluation(self) -> None:
        """The loss panel draws the held-out loss too; a perplexity panel is
        added; no panel says "no MoE layer" when every record has a load."""
        if importlib_missing("matplotlib"):
            self.skipTest("matplotlib is not installed")
        import matplotlib.axes

        records = [
            {"step": s, "loss": 3.0 - s / 10, "grad_norm": 1.0, "tokens_per_s": 100.0,
             "imbalance": 1.5, "eval_loss": (3.1 - s / 10) if s % 2 == 0 else None,
             "eval_perplexity": math.exp(3.1 - s / 10) if s % 2 == 0 else None}
            for s in range(1, 5)
        ]  # fmt: skip
        drawn: list[tuple[str, list[float]]] = []
        texts: list[str] = []
        plot, text = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.text

        def spy_plot(ax: Any, *args: Any, **kwargs: Any) -> Any:
            drawn.append((ax.get_ylabel(), list(args[1])))
            return plot(ax, *args, **kwargs)

        def spy_text(ax: Any, x: float, y: float, s: str, **kwargs: Any) -> Any:
            texts.append(s)
            return text(ax, x, y, s, **kwargs)

        path = os.path.join(self.tmp(), "p.png")
        with (
            mock.patch.object(matplotlib.axes.Axes, "plot", spy_plot),
            mock.patch.object(matplotlib.axes.Axes, "text", spy_text),
        ):
            self.assertTrue(_plot.plot_run(records, path, "t"))
        self.assertGreater(os.path.getsize(path), 1000)
        self.assertEqual(texts, [])
        self.assertEqual(len(drawn), 6)  # 5 panels, the loss panel twice
        self.assertIn([2.9, 2.7], [values for _, values in drawn])  # held-out losses
        self.assertEqual(drawn[-1][1], [math.exp(2.9), math.exp(2.7)])


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    run_tests()
