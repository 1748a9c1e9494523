# Owner(s): ["oncall: distributed"]
"""Single-process tests of ``torch_pipelining_ext.hf``: every supported
Hugging Face family (tiny configs) split into stages whose chained forwards,
:class:`CausalLMLoss` and gradients equal the unsplit model's own forward and
loss; layout errors; meta construction and per-stage safetensors loading
(single file, sharded, tied weights, dtype, all-or-nothing errors)."""

from __future__ import annotations

from collections.abc import Iterable
import json
import os
import tempfile
import unittest
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from common_pipelining import OneRankGroupTestCase
from hf_model_registry import HF_FAMILIES, tiny_hf_config, tiny_hf_model
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_pipelining_ext import stage_split as ss


try:
    import safetensors.torch
    import transformers  # noqa: F401

    from torch_pipelining_ext import hf

    from torch_pipelining_ext.hf import (
        _config as _hf_config,
        _factory as _hf_factory,
        _loading as _hf_loading,
        _stage as _hf_stage,
    )

    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

VOCAB = 64


def _check_schedule(policy, schedule: str) -> None:
    _hf_config.check_checkpointing_schedule(policy, ss.resolve_schedule_class(schedule))


def _split(
    model: nn.Module, num_stages: int, stage_ids=None, activation_checkpointing=None
) -> list:
    """All (or ``stage_ids``) stages of ``model`` as HFCausalLMStage modules, in one process."""
    from torch_pipelining_ext.hf import _compat as _hf_compat

    names = hf.hf_module_names_per_stage(model, num_stages)
    ids = list(range(num_stages)) if stage_ids is None else stage_ids
    layout = hf.detect_layout(model)
    raw = ss.build_stage_modules(model, names, ids)
    stages = [
        hf.HFCausalLMStage(
            p,
            layout,
            i,
            num_stages,
            tied_groups=_hf_factory.tied_groups(model),
            full_state_keys=_hf_factory.state_keys(model),
            checkpoint_conversions=_hf_compat.conversion_mapping(model),
        )
        for p, i in zip(raw, ids)
    ]
    for stage in stages:
        stage.set_activation_checkpointing(activation_checkpointing)
    return stages


