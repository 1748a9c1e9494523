# Owner(s): ["oncall: distributed"]
"""The trainer balances MoE routers by default (``[Note: balanced by
default]`` in ``torch_pipelining_ext/train/_balance.py``).

* ``TrainBalanceSettingTest``: which balancing a run gets (the tiny recipes'
  defaults, a model directory's config, flags over them, the record of the
  checkpoint a run resumes, refused conflicts), without any rank.
* ``CollapseWatchTest``: the threshold of a collapsed layer and the warning,
  said once, on step records.
* ``TrainBalanceRunTest``: the default run of a tiny Qwen3-MoE (PP=1 x EP=2)
  trains the per-layer loss at 0.02: every step's loss is the unsplit
  model's with transformers' ``load_balancing_loss_func`` applied to each
  layer alone; ``metrics.jsonl`` holds every layer's load; the checkpoint
  records the setting.
* ``TrainBalanceSlowTest`` (``PYTORCH_TEST_WITH_SLOW=1``): a resumed run
  keeps the balancing it was trained with (bitwise) and refuses a flag that
  contradicts it; DeepSeek-V3's default is its sequence loss plus the bias
  update; a run whose routers stay collapsed says so once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import unittest
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from common_pipelining import local_ranks_env, REPO, slow_only
from test_train import (
    _NEEDS,
    _RunDirTest,
    _TINY,
    _TINY_MODEL,
    HAS_FUSED,
    exported,
    losses_of,
    reference_run,
    run_main,
    text_flags,
)
from torch.testing._internal.common_utils import run_tests, TestCase

import torch_pipelining_ext  # noqa: F401  (patches torch)


try:
    from torch_pipelining_ext import train
    from torch_pipelining_ext.train import _balance, _checkpoints
    from torch_pipelining_ext.train._metrics import StepRecord
    from torch_pipelining_ext.train._options import build_parser, UsageError
except ImportError:
    pass

_TIMEOUT_S = 600


def _args(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def _tiny(model_type: str) -> Any:
    return train.tiny_config(model_type, vocab_size=64, hidden_size=64)


def _setting(args: Any) -> tuple[str, float | None, float]:
    return (args.router_aux_loss, args.router_aux_loss_coef, args.expert_bias_rate)


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainBalanceSettingTest(_RunDirTest):
    def resolved(
        self,
        *argv: str,
        config: Any = None,
        resume: Any = None,
    ) -> tuple[tuple[str, float | None, float], Any]:
        args = _args(*argv)
        if config is None:
            config = _tiny(args.model_type)
        balancing = _balance.resolve(args, config, resume)
        self.assertEqual(_setting(args), tuple(balancing.values().values()))
        return _setting(args), balancing

    def test_recipe_defaults(self) -> None:
        """The tiny MoE recipes balance each layer; the dense ones have nothing
        to balance."""
        for model_type in ("qwen3_moe", "mixtral"):
            self.assertEqual(
                self.resolved("--model-type", model_type)[0], ("per_layer", 0.02, 0.0)
            )
        self.assertEqual(
            self.resolved("--model-type", "deepseek_v3")[0], ("sequence", 1e-4, 1e-2)
        )
        for model_type in ("qwen3", "llama"):
            self.assertEqual(
                self.resolved("--model-type", model_type)[0], ("none", None, 0.0)
            )
        # transformers 4.x: the stages record no router logits
        with mock.patch.object(_balance.hf, "has_fused_experts", return_value=False):
            self.assertEqual(
                self.resolved("--model-type", "qwen3_moe")[0], ("none", None, 0.0)
            )
        # the comparison with the unsplit model trains without
        self.assertEqual(
            self.resolved("--model-type", "qwen3_moe", "--compare-sequential")[0],
            ("none", None, 0.0),
        )

    def test_model_directory_keeps_its_config(self) -> None:
        config = _tiny("qwen3_moe")
        self.assertFalse(config.output_router_logits)
        self.assertEqual(
            self.resolved("--model", "m", config=config)[0], ("none", None, 0.0)
        )
        config.output_router_logits, config.router_aux_loss_coef = True, 0.005
        self.assertEqual(
            self.resolved("--model", "m", config=config)[0], ("pooled", 0.005, 0.0)
        )
        self.assertEqual(
            self.resolved("--model", "m", "--compare-sequential", config=config)[0],
            ("pooled", 0.005, 0.0),
        )
        # an explicit none turns the config's pooled loss off in the stages too
        self.assertEqual(
            self.resolved("--model", "m", "--router-aux-loss", "none", config=config)[
                0
            ],
            ("none", None, 0.0),
        )
        self.assertFalse(config.output_router_logits)

    def test_flags_over_the_defaults(self) -> None:
        q = ("--model-type", "qwen3_moe")
        d = ("--model-type", "deepseek_v3")
        cases = [
            ((*q, "--router-aux-loss-coef", "0.05"), ("per_layer", 0.05, 0.0)),
            ((*q, "--router-aux-loss", "pooled"), ("pooled", 0.001, 0.0)),  # HF's coef
            ((*q, "--router-aux-loss", "none"), ("none", None, 0.0)),
            ((*d, "--router-aux-loss", "none"), ("none", None, 1e-2)),
            ((*d, "--expert-bias-rate", "0"), ("sequence", 1e-4, 0.0)),
            ((*d, "--router-aux-loss", "sequence"), ("sequence", 1e-4, 1e-2)),
        ]
        for argv, want in cases:
            self.assertEqual(self.resolved(*argv)[0], want, argv)
        with self.assertRaisesRegex(UsageError, "needs --router-aux-loss-coef"):
            self.resolved(*q, "--router-aux-loss", "sequence")
        with self.assertRaisesRegex(UsageError, "without an auxiliary loss"):
            self.resolved("--model-type", "llama", "--router-aux-loss-coef", "0.1")
        with self.assertRaisesRegex(UsageError, "without an auxiliary loss"):
            self.resolved(*q, "--compare-sequential", "--router-aux-loss-coef", "0.1")

    def checkpoint(self, record: dict[str, Any] | None) -> Any:
        root = os.path.join(self.dir, "checkpoints", "step-00000004")
        os.makedirs(root)
        if record is not None:
            with open(os.path.join(root, _balance.BALANCING_FILE), "w") as f:
                json.dump(record, f)
        return _checkpoints.Checkpoint(4, root, _checkpoints.CheckpointState.COMPLETE)

    def setUp(self) -> None:
        super().setUp()
        self.dir = self.run_dir()

    def test_resume_keeps_the_record(self) -> None:
        """A resumed run trains with its checkpoint's balancing; a flag that
        names another is refused; a checkpoint without a record resumes with
        the defaults."""
        q = ("--model-type", "qwen3_moe", "--run-dir", self.dir)
        pooled = dict(
            router_aux_loss="pooled", router_aux_loss_coef=0.01, expert_bias_rate=0.0
        )
        resume = self.checkpoint(pooled)
        self.assertEqual(resume.step, 4)
        setting, balancing = self.resolved(*q, resume=resume)
        self.assertEqual(setting, ("pooled", 0.01, 0.0))
        self.assertIn("step 4", balancing.describe())
        # a comparison trains the initial weights: the record does not apply
        self.assertEqual(
            self.resolved(*q, "--compare-sequential", resume=resume)[0],
            ("none", None, 0.0),
        )
        # flags that agree with the record
        self.assertEqual(
            self.resolved(*q, "--router-aux-loss", "pooled", resume=resume)[0],
            ("pooled", 0.01, 0.0),
        )
        for conflict in (
            ["--router-aux-loss", "per_layer"],
            ["--router-aux-loss-coef", "0.02"],
            ["--router-aux-loss", "none"],
        ):
            with self.assertRaises(UsageError) as refused:
                self.resolved(*q, *conflict, resume=resume)
            message = str(refused.exception)
            self.assertIn(
                "was trained with --router-aux-loss pooled --router-aux-loss-coef 0.01",
                message,
            )
            self.assertIn(f"gives {' '.join(conflict)}", message)
            self.assertIn("--no-resume", message)

    def test_resume_without_a_record(self) -> None:
        resume = self.checkpoint(None)
        self.assertEqual(
            self.resolved(
                "--model-type", "qwen3_moe", "--run-dir", self.dir, resume=resume
            )[0],
            ("per_layer", 0.02, 0.0),
        )

    def test_unreadable_record(self) -> None:
        resume = self.checkpoint({"router_aux_loss": "pooled"})
        with self.assertRaisesRegex(UsageError, "cannot read the balancing"):
            self.resolved("--model-type", "qwen3_moe", resume=resume)

    def test_record_round_trip(self) -> None:
        args = _args("--model-type", "deepseek_v3")
        _balance.resolve(args, _tiny("deepseek_v3"), None)
        resume = self.checkpoint(None)
        _balance.write_record(resume.path, SimpleNamespace(args=args))  # type: ignore[arg-type]
        recorded = _balance.read_record(resume.path)
        self.assertEqual(
            recorded.values(),
            dict(
                router_aux_loss="sequence",
                router_aux_loss_coef=1e-4,
                expert_bias_rate=1e-2,
            ),
        )


def _record(step: int, imbalance: float | None) -> StepRecord:
    per_layer = None if imbalance is None else {"0": 1.0, "1": imbalance}
    return StepRecord(
        step=step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=1, step_time_s=1.0,
        tokens_per_s=1.0, tokens_per_s_per_rank=1.0, imbalance=imbalance,
        imbalance_per_layer=per_layer, data_position=step, eta_s=0.0,
    )  # fmt: skip


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class CollapseWatchTest(TestCase):
    def watch(
        self,
        model_type: str = "qwen3_moe",
        aux: str = "none",
        coef: float | None = None,
        rate: float = 0.0,
    ) -> Any:
        config = _tiny(model_type)
        plan = SimpleNamespace(
            config=config,
            num_experts=8,
            args=SimpleNamespace(
                warmup_steps=10,
                router_aux_loss=aux,
                router_aux_loss_coef=coef,
                expert_bias_rate=rate,
            ),
        )
        return _balance.CollapseWatch(plan)  # type: ignore[arg-type]

    def test_threshold(self) -> None:
        self.assertAlmostEqual(_balance.collapse_threshold(8, 2), 3.7)
        self.assertAlmostEqual(_balance.collapse_threshold(4, 2), 1.9)
        self.assertEqual(_balance.collapse_threshold(256, 8), _balance.COLLAPSED)
        self.assertIsNone(_balance.collapse_threshold(2, 2))
        self.assertIsNone(_balance.collapse_threshold(0, 2))

    def feed(self, watch: Any, ratios: list[float]) -> list[tuple[int, str]]:
        said = []
        for step, ratio in enumerate(ratios, start=1):
            message = watch.observe(_record(step, ratio))
            if message is not None:
                said.append((step, message))
        return said

    def test_said_once_after_the_warm_up(self) -> None:
        """The README's tiny run without balancing (4.00 from step 8): said at
        step 10 + COLLAPSED_STEPS, once, naming the per-layer loss."""
        ratios = [2.1, 2.5, 2.3, 3.1, 3.9, 3.96, 3.99] + [4.0] * 53
        said = self.feed(self.watch(), ratios)
        self.assertEqual([s for s, _ in said], [10 + _balance.COLLAPSED_STEPS])
        message = said[0][1]
        self.assertIn("collapsed", message)
        self.assertIn(
            "--router-aux-loss per_layer --router-aux-loss-coef 0.02", message
        )
        self.assertIn("layers 1", message)
        pooled = self.feed(self.watch(aux="pooled", coef=0.02), ratios)[0][1]
        self.assertIn("pooled loss balances the layers taken together", pooled)
        per_layer = self.feed(self.watch(aux="per_layer", coef=0.02), ratios)[0][1]
        self.assertIn("larger --router-aux-loss-coef than 0.02", per_layer)
        bias = self.feed(self.watch("deepseek_v3", rate=1e-2), ratios)[0][1]
        self.assertIn("larger --expert-bias-rate than 0.01", bias)

    def test_recovering_run_says_nothing(self) -> None:
        """The README's tiny run with the per-layer loss (its measured
        imbalance, step by step): collapsed in and after the warm-up, then
        recovering; nothing said.  A dense run has nothing to say."""
        ratios = [
            2.12, 2.2, 1.92, 2.35, 3.8, 3.87, 3.9, 3.99, 3.98, 3.98, 3.97, 3.99, 4.0,
            3.99, 3.98, 3.99, 4.0, 3.99, 3.99, 3.99, 3.97, 4.0, 4.0, 3.96, 3.79, 3.99,
            3.7, 3.25, 3.54, 3.83, 3.61, 3.62, 3.45, 2.9, 2.75, 3.28, 3.31, 2.38, 2.55,
            2.06, 2.2, 2.59, 2.86, 2.07, 2.64, 2.71, 2.53, 2.29, 1.99, 1.89, 1.83, 2.07,
            1.98, 1.94, 2.28, 2.1, 2.0, 2.0, 1.87, 1.7,
        ]  # fmt: skip
        self.assertEqual(
            self.feed(self.watch("qwen3_moe", "per_layer", 0.02), ratios), []
        )
        dense = self.watch()
        dense.threshold = _balance.collapse_threshold(0, None)
        self.assertEqual(self.feed(dense, [4.0] * 60), [])
        # a streak broken by one balanced step starts again
        broken = [4.0] * 30 + [1.5] + [4.0] * (_balance.COLLAPSED_STEPS - 1)
        self.assertEqual(self.feed(self.watch(), broken), [])


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


def per_layer_loss(
    config: Any, coef: float, chunks: int
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A step's loss as the trainer's default computes it, for
    :func:`reference_run`: the token-mean cross entropy of the global batch
    plus the plain mean, over the ``chunks`` microbatches of all data ranks
    (in order: data rank d's microbatch m is chunk ``d * microbatches + m``),
    of ``coef`` times transformers' ``load_balancing_loss_func`` of each
    layer alone, summed over the layers."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    e, k = config.num_experts, config.num_experts_per_tok

    def loss_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, output_router_logits=True)
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        ce = torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
        rows = ids.numel() // chunks
        aux = torch.stack(
            [
                sum(
                    load_balancing_loss_func((layer[c * rows : (c + 1) * rows],), e, k)
                    for layer in out.router_logits
                )
                for c in range(chunks)
            ]
        ).mean()
        return ce + coef * aux

    return loss_of


@unittest.skipUnless(HAS_FUSED, _NEEDS)
class TrainBalanceRunTest(_RunDirTest):
    def test_default_is_per_layer(self) -> None:
        """No balancing flag: the per-layer loss at 0.02 (every loss and the
        exported weights of the unsplit reference), every layer's load in
        metrics.jsonl, the setting recorded in the checkpoint."""
        run_dir = self.run_dir()
        export = os.path.join(os.path.dirname(run_dir), "export")
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", "3", "--run-dir", run_dir, "--export", export,
        ]  # fmt: skip
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        config = train.tiny_config("qwen3_moe", vocab_size=512, hidden_size=64)
        want, model = reference_run(
            config, run_dir, argv, 3, loss_of=per_layer_loss(config, 0.02, chunks=4)
        )
        torch.testing.assert_close(
            torch.tensor(losses_of(run_dir)), torch.tensor(want), atol=2e-5, rtol=2e-5
        )
        got = exported(export)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(got[key], value, atol=1e-3, rtol=1e-3, msg=key)
        for record in train.read_metrics(run_dir):
            layers = record["imbalance_per_layer"]
            self.assertEqual(sorted(layers), ["0", "1", "2", "3"])
            self.assertEqual(max(layers.values()), record["imbalance"])
            self.assertTrue(all(1.0 <= r <= 4.0 for r in layers.values()), layers)
        (checkpoint,) = _checkpoints.RunCheckpoints(run_dir).complete()
        self.assertEqual(
            _balance.read_record(checkpoint.path).values(),
            dict(router_aux_loss="per_layer", router_aux_loss_coef=0.02, expert_bias_rate=0.0),
        )  # fmt: skip


@unittest.skipUnless(HAS_FUSED, _NEEDS)
@slow_only("slow: PYTORCH_TEST_WITH_SLOW=1")
class TrainBalanceSlowTest(_RunDirTest):
    def test_resume_keeps_balancing(self) -> None:
        """A run trained with the pooled loss at 0.01 resumes with it (the same
        losses bitwise as the run never interrupted, not the recipe's
        per-layer default), and a flag that contradicts it is refused."""
        run_dir = self.run_dir()
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", "4", "--checkpoint-every", "2", "--run-dir", run_dir,
        ]  # fmt: skip
        pooled = ["--router-aux-loss", "pooled", "--router-aux-loss-coef", "0.01"]
        rc, err = run_main(*argv, *pooled)
        self.assertEqual(rc, 0, err)
        whole = losses_of(run_dir)
        shutil.rmtree(os.path.join(run_dir, "checkpoints", "step-00000004"))
        rc, err = run_main(*argv, "--router-aux-loss", "per_layer")
        self.assertEqual(rc, 2, err)
        self.assertIn("the checkpoint of step 2", err)
        self.assertIn("was trained with --router-aux-loss pooled", err)
        rc, err = run_main(*argv)
        self.assertEqual(rc, 0, err)
        self.assertEqual(losses_of(run_dir), whole)
        (step4,) = [
            c for c in _checkpoints.RunCheckpoints(run_dir).complete() if c.step == 4
        ]
        self.assertEqual(_balance.read_record(step4.path).router_aux_loss, "pooled")

    def test_deepseek_v3_default(self) -> None:
        """DeepSeek-V3's default is its sequence loss at 1e-4 plus the bias
        update at 1e-2: bitwise the run with those flags (PP=2 x EP=2), and the
        biases moved by whole steps of 1e-2."""
        results = []
        for flags in (
            [],
            ["--router-aux-loss", "sequence", "--router-aux-loss-coef", "1e-4",
             "--expert-bias-rate", "1e-2"],
            ["--router-aux-loss", "none", "--expert-bias-rate", "0"],
        ):  # fmt: skip
            run_dir = self.run_dir()
            export = os.path.join(os.path.dirname(run_dir), "export")
            argv = [
                "--model-type", "deepseek_v3", *text_flags(), *_TINY, *_TINY_MODEL,
                "--pp", "2", "--ep", "2", "--microbatches", "4", "--steps", "3",
                "--run-dir", run_dir, "--export", export, *flags,
            ]  # fmt: skip
            rc, err = run_main(*argv)
            self.assertEqual(rc, 0, err)
            results.append((losses_of(run_dir), exported(export)))
        (default, weights), (explicit, explicit_weights), (off, _) = results
        self.assertEqual(default, explicit)
        self.assertNotEqual(default[0], off[0])  # the auxiliary term is in the loss
        for key, value in explicit_weights.items():
            self.assertTrue(torch.equal(weights[key], value), key)
        biases = [
            v for k, v in weights.items() if k.endswith("e_score_correction_bias")
        ]
        self.assertEqual(len(biases), 3)
        for bias in biases:
            steps = bias / 1e-2
            torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)
            self.assertGreater(steps.abs().max().item(), 0.5)

    def test_collapse_said_once(self) -> None:
        """Without balancing the tiny Qwen3-MoE's routers collapse and stay
        so: the run says it once, with the flag that helps; metrics.jsonl
        shows the collapsed layer."""
        run_dir = self.run_dir()
        steps = 2 + _balance.COLLAPSED_STEPS + 8
        argv = [
            "--model-type", "qwen3_moe", *text_flags(), *_TINY, *_TINY_MODEL, "--ep", "2",
            "--steps", str(steps), "--checkpoint-every", "0", "--run-dir", run_dir,
            "--router-aux-loss", "none",
        ]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "torch_pipelining_ext.train", *argv],
            cwd=REPO, env=local_ranks_env(), capture_output=True, text=True, timeout=_TIMEOUT_S,
        )  # fmt: skip
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertIn("train: expert balancing: no auxiliary loss", done.stdout)
        records = train.read_metrics(run_dir)
        ratios = [r["imbalance"] for r in records]
        threshold = _balance.collapse_threshold(8, 2)
        self.assertTrue(all(r > threshold for r in ratios[-_balance.COLLAPSED_STEPS:]), ratios)  # fmt: skip
        warnings = [
            line for line in done.stdout.splitlines() if "stay collapsed" in line
        ]
        self.assertEqual(len(warnings), 1, done.stdout[-3000:])
        self.assertIn(
            "--router-aux-loss per_layer --router-aux-loss-coef 0.02", warnings[0]
        )


if __name__ == "__main__":
    run_tests()
