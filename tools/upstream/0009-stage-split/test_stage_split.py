# Copyright (c) Meta Platforms, Inc. and affiliates
# Owner(s): ["oncall: distributed"]
"""``torch.distributed.pipelining.stage_split``: pipeline stages by module names.

Single process: stage models keep exactly their named modules under the
original FQNs, chained stages compute what the whole model computes, the
generated FQN lists are balanced, bad names are rejected.  Two ranks:
``pipeline_module_split`` builds each rank's stages, and a schedule over them
gives the losses and every gradient of a single-process reference.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.stage_split import (
    call_if_present,
    generate_module_names_per_stage,
    pipeline_module_split,
    build_stage_module,
    stage_ids_this_rank,
)
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    skip_but_pass_in_sandcastle_if,
    TestCase,
)


VOCAB = 16
DIM = 8
SEQ = 4
N_LAYERS = 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(self.norm(h)))


class ToyLM(nn.Module):
    """Embedding, a list of blocks, a norm and a head; any stage runs its part."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = call_if_present(self.tok_embeddings, tokens_or_hidden)
        for layer in self.layers:
            h = layer(h)
        h = call_if_present(self.norm, h)
        return call_if_present(self.output, h)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_model() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


class StageSplitTest(TestCase):
    def test_stages_keep_original_fqns(self):
        model = make_model()
        names = generate_module_names_per_stage(3, N_LAYERS)
        parts = [build_stage_module(model, stage_names) for stage_names in names]
        keys = [set(part.state_dict()) for part in parts]
        self.assertEqual(set().union(*keys), set(model.state_dict()))
        self.assertEqual(sum(len(k) for k in keys), len(model.state_dict()))
        state = model.state_dict()
        for part in parts:
            for key, value in part.state_dict().items():
                self.assertEqual(value, state[key])
                self.assertNotEqual(value.data_ptr(), state[key].data_ptr())
        # A stage without layers keeps an empty ModuleList; sparse keys stay.
        self.assertEqual(
            names,
            [
                ["tok_embeddings", "layers.0"],
                ["layers.1", "layers.2"],
                ["layers.3", "norm", "output"],
            ],
        )
        self.assertEqual([n for n, _ in parts[1].layers.named_children()], ["1", "2"])
        self.assertIsNone(parts[1].tok_embeddings)
        self.assertIsNone(parts[1].output)

    def test_chained_stages_match_model(self):
        model = make_model()
        parts = [
            build_stage_module(model, n)
            for n in generate_module_names_per_stage(4, N_LAYERS)
        ]
        tokens = torch.randint(VOCAB, (2, SEQ))
        h = tokens
        for part in parts:
            h = part(h)
        torch.testing.assert_close(h, model(tokens))

    def test_move_takes_modules_out_of_model(self):
        model = make_model()
        layer = model.layers[1]
        part = build_stage_module(model, ["layers.1"], move=True)
        self.assertIs(dict(part.layers.named_children())["1"], layer)
        self.assertNotIn("1", dict(model.layers.named_children()))

    def test_generate_module_names_per_stage(self):
        self.assertEqual(
            generate_module_names_per_stage(2, 4),
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "norm", "output"],
            ],
        )
        # An expensive head gets a stage with fewer layers.
        self.assertEqual(
            generate_module_names_per_stage(2, 4, output_weight=3),
            [
                ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                ["layers.3", "norm", "output"],
            ],
        )
        with self.assertRaisesRegex(ValueError, "at most 6 stages"):
            generate_module_names_per_stage(7, 4)

    def test_stage_ids_this_rank(self):
        self.assertEqual(stage_ids_this_rank(1, 4, 8, "loop"), (1, 5))
        self.assertEqual(stage_ids_this_rank(1, 4, 8, ScheduleDualPipeV), (1, 6))
        self.assertEqual(stage_ids_this_rank(0, 2, 4, "Interleaved1F1B"), (0, 2))

    def test_bad_names_raise(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "layer"):
            build_stage_module(model, ["layer.0"])
        with self.assertRaises(ValueError):
            build_stage_module(model, ["layers.7"])


N_MICROBATCHES = 4
MB_SIZE = 2


class StageSplitMultiProcTest(MultiProcContinuousTest):
    """Two ranks on gloo/CPU (:class:`StageSplitMultiProcTestNCCL`: NCCL, two GPUs)."""

    world_size = 2

    @classmethod
    def backend_str(cls) -> str:
        return "gloo"

    @property
    def device(self) -> torch.device:
        torch.set_num_threads(1)
        return torch.device("cpu")

    @parametrize("ScheduleClass", [ScheduleInterleaved1F1B, ScheduleDualPipeV])
    def test_pipeline_module_split_gradients(self, ScheduleClass):
        ref = make_model().to(self.device)
        names = generate_module_names_per_stage(2 * self.world_size, N_LAYERS)
        stages, parts = pipeline_module_split(
            copy.deepcopy(ref), dist.group.WORLD, ScheduleClass, self.device, names
        )
        self.assertTrue(all(isinstance(s, PipelineStage) for s in stages))
        self.assertEqual(
            [s.stage_index for s in stages],
            list(
                stage_ids_this_rank(
                    self.rank, self.world_size, len(names), ScheduleClass
                )
            ),
        )
        schedule = ScheduleClass(stages, N_MICROBATCHES, loss_fn=loss_fn)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(VOCAB, (N_MICROBATCHES * MB_SIZE, SEQ), generator=gen)
        target = torch.randint(VOCAB, (N_MICROBATCHES * MB_SIZE, SEQ), generator=gen)
        tokens, target = tokens.to(self.device), target.to(self.device)
        losses: list[torch.Tensor] = []
        schedule.step(tokens, target=target, losses=losses)

        ref_losses = []
        for x_mb, y_mb in zip(
            tokens.chunk(N_MICROBATCHES), target.chunk(N_MICROBATCHES)
        ):
            loss = loss_fn(ref(x_mb), y_mb)
            (loss / N_MICROBATCHES).backward()
            ref_losses.append(loss.detach())
        if any(s.is_last for s in stages):
            torch.testing.assert_close(losses, ref_losses)
        ref_params = dict(ref.named_parameters())
        for part in parts:
            for name, p in part.named_parameters():
                torch.testing.assert_close(p.grad, ref_params[name].grad, msg=name)


@requires_nccl()
@skip_but_pass_in_sandcastle_if(
    torch.cuda.device_count() < 2, "NCCL test requires 2+ GPUs"
)
class StageSplitMultiProcTestNCCL(StageSplitMultiProcTest):
    @classmethod
    def backend_str(cls) -> str:
        return "nccl"

    @property
    def device(self) -> torch.device:
        torch.cuda.set_device(self.rank)
        return torch.device("cuda", self.rank)


instantiate_parametrized_tests(StageSplitMultiProcTest)


if __name__ == "__main__":
    run_tests()