def _chain_and_check(
    test: TestCase, model: nn.Module, stages: list, ids, labels
) -> None:
    """Chained stage forwards, CausalLMLoss and every gradient equal the unsplit model's."""
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    loss_fn = hf.CausalLMLoss()
    loss_fn.set_labels(labels)
    losses = []
    for i, (mb_ids, mb_labels) in enumerate(zip(ids.split(2), labels.split(2))):
        h = mb_ids
        for stage in stages:
            h = stage(h)
        torch.testing.assert_close(h, ref.logits[2 * i : 2 * i + 2])
        losses.append(loss_fn(h, mb_labels))
    total = torch.stack(losses).sum()
    torch.testing.assert_close(total, ref.loss)
    total.backward()
    hf.sync_tied_gradients(stages)
    ref_params = dict(model.named_parameters(remove_duplicate=False))
    checked = []
    for stage in stages:
        for name, p in stage.named_parameters():
            want = ref_params[name].grad
            if want is None:
                test.assertIsNone(p.grad, name)
            else:
                torch.testing.assert_close(p.grad, want, msg=f"grad of {name}")
            checked.append(name)
    test.assertEqual(sorted(checked), sorted(ref_params))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels = ids.clone()
    labels[0, 2:5] = -100  # microbatches with different numbers of labelled tokens
    labels[3, 1] = -100
    return ids, labels


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers (pip install .[hf])")
class TestHFStages(TestCase):
    def setUp(self):
        super().setUp()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def tearDown(self):
        torch.set_num_threads(self._threads)
        super().tearDown()

    @parametrize("num_stages", [2, 4])
    @parametrize("family", HF_FAMILIES)
    def test_stage_chain_matches_hf_forward_loss_and_gradients(
        self, family, num_stages
    ):
        model = tiny_hf_model(family, num_layers=4)
        ids, labels = _batch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stages = _split(model, num_stages)
        tie_warnings = [
            w for w in caught if "shared across pipeline stages" in str(w.message)
        ]
        self.assertEqual(len(tie_warnings), 1 if _hf_factory.tied_groups(model) else 0)
        _chain_and_check(self, model, stages, ids, labels)

    @parametrize("family", ["gemma2", "qwen2_sliding", "gpt_oss"])
    def test_mixed_attention_layers_get_their_own_masks(self, family):
        # a wrong mask changes the logits: the same stages with every layer given the full causal mask differ
        from torch_pipelining_ext.hf import _compat as _hf_compat

        model = tiny_hf_model(family, num_layers=4)
        kinds = [
            _hf_compat.layer_kind(model.config, layer, i)
            for i, layer in enumerate(model.model.layers)
        ]
        self.assertEqual(set(kinds), {"full_attention", "sliding_attention"})
        ids, labels = _batch()
        stages = _split(model, 2)
        _chain_and_check(self, model, stages, ids, labels)
        with (
            mock.patch.object(_hf_compat, "layer_kind", lambda *a: "full_attention"),
            torch.no_grad(),
        ):
            h = ids
            for stage in stages:
                h = stage(h)
            self.assertGreater(
                (h - model(input_ids=ids).logits).abs().max().item(), 1e-3
            )

    @parametrize("mode", ["full", "selective"])
    def test_activation_checkpointing_gradients(self, mode):
        model = tiny_hf_model("qwen3_moe", num_layers=4)
        policy = "full" if mode == "full" else [torch.ops.aten.mm.default]
        stages = _split(model, 2, activation_checkpointing=policy)
        ids, labels = _batch()
        with mock.patch(
            "torch.utils.checkpoint.checkpoint", wraps=torch.utils.checkpoint.checkpoint
        ) as ckpt:
            _chain_and_check(self, model, stages, ids, labels)
        self.assertEqual(ckpt.call_count, 4 * 2)  # every layer, both microbatches
        self.assertTrue(
            all(c.kwargs["use_reentrant"] is False for c in ckpt.call_args_list)
        )
        with self.assertRaisesRegex(ValueError, "activation_checkpointing must be"):
            stages[0].set_activation_checkpointing("sometimes")
        # selective under a split backward: allowed where the patch is in force
        # (pinned per torch minor in test_patching.py), refused with its
        # status where not
        _check_schedule(policy, "Schedule1F1B")
        status = _hf_config._sac_patch_status()
        in_force = status in ("applied", "upstream")
        if mode == "full" or in_force:
            _check_schedule(policy, "ScheduleDualPipeV")
        refusals = ["disabled"] + ([] if in_force else [status])
        for refused in refusals if mode == "selective" else []:
            with mock.patch.object(
                _hf_config, "_sac_patch_status", return_value=refused
            ):
                with self.assertRaisesRegex(
                    ValueError,
                    "selective activation checkpointing under ScheduleDualPipeV needs the "
                    f"package's checkpoint_split_backward patch, which is {refused}",
                ):
                    _check_schedule(policy, "ScheduleDualPipeV")

    def test_reentrant_gradient_checkpointing_is_refused(self):
        model = tiny_hf_model("llama", num_layers=2)
        # reentrant: the default of gradient_checkpointing_enable() on 4.57 (5.x defaults to non-reentrant)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # 5.x: deprecated alias of activation_checkpointing_enable
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True}
            )
        model.train()
        with self.assertRaisesRegex(
            ValueError,
            r"model.layers.0 uses reentrant activation checkpointing.*use_reentrant",
        ):
            _hf_stage.check_trainable(model, hf.detect_layout(model))
        stages = _split(model, 2)
        ids, _ = _batch()
        with self.assertRaisesRegex(ValueError, "reentrant activation checkpointing"):
            stages[0](ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        _hf_stage.check_trainable(
            model, hf.detect_layout(model)
        )  # the non-reentrant variant trains correctly
        ids, labels = _batch()
        _chain_and_check(self, model, _split(model, 2), ids, labels)

    def test_self_check_refuses_a_model_type_the_stages_get_wrong(self):
        import transformers as tf

        # Cohere scales its logits (config.logit_scale), which the stage forward does not do
        config = tf.CohereConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
        )
        with self.assertRaisesRegex(
            ValueError, r"model type 'cohere': the pipeline stages do not reproduce"
        ):
            hf.self_check(config)
        with self.assertRaisesRegex(ValueError, "do not reproduce"):
            hf.pipeline_hf_causal_lm(
                config, None, "Interleaved1F1B", "cpu", num_stages=2, init_weights=True
            )
        # a verified type passes; an unverified one the stages get right passes too (Starcoder2)
        self.assertEqual(hf.self_check(tiny_hf_config("gemma2", num_layers=4)), 0.0)
        self.assertLess(hf.self_check(tf.Starcoder2Config(num_hidden_layers=2)), 1e-5)

    def test_moe_balancing_counts_active_experts(self):
        import transformers as tf

        # DeepSeek-V3 shape: 3 dense + 5 MoE layers, 256 experts, top-8
        config = tf.DeepseekV3Config(num_hidden_layers=8, first_k_dense_replace=3)
        model = hf.meta_causal_lm(config)
        costs = hf.estimate_layer_costs(model)
        self.assertEqual(len(set(costs[:3])), 1)
        self.assertEqual(len(set(costs[3:])), 1)
        # active parameters of an MoE layer: attention, router, 1 shared + 8 of 256 routed experts of width
        # 2048 = one dense MLP of width 18432 (9 x 2048); counting every expert would make it ~23x a dense layer
        self.assertAlmostEqual(costs[3], 1.0, delta=0.01)
        names = hf.hf_module_names_per_stage(model, 4, input_weight=0, output_weight=0)
        self.assertEqual(
            [sum(n.startswith("model.layers.") for n in stage) for stage in names],
            [2, 2, 2, 2],
        )

    def test_stage_inputs_and_outputs_are_plain_tensors(self):
        model = tiny_hf_model("llama", num_layers=2)
        first, middle, last = _split(model, 3)
        ids, _ = _batch()
        h = first(ids)
        self.assertEqual((type(h), h.shape), (torch.Tensor, (4, 8, 32)))
        h = middle(h)
        self.assertEqual(h.shape, (4, 8, 32))
        self.assertEqual(last(h).shape, (4, 8, VOCAB))
        with self.assertRaisesRegex(TypeError, "first stage takes token ids"):
            first(h)

    def test_layer_costs_option(self):
        model = tiny_hf_model("deepseek_v3", num_layers=4)  # layer 0 dense, 1..3 MoE
        names = hf.hf_module_names_per_stage(model, 2, layer_costs=[1, 3, 3, 3])
        self.assertEqual(
            names[0][:3], ["model.embed_tokens", "model.layers.0", "model.layers.1"]
        )
        self.assertEqual(names[1][-3:], ["model.norm", "lm_head", "model.rotary_emb"])
        with self.assertRaisesRegex(ValueError, "layer_costs must be 'auto'"):
            hf.hf_module_names_per_stage(model, 2, layer_costs="flops")

    def test_loss_errors(self):
        loss_fn = hf.CausalLMLoss()
        logits, labels = torch.randn(1, 4, VOCAB), torch.zeros(1, 4, dtype=torch.long)
        with self.assertRaisesRegex(RuntimeError, "call set_labels"):
            loss_fn(logits, labels)
        with self.assertRaisesRegex(ValueError, "no token to predict"):
            loss_fn.set_labels(torch.full((2, 4), -100))

    def test_layout_errors_name_what_is_missing(self):
        with self.assertRaisesRegex(ValueError, "no .config"):
            hf.detect_layout(nn.Linear(2, 2))
        model = tiny_hf_model("llama", num_layers=2)
        model.extra = nn.Linear(2, 2)
        with self.assertRaisesRegex(
            ValueError,
            r"'extra' holds parameters and is neither the base model nor the head",
        ):
            hf.detect_layout(model)
        model = tiny_hf_model("gpt2", num_layers=2)
        del model.transformer.ln_f
        with self.assertRaisesRegex(
            ValueError, r"expected one final norm after transformer.h, found none"
        ):
            hf.detect_layout(model)
        model = tiny_hf_model("llama", num_layers=2)
        model.model.adapter = nn.Linear(2, 2)
        with self.assertRaisesRegex(
            ValueError,
            r"model.adapter holds parameters but is not in base_model_pp_plan",
        ):
            hf.detect_layout(model)

    def test_expert_parallel_transport_is_installed_and_restored(self):
        class Quiet(hf.ExpertParallelTransport):
            pass

        mine = Quiet()
        previous = hf.set_expert_parallel_transport(mine)
        try:
            self.assertIs(type(previous), hf.ExpertParallelTransport)  # the default
            self.assertIs(hf.set_expert_parallel_transport(None), mine)
            self.assertIs(
                type(hf.set_expert_parallel_transport(mine)), hf.ExpertParallelTransport
            )
            with self.assertRaisesRegex(
                TypeError, "must be an ExpertParallelTransport or None, got function"
            ):
                hf.set_expert_parallel_transport(dist.all_to_all_single)
        finally:
            self.assertIs(hf.set_expert_parallel_transport(previous), mine)
        self.assertIsInstance(hf.has_fused_experts(), bool)
        self.assertEqual(
            hf.expert_parallel_shards(_split(tiny_hf_model("llama", num_layers=2), 2)),
            [],
        )

    def test_stage_placement_errors(self):
        model = tiny_hf_model("llama", num_layers=2)
        layout = hf.detect_layout(model)
        names = [
            ["model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb"],
            ["model.layers.1", "lm_head"],
        ]
        part = ss.build_stage_modules(model, names, [0])[0]
        with self.assertRaisesRegex(
            ValueError,
            r"stage 0 of 2 holds 'model.norm', which only the last stage can run",
        ):
            hf.HFCausalLMStage(part, layout, 0, 2)
        names = [
            ["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
            ["model.layers.1", "model.norm", "lm_head"],
        ]
        part = ss.build_stage_modules(model, names, [1])[0]
        with self.assertRaisesRegex(
            ValueError, r"stage 1 of 2 runs layers but lacks 'model.rotary_emb'"
        ):
            hf.HFCausalLMStage(part, layout, 1, 2)


def _keep_experts_1_and_2(part: nn.Module, names: Iterable[str]) -> None:
    """Give layer 1's fused expert parameters ``names`` of ``part`` the shape of experts 1 and 2 only, as a rank of expert parallelism keeps them."""
    experts = part.get_submodule("model.layers.1.mlp.experts")
    for name in names:
        full = getattr(experts, name)
        setattr(
            experts,
            name,
            nn.Parameter(torch.empty((2, *full.shape[1:]), device="meta")),
        )
        part.expert_ranges[f"model.layers.1.mlp.experts.{name}"] = (1, 3)


def _save_hf(model: nn.Module, directory: str, **kwargs) -> None:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)


