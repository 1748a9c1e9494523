"""Evaluation on held-out data through the pipeline's forward only.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: held-out
data]`` (``_data.py``) for what is held out and ``[Note: evaluation leaves
training alone]`` for why a run that evaluates trains bitwise as one that
does not.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torch_pipelining_ext import hf


if TYPE_CHECKING:
    from torch_pipelining_ext.train._data import Sequences
    from torch_pipelining_ext.train._pipeline import Pipeline


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: evaluation leaves training alone]
# An evaluation runs between two training steps, after the optimizer step
# (never before the first training step of the process: on torch 2.9 a
# forward-only step before the first training step breaks the schedule's
# backward set-up, pytorch#162822; here the shape-inference step of
# Trainer.infer_shapes and one training step always come first, also in a
# resumed run).  For each held-out batch it calls the schedule's eval()
# (forward only; the package's eval() sets the gradients aside and gives
# them back, and torch re-runs its metadata inference, inside fork_rng, on
# the next training step), with
#   * every stage module in eval mode (no dropout), put back in train mode;
#   * torch.random.fork_rng around it all: the training random streams
#     continue as if no evaluation had run;
#   * the expert-load counts it adds read and dropped afterwards
#     (hf.expert_load starts the counts from zero), so that neither the
#     logged imbalance nor DeepSeek-V3's bias update sees evaluation tokens;
#   * no optimizer, learning-rate schedule or data position touched.
# The evaluation loss is the language-model loss alone (token mean of the
# cross entropy over every held-out batch, no router auxiliary term:
# recomputed from the last stage's logits when the model carries one), and
# the perplexity its exponential.  test_train_eval.py checks that the losses
# and gradient norms of runs with and without --eval-every are bitwise equal.


@dataclass(frozen=True)
class EvalResult:
    loss: float  # the held-out batches' mean language-model loss
    perplexity: float  # exp(loss)


class Evaluator:
    """Evaluates a rank's :class:`Pipeline` on the held-out batches of
    ``data`` (``[Note: evaluation leaves training alone]``)."""

    def __init__(self, pipe: Pipeline, data: Sequences, batches: int) -> None:
        self.pipe, self.data, self.batches = pipe, data, batches

    def evaluate(self) -> EvalResult:
        """A collective over all ranks: every rank gets the result."""
        pipe = self.pipe
        devices = [pipe.device] if pipe.device.type == "cuda" else []
        total = torch.zeros((), dtype=torch.float64, device=pipe.device)
        for part in pipe.parts:
            part.eval()
        try:
            with torch.random.fork_rng(devices=devices, device_type=pipe.device.type):
                for index in range(self.batches):
                    total += self._batch_loss(index)
        finally:
            for part in pipe.parts:
                part.train()
        if pipe.moe:  # the evaluation's expert counts: read and dropped
            hf.expert_load(pipe.parts, dist.group.WORLD)
        dist.all_reduce(total)
        loss = float(total) / pipe.plan.layout.data_ranks / self.batches
        perplexity = math.exp(loss) if loss < 700 else math.inf
        logger.debug("rank %d: evaluation loss %.6f", dist.get_rank(), loss)
        return EvalResult(loss, perplexity)

    def _batch_loss(self, index: int) -> torch.Tensor:
        """This rank's share of held-out batch ``index``'s loss (0 on ranks
        without the last stage)."""
        pipe, args = self.pipe, self.pipe.plan.args
        data = pipe.data
        ids = self.data.held_out_batch(
            index, args.batch_size, data.get_local_rank(), data.size()
        ).to(pipe.device)
        losses: list[torch.Tensor] = []
        output = pipe.run_schedule(pipe.schedule.eval, ids, losses)
        if not pipe.has_last:
            return torch.zeros((), dtype=torch.float64, device=pipe.device)
        if pipe.aux:  # (logits, auxiliary terms): the language-model loss alone
            with pipe.autocast():
                loss = pipe.loss_fn(output[0], ids)
        else:
            loss = torch.stack(losses).sum()
        return loss.detach().double()
