# Owner(s): ["oncall: distributed"]
"""Single-process tests of ``torch.distributed.pipelining.stage_split``
(``torch_pipelining_ext/stage_split.py``): FQN preservation, meta device,
containers, sharing, ``move=True``, every bad-input error, the partition
generator (property tests against brute force) and stage placement."""

from __future__ import annotations

import importlib
import itertools
import sys
import threading
import types
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from common_pipelining import OneRankGroupTestCase
from model_registry import NestedToyLLM, ToyBlock, ToyLLM, toy_moe_llm
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext
from torch_pipelining_ext import _stage_split, stage_split as ss
from torch_pipelining_ext._patching._registry import Target
from torch_pipelining_ext.stage_split import (
    build_stage_module,
    build_stage_modules,
    call_if_present,
    generate_module_names_per_stage,
    pipeline_module_split,
    resolve_schedule_class,
    stage_ids_this_rank,
)


_NESTED_NAMES = dict(
    layers_prefix="model.layers",
    input_modules=["model.embed_tokens"],
    output_modules=["model.norm", "lm_head"],
    replicated_modules=["model.rotary_emb"],
)


def _toy(kind: str) -> tuple[nn.Module, dict]:
    """A toy model and the generator arguments that name its parts."""
    if kind == "flat_dict":
        return ToyLLM(n_layers=5, container="dict"), {}
    if kind == "flat_list":
        return ToyLLM(n_layers=5, container="list"), {}
    if kind == "moe":
        return toy_moe_llm(n_layers=5, n_dense=2), {}
    if kind == "nested":
        return NestedToyLLM(n_layers=5), dict(_NESTED_NAMES)
    raise AssertionError(kind)


def _num_layers(model: nn.Module) -> int:
    return (
        len(model.model.layers)
        if isinstance(model, NestedToyLLM)
        else len(model.layers)
    )


def _names(model: nn.Module, num_stages: int, gen_kwargs: dict) -> list[list[str]]:
    return generate_module_names_per_stage(num_stages, _num_layers(model), **gen_kwargs)


def _split_all(model: nn.Module, names: list[list[str]], **kwargs) -> list[nn.Module]:
    return build_stage_modules(model, names, range(len(names)), **kwargs)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


