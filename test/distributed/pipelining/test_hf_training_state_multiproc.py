# Owner(s): ["oncall: distributed"]
"""Training state of Hugging Face stages over PP x DP x EP, four gloo ranks,
against the unsplit model and against an uninterrupted run:

* checkpoints (``hf.save_checkpoint`` / ``hf.load_checkpoint``, model and
  AdamW state) keep every expert: each rank's experts and their moments are
  in the checkpoint under the whole tensor's key, a resume in the same layout
  continues bitwise, and a checkpoint loads into other layouts (PP=2 x EP=2
  -> PP=1 x EP=4 -> PP=4 x EP=1 -> the unsplit model) with every tensor as
  saved and training going on as the unsplit model's;
* the ``("pp", "dp", "ep")`` layout (PP=1 x DP=2 x EP=2, PP=2 x DP=1 x EP=2;
  plain and FSDP2): losses, auxiliary losses and gradients equal the unsplit
  model's on the global batch;
* ``hf.clip_grad_norm_``: the whole model's norm on every rank, equal to the
  unsplit model's, and the same scaling everywhere;
* ``hf.save_pretrained``: transformers' own key layout, ``from_pretrained``
  equal bitwise, loadable into another layout;
* bad input: checkpoints of another model, another transformers major or
  another optimizer, experts not divisible by the new EP size, a non-empty
  export directory, experts without a per-expert layout.

The default run has one covering case per feature (``HFTrainingStateTest``);
every layout and family is in ``HFTrainingStateSlowTest``, which runs with
``PYTORCH_TEST_WITH_SLOW=1``.
"""

from __future__ import annotations

import json
import os
import unittest
from unittest import mock

import torch
import torch.distributed as dist
from common_pipelining import slow_only
from common_hf import (
    HAS_FUSED,
    MAX_NORM,
    HAS_TRANSFORMERS,
    HFMultiProcTest,
    local_view,
    read_checkpoint,
    reference_backward,
    reference_optimizer,
    reference_step,
    rows_of,
    TrainingRun,
)
from hf_model_registry import balanced_loss_by_hand, padded_batch, tiny_hf_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)
from torch_pipelining_ext import launcher


if HAS_TRANSFORMERS:
    from torch_pipelining_ext import hf

VOCAB = 64
EXPERTS = 8
COEF = 0.5
MAX_NORM_TEST = 0.1
# AdamW normalises every update: the float noise of another reduction order in
# a gradient element near zero becomes up to ~1.3e-4 in the weights after two
# steps (measured); a wrong moment or weight shows as ~lr = 1e-2
ADAMW_TOLERANCE = dict(atol=5e-4, rtol=1e-4)
# ... and the gradient norm of a later step, computed at those weights, moves by
# up to ~5e-5 of itself (measured: step 2 of qwen3_moe on every CPU kernel
# path); a wrong gradient moves it by far more
ADAMW_NORM_TOLERANCE = dict(atol=0.0, rtol=1e-4)
# (pp, dp, ep) -> (schedule, microbatches): every layout a schedule that fits
# the tiny 4-layer models and the 8-row global batch
_LAYOUTS = {
    (2, 1, 2): (ScheduleDualPipeV, 4),
    (1, 4, 1): (Schedule1F1B, 2),
    (1, 1, 4): (Schedule1F1B, 2),
    (4, 1, 1): (Schedule1F1B, 4),
    (1, 2, 2): (Schedule1F1B, 2),
    (2, 2, 1): (Schedule1F1B, 2),
}


_needs_fused = unittest.skipIf(not HAS_FUSED, "needs transformers 5.x (fused experts)")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (8, 8), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100  # the data ranks predict different numbers of tokens
    return ids, labels


def _model(family: str, seed: int = 0, **kwargs):
    experts = {"deepseek_v3": "n_routed_experts", "mixtral": "num_local_experts"}
    kwargs.setdefault(experts.get(family, "num_experts"), EXPERTS)
    return tiny_hf_model(family, seed=seed, num_layers=4, **kwargs)


