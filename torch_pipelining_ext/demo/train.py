"""The main job: ``python -m torch_pipelining_ext.demo`` (``bash tools/run_demo.sh``).

The demo is the trainer's comparison mode with the demo's defaults:
``python -m torch_pipelining_ext.demo [FLAGS]`` runs
``python -m torch_pipelining_ext.train`` with :data:`DEMO_FLAGS` followed by
``FLAGS`` (a later flag overrides an earlier one; ``--model TYPE`` is taken
as ``--model-type TYPE``).  It trains a tiny Qwen3-MoE from a transformers
5.x config -- no download -- on synthetic sequences with
``ScheduleDualPipeV`` and expert parallelism (EP=2, both stages of the V on
each of 2 processes; ``--pp 2``: PP=2 x EP=2 on 4), every step with the
concurrent OVERLAP_F_B and with the sequential one over a simulated slow
link, and the unsplit Hugging Face model as the reference; see
:mod:`torch_pipelining_ext.train` (``--compare-sequential``).

Exit status: 0 when the losses and weights of both runs are bitwise equal
and the reference's losses equal within float rounding, 1 when not, 2 for
bad arguments.

The rest of this module is the workload of ``tools/bench_hf_overlap.py``
and ``tools/bench_moe_balance.py``: the tiny config, the synthetic global
batch and a pipeline trained with SGD.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import OVERLAP_F_B

import torch_pipelining_ext  # noqa: F401  (applies the patches)
from torch_pipelining_ext import hf, train
from torch_pipelining_ext.runtime import sequential_overlap_f_b


__all__ = ["DEMO_FLAGS", "Pipeline", "main", "tiny_moe_config"]

VOCAB, SEQ_LEN, MICROBATCH_SIZE, LR = 256, 256, 2, 0.2
MODELS = ("qwen3_moe", "mixtral", "deepseek_v3")

DEMO_FLAGS = (
    "--compare-sequential", "--synthetic-data", "--model-type", "qwen3_moe",
    "--layers", "4", "--experts", "8", "--ep", "2", "--microbatches", "8",
    "--batch-size", "32", "--seq-len", str(SEQ_LEN), "--vocab-size", str(VOCAB),
    "--steps", "6", "--warmup-steps", "1", "--timeout", "300",
)  # fmt: skip
"""The trainer's flags of the demo, before the command line's."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_pipelining_ext.demo``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # the demo's former --model TYPE is the trainer's --model-type (--model: a directory)
    for i, arg in enumerate(argv):
        if arg == "--model":
            argv[i] = "--model-type"
        elif arg.startswith("--model="):
            argv[i] = "--model-type=" + arg.split("=", 1)[1]
    return train.main([*DEMO_FLAGS, *argv])


def tiny_moe_config(args: argparse.Namespace) -> Any:
    """A tiny MoE config whose experts do most of a layer's work, as in real
    MoEs (the trainer's tiny config of ``--model``, sequences of ``SEQ_LEN``)."""
    return train.tiny_config(
        args.model,
        vocab_size=VOCAB,
        layers=args.layers,
        experts=args.experts,
        hidden_size=128,
        max_positions=SEQ_LEN,
    )


def global_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Token ids of the whole step (all EP ranks): sequences that follow a fixed
    permutation of the vocabulary from a random first token, which the model learns."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(args.seed))
    ids = torch.empty(
        args.ep * args.microbatches * MICROBATCH_SIZE, SEQ_LEN, dtype=torch.long
    )
    ids[:, 0] = torch.randint(0, VOCAB, (ids.shape[0],), generator=gen)
    for t in range(1, SEQ_LEN):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


class Pipeline:
    """This rank's stages of ``model`` (PP x EP), their schedule and optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh: DeviceMesh,
        names: list[list[str]],
        args: argparse.Namespace,
        *,
        overlap: bool,
    ) -> None:
        self.ep_group = mesh["ep"].get_group()
        # every MoE layer keeps E / ep experts; all-to-alls inside the overlap's marked regions
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            model, mesh, ScheduleDualPipeV, "cpu", names
        )
        self.loss_fn = (
            hf.CausalLMLoss()
        )  # EP ranks' losses average to HF's loss of the global batch
        self.schedule = ScheduleDualPipeV(
            # torch's stub wants a list[_PipelineStageBase] (invariant), it only reads it
            self.stages,  # type: ignore[arg-type]
            n_microbatches=args.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )
        if (
            not overlap
        ):  # what stock torch does: the two sub-actions one after the other
            # the patched step loop passes the package's PipelineContext, which the
            # patch table installs as schedules._PipelineContext (torch's stub names
            # torch's own class)
            self.schedule.register_custom_function(OVERLAP_F_B, sequential_overlap_f_b)  # type: ignore[arg-type]
        self.optimizer = torch.optim.SGD(
            [p for part in self.parts for p in part.parameters()], lr=LR, momentum=0.9
        )
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)

    def train_step(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """One step on this EP rank's ``ids``; returns the microbatch losses (last stage)."""
        self.optimizer.zero_grad()
        self.loss_fn.set_labels(
            ids, group=self.ep_group
        )  # EP ranks see different tokens
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *((ids,) if self.has_first else ()),
            target=ids if self.has_last else None,
            losses=losses,
        )
        hf.reduce_expert_parallel_gradients(
            self.parts, self.ep_group
        )  # replicated: average over EP; experts: / ep
        self.optimizer.step()
        return [loss.detach() for loss in losses]