class TiedLM(nn.Module):
    """Embedding and head share one weight; ``pos_embed`` lives on the root."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(8, 4))
        self.tok_embeddings = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.output = nn.Linear(4, 10, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


class NoDeepCopy(nn.Linear):
    """A layer that fails if anyone deep-copies it."""

    def __deepcopy__(self, memo):
        raise AssertionError(
            "build_stage_module deep-copied a module the stage does not keep"
        )


class TestSplitModule(TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)
        # tiny matmuls: extra intra-op threads only contend for the two cores
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def tearDown(self):
        torch.set_num_threads(self._threads)
        super().tearDown()

    @parametrize("kind", ["flat_dict", "flat_list", "moe", "nested"])
    @parametrize("device", ["cpu", "meta"])
    @parametrize("num_stages", [2, 3, 7])
    def test_fqns_preserved_disjoint_and_complete(self, kind, device, num_stages):
        with torch.device(device):
            model, gen = _toy(kind)
        full = _state(model)
        full_keys_before = list(full)
        names = _names(model, num_stages, gen)
        stages = _split_all(model, names)
        self.assertEqual(len(stages), num_stages)
        seen: set[str] = set()
        for stage in stages:
            self.assertIs(type(stage), type(model))
            sd = _state(stage)
            self.assertTrue(sd, "a stage holds no state")
            self.assertFalse(seen & set(sd), f"keys in two stages: {seen & set(sd)}")
            seen |= set(sd)
            for key, t in sd.items():
                self.assertIn(key, full)
                self.assertEqual(t.device.type, device)
                self.assertEqual(t.shape, full[key].shape)
                self.assertEqual(t.dtype, full[key].dtype)
                self.assertIsNot(t, full[key])
                if device == "cpu":
                    self.assertNotEqual(t.data_ptr(), full[key].data_ptr())
                    self.assertTrue(torch.equal(t, full[key]), key)
            for key, p in stage.named_parameters():
                self.assertIsInstance(p, nn.Parameter)
                self.assertTrue(p.requires_grad, key)
        self.assertEqual(seen, set(full))
        # The original is untouched.
        self.assertEqual(list(_state(model)), full_keys_before)

    @parametrize("kind", ["flat_dict", "flat_list", "moe", "nested"])
    def test_stage_chain_matches_full_model(self, kind):
        model, gen = _toy(kind)
        tokens = torch.randint(0, 32, (3, 8))
        target = torch.randint(0, 32, (3, 8))
        ref_out = model(tokens)
        nn.functional.cross_entropy(ref_out.flatten(0, 1), target.flatten()).backward()
        stages = _split_all(model, _names(model, 3, gen))
        h = tokens
        for stage in stages:
            h = stage(h)
        torch.testing.assert_close(h, ref_out)
        nn.functional.cross_entropy(h.flatten(0, 1), target.flatten()).backward()
        ref_params = dict(model.named_parameters())
        checked = set()
        for stage in stages:
            for name, p in stage.named_parameters():
                ref_grad = ref_params[name].grad
                if ref_grad is None:
                    self.assertIsNone(p.grad, name)
                else:
                    torch.testing.assert_close(p.grad, ref_grad, msg=name)
                checked.add(name)
        self.assertEqual(checked, set(ref_params))

    def test_meta_split_then_materialize_loads_full_checkpoint(self):
        ref = ToyLLM(n_layers=4)
        with torch.device("meta"):
            model = ToyLLM(n_layers=4)
        stages = _split_all(model, generate_module_names_per_stage(2, 4))
        full_sd = ref.state_dict()
        tokens = torch.randint(0, 32, (2, 8))
        h = tokens
        for stage in stages:
            stage.to_empty(device="cpu")
            # non-persistent buffers are not in checkpoints: recompute them
            stage.rope_cos.copy_(ref.rope_cos)
            stage.rope_sin.copy_(ref.rope_sin)
            missing, unexpected = stage.load_state_dict(full_sd, strict=False)
            self.assertEqual(missing, [])
            h = stage(h)
        torch.testing.assert_close(h, ref(tokens))

    def test_only_kept_modules_are_deep_copied(self):
        model = nn.Sequential(*[NoDeepCopy(4, 4) for _ in range(6)])
        # Modules the stage keeps may be copied; make those copyable.
        model[2].__class__ = nn.Linear
        model[3].__class__ = nn.Linear
        stage = build_stage_module(model, ["2", "3"])
        self.assertEqual(list(stage._modules), ["2", "3"])
        self.assertEqual(
            set(stage.state_dict()), {"2.weight", "2.bias", "3.weight", "3.bias"}
        )
        x = torch.randn(2, 4)
        torch.testing.assert_close(stage(x), model[3](model[2](x)))

    def test_nested_name_keeps_only_that_submodule(self):
        model = ToyLLM(n_layers=4)
        stage = build_stage_module(model, ["layers.3.attention"])
        self.assertEqual(
            set(stage.state_dict()),
            {f"layers.3.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")},
        )
        self.assertEqual(list(stage.layers.keys()), ["3"])
        layer = stage.layers["3"]
        self.assertIsInstance(layer, ToyBlock)
        self.assertIsNone(layer.attention_norm)
        self.assertIsNone(layer.feed_forward)
        self.assertIsNone(stage.tok_embeddings)
        self.assertIsNone(stage.output)

    @parametrize("container", ["dict", "list"])
    def test_stage_without_layers_has_an_empty_container(self, container):
        model = ToyLLM(n_layers=2, container=container)
        stage = build_stage_module(model, ["norm", "output"])
        self.assertIs(type(stage.layers), type(model.layers))
        self.assertEqual(len(stage.layers), 0)
        self.assertIsNot(stage.layers, model.layers)
        self.assertEqual(len(model.layers), 2)
        h = torch.randn(2, 4, 16)
        torch.testing.assert_close(stage(h), model.output(model.norm(h)))

    def test_sparse_module_list_keeps_indices(self):
        model = ToyLLM(n_layers=6, container="list")
        stage = build_stage_module(model, ["layers.2", "layers.4", "layers.5"])
        self.assertIsInstance(stage.layers, nn.ModuleList)
        self.assertEqual(list(stage.layers._modules), ["2", "4", "5"])
        self.assertEqual(len(stage.layers), 3)
        self.assertEqual(
            [id(m) for m in stage.layers],
            [id(m) for m in stage.layers._modules.values()],
        )
        self.assertTrue(
            all(
                k.startswith(("layers.2.", "layers.4.", "layers.5."))
                for k in stage.state_dict()
            )
        )

    def test_sequential_model(self):
        model = nn.Sequential(
            nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )
        first = build_stage_module(model, ["0", "1", "2"])
        second = build_stage_module(model, ["3", "4"])
        x = torch.randn(5, 4)
        torch.testing.assert_close(second(first(x)), model(x))
        self.assertEqual(set(second.state_dict()), {"4.weight", "4.bias"})

    def test_shared_parameters_within_a_stage_stay_shared(self):
        model = TiedLM()
        stage = build_stage_module(model, ["tok_embeddings", "output", "pos_embed"])
        self.assertIs(stage.tok_embeddings.weight, stage.output.weight)
        self.assertIsNot(stage.tok_embeddings.weight, model.tok_embeddings.weight)
        self.assertEqual(len(list(stage.parameters())), 2)

    def test_tied_parameter_across_stages_warns_with_fqns(self):
        model = TiedLM()
        names = [
            ["pos_embed", "tok_embeddings", "layers.0"],
            ["layers.1", "layers.2", "output"],
        ]
        tie = r"'tok_embeddings\.weight' \(stage \[0\]\).*'output\.weight' \(stage \[1\]\)"
        with self.assertWarnsRegex(UserWarning, tie):
            stages = _split_all(model, names)
        self.assertIsNot(stages[0].tok_embeddings.weight, stages[1].output.weight)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _split_all(TiedLM(tie=False), names)

    def test_root_parameter_is_not_copied_into_every_stage(self):
        model = TiedLM(tie=False)
        names = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "output"]]
        with self.assertRaisesRegex(
            ValueError,
            r"1 parameters/persistent buffers belong to no stage: 'pos_embed'",
        ):
            _split_all(model, names)
        stages = _split_all(model, [["pos_embed"] + names[0], names[1]])
        self.assertIn("pos_embed", stages[0].state_dict())
        self.assertNotIn("pos_embed", stages[1].state_dict())
        self.assertIsNone(stages[1].pos_embed)
        torch.testing.assert_close(stages[0].pos_embed, model.pos_embed)

    def test_non_persistent_buffers_of_ancestors_are_replicated(self):
        model = ToyLLM(n_layers=4)
        for stage in _split_all(model, generate_module_names_per_stage(3, 4)):
            self.assertNotIn("rope_cos", stage.state_dict())
            torch.testing.assert_close(stage.rope_cos, model.rope_cos)
            self.assertNotEqual(stage.rope_cos.data_ptr(), model.rope_cos.data_ptr())

    def test_replicated_parameter_free_module(self):
        model = NestedToyLLM(n_layers=4)
        stages = _split_all(
            model, generate_module_names_per_stage(2, 4, **_NESTED_NAMES)
        )
        rotaries = [s.model.rotary_emb for s in stages]
        self.assertIsNot(rotaries[0], rotaries[1])
        self.assertIsNot(rotaries[0], model.model.rotary_emb)
        # Listing it nowhere is allowed (it owns no state) but leaves the stages unable to run.
        names = generate_module_names_per_stage(
            2, 4, **{**_NESTED_NAMES, "replicated_modules": []}
        )
        stage = _split_all(model, names)[1]
        self.assertIsNone(stage.model.rotary_emb)
        with self.assertRaises(TypeError):
            stage(torch.randn(2, 8, 16))

    def test_stage_has_own_hooks_and_mode(self):
        model = ToyLLM(n_layers=2)
        model.eval()
        calls = []
        model.register_forward_hook(lambda m, i, o: calls.append("orig"))
        stage = build_stage_module(model, ["tok_embeddings", "layers.0"])
        self.assertFalse(stage.training)
        stage.register_forward_hook(lambda m, i, o: calls.append("stage"))
        stage(torch.randint(0, 32, (1, 4)))
        self.assertEqual(
            calls, ["orig", "stage"]
        )  # the original's hook was copied, not shared
        calls.clear()
        model(torch.randint(0, 32, (1, 4)))
        self.assertEqual(calls, ["orig"])

    def test_parameter_and_buffer_names(self):
        model = nn.Module()
        model.lin = nn.Linear(3, 3)
        model.register_buffer("scale", torch.ones(3))
        stage = build_stage_module(model, ["lin.weight", "scale"])
        self.assertEqual(set(stage.state_dict()), {"lin.weight", "scale"})
        self.assertIsNone(stage.lin.bias)

    def test_move_takes_modules_out_of_the_original(self):
        model = ToyLLM(n_layers=4, container="list")
        params = dict(model.named_parameters())
        names = generate_module_names_per_stage(2, 4)
        stages = _split_all(model, names, move=True)
        for stage in stages:
            for name, p in stage.named_parameters():
                self.assertIs(p, params[name])
        self.assertEqual(list(model.parameters()), [])
        self.assertEqual(len(model.layers), 0)
        self.assertIsNone(model.tok_embeddings)
        # the sparse list of the last stage was not renumbered
        self.assertEqual(list(stages[1].layers._modules), ["2", "3"])
        # the ancestors' non-persistent buffers stay in the original, shared
        self.assertIs(stages[0].rope_cos, model.rope_cos)

    def test_move_then_split_again_names_the_removal(self):
        model = ToyLLM(n_layers=2)
        build_stage_module(model, ["tok_embeddings", "layers.0"], move=True)
        with self.assertRaisesRegex(
            ValueError, r"'tok_embeddings' was removed from the model"
        ):
            build_stage_module(model, ["tok_embeddings"])

    def test_move_copies_replicated_modules(self):
        model = NestedToyLLM(n_layers=2)
        rotary = model.model.rotary_emb
        stages = _split_all(
            model, generate_module_names_per_stage(2, 2, **_NESTED_NAMES), move=True
        )
        self.assertIs(model.model.rotary_emb, rotary)
        self.assertIsNot(stages[0].model.rotary_emb, rotary)
        self.assertIsNot(stages[0].model.rotary_emb, stages[1].model.rotary_emb)

    def test_call_if_present(self):
        x = torch.randn(2)
        self.assertIs(call_if_present(None, x), x)
        torch.testing.assert_close(call_if_present(torch.mul, x, 3.0), x * 3)


class TestBadInput(TestCase):
    """Each bad input raises a clear error before anything is built."""

    def test_unknown_name_suggests_close_match(self):
        model = ToyLLM(n_layers=4)
        with self.assertRaisesRegex(
            ValueError,
            r"'tok_embedding' names no submodule.*did you mean 'tok_embeddings'",
        ):
            build_stage_module(model, ["tok_embedding"])

    def test_out_of_range_layer(self):
        model = ToyLLM(n_layers=4, container="list")
        with self.assertRaisesRegex(
            ValueError,
            r"'layers.99' names no.*'layers' \(ModuleList\) has entries 0\.\.3",
        ):
            build_stage_module(model, ["layers.0", "layers.99"])
        with self.assertRaisesRegex(
            ValueError, r"'layers.3.attn' .*has children 'attention_norm', 'attention'"
        ):
            build_stage_module(model, ["layers.3.attn"])

    def test_names_must_be_a_sequence_of_strings(self):
        model = ToyLLM(n_layers=2)
        with self.assertRaisesRegex(TypeError, r"did you mean \['layers.0'\]"):
            build_stage_module(model, "layers.0")
        with self.assertRaisesRegex(TypeError, "module names must be strings"):
            build_stage_module(model, ["layers.0", 1])
        with self.assertRaisesRegex(ValueError, "empty name means the whole model"):
            build_stage_module(model, [""])

    def test_empty_stage(self):
        model = ToyLLM(n_layers=2)
        with self.assertRaisesRegex(ValueError, "module_names is empty"):
            build_stage_module(model, [])
        with self.assertRaisesRegex(ValueError, "stage 1 is empty"):
            _split_all(
                model,
                [["tok_embeddings", "layers.0", "layers.1", "norm", "output"], []],
            )
        with self.assertRaisesRegex(ValueError, "module_names_per_stage is empty"):
            _split_all(model, [])

    def test_name_in_two_stages(self):
        model = ToyLLM(n_layers=2)
        with self.assertRaisesRegex(
            ValueError, r"'layers.1' is listed in stages \[0, 1\]"
        ):
            _split_all(
                model,
                [
                    ["tok_embeddings", "layers.0", "layers.1"],
                    ["layers.1", "norm", "output"],
                ],
            )

    def test_module_inside_a_module_of_another_stage(self):
        model = ToyLLM(n_layers=2)
        names = [
            ["tok_embeddings", "layers.0", "layers.1.attention"],
            ["layers.1", "norm", "output"],
        ]
        msg = r"'layers.1.attention' \(stage 0\) is inside 'layers.1', which stage 1"
        with self.assertRaisesRegex(ValueError, msg):
            _split_all(model, names)

    def test_uncovered_parameters(self):
        model = ToyLLM(n_layers=3)
        names = [["tok_embeddings", "layers.0"], ["layers.2", "norm", "output"]]
        msg = r"9 parameters/persistent buffers belong to no stage: 'layers.1.attention_norm.weight'"
        with self.assertRaisesRegex(ValueError, msg):
            _split_all(model, names)
        stages = _split_all(model, names, allow_uncovered=True)
        self.assertFalse(
            any(k.startswith("layers.1.") for s in stages for k in s.state_dict())
        )

    def test_nothing_is_built_or_moved_on_error(self):
        model = ToyLLM(n_layers=3)
        before = dict(model.state_dict(keep_vars=True))
        names = [
            ["tok_embeddings", "layers.0"],
            ["layers.1", "layers.2", "norm", "outptu"],
        ]
        with mock.patch.object(
            _stage_split, "_build_stage", wraps=_stage_split._build_stage
        ) as build:
            with self.assertRaisesRegex(ValueError, "did you mean 'output'"):
                _split_all(model, names, move=True)
            with self.assertRaisesRegex(ValueError, "belong to no stage"):
                _split_all(model, [names[0], ["layers.2", "norm", "output"]], move=True)
            self.assertEqual(build.call_count, 0)
        after = model.state_dict(keep_vars=True)
        self.assertEqual(list(after), list(before))
        self.assertTrue(all(after[k] is before[k] for k in before))

    def test_generator_more_stages_than_units(self):
        msg = r"cannot make 7 non-empty stages from 4 layers plus the input modules plus the output modules: at most 6"
        with self.assertRaisesRegex(ValueError, msg):
            generate_module_names_per_stage(7, 4)
        with self.assertRaisesRegex(ValueError, "at most 4 stages"):
            generate_module_names_per_stage(5, 4, input_modules=[], output_modules=[])

    def test_generator_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "num_stages must be an int >= 1"):
            generate_module_names_per_stage(0, 4)
        with self.assertRaisesRegex(
            ValueError, "layer_costs has 3 entries for 4 layers"
        ):
            generate_module_names_per_stage(2, 4, layer_costs=[1, 2, 3])
        with self.assertRaisesRegex(
            ValueError, r"layer_costs\[1\] must be a finite number >= 0"
        ):
            generate_module_names_per_stage(2, 2, layer_costs=[1, -1])
        with self.assertRaisesRegex(ValueError, "input_weight must be a finite number"):
            generate_module_names_per_stage(2, 2, input_weight=float("nan"))
        with self.assertRaisesRegex(
            TypeError, "input_modules must be a sequence of module names"
        ):
            generate_module_names_per_stage(2, 2, input_modules="tok_embeddings")

    def test_model_must_be_a_module(self):
        for bad in ("abc", None, 3):
            with self.assertRaisesRegex(
                TypeError, r"model must be an nn.Module, got " + type(bad).__name__
            ):
                build_stage_module(bad, ["layers.0"])
            with self.assertRaisesRegex(TypeError, "model must be an nn.Module"):
                _split_all(bad, [["layers.0"]])

    def test_generator_rejects_a_module_in_two_places(self):
        cases = [
            (
                dict(input_modules=["norm"], output_modules=["norm", "output"]),
                r"'norm' \(input_modules\) and 'norm' "
                r"\(output_modules\) name the same module",
            ),
            (
                dict(replicated_modules=["layers.1"]),
                r"'layers.1' \(replicated_modules\) and 'layers' \(the layers "
                r"layers.0..3\) overlap",
            ),
            (
                dict(replicated_modules=["tok_embeddings"]),
                r"'tok_embeddings' \(input_modules\) and 'tok_embeddings' "
                r"\(replicated_modules\)",
            ),
            (
                dict(input_modules=["layers"]),
                r"'layers' \(input_modules\) and 'layers' \(the layers",
            ),
            (
                dict(output_modules=["norm", "norm"]),
                r"'norm' \(output_modules\) and 'norm' \(output_modules\)",
            ),
            (
                {**_NESTED_NAMES, "input_modules": ["model"]},
                r"'model' \(input_modules\) and 'model.norm'",
            ),
        ]
        for kwargs, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                generate_module_names_per_stage(2, 4, **kwargs)
        # Every stage list the generator returns can be split without copying a module twice.
        model = ToyLLM(n_layers=4)
        for n in range(1, 7):
            names = generate_module_names_per_stage(n, 4)
            flat = [name for stage in names for name in stage]
            self.assertEqual(len(flat), len(set(flat)))
            _split_all(model, names)

    def test_style_class_must_be_a_schedule(self):
        for bad in (int, nn.Module):
            with self.assertRaisesRegex(
                TypeError, f"{bad.__name__} is not a pipeline schedule class"
            ):
                stage_ids_this_rank(0, 2, 4, bad)
        with self.assertRaisesRegex(ValueError, "unknown pipeline schedule 'nope'"):
            stage_ids_this_rank(0, 2, 4, "nope")

    def test_stages_not_divisible_by_pp_size(self):
        with self.assertRaisesRegex(
            ValueError,
            r"^6 stages cannot be spread evenly over 4 pipeline ranks: every rank "
            r"runs the same number of stages, so num_stages must be a multiple of "
            r"the pipeline size \(4, 8, \.\.\.\)$",
        ):
            stage_ids_this_rank(0, 4, 6)

    def test_v_schedule_needs_two_stages_per_rank(self):
        for schedule, name in (
            ("v", "a V-style schedule"),
            ("ScheduleDualPipeV", "ScheduleDualPipeV"),
            ("ZBVZeroBubble", "ZBVZeroBubble"),
        ):
            for num_stages in (12, 6, 4):
                with self.assertRaisesRegex(
                    ValueError,
                    f"^{name} runs exactly 2 stages on each pipeline rank \\(rank r "
                    r"runs stages r and 7 - r, a V\), so 4 pipeline ranks need 8 "
                    f"stages, but {num_stages} were given: make the stage names for 8 "
                    r"stages, e.g. generate_module_names_per_stage\(8, num_layers\)$",
                ):
                    stage_ids_this_rank(0, 4, num_stages, schedule)
        from torch.distributed.pipelining import ScheduleDualPipeV

        # the count of the report: 4 stages for one pipeline rank
        with self.assertRaisesRegex(
            ValueError,
            r"^ScheduleDualPipeV runs exactly 2 stages on each pipeline rank \(rank r "
            r"runs stages r and 1 - r, a V\), so 1 pipeline rank needs 2 stages, but "
            r"4 were given",
        ):
            stage_ids_this_rank(0, 1, 4, ScheduleDualPipeV)

    def test_bad_rank_and_schedule(self):
        with self.assertRaisesRegex(ValueError, "pp_rank 4 is out of range"):
            stage_ids_this_rank(4, 4, 8)
        with self.assertRaisesRegex(ValueError, "unknown pipeline schedule 'Zigzag'"):
            stage_ids_this_rank(0, 4, 8, "Zigzag")
        with self.assertRaisesRegex(TypeError, "schedule class or name"):
            stage_ids_this_rank(0, 4, 8, 3)


def _units(num_layers, input_weight, output_weight, costs, with_in, with_out):
    units = (
        ([input_weight] if with_in else [])
        + list(costs)
        + ([output_weight] if with_out else [])
    )
    return units


def _brute_force(units, num_stages):
    """All contiguous partitions, ordered by the documented tie-breaking."""
    best = None
    for cuts in itertools.combinations(range(1, len(units)), num_stages - 1):
        bounds = (0,) + cuts + (len(units),)
        stage_costs = [sum(units[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (
            max(stage_costs),
            sum(c * c for c in stage_costs),
            [x for pair in zip(stage_costs, bounds[1:]) for x in pair],
        )
        if best is None or key < best[0]:
            best = (key, bounds)
    return best


class TestGenerator(TestCase):
    def test_examples(self):
        self.assertEqual(
            generate_module_names_per_stage(2, 4),
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "norm", "output"],
            ],
        )
        # max stage cost 3 either way; ties go to the most even partition, then
        # to the cheapest earlier stages
        self.assertEqual(
            generate_module_names_per_stage(4, 6, input_weight=2, output_weight=2),
            [
                ["tok_embeddings"],
                ["layers.0", "layers.1"],
                ["layers.2", "layers.3", "layers.4"],
                ["layers.5", "norm", "output"],
            ],
        )
        # dense layers 0-2 cost 1, MoE layers cost 3: the MoE stages get fewer layers
        costs = [1, 1, 1] + [3] * 5
        self.assertEqual(
            generate_module_names_per_stage(
                4, 8, layer_costs=costs, input_weight=0, output_weight=0
            ),
            [
                ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                ["layers.3"],
                ["layers.4", "layers.5"],
                ["layers.6", "layers.7", "norm", "output"],
            ],
        )
        # a heavy head gets a stage of its own
        self.assertEqual(
            generate_module_names_per_stage(3, 4, output_weight=4),
            [
                ["tok_embeddings", "layers.0"],
                ["layers.1", "layers.2", "layers.3"],
                ["norm", "output"],
            ],
        )
        self.assertEqual(
            generate_module_names_per_stage(2, 2, **_NESTED_NAMES),
            [
                ["model.embed_tokens", "model.layers.0", "model.rotary_emb"],
                ["model.layers.1", "model.norm", "lm_head", "model.rotary_emb"],
            ],
        )

    @settings(max_examples=150, deadline=None)
    @given(
        data=st.data(),
        num_layers=st.integers(0, 8),
        input_weight=st.integers(0, 4),
        output_weight=st.integers(0, 4),
        with_in=st.booleans(),
        with_out=st.booleans(),
        uniform=st.booleans(),
    )
    def test_partition_properties(
        self, data, num_layers, input_weight, output_weight, with_in, with_out, uniform
    ):
        costs = [1] * num_layers
        if not uniform:
            costs = data.draw(
                st.lists(st.integers(0, 6), min_size=num_layers, max_size=num_layers)
            )
        units = _units(
            num_layers, input_weight, output_weight, costs, with_in, with_out
        )
        if not units:
            with self.assertRaisesRegex(
                ValueError, "cannot make 1 non-empty stages from 0 layers: at most 0"
            ):
                generate_module_names_per_stage(
                    1, 0, input_modules=[], output_modules=[]
                )
            return
        num_stages = data.draw(st.integers(1, len(units)))
        kwargs = dict(
            input_weight=input_weight,
            output_weight=output_weight,
            layer_costs=None if uniform else costs,
            input_modules=["emb", "pos"] if with_in else [],
            output_modules=["norm", "head"] if with_out else [],
            replicated_modules=["rope"],
        )
        result = generate_module_names_per_stage(num_stages, num_layers, **kwargs)
        self.assertEqual(
            result, generate_module_names_per_stage(num_stages, num_layers, **kwargs)
        )
        self.assertEqual(len(result), num_stages)
        for stage in result:
            self.assertEqual(stage[-1], "rope")
            self.assertGreater(len(stage), 1, "empty stage")
        flat = [n for stage in result for n in stage[:-1]]
        expected = (["emb", "pos"] if with_in else []) + [
            f"layers.{i}" for i in range(num_layers)
        ]
        expected += ["norm", "head"] if with_out else []
        self.assertEqual(flat, expected)  # every unit exactly once, in order
        if with_in:
            self.assertEqual(result[0][:2], ["emb", "pos"])
        if with_out:
            self.assertEqual(result[-1][-3:-1], ["norm", "head"])
        # optimal, and the documented tie-breaking, against brute force
        name_cost = {f"layers.{i}": c for i, c in enumerate(costs)}
        name_cost.update(emb=input_weight, pos=0, norm=output_weight, head=0)
        stage_costs = [sum(name_cost[n] for n in stage[:-1]) for stage in result]
        (bf_max, _, _), bf_bounds = _brute_force(units, num_stages)
        self.assertEqual(max(stage_costs), bf_max)
        unit_counts = [b - a for a, b in zip(bf_bounds, bf_bounds[1:])]
        got_counts = []
        for stage in result:
            n = len(stage) - 1
            got_counts.append(
                n - (1 if "emb" in stage else 0) - (1 if "norm" in stage else 0)
            )
        self.assertEqual(got_counts, unit_counts)

    @settings(max_examples=40, deadline=None)
    @given(
        costs=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=7),
        data=st.data(),
    )
    def test_float_costs_are_optimal(self, costs, data):
        num_stages = data.draw(st.integers(1, len(costs)))
        result = generate_module_names_per_stage(
            num_stages,
            len(costs),
            layer_costs=costs,
            input_modules=[],
            output_modules=[],
        )
        got = max(sum(costs[int(n.split(".")[1])] for n in stage) for stage in result)
        (bf_max, _, _), _ = _brute_force(costs, num_stages)
        self.assertTrue(abs(got - bf_max) <= 1e-9 * max(1.0, bf_max), (got, bf_max))


class TestStagePlacement(TestCase):
    def test_loop_and_v(self):
        self.assertEqual(stage_ids_this_rank(1, 4, 8), (1, 5))
        self.assertEqual(stage_ids_this_rank(1, 4, 4), (1,))
        self.assertEqual(stage_ids_this_rank(1, 4, 12, "loop"), (1, 5, 9))
        self.assertEqual(stage_ids_this_rank(1, 4, 8, "v"), (1, 6))

    def test_style_inferred_from_schedule(self):
        from torch.distributed.pipelining import schedules as S

        v_style = (
            S.ScheduleDualPipeV,
            S.ScheduleZBVZeroBubble,
            "DualPipeV",
            "ScheduleZBVZeroBubble",
            "zbvzerobubble",
        )
        for sched in v_style:
            self.assertEqual(stage_ids_this_rank(0, 2, 4, sched), (0, 3), sched)
        loop_style = (
            S.ScheduleInterleaved1F1B,
            S.ScheduleLoopedBFS,
            "Interleaved1F1B",
            "InterleavedZeroBubble",
        )
        for sched in loop_style:
            self.assertEqual(stage_ids_this_rank(0, 2, 4, sched), (0, 2), sched)

    @parametrize("style", ["loop", "v"])
    def test_matches_torch_stage_to_rank_mapping(self, style):
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        for pp_size in (1, 2, 3, 4):
            per_rank = [2] if style == "v" else [1, 2, 3]
            for k in per_rank:
                num_stages = pp_size * k
                mapping = generate_stage_to_rank_mapping(
                    pp_size, num_stages, style=style
                )
                for rank in range(pp_size):
                    ids = stage_ids_this_rank(rank, pp_size, num_stages, style)
                    self.assertEqual(
                        sorted(ids), sorted(s for s, r in mapping.items() if r == rank)
                    )


class TestPipelineModuleSplit(OneRankGroupTestCase):
    """``pipeline_module_split`` on a one-rank gloo group (all stages local)."""

    def test_group_and_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        model = ToyLLM(n_layers=4)
        names = generate_module_names_per_stage(3, 4)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        for group in (dist.group.WORLD, mesh):
            stages, parts = pipeline_module_split(
                model, group, ScheduleInterleaved1F1B, "cpu", names
            )
            self.assertEqual([s.stage_index for s in stages], [0, 1, 2])
            self.assertTrue(
                all(isinstance(s, PipelineStage) and s.num_stages == 3 for s in stages)
            )
            self.assertEqual([s.submod for s in stages], parts)
            self.assertEqual(
                set().union(*(p.state_dict() for p in parts)), set(model.state_dict())
            )

    def test_v_style_order(self):
        model = ToyLLM(n_layers=4)
        stages, parts = pipeline_module_split(
            model,
            dist.group.WORLD,
            "DualPipeV",
            torch.device("cpu"),
            generate_module_names_per_stage(2, 4),
        )
        self.assertEqual([s.stage_index for s in stages], [0, 1])
        self.assertIsNotNone(parts[0].tok_embeddings)
        self.assertIsNotNone(parts[1].output)

    def test_prepare_part(self):
        model = ToyLLM(n_layers=4)
        seen = []

        def prepare(part: nn.Module, stage_id: int, num_stages: int) -> nn.Module:
            seen.append((stage_id, num_stages))
            return nn.Sequential(part)

        stages, parts = pipeline_module_split(
            model,
            dist.group.WORLD,
            "Interleaved1F1B",
            "cpu",
            generate_module_names_per_stage(2, 4),
            prepare_part=prepare,
        )
        self.assertEqual(seen, [(0, 2), (1, 2)])
        self.assertTrue(all(isinstance(p, nn.Sequential) for p in parts))
        self.assertEqual([s.submod for s in stages], parts)

    def test_errors_before_building(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import Schedule1F1B

        model = ToyLLM(n_layers=4)
        names = generate_module_names_per_stage(2, 4)
        with mock.patch.object(_stage_split, "_build_stage") as build:
            with self.assertRaisesRegex(
                ValueError, "Schedule1F1B runs one stage per rank, but 2 stages"
            ):
                pipeline_module_split(
                    model, dist.group.WORLD, Schedule1F1B, "cpu", names
                )
            with self.assertRaisesRegex(
                ValueError, "exactly 2 stages on each pipeline"
            ):
                pipeline_module_split(
                    model, dist.group.WORLD, "DualPipeV", "cpu", names + [["norm"]]
                )
            with self.assertRaisesRegex(ValueError, "1-D pipeline mesh"):
                pipeline_module_split(
                    model,
                    init_device_mesh("cpu", (1, 1)),
                    "Interleaved1F1B",
                    "cpu",
                    names,
                )
            with self.assertRaisesRegex(TypeError, "DeviceMesh or a ProcessGroup"):
                pipeline_module_split(model, 0, "Interleaved1F1B", "cpu", names)
            with self.assertRaisesRegex(TypeError, "sets 'group' itself"):
                pipeline_module_split(
                    model, dist.group.WORLD, "Interleaved1F1B", "cpu", names, group=None
                )
            with self.assertRaisesRegex(
                TypeError, "stage_kwargs do not fit PipelineStage"
            ):
                pipeline_module_split(
                    model, dist.group.WORLD, "Interleaved1F1B", "cpu", names, bogus=1
                )
            with self.assertRaisesRegex(ValueError, "did you mean 'output'"):
                pipeline_module_split(
                    model,
                    dist.group.WORLD,
                    "Interleaved1F1B",
                    "cpu",
                    [names[0], ["outptu"]],
                )
            self.assertEqual(build.call_count, 0)


class _Dispatcher:
    """A plain object a layer keeps: a group, a back-reference, some state."""

    def __init__(self, group, owner: nn.Module | None = None) -> None:
        self.group = group
        self.owner = owner
        self.sizes = [1, 2]


class _Pinned:
    """An object that cannot be copied (as a C++ handle or a socket)."""

    def __init__(self, tensor: torch.Tensor | None = None) -> None:
        self.tensor = tensor

    def __reduce_ex__(self, protocol):
        raise TypeError("cannot pickle '_Pinned' object")


class _NotCopyableBlock(ToyBlock):
    def __deepcopy__(self, memo):
        raise TypeError("cannot pickle '_NotCopyableBlock' object")


class TestSharedAttributes(OneRankGroupTestCase):
    """What a stage shares with the model: process groups, device meshes and
    what cannot be copied (see [Note: what a stage shares with the model])."""

    def _model_with_handles(self):
        from torch.distributed.device_mesh import init_device_mesh

        group = dist.new_group([0])
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        model = ToyLLM(n_layers=4, container="list")
        for layer in model.layers:
            layer.ep_group = group  # the usual way: a group kept on the layer
            layer.feed_forward.mesh = mesh
            layer.settings = {"groups": [group], "top_k": 2}
            layer.dispatcher = _Dispatcher(group, owner=layer)
        return model, group, mesh

    def test_groups_and_meshes_are_shared_the_rest_copied(self):
        model, group, mesh = self._model_with_handles()
        tokens = torch.randint(0, 32, (2, 8))
        names = generate_module_names_per_stage(2, 4)
        stages = _split_all(model, names)
        h = tokens
        for stage in stages:
            for i, layer in stage.layers._modules.items():
                orig = model.layers[int(i)]
                self.assertIs(layer.ep_group, group)
                self.assertIs(layer.feed_forward.mesh, mesh)
                self.assertIsNot(layer.settings, orig.settings)
                self.assertIs(layer.settings["groups"][0], group)
                self.assertIsNot(layer.dispatcher, orig.dispatcher)
                self.assertIs(layer.dispatcher.group, group)
                self.assertIs(layer.dispatcher.owner, layer)  # the copy's own
                self.assertEqual(layer.dispatcher.sizes, [1, 2])
                self.assertIsNot(layer.dispatcher.sizes, orig.dispatcher.sizes)
                self.assertIsNot(layer.attention.wq.weight, orig.attention.wq.weight)
            h = stage(h)
        torch.testing.assert_close(h, model(tokens))

    def test_split_with_a_group_attribute_through_pipeline_module_split(self):
        model, group, _ = self._model_with_handles()
        stages, parts = pipeline_module_split(
            model,
            dist.group.WORLD,
            "DualPipeV",
            "cpu",
            generate_module_names_per_stage(2, 4),
        )
        self.assertEqual(len(parts), 2)
        self.assertTrue(all(lay.ep_group is group for p in parts for lay in p.layers))

    def test_an_object_that_cannot_be_copied_is_shared(self):
        model = ToyLLM(n_layers=2, container="list")
        lock = threading.Lock()
        pinned = _Pinned()
        model.layers[1].lock = lock
        model.layers[1].helper = types.SimpleNamespace(pinned=pinned, calls=[0])
        # the layer refers to the helper before the lock: the lock is shared first
        model.layers[1].dispatcher = _Dispatcher(None, owner=model.layers[1])
        stage = build_stage_module(model, ["layers.1"])
        layer = stage.layers._modules["1"]
        self.assertIs(layer.lock, lock)
        self.assertIsNot(layer.helper, model.layers[1].helper)
        self.assertIs(layer.helper.pinned, pinned)
        self.assertIsNot(layer.helper.calls, model.layers[1].helper.calls)
        self.assertIs(layer.dispatcher.owner, layer)

    def test_an_error_while_copying_is_raised_not_shared(self):
        # a RuntimeError from deepcopy is an error of the object, not "cannot be
        # copied": it propagates instead of the object being shared silently
        class _FailingCopy:
            def __deepcopy__(self, memo):
                raise RuntimeError("copy failed halfway")

        model = ToyLLM(n_layers=2, container="list")
        model.layers[1].helper = _FailingCopy()
        with self.assertRaisesRegex(RuntimeError, "copy failed halfway"):
            build_stage_module(model, ["layers.1"])

    def test_an_object_that_can_be_neither_copied_nor_shared_is_named(self):
        model = ToyLLM(n_layers=2, container="list")
        model.layers[1].feed_forward.cache = _Pinned(torch.zeros(3))
        with self.assertRaisesRegex(
            TypeError,
            r"'layers\.1\.feed_forward\.cache' \(_Pinned\) cannot be copied "
            r"\(TypeError: cannot pickle '_Pinned' object\), and it cannot be "
            r"shared with the model either, since it refers to "
            r"'layers\.1\.feed_forward\.cache\.tensor'.*__deepcopy__.*move=True",
        ):
            build_stage_module(model, ["layers.1"])
        with self.assertRaisesRegex(TypeError, r"'layers\.1\.feed_forward\.cache'"):
            _split_all(model, generate_module_names_per_stage(2, 2))
        # move=True copies nothing: the stage takes the layer itself
        layer = model.layers[1]
        stage = build_stage_module(model, ["layers.1"], move=True)
        self.assertIs(stage.layers._modules["1"], layer)

    def test_a_module_that_cannot_be_copied_is_named(self):
        model = ToyLLM(n_layers=2, container="list")
        model.layers[1].__class__ = _NotCopyableBlock
        with self.assertRaisesRegex(
            TypeError,
            r"copying 'layers\.1' \(_NotCopyableBlock\) failed \(TypeError: "
            r"cannot pickle '_NotCopyableBlock' object\).*__deepcopy__.*move=True",
        ):
            build_stage_module(model, ["tok_embeddings", "layers.1"])


class TestPublicNames(TestCase):
    def test_split_module_is_a_deprecated_alias(self):
        # the public face hands on every name of the upstream module
        self.assertLessEqual(set(_stage_split.__all__), set(ss.__all__))
        for name in _stage_split.__all__:
            self.assertIs(getattr(ss, name), getattr(_stage_split, name), name)
        model = ToyLLM(n_layers=4)
        with self.assertWarnsRegex(
            FutureWarning, "split_module is deprecated.*build_stage_module"
        ):
            old = ss.split_module(model, ["layers.1", "norm"])
        new = build_stage_module(model, ["layers.1", "norm"])
        self.assertIs(type(old), type(new))
        self.assertEqual(old.state_dict().keys(), new.state_dict().keys())
        for key, value in new.state_dict().items():
            self.assertTrue(torch.equal(old.state_dict()[key], value), key)

    def test_build_stage_modules_builds_only_the_given_stages(self):
        model = ToyLLM(n_layers=4)
        names = generate_module_names_per_stage(4, 4)
        with mock.patch.object(
            _stage_split, "_build_stage", wraps=_stage_split._build_stage
        ) as build:
            parts = build_stage_modules(model, names, [2, 0])
        self.assertEqual(build.call_count, 2)
        self.assertEqual(
            set(parts[0].state_dict()),
            {k for n in names[2] for k in model.state_dict() if k.startswith(n + ".")},
        )
        self.assertIsNotNone(parts[1].tok_embeddings)
        with self.assertRaisesRegex(ValueError, "stage id 4 out of range for 4 stages"):
            build_stage_modules(model, names, [4])
        with self.assertRaisesRegex(ValueError, "listed in stages"):
            build_stage_modules(model, [names[0], names[0] + names[1]], [0])

    def test_resolve_schedule_class(self):
        from torch.distributed.pipelining import (
            ScheduleDualPipeV,
            ScheduleInterleaved1F1B,
        )

        self.assertIs(
            resolve_schedule_class("Interleaved1F1B"), ScheduleInterleaved1F1B
        )
        self.assertIs(resolve_schedule_class("ScheduleDualPipeV"), ScheduleDualPipeV)
        self.assertIs(resolve_schedule_class(ScheduleDualPipeV), ScheduleDualPipeV)
        with self.assertRaisesRegex(TypeError, "not a pipeline schedule class"):
            resolve_schedule_class(nn.Linear)
        with self.assertRaisesRegex(ValueError, "unknown pipeline schedule 'NoSuch'"):
            resolve_schedule_class("NoSuch")
        with self.assertRaisesRegex(TypeError, "schedule class or name"):
            resolve_schedule_class(3)


class TestPatch(TestCase):
    def test_reachable_under_torch_while_patched(self):
        import torch.distributed.pipelining as pipelining

        try:
            torch_pipelining_ext.patch()
            status = {
                r.name: r.status.value for r in torch_pipelining_ext.patch_report()
            }["stage_split"]
            self.assertEqual(status, "applied")
            # torch gets the upstream form, without the package's deprecated name
            self.assertIs(pipelining.stage_split, _stage_split)
            self.assertFalse(hasattr(pipelining.stage_split, "split_module"))
            mod = importlib.import_module("torch.distributed.pipelining.stage_split")
            self.assertIs(mod, _stage_split)
            from torch.distributed.pipelining.stage_split import (
                build_stage_module as imported,
            )

            self.assertIs(imported, build_stage_module)
            torch_pipelining_ext.unpatch()
            self.assertFalse(hasattr(pipelining, "stage_split"))
            self.assertNotIn("torch.distributed.pipelining.stage_split", sys.modules)
            with self.assertRaises(ImportError):
                importlib.import_module("torch.distributed.pipelining.stage_split")
        finally:
            torch_pipelining_ext.patch()
        self.assertIs(pipelining.stage_split, _stage_split)

    def test_probe(self):
        import torch.distributed.pipelining as pipelining

        from torch_pipelining_ext._patching import _probes

        try:
            torch_pipelining_ext.unpatch()
            self.assertEqual(_probes._upstream_probe()[0], "needed")
            with mock.patch.object(
                pipelining, "build_stage_module", build_stage_module, create=True
            ):
                self.assertEqual(_probes._upstream_probe()[0], "upstream")
            with mock.patch.dict(pipelining.__dict__):
                del pipelining.PipelineStage
                with self.assertRaisesRegex(RuntimeError, "no PipelineStage"):
                    _probes._upstream_probe()
            self.assertTrue(hasattr(pipelining, "PipelineStage"))
        finally:
            torch_pipelining_ext.patch()

    def test_target_key_with_dots(self):
        name = "_stage_split_test_owner"
        owner = types.ModuleType(name)
        owner.table = {}
        sys.modules[name] = owner
        try:
            t = Target(name, "table", make=lambda orig: "new", key="a.b.c")
            self.assertEqual(t.qualname, f"{name}.table['a.b.c']")
            self.assertIs(t._get(), ss_missing())
            t._set("x")
            self.assertEqual(owner.table, {"a.b.c": "x"})
            self.assertEqual(t._get(), "x")
            t._set(ss_missing())
            self.assertEqual(owner.table, {})
        finally:
            del sys.modules[name]


def ss_missing():
    from torch_pipelining_ext._patching._registry import _MISSING

    return _MISSING


instantiate_parametrized_tests(TestSplitModule)
instantiate_parametrized_tests(TestStagePlacement)

if __name__ == "__main__":
    run_tests()