class _TrainingStateTests:
    """Helpers of both test classes."""

    def run_in(self, model, pp, dp, ep, **kwargs) -> TrainingRun:
        schedule, microbatches = _LAYOUTS[(pp, dp, ep)]
        return TrainingRun(
            model,
            self.layout(pp=pp, dp=dp, ep=ep),
            schedule,
            microbatches=microbatches,
            **kwargs,
        )

    def assert_holds_checkpoint(self, run: TrainingRun, whole: dict, what: str) -> None:
        """Every tensor of this rank's model and optimizer state equals its part
        of the whole checkpoint, bitwise."""
        model_sd, optim_sd = hf.get_state_dict(run.parts, run.optimizers)
        views = {
            prefix + key: local_view(value, run.parts, key)
            for prefix, sd in (("model.", model_sd), ("optim.", optim_sd))
            for key, value in sd.items()
            if torch.is_tensor(value)
        }

        def check() -> None:
            if any(
                k.startswith("model.") and ".experts." in k for k in views
            ):  # their moments too
                self.assertTrue(any(".experts." in k and "exp_avg" in k for k in views))
            for key, got in views.items():
                fqn = (
                    key[len("model.") :]
                    if key.startswith("model.")
                    else key.split(".", 2)[2].rsplit(".", 1)[0]
                )
                want = rows_of(whole[key], run.parts, fqn)
                self.assertTrue(torch.equal(got, want), f"{what}: {key}")

        self.check_all(check)

    def assert_close_on_every_rank(self, got, want, what: str, **tolerance) -> None:
        def check() -> None:
            if got is not None:
                torch.testing.assert_close(
                    got, want, msg=lambda detail: f"{what}: {detail}", **tolerance
                )

        self.check_all(check)

    def resume_is_bitwise(
        self, family: str, layout: tuple[int, int, int], fsdp: bool
    ) -> None:
        """Two steps, a checkpoint, two more: a fresh run from the checkpoint
        has the same losses and norms and ends with the same weights, bitwise."""
        run = self.run_in(_model(family), *layout, fsdp=fsdp)
        for step in range(2):
            run.step(_batch(step))
        path = self.shared_dir()
        hf.save_checkpoint(path, run.parts, run.optimizers)
        resumed = self.run_in(_model(family, seed=1), *layout, fsdp=fsdp)
        hf.load_checkpoint(path, resumed.parts, resumed.optimizers)
        self.assert_holds_checkpoint(
            resumed, read_checkpoint(path), "loaded into the same layout"
        )
        for step in (2, 3):
            got, want = resumed.step(_batch(step)), run.step(_batch(step))

            def check() -> None:
                for a, b in zip(got, want):
                    self.assertTrue(
                        a is b is None or torch.equal(a, b), f"step {step}: {a} vs {b}"
                    )

            self.check_all(check)
        self.params_equal(resumed, run, "after two steps")

    def matches_unsplit_model(
        self, ref, layout, mode: str | None, fsdp: bool, steps: int = 2
    ) -> TrainingRun:
        """``steps`` steps of ``ref``'s stages in ``layout`` (with the auxiliary
        loss ``mode``, padded batches) equal to ``ref``'s own: losses, norms,
        then every weight."""
        options = (
            {}
            if mode is None
            else {"router_aux_loss": mode, "router_aux_loss_coef": COEF}
        )
        run = self.run_in(ref, *layout, fsdp=fsdp, **options)
        ref_opt = reference_optimizer(ref)
        loss = (
            None
            if mode is None
            else (lambda m, b: balanced_loss_by_hand(m, b, mode, COEF))
        )
        for step in range(steps):
            batch = padded_batch(600 + step, VOCAB)
            if mode is None:  # no auxiliary loss: no mask travels with the stages
                batch = (batch[0], batch[2])
            got_loss = run.backward(batch)
            want_loss = reference_backward(ref, ref_opt, batch, loss)
            self.assert_close_on_every_rank(got_loss, want_loss, f"loss of step {step}")
            self.assert_grads_match(run, ref, f"step {step}")
            got_norm = run.clip_and_step()
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            ref_opt.step()
            self.assert_close_on_every_rank(got_norm, want_norm, f"norm of step {step}")
        got, want = run.params(), ref.state_dict()

        def check() -> None:
            for key, value in got.items():
                want_rows = rows_of(want[key].detach(), run.parts, key)
                torch.testing.assert_close(value, want_rows, msg=key, **ADAMW_TOLERANCE)

        self.check_all(check)
        return run

    def assert_grads_match(self, run: TrainingRun, ref, what: str) -> None:
        """Every gradient of this rank (experts: its rows) equals the unsplit model's."""
        got, want = run.grads(), dict(ref.named_parameters(remove_duplicate=False))

        def check() -> None:
            for key, grad in got.items():
                ref_grad = want[key].grad
                ref_grad = torch.zeros_like(want[key]) if ref_grad is None else ref_grad
                torch.testing.assert_close(
                    grad,
                    rows_of(ref_grad, run.parts, key),
                    msg=f"{what}: grad of {key}",
                )

        self.check_all(check)

    def params_equal(self, a: TrainingRun, b: TrainingRun, what: str) -> None:
        got, want = a.params(), b.params()

        def check() -> None:
            self.assertEqual(got.keys(), want.keys())
            for key in got:
                self.assertTrue(torch.equal(got[key], want[key]), f"{what}: {key}")

        self.check_all(check)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers (pip install .[hf])")
