"""What a checkpoint holds besides the model and the optimizers: the step,
the data position, the learning-rate schedule and every rank's random
number generators.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: trainer
state]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: trainer state]
# hf.save_checkpoint stores, next to the model ("model.<fqn>") and the
# optimizers ("optim.<...>"), the entries of state=:
#
# * "trainer.step" and "trainer.data_position" (int64 tensors, the same on
#   every rank): optimizer steps done, and sequences consumed by the whole
#   run (the global data position of [Note: training data]);
# * "trainer.lr_schedule": the learning-rate schedulers' state (a Stateful;
#   the same on every rank: the learning rate is a function of the step);
# * "rng.<layout>.rank<r>.<generator>" (layout e.g. "pp2_dp1_ep2"): rank
#   r's random number generators (CPU, and the accelerator's), under
#   per-rank keys: DCP keeps one copy of a key that several ranks save, so a
#   shared key would give every rank one rank's state.  They are restored
#   where the checkpoint has this rank's keys of this layout; in another
#   layout every rank starts from (seed, step, rank).
#
# On every start, torch runs the stages once on uninitialised tensors to
# infer their shapes (the first schedule.step), and with random ops (dropout)
# that draws random numbers.  The trainer runs that first step itself before
# training -- the next batch's forward and backward inside
# torch.random.fork_rng, the gradients dropped, the expert load discarded,
# no optimizer step -- so that an uninterrupted run and a resumed one enter
# every step from the same state (_loop.Trainer.infer_shapes).

STEP = "trainer.step"
POSITION = "trainer.data_position"
LR_SCHEDULE = "trainer.lr_schedule"


def lr_factor(step: int, *, steps: int, warmup: int, min_ratio: float) -> float:
    """The learning rate of ``step`` (0-based) over the peak: linear warm-up
    over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LRSchedules:
    """The learning-rate schedulers of the optimizers, as one ``Stateful``
    of a checkpoint (see ``[Note: trainer state]``)."""

    def __init__(self, schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR]) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        # the same step on every scheduler (their optimizers' groups differ)
        first = self.schedulers[0].state_dict()
        return {"last_epoch": first["last_epoch"], "_step_count": first["_step_count"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            full = s.state_dict()
            full.update(
                last_epoch=int(state["last_epoch"]),
                _step_count=int(state["_step_count"]),
            )
            full["_last_lr"] = [
                base * rule(full["last_epoch"])
                for base, rule in zip(full["base_lrs"], s.lr_lambdas)
            ]
            s.load_state_dict(full)


def rng_keys(rank: int, layout: str) -> dict[str, torch.Tensor]:
    """This rank's generator states under keys of this rank in this layout
    (``rng.<layout>.rank<r>.<generator>``)."""
    states = {f"rng.{layout}.rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[f"rng.{layout}.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng(states: dict[str, torch.Tensor], rank: int, layout: str) -> None:
    """Restore what :func:`rng_keys` saved."""
    torch.set_rng_state(states[f"rng.{layout}.rank{rank}.cpu"])
    key = f"rng.{layout}.rank{rank}.cuda"
    if key in states:
        torch.cuda.set_rng_state(states[key])


def seed_rank(seed: int, step: int, rank: int) -> None:
    """Seed this rank's generators from the run's seed, the step and the rank
    (a fresh run, or a resume without this rank's saved states)."""
    torch.manual_seed((seed * 1_000_003 + step) * 65_537 + rank)
