# Owner(s): ["oncall: distributed"]
"""Multi-process tests of ``torch.distributed.pipelining.stage_split``: toy
dense and MoE LLMs are split with ``generate_module_names_per_stage`` and
``pipeline_module_split`` and run with ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` and ``ScheduleDualPipeV``; outputs, losses and
every parameter gradient must equal an unsplit single-process reference.

Four ranks on gloo/CPU (NCCL when four GPUs exist): pipelines of 4 ranks,
and of 2 ranks (two pipelines side by side, whose groups' ranks differ from the
global ranks), the group given as a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from common_pipelining import (
    check_on_all_ranks,
    nccl_variant,
    PipelineMultiProcTest,
    token_cross_entropy,
)
from model_registry import NestedToyLLM, ToyLLM, toy_moe_llm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_pipelining_ext  # noqa: F401  (patches torch)
from torch_pipelining_ext.stage_split import (
    generate_module_names_per_stage,
    pipeline_module_split,
)


VOCAB = 32
SEQ = 8

_SCHEDULES = {
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
    "dualpipev": (ScheduleDualPipeV, 2),
}

_NESTED_NAMES = dict(
    layers_prefix="model.layers",
    input_modules=["model.embed_tokens"],
    output_modules=["model.norm", "lm_head"],
    replicated_modules=["model.rotary_emb"],
)


class StageSplitGlooTest(PipelineMultiProcTest):
    world_size = 4
    # (pp size, as mesh) -> pipeline group or mesh, built once per rank
    _groups: dict = {}

    def _build(self, kind: str, num_layers: int, meta: bool) -> nn.Module:
        with torch.device("meta" if meta else self.device):
            if kind == "dense":
                return ToyLLM(n_layers=num_layers, container="dict")
            if kind == "moe":
                return toy_moe_llm(n_layers=num_layers, n_dense=2)
            if kind == "nested":
                return NestedToyLLM(n_layers=num_layers)
        raise AssertionError(kind)

    def _pipeline_group(self, pp: int, use_mesh: bool):
        key = (pp, use_mesh)
        if key not in self._groups:
            dp = self.world_size // pp
            if use_mesh:
                mesh = init_device_mesh(
                    self.device.type, (dp, pp), mesh_dim_names=("dp", "pp")
                )
                self._groups[key] = mesh["pp"]
            elif dp == 1:
                self._groups[key] = dist.group.WORLD
            else:
                self._groups[key] = dist.new_subgroups(group_size=pp)[0]
        return self._groups[key]

    def _check_split_schedule(
        self, kind: str, schedule: str, pp: int, source: str, use_mesh: bool
    ) -> None:
        torch.manual_seed(0)
        schedule_cls, stages_per_rank = _SCHEDULES[schedule]
        num_stages = pp * stages_per_rank
        n_microbatches = 2 * pp
        num_layers = num_stages + 1

        # Reference: the unsplit model, same seed on every rank.
        ref = self._build(kind, num_layers, meta=False)
        tokens = torch.randint(0, VOCAB, (n_microbatches, SEQ), device=self.device)
        target = torch.randint(0, VOCAB, (n_microbatches, SEQ), device=self.device)
        ref_out = ref(tokens)
        ref_losses = [
            token_cross_entropy(o, t) for o, t in zip(ref_out.split(1), target.split(1))
        ]
        (torch.stack(ref_losses).sum() / n_microbatches).backward()

        gen_kwargs: dict = dict(_NESTED_NAMES) if kind == "nested" else {}
        if kind == "moe":  # MoE layers cost twice a dense layer
            gen_kwargs["layer_costs"] = [1] * 2 + [2] * (num_layers - 2)
        names = generate_module_names_per_stage(num_stages, num_layers, **gen_kwargs)

        if source == "copy":
            whole = ref  # build_stage_module copies: the reference stays intact
        else:  # build on meta, split (moving), materialise, load the full checkpoint
            whole = self._build(kind, num_layers, meta=True)
        group = self._pipeline_group(pp, use_mesh)
        stages, parts = pipeline_module_split(
            whole, group, schedule_cls, self.device, names, move=source == "meta_move"
        )
        ref_buffers = dict(ref.named_buffers())
        ref_params = dict(ref.named_parameters())
        ref_state = ref.state_dict()
        missing: list[str] = []
        for part in parts:
            if source != "copy":
                part.to_empty(device=self.device)
                missing += part.load_state_dict(ref_state, strict=False).missing_keys
                with torch.no_grad():  # non-persistent buffers are not checkpointed
                    for name, buf in part.named_buffers():
                        buf.copy_(ref_buffers[name])

        def check_parts() -> None:
            self.assertEqual(len(stages), stages_per_rank)
            self.assertEqual(missing, [])
            for part in parts:
                for name, p in part.named_parameters():
                    self.assertIsNot(p, ref_params[name])

        check_on_all_ranks(check_parts, self.device)

        # single-stage schedules take the stage, multi-stage ones the list
        sched = schedule_cls(
            stages[0] if stages_per_rank == 1 else stages,
            n_microbatches=n_microbatches,
            loss_fn=token_cross_entropy,
        )
        losses: list[torch.Tensor] = []
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        args = (tokens,) if has_first else ()
        out = sched.step(*args, target=target, losses=losses)
        # Every parameter of the model is checked on exactly one rank of the pipeline.
        checked = [name for part in parts for name, _ in part.named_parameters()]
        gathered: list = [None] * pp
        dist.all_gather_object(
            gathered, checked, group=group.get_group() if use_mesh else group
        )

        def check_results() -> None:
            if has_last:
                torch.testing.assert_close(out, ref_out)
                self.assertEqual(len(losses), n_microbatches)
                for got, want in zip(losses, ref_losses):
                    torch.testing.assert_close(got, want)
            for part in parts:
                for name, p in part.named_parameters():
                    want = ref_params[name].grad
                    if want is None:  # an expert no token was routed to
                        self.assertIsNone(p.grad, name)
                    else:
                        self.assertIsNotNone(p.grad, name)
                        torch.testing.assert_close(p.grad, want, msg=f"grad of {name}")
            self.assertEqual(
                sorted(n for names_ in gathered for n in names_), sorted(ref_params)
            )

        check_on_all_ranks(check_results, self.device)

    @parametrize("pp", [2, 4])
    @parametrize("schedule", list(_SCHEDULES))
    def test_dense_llm(self, schedule, pp):
        self._check_split_schedule("dense", schedule, pp, source="copy", use_mesh=False)

    @parametrize("pp", [2, 4])
    @parametrize("schedule", list(_SCHEDULES))
    def test_moe_llm(self, schedule, pp):
        self._check_split_schedule(
            "moe", schedule, pp, source="meta_move", use_mesh=True
        )

    @parametrize("pp", [2, 4])
    def test_nested_llm_replicated_rotary(self, pp):
        self._check_split_schedule(
            "nested", "interleaved1f1b", pp, source="meta", use_mesh=False
        )


instantiate_parametrized_tests(StageSplitGlooTest)


StageSplitNcclTest = nccl_variant(StageSplitGlooTest, "StageSplitNcclTest")


if __name__ == "__main__":
    run_tests()