@instantiate_parametrized_tests
class HFTrainingStateTest(_TrainingStateTests, HFMultiProcTest):
    """One covering case per feature (the default run)."""

    def test_without_expert_parallelism_pp2xdp2_fsdp(self):
        # on transformers 4.57 (experts as modules) and 5.x: checkpoint -> PP=4, export, from_pretrained
        import transformers

        ref = _model("qwen3_moe")
        run = self.run_in(ref, 2, 2, 1, fsdp=True)
        ref_opt = reference_optimizer(ref)
        loss, norm = run.step(_batch(0))
        want_loss, want_norm = reference_step(ref, ref_opt, _batch(0))
        self.assert_close_on_every_rank(loss, want_loss, "loss")
        self.assert_close_on_every_rank(norm, want_norm, "norm")
        path = self.shared_dir()
        hf.save_checkpoint(path, run.parts, run.optimizers)
        whole = read_checkpoint(path)
        other = self.run_in(_model("qwen3_moe", seed=1), 4, 1, 1)
        hf.load_checkpoint(path, other.parts, other.optimizers)
        self.assert_holds_checkpoint(other, whole, "loaded into PP=4")
        export, own = self.shared_dir(), self.shared_dir()
        hf.save_pretrained(other.parts, export)
        if self.rank == 0:
            ref.save_pretrained(own)
        dist.barrier()
        exported = transformers.AutoModelForCausalLM.from_pretrained(
            export
        ).state_dict()
        mine = other.params()

        def check() -> None:
            self.assertEqual(_saved_shapes(export), _saved_shapes(own))
            for key, value in mine.items():
                self.assertTrue(torch.equal(value, exported[key]), key)
                self.assertTrue(torch.equal(value, whole["model." + key]), key)

        self.check_all(check)

    @_needs_fused
    def test_checkpoint_keeps_every_expert_and_reshards(self):
        import torch.distributed.checkpoint as dcp

        # PP=2 x EP=2 (DualPipeV: two stage modules, two optimizers per rank) -> PP=1 x EP=4
        ref = _model("qwen3_moe")
        run = self.run_in(ref, 2, 1, 2)
        ref_opt = reference_optimizer(ref)
        for step in range(2):
            loss, norm = run.step(_batch(step))
            want_loss, want_norm = reference_step(ref, ref_opt, _batch(step))
            self.assert_close_on_every_rank(loss, want_loss, f"loss of step {step}")
            self.assert_close_on_every_rank(norm, want_norm, f"norm of step {step}")
        path = self.shared_dir()
        hf.save_checkpoint(path, run.parts, run.optimizers)
        whole = read_checkpoint(path)
        # every rank's experts and their moments are in the checkpoint, under the whole tensor's key
        self.assertEqual(
            whole["model.model.layers.1.mlp.experts.down_proj"].shape[0], EXPERTS
        )
        self.assert_holds_checkpoint(run, whole, "saved PP=2 x EP=2")
        # the stage modules' own state_dict() shows the experts as shards of the whole tensor too
        raw = self.shared_dir()
        dcp.save(
            {k: v for part in run.parts for k, v in part.state_dict().items()},
            checkpoint_id=raw,
        )
        self.assertTrue(
            all(
                torch.equal(t, whole["model." + k])
                for k, t in read_checkpoint(raw).items()
            )
        )
        other = self.run_in(_model("qwen3_moe", seed=1), 1, 1, 4)
        hf.load_checkpoint(path, other.parts, other.optimizers)
        self.assert_holds_checkpoint(other, whole, "loaded into PP=1 x EP=4")
        # a state dict of whole tensors (the unsplit model's) loads too: each rank takes its experts' rows
        with torch.no_grad():
            for p in other.parts[0].parameters():
                p.zero_()
        unsplit = {
            k[len("model.") :]: t for k, t in whole.items() if k.startswith("model.")
        }
        hf.set_state_dict(other.parts, model_state_dict=unsplit)
        self.assert_holds_checkpoint(other, whole, "whole tensors set into PP=1 x EP=4")
        # training goes on as it would have in the saved layout: the same
        # state, so the same loss and gradient norm up to summation order
        loss, norm = other.step(_batch(2))
        kept_loss, kept_norm = run.step(_batch(2))
        self.assert_close_on_every_rank(
            kept_loss, loss, "loss after the layout change"
        )  # (the saved layout's last stage holds it)
        self.assert_close_on_every_rank(norm, kept_norm, "norm after the layout change")
        # and as the unsplit model's, two AdamW steps apart (ADAMW_NORM_TOLERANCE)
        want_loss, want_norm = reference_step(ref, ref_opt, _batch(2))
        self.assert_close_on_every_rank(
            loss, want_loss, "loss against the unsplit model"
        )
        self.assert_close_on_every_rank(
            norm, want_norm, "norm against the unsplit model", **ADAMW_NORM_TOLERANCE
        )

    def test_layouts_that_do_not_fit_are_refused(self):
        with self.assertRaisesRegex(
            ValueError, r"pp=3 x dp=1 x ep=1 needs 3 ranks, but the job has 4"
        ):
            launcher.parallel_layout(pp=3)
        with self.assertRaisesRegex(
            ValueError, r"must be a positive integer, got dp=0"
        ):
            launcher.parallel_layout(pp=4, dp=0)
        data_mesh = launcher.ParallelLayout.of(self.layout(pp=1, dp=2, ep=2)).data_mesh
        self.assertEqual(data_mesh.size(), 4)
        with self.assertRaisesRegex(
            ValueError, r"named from \('pp', 'dp', 'ep'\) in that order"
        ):
            hf.pipeline_hf_causal_lm(
                _model("qwen3_moe"),
                init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
                Schedule1F1B,
                "cpu",
            )

    @_needs_fused
    def test_three_dimensional_layout_matches_unsplit_model(self):
        # PP=1 x DP=2 x EP=2, DeepSeek-V3's sequence-wise auxiliary loss, plain gradients
        self.matches_unsplit_model(
            _model("deepseek_v3"), (1, 2, 2), "sequence", fsdp=False
        )

    @_needs_fused
    def test_save_pretrained_from_pp_x_ep(self):
        import transformers

        ref = _model("qwen3_moe")
        run = self.run_in(ref, 2, 1, 2)
        run.step(_batch(0))  # trained weights, not the initial ones
        path = self.shared_dir()
        hf.save_pretrained(run.parts, path)
        own = self.shared_dir()
        if self.rank == 0:
            ref.save_pretrained(own)
        dist.barrier()
        exported = transformers.AutoModelForCausalLM.from_pretrained(path)
        mine = run.params()

        def check() -> None:
            # transformers' own layout (per-expert keys), one file per writing rank
            self.assertEqual(_saved_shapes(path), _saved_shapes(own))
            self.assertEqual(
                len([f for f in os.listdir(path) if f.endswith(".safetensors")]), 4
            )
            theirs = exported.state_dict()
            for key, value in mine.items():
                self.assertTrue(
                    torch.equal(value, rows_of(theirs[key], run.parts, key)), key
                )

        self.check_all(check)
        other = self.run_in(
            _model("qwen3_moe", seed=1).config, 1, 1, 4, checkpoint=path
        )
        got = other.params()
        self.check_all(
            lambda: [
                self.assertTrue(
                    torch.equal(v, rows_of(exported.state_dict()[k], other.parts, k)), k
                )
                for k, v in got.items()
            ]
        )

    # ------------------------------------------------------------------
    # Bad input
    # ------------------------------------------------------------------

    @_needs_fused
    def test_checkpoint_of_another_model_is_refused_before_loading(self):
        run = self.run_in(_model("qwen3_moe"), 2, 1, 2)
        path = self.shared_dir()
        hf.save_checkpoint(path, run.parts, run.optimizers)
        cases = {
            "two layers": (
                dict(num_layers=2),
                r"checkpoint keys the model does not have \(\d+\): 'model.layers.2",
            ),
            "16 experts": (
                dict(num_experts=16),
                r"'model.layers.\d.mlp.experts.gate_up_proj': saved \[8, 32, 32\], here \[16, 32, 32\]",
            ),
        }
        for what, (kwargs, pattern) in cases.items():
            kwargs = {"num_layers": 4, **kwargs}
            other = TrainingRun(
                tiny_hf_model("qwen3_moe", seed=1, **kwargs),
                self.layout(pp=2, ep=2),
                Schedule1F1B,
            )
            before = other.params()
            with self.assertRaisesRegex(ValueError, pattern, msg=what):
                hf.load_checkpoint(path, other.parts, other.optimizers)
            after = other.params()
            self.assertTrue(all(torch.equal(before[k], after[k]) for k in before), what)

    @_needs_fused
    def test_checkpoint_of_the_other_transformers_major_is_refused(self):
        # the per-expert keys transformers 4.x models have, made up from a 5.x model
        ref = _model("qwen3_moe")
        sd = {}
        for key, value in ref.state_dict().items():
            if key.endswith("experts.gate_up_proj"):
                for e in range(EXPERTS):
                    gate, up = value[e].chunk(2)
                    sd[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = (
                        gate.clone()
                    )
                    sd[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.clone()
            elif key.endswith("experts.down_proj"):
                for e in range(EXPERTS):
                    sd[key.replace("down_proj", f"{e}.down_proj.weight")] = value[
                        e
                    ].clone()
            else:
                sd[key] = value
        path = self.shared_dir()
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": sd}, checkpoint_id=path)
        run = self.run_in(_model("qwen3_moe", seed=1), 2, 1, 2)
        with self.assertRaisesRegex(
            ValueError, r"experts as separate modules .* transformers 4.x"
        ):
            hf.load_checkpoint(path, run.parts)
        with self.assertRaisesRegex(
            ValueError, "optimizer state missing from the checkpoint"
        ):
            hf.load_checkpoint(path, run.parts, run.optimizers)

    @_needs_fused
    def test_experts_not_divisible_by_the_new_expert_parallel_size(self):
        run = self.run_in(_model("qwen3_moe", num_experts=6), 2, 1, 2)
        path = self.shared_dir()
        hf.save_checkpoint(path, run.parts, run.optimizers)
        with self.assertRaisesRegex(
            ValueError, "6 experts cannot be split over an expert-parallel group of 4"
        ):
            self.run_in(_model("qwen3_moe", num_experts=6), 1, 1, 4)
        with self.assertRaisesRegex(
            ValueError, r"gate_up_proj': saved \[6, 32, 32\], here \[8, 32, 32\]"
        ):
            other = self.run_in(_model("qwen3_moe", seed=1), 1, 1, 4)
            hf.load_checkpoint(path, other.parts, other.optimizers)

    @_needs_fused
    def test_save_pretrained_refusals(self):
        run = self.run_in(_model("qwen3_moe"), 2, 1, 2)
        path = self.shared_dir()
        if self.rank == 0:
            with open(os.path.join(path, "notes.txt"), "w") as f:
                f.write("mine")
        dist.barrier()
        with self.assertRaisesRegex(
            ValueError,
            r"is not empty \(it holds \['notes.txt'\]\): pass overwrite=True",
        ):
            hf.save_pretrained(run.parts, path)
        # experts of a model type whose conversion table has no per-expert layout
        with (
            mock.patch.multiple(run.parts[0], _weight_conversions=[]),
            mock.patch.multiple(run.parts[1], _weight_conversions=[]),
        ):
            with self.assertRaisesRegex(
                ValueError,
                r"no per-expert layout for model type 'qwen3_moe'.*Nothing was written",
            ):
                hf.save_pretrained(run.parts, path, overwrite=True)
        self.assertEqual(os.listdir(path), ["notes.txt"])
        hf.save_pretrained(run.parts, path, overwrite=True)
        self.assertIn("model.safetensors.index.json", os.listdir(path))


@unittest.skipIf(not HAS_FUSED, "needs transformers 5.x (fused experts)")
@slow_only("every layout and family: PYTORCH_TEST_WITH_SLOW=1")
@instantiate_parametrized_tests
class HFTrainingStateSlowTest(_TrainingStateTests, HFMultiProcTest):
    """Every layout change, layout and family (``PYTORCH_TEST_WITH_SLOW=1``)."""

    @parametrize("family", ["qwen3_moe", "deepseek_v3"])
    def test_layout_chain_to_the_unsplit_model(self, family):
        # PP=2 x EP=2 -> PP=1 x EP=4 -> PP=4 x EP=1 -> the unsplit model, a step in each
        import torch.distributed.checkpoint as dcp

        ref = _model(family)
        ref_opt = reference_optimizer(ref)
        run = self.run_in(ref, 2, 1, 2)
        path, whole = None, None
        for step, layout in enumerate([(2, 1, 2), (1, 1, 4), (4, 1, 1)]):
            if step:  # the previous layout's checkpoint
                run = self.run_in(_model(family, seed=step), *layout)
                hf.load_checkpoint(path, run.parts, run.optimizers)
                self.assert_holds_checkpoint(run, whole, f"loaded into {layout}")
            loss, norm = run.step(_batch(step))
            want_loss, want_norm = reference_step(ref, ref_opt, _batch(step))
            self.assert_close_on_every_rank(
                loss, want_loss, f"{layout}: loss of step {step}"
            )
            self.assert_close_on_every_rank(
                norm,
                want_norm,
                f"{layout}: norm of step {step}",
                **(ADAMW_NORM_TOLERANCE if step >= 2 else {}),
            )
            path = self.shared_dir()
            hf.save_checkpoint(path, run.parts, run.optimizers)
            whole = read_checkpoint(path)
            self.assert_holds_checkpoint(run, whole, f"saved from {layout}")
        unsplit = _model(family, seed=9)
        sd = unsplit.state_dict()
        dcp.load({"model": sd}, checkpoint_id=path)
        want = ref.state_dict()

        def check() -> None:
            for key, value in unsplit.state_dict().items():
                self.assertTrue(torch.equal(value, whole["model." + key]), key)
                torch.testing.assert_close(value, want[key], msg=key, **ADAMW_TOLERANCE)

        self.check_all(check)

    @parametrize(
        "case",
        [
            "qwen3_moe_pp2xep2",
            "qwen3_moe_pp2xep2_fsdp_over_ep",
            "deepseek_v3_pp2xep2_fsdp",
            "qwen3_moe_pp1xdp2xep2",
            "deepseek_v3_pp1xdp2xep2_fsdp",
            "mixtral_pp2xdp2_fsdp",
        ],
    )
    def test_resume_continues_bitwise(self, case):
        family, layout, fsdp = {
            "qwen3_moe_pp2xep2": ("qwen3_moe", (2, 1, 2), False),
            "qwen3_moe_pp2xep2_fsdp_over_ep": ("qwen3_moe", (2, 1, 2), "ep"),
            "deepseek_v3_pp2xep2_fsdp": ("deepseek_v3", (2, 1, 2), True),
            "qwen3_moe_pp1xdp2xep2": ("qwen3_moe", (1, 2, 2), False),
            "deepseek_v3_pp1xdp2xep2_fsdp": ("deepseek_v3", (1, 2, 2), True),
            "mixtral_pp2xdp2_fsdp": ("mixtral", (2, 2, 1), True),
        }[case]
        self.resume_is_bitwise(family, layout, fsdp)

    @parametrize("fsdp", [False, True])
    @parametrize("layout", ["pp1xdp2xep2", "pp2xdp1xep2"])
    @parametrize("family", ["qwen3_moe", "deepseek_v3"])
    def test_three_dimensional_layout_matches_unsplit_model(self, family, layout, fsdp):
        mode = "sequence" if family == "deepseek_v3" else "pooled"
        kwargs = (
            {}
            if mode == "sequence"
            else {"router_aux_loss_coef": COEF, "output_router_logits": True}
        )
        shape = {"pp1xdp2xep2": (1, 2, 2), "pp2xdp1xep2": (2, 1, 2)}[layout]
        self.matches_unsplit_model(_model(family, **kwargs), shape, mode, fsdp)

    def test_clip_counts_tied_weights_once(self):
        # GPT-2's embedding and head are one tensor, split over the two pipeline stages; PP=2 x DP=2 with FSDP2
        self.matches_unsplit_model(
            tiny_hf_model("gpt2", num_layers=4), (2, 2, 1), None, fsdp=True
        )

    @parametrize("norm_type", [1.0, float("inf")])
    def test_clip_norm_types(self, norm_type):
        ref = _model("qwen3_moe")
        run = self.run_in(ref, 2, 1, 2)
        run.backward(_batch(0))
        got = hf.clip_grad_norm_(run.parts, MAX_NORM_TEST, norm_type, mesh=run.mesh)
        ref(input_ids=_batch(0)[0], labels=_batch(0)[1]).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(
            ref.parameters(), MAX_NORM_TEST, norm_type
        )
        grads = {k: p.grad for part in run.parts for k, p in part.named_parameters()}
        ref_grads = dict(ref.named_parameters())

        def check() -> None:
            torch.testing.assert_close(got, want)
            for key, grad in grads.items():
                torch.testing.assert_close(
                    grad, rows_of(ref_grads[key].grad, run.parts, key), msg=key
                )

        self.check_all(check)

    def test_clip_non_finite_norm(self):
        run = self.run_in(_model("qwen3_moe"), 2, 1, 2)
        run.backward(_batch(0))
        if self.rank == 3:  # one rank's experts
            hf.expert_parallel_shards(run.parts)[0][0].down_proj.grad[0, 0, 0] = float(
                "nan"
            )
        with self.assertRaisesRegex(
            RuntimeError, r"rank \d: the total norm of order 2.0 .* is non-finite"
        ):
            hf.clip_grad_norm_(
                run.parts, MAX_NORM_TEST, mesh=run.mesh, error_if_nonfinite=True
            )
        norm = hf.clip_grad_norm_(run.parts, MAX_NORM_TEST, mesh=run.mesh)
        self.assertTrue(norm.isnan())  # as torch does: every gradient scaled by nan
        self.assertTrue(
            all(p.grad.isnan().all() for part in run.parts for p in part.parameters())
        )

    def test_clip_refuses_unreduced_gradients(self):
        run = self.run_in(_model("qwen3_moe"), 2, 1, 2)
        *inputs, labels = run.local(*_batch(0))
        run.loss_fn.set_labels(labels, group=run.data.get_group())
        run.schedule.step(
            *(inputs if any(s.is_first for s in run.stages) else ()), target=labels
        )
        with self.assertRaisesRegex(
            RuntimeError, "not reduced yet: call hf.reduce_expert_parallel_gradients"
        ):
            hf.clip_grad_norm_(run.parts, MAX_NORM_TEST, mesh=run.mesh)
        hf.reduce_expert_parallel_gradients(run.parts, run.mesh)
        hf.clip_grad_norm_(run.parts, MAX_NORM_TEST, mesh=run.mesh)

    @parametrize("case", ["deepseek_v3_pp1xdp2xep2_fsdp", "mixtral_pp2xep2"])
    def test_save_pretrained(self, case):
        import transformers

        family, layout, fsdp = {
            "deepseek_v3_pp1xdp2xep2_fsdp": ("deepseek_v3", (1, 2, 2), True),
            "mixtral_pp2xep2": ("mixtral", (2, 1, 2), False),
        }[case]
        ref = _model(family)
        run = self.run_in(ref, *layout, fsdp=fsdp)
        run.step(_batch(0))
        path, own = self.shared_dir(), self.shared_dir()
        hf.save_pretrained(run.parts, path)
        if self.rank == 0:
            ref.save_pretrained(own)
        dist.barrier()
        exported = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        mine = run.params()

        def check() -> None:
            self.assertEqual(_saved_shapes(path), _saved_shapes(own))
            for key, value in mine.items():
                self.assertTrue(
                    torch.equal(value, rows_of(exported[key], run.parts, key)), key
                )

        self.check_all(check)
        # in another dtype: the tensors cast, config.json saying so
        half = self.shared_dir()
        hf.save_pretrained(run.parts, half, dtype=torch.bfloat16)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(half)
        self.assertEqual(loaded.config.dtype, torch.bfloat16)
        exported = loaded.state_dict()
        self.check_all(
            lambda: [
                self.assertTrue(
                    torch.equal(
                        v.to(torch.bfloat16), rows_of(exported[k], run.parts, k)
                    ),
                    k,
                )
                for k, v in mine.items()
                if v.is_floating_point()
            ]
        )

    def test_save_pretrained_without_torchs_hugging_face_writer(self):
        # a torch without torch.distributed.checkpoint.HuggingFaceStorageWriter: safetensors files and an index
        import torch.distributed.checkpoint as dcp
        import transformers

        run = self.run_in(_model("qwen3_moe"), 2, 1, 2)
        path = self.shared_dir()
        writer = getattr(dcp, "HuggingFaceStorageWriter", None)
        if writer is not None:
            delattr(dcp, "HuggingFaceStorageWriter")
        try:
            hf.save_pretrained(run.parts, path)
        finally:
            if writer is not None:
                dcp.HuggingFaceStorageWriter = writer
        exported = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        mine = run.params()
        self.check_all(
            lambda: [
                self.assertTrue(torch.equal(v, rows_of(exported[k], run.parts, k)), k)
                for k, v in mine.items()
            ]
        )


def _saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor of a Hugging Face checkpoint directory."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    files = {"model.safetensors"}
    if os.path.exists(index):
        with open(index) as f:
            files = set(json.load(f)["weight_map"].values())
    shapes = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return shapes


if __name__ == "__main__":
    run_tests()