@unittest.skipIf(not HAS_TRANSFORMERS, "needs transformers (pip install .[hf])")
class TestHFLoading(OneRankGroupTestCase):
    """Meta construction and per-stage loading through ``pipeline_hf_causal_lm``
    on a one-rank gloo group (every stage local)."""

    def setUp(self):
        super().setUp()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._dir = tempfile.TemporaryDirectory()
        self.addCleanup(self._dir.cleanup)
        self.dir = self._dir.name

    def tearDown(self):
        torch.set_num_threads(self._threads)
        super().tearDown()

    @parametrize(
        "family",
        [
            "llama",
            "gpt2",
            "deepseek_v3",
            "qwen3_moe",
            "mixtral",
            "gpt_oss",
            "gemma3_text",
        ],
    )
    @parametrize("sharded", [False, True])
    def test_meta_build_load_only_stage_tensors(self, family, sharded):
        ref = tiny_hf_model(family, num_layers=3).to(torch.bfloat16)
        _save_hf(ref, self.dir, max_shard_size="20KB" if sharded else "1GB")
        files = os.listdir(self.dir)
        self.assertEqual("model.safetensors.index.json" in files, sharded)
        config = tiny_hf_config(family, num_layers=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's tie across stages
            stages, parts = hf.pipeline_hf_causal_lm(
                config,
                dist.group.WORLD,
                "Interleaved1F1B",
                "cpu",
                num_stages=3,
                checkpoint=self.dir,
            )
        self.assertEqual(len(parts), 3)
        want = ref.state_dict()
        ids, _ = _batch()
        h = ids
        for part in parts:
            for key, t in part.state_dict().items():
                self.assertEqual(
                    t.dtype, torch.bfloat16, key
                )  # the checkpoint's dtype is kept
                self.assertTrue(torch.equal(t, want[key]), key)
            self.assertFalse(any(t.is_meta for t in part.state_dict().values()))
            h = part(h)
        with torch.no_grad():
            # bf16 tolerance: ``ref.to(bfloat16)`` also rounded its rotary frequencies, which
            # stay float32 in the meta-built model (as in ``from_pretrained``)
            torch.testing.assert_close(
                h, ref(input_ids=ids).logits, atol=4e-3, rtol=2e-2
            )

    def test_reads_only_this_stage(self):
        ref = tiny_hf_model("llama", num_layers=4)
        _save_hf(ref, self.dir, max_shard_size="20KB")
        model = hf.meta_causal_lm(tiny_hf_config("llama", num_layers=4))
        self.assertTrue(all(p.is_meta for p in model.parameters()))
        (part,) = _split(model, 4, stage_ids=[1])
        read = []
        real_read = _hf_loading.read_tensor
        with mock.patch.object(
            _hf_loading,
            "read_tensor",
            lambda e, out: (read.append(e), real_read(e, out)),
        ):
            hf.load_stage_weights([part], self.dir)
        keys = set(part.state_dict())
        self.assertTrue(keys and all(k.startswith("model.layers.") for k in keys))
        self.assertEqual(len(read), len(keys))
        self.assertEqual(
            sum(e.nbytes for e in read),
            sum(t.nbytes for t in part.state_dict().values()),
        )
        for key, t in part.state_dict().items():
            self.assertTrue(torch.equal(t, ref.state_dict()[key]), key)
        # non-persistent buffers (rotary frequencies): real, and those of a model built for real
        torch.testing.assert_close(
            part.model.rotary_emb.inv_freq,
            ref.model.rotary_emb.inv_freq,
            rtol=0,
            atol=0,
        )

    @parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
    def test_fused_experts_read_straight_into_their_slices(self, family):
        from torch_pipelining_ext.hf import _compat as _hf_compat

        ref = tiny_hf_model(family, num_layers=4)
        _save_hf(ref, self.dir, max_shard_size="20KB")
        header = _hf_loading.checkpoint_entries(self.dir)
        fused_model = any(k.endswith("experts.gate_up_proj") for k in ref.state_dict())
        per_expert_disk = any(".experts.0." in k for k in header)
        if family == "gpt_oss":  # fused in the model and on disk on both majors
            self.assertTrue(fused_model and not per_expert_disk)
        elif (
            _hf_compat.conversion_mapping(ref) is None
        ):  # 4.57: per-expert modules, keys as they are
            self.assertFalse(fused_model)
        else:  # 5.x: fused in the model, per expert on disk
            self.assertTrue(fused_model and per_expert_disk)
        model = hf.meta_causal_lm(tiny_hf_config(family, num_layers=4))
        (part,) = _split(model, 4, stage_ids=[1])
        read = []
        real_read = _hf_loading.read_tensor
        with mock.patch.object(
            _hf_loading,
            "read_tensor",
            lambda e, out: (read.append(e), real_read(e, out)),
        ):
            hf.load_stage_weights([part], self.dir)
        want = {k: v for k, v in ref.state_dict().items() if k in part.state_dict()}
        self.assertEqual(set(want), set(part.state_dict()))
        for key, t in part.state_dict().items():
            self.assertTrue(torch.equal(t, want[key]), key)
        # every stored tensor of this stage read once, nothing else: the stage's bytes
        self.assertEqual(
            sum(e.nbytes for e in read),
            sum(t.nbytes for t in part.state_dict().values()),
        )
        self.assertEqual(len(read), len({(e.file, e.key, e.start) for e in read}))

    def test_expert_range_reads_only_those_experts(self):
        ref = tiny_hf_model("qwen3_moe", num_layers=2)
        _save_hf(ref, self.dir)
        model = hf.meta_causal_lm(tiny_hf_config("qwen3_moe", num_layers=2))
        (part,) = _split(model, 2, stage_ids=[1])
        experts = part.get_submodule("model.layers.1.mlp.experts")
        fused = [
            n
            for n, _ in experts.named_parameters()
            if n in ("gate_up_proj", "down_proj")
        ]
        if not fused:
            self.skipTest(
                "per-expert modules (transformers 4.57): expert ranges apply to fused experts"
            )
        _keep_experts_1_and_2(part, fused)  # of 4
        hf.load_stage_weights([part], self.dir)
        for name in fused:
            got = getattr(part.get_submodule("model.layers.1.mlp.experts"), name)
            self.assertTrue(
                torch.equal(got, getattr(ref.model.layers[1].mlp.experts, name)[1:3]),
                name,
            )

    def test_reads_are_row_blocks_each_with_the_file_open_for_it(self):
        # each read of at most _READ_BYTES opens the file for itself (its mapped pages are
        # released when it closes), and an expert range starts its reads at its first row
        import safetensors as safetensors_pkg

        ref = tiny_hf_model("gpt_oss", num_layers=2)
        _save_hf(ref, self.dir)
        model = hf.meta_causal_lm(tiny_hf_config("gpt_oss", num_layers=2))
        (part,) = _split(model, 2, stage_ids=[1])
        _keep_experts_1_and_2(part, ("gate_up_proj", "down_proj"))
        read_sizes = []
        opened = []
        real_open = safetensors_pkg.safe_open

        class RecordingSlice:
            def __init__(self, stored, owner):
                self.stored, self.owner = stored, owner

            def __getitem__(self, index):
                read_sizes.append(self.stored[index].nbytes)
                self.owner.reads += 1
                return self.stored[index]

            def __getattr__(self, name):  # get_shape(), get_dtype(): the header
                return getattr(self.stored, name)

        class Recording:
            def __init__(self, *args, **kwargs):
                self.f = real_open(*args, **kwargs)
                self.reads = 0
                opened.append(self)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def __getattr__(self, name):  # keys()
                return getattr(self.f, name)

            def get_slice(self, key):
                return RecordingSlice(self.f.get_slice(key), self)

            def get_tensor(self, key):
                t = self.f.get_tensor(key)
                read_sizes.append(t.nbytes)
                self.reads += 1
                return t

        limit = 512
        with (
            mock.patch.object(_hf_loading, "_READ_BYTES", limit),
            mock.patch.object(safetensors_pkg, "safe_open", Recording),
        ):
            hf.load_stage_weights([part], self.dir)
        for key, t in part.state_dict().items():
            want = ref.state_dict()[key]
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                want = want[1:3]
            self.assertTrue(torch.equal(t, want), key)
        stage_bytes = sum(t.nbytes for t in part.state_dict().values())
        self.assertEqual(sum(read_sizes), stage_bytes)
        self.assertGreater(len(read_sizes), len(part.state_dict()))
        largest_row = max(
            t[0].nbytes for t in part.state_dict().values() if t.dim() > 0
        )
        self.assertLessEqual(max(read_sizes), max(limit, largest_row))
        self.assertEqual(max(f.reads for f in opened), 1)  # one read per open

    def test_long_key_lists_are_summarised(self):
        ref = tiny_hf_model("qwen3_moe", num_layers=4)
        sd = {
            k: v.contiguous() for k, v in ref.state_dict().items() if ".mlp." not in k
        }
        path = os.path.join(self.dir, "model.safetensors")
        safetensors.torch.save_file(sd, path)
        parts = _split(hf.meta_causal_lm(tiny_hf_config("qwen3_moe", num_layers=4)), 2)
        with self.assertRaises(ValueError) as ctx:
            hf.load_stage_weights(parts, path)
        msg = str(ctx.exception)
        self.assertRegex(
            msg, r"missing from the checkpoint \(\d+\): 'model.layers.0.mlp."
        )
        self.assertIn("patterns: 'model.layers.*.mlp.", msg)
        self.assertLess(len(msg), 1000)

    @parametrize("family", HF_FAMILIES)
    def test_meta_build_allocates_nothing_and_restores_buffers(self, family):
        from torch.overrides import TorchFunctionMode

        from torch_pipelining_ext.hf import _compat as _hf_compat

        class CountAllocations(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.bytes = self.largest = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and not out.is_meta:
                    self.bytes += out.numel() * out.element_size()
                    self.largest = max(self.largest, out.numel() * out.element_size())
                return out

        config = tiny_hf_config(family, num_layers=4)
        counter = CountAllocations()
        with counter:
            model = hf.meta_causal_lm(config)
        self.assertTrue(all(p.is_meta for p in model.parameters()))
        params = [p.numel() * p.element_size() for p in model.parameters()]
        if _hf_compat.builds_buffers_on_meta():  # 5.x: buffers at most, never a weight
            self.assertLess(counter.bytes, sum(params) / 10)
        else:  # 4.57: each parameter moved to meta as it is registered, one at a time
            self.assertLessEqual(counter.largest, max(params))
        ref = tiny_hf_model(family, num_layers=4)
        _save_hf(ref, self.dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, parts = hf.pipeline_hf_causal_lm(
                config,
                dist.group.WORLD,
                "Interleaved1F1B",
                "cpu",
                num_stages=2,
                checkpoint=self.dir,
            )
        ref_buffers = dict(ref.named_buffers())
        for part in parts:
            for name, b in part.named_buffers():
                torch.testing.assert_close(
                    b, ref_buffers[name], rtol=0, atol=0, msg=name
                )

    def test_tied_head_read_from_embedding_key(self):
        ref = tiny_hf_model("gpt2", num_layers=2)
        _save_hf(ref, self.dir)
        header = _hf_loading.checkpoint_entries(self.dir)
        self.assertNotIn("lm_head.weight", header)  # transformers saves the tie once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (last,) = _split(
                hf.meta_causal_lm(tiny_hf_config("gpt2", num_layers=2)),
                2,
                stage_ids=[1],
            )
        hf.load_stage_weights([last], self.dir)
        self.assertTrue(torch.equal(last.lm_head.weight, ref.transformer.wte.weight))

    def test_errors_list_every_key_and_load_nothing(self):
        ref = tiny_hf_model("llama", num_layers=2)
        sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
        del sd["model.layers.1.mlp.up_proj.weight"], sd["model.norm.weight"]
        sd["model.layers.7.bogus"] = torch.zeros(2)
        sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
        path = os.path.join(self.dir, "model.safetensors")
        safetensors.torch.save_file(sd, path)
        model = hf.meta_causal_lm(tiny_hf_config("llama", num_layers=2))
        parts = _split(model, 2)
        msg = (
            r"missing from the checkpoint \(2\): 'model.layers.1.mlp.up_proj.weight', 'model.norm.weight'; "
            r"not in the model \(1\): 'model.layers.7.bogus'; shape mismatches \(1\): "
            r"'model.layers.0.mlp.down_proj.weight': checkpoint \[3, 3\] vs model \[32, 64\]. Nothing was loaded"
        )
        with mock.patch.object(_hf_loading, "read_tensor") as read:
            with self.assertRaisesRegex(ValueError, msg):
                hf.load_stage_weights(parts, path)
            self.assertEqual(read.call_count, 0)
        self.assertTrue(all(p.is_meta for part in parts for p in part.parameters()))
        with self.assertRaisesRegex(FileNotFoundError, "neither model.safetensors nor"):
            hf.load_stage_weights(parts, tempfile.mkdtemp(dir=self.dir))
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"model.norm.weight": "absent.safetensors"}}, f)
        with self.assertRaises(FileNotFoundError):
            hf.load_stage_weights(parts, self.dir)
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")
        with self.assertRaisesRegex(
            ValueError, "model.safetensors is not a safetensors"
        ):
            hf.load_stage_weights(parts, path)

    def test_meta_model_needs_checkpoint_or_init(self):
        config = tiny_hf_config("llama", num_layers=2)
        with self.assertRaisesRegex(
            ValueError, "pass checkpoint= .* or init_weights=True"
        ):
            hf.pipeline_hf_causal_lm(
                config, dist.group.WORLD, "Interleaved1F1B", "cpu", num_stages=2
            )
        _, parts = hf.pipeline_hf_causal_lm(
            config,
            dist.group.WORLD,
            "Interleaved1F1B",
            "cpu",
            num_stages=2,
            init_weights=True,
        )
        for part in parts:
            for key, t in part.state_dict().items():
                self.assertFalse(t.is_meta, key)
                self.assertTrue(torch.isfinite(t).all(), key)
        torch.testing.assert_close(parts[1].model.norm.weight, torch.ones(32))

    def test_real_model_is_copied_not_modified(self):
        model = tiny_hf_model("qwen3", num_layers=2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        stages, parts = hf.pipeline_hf_causal_lm(
            model, dist.group.WORLD, "Interleaved1F1B", "cpu", num_stages=2
        )
        self.assertEqual([s.stage_index for s in stages], [0, 1])
        self.assertEqual(
            set(parts[0].state_dict()) | set(parts[1].state_dict()), set(before)
        )
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        self.assertIsNot(
            parts[0].model.embed_tokens.weight, model.model.embed_tokens.weight
        )


instantiate_parametrized_tests(TestHFStages)
instantiate_parametrized_tests(TestHFLoading)

if __name__ == "__main__":
    run_tests()
