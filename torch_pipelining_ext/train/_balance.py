"""How a run balances its MoE routers: the setting in force (the flags, the
tiny recipe's default, the model's config, or the checkpoint it resumes) and
a watch for routers that stay collapsed.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: balanced
by default]``.  :func:`resolve` runs before any process group (a conflict is
a :class:`UsageError`, exit status 2); :class:`CollapseWatch` runs on rank 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, TYPE_CHECKING

from torch_pipelining_ext import hf
from torch_pipelining_ext.train import _checkpoints
from torch_pipelining_ext.train._options import UsageError


if TYPE_CHECKING:
    from torch_pipelining_ext.train._metrics import StepRecord


__all__: list[str] = []

logger = logging.getLogger(__name__)

# [Note: balanced by default]
# A MoE's routers are balanced by a router auxiliary loss (--router-aux-loss
# and --router-aux-loss-coef; [Note: HF router auxiliary loss]) and, for
# DeepSeek-V3's routers, by the auxiliary-loss-free bias update
# (--expert-bias-rate).  Hugging Face's own loss ("pooled") sums the counts
# and probabilities over every layer before it multiplies them, so it
# balances the layers taken together, not each layer: every layer may send
# every token to the same two of eight experts (max/mean load 4.00), each on
# other experts, while the pooled loss reads its balanced value
# (huggingface/transformers#28255).  Measured on the README's tiny run
# (Qwen3-MoE, 4 layers of 8 experts, top-2, 60 steps): without a loss, and
# with the pooled one at 0.001, the worst layer ends at 4.00 (pooled at
# 0.02: 3.77), in plain transformers training of the same model alike;
# "per_layer" at 0.02 ends at 1.70 (plain transformers: 1.75), DeepSeek-V3's
# bias update at 1e-2 at 2.20, the deepseek_v3 recipe below at 1.73.  All of
# them collapse during the warm-up (steps 5-8) at the default peak learning
# rate; the balancing ones recover later.  An auxiliary loss is the mean of
# the microbatches' terms, so it depends on the sequences per microbatch: a
# resume in a layout that cuts the batch otherwise trains a slightly other
# loss from the same state.
#
# The setting of a run, field by field (loss, coefficient, bias rate):
# * a flag given on the command line (their argparse default is None);
# * resuming a checkpoint: its record (BALANCING_FILE, written into every
#   checkpoint before it is committed).  A flag that names another value
#   than the record is refused (exit status 2): a run keeps the balancing it
#   was trained with, and changes it only by starting afresh (--no-resume or
#   another --run-dir).  A checkpoint without a record (written before the
#   trainer kept one) resumes with the rules below;
# * --model-type (a tiny recipe): RECIPES, a form that balances each layer
#   (none on transformers 4.x, whose stages record no router logits);
# * --model DIR: its config's setting, i.e. Hugging Face's pooled loss at
#   config.router_aux_loss_coef where config.output_router_logits is set,
#   else none; no bias update;
# * --compare-sequential of a tiny recipe: none (it compares with the
#   unsplit model without).
# A coefficient not given is the default's for the default's loss, else the
# config's (sequence: required).  The setting is written back into the flags'
# namespace, concretely, so the stages are built from it alone.
#
# [Note: collapsed routers]
# The worst MoE layer's max/mean load is at most E / k (every token sent to
# the same k of E experts).  A layer counts as collapsed above
# min(COLLAPSED, 1 + 0.9 (E/k - 1)) (3.70 for 8 experts, top-2).  A run whose
# worst layer stays collapsed for COLLAPSED_STEPS consecutive steps after the
# warm-up says so once, on rank 0, with the flags that would help (once per
# start: a resumed run counts afresh).  The window is long enough for the
# early collapse that the balancing losses recover from: the README's tiny
# run with the per-layer loss is collapsed from step 5 (in the warm-up) to
# step 26 (16 steps after the warm-up) and ends at 1.70, which says nothing;
# without balancing it stays at 4.00 from step 8, which is said at step 35.

RECIPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(router_aux_loss="per_layer", router_aux_loss_coef=0.02),
    "mixtral": dict(router_aux_loss="per_layer", router_aux_loss_coef=0.02),
    "deepseek_v3": dict(
        router_aux_loss="sequence", router_aux_loss_coef=1e-4, expert_bias_rate=1e-2
    ),
}
"""The tiny recipes' balancing (``--model-type``; the dense ones have none)."""

BALANCING_FILE = "balancing.json"
COLLAPSED = 4.0
COLLAPSED_STEPS = 25
_FIELDS = ("router_aux_loss", "router_aux_loss_coef", "expert_bias_rate")


@dataclass(frozen=True)
class Balancing:
    """A run's balancing: the router auxiliary loss (``"none"``,
    ``"pooled"``, ``"per_layer"``, ``"sequence"``), its coefficient
    (``None`` without a loss), DeepSeek-V3's bias update rate (0: off), and
    where the setting came from (for the log)."""

    router_aux_loss: str = "none"
    router_aux_loss_coef: float | None = None
    expert_bias_rate: float = 0.0
    source: str = "no balancing asked for"

    def values(self) -> dict[str, Any]:
        """The setting without its source (what a checkpoint records)."""
        return {f: getattr(self, f) for f in _FIELDS}

    def flags(self) -> str:
        """The command-line flags of this setting."""
        words = [f"--router-aux-loss {self.router_aux_loss}"]
        if self.router_aux_loss_coef is not None:
            words.append(f"--router-aux-loss-coef {self.router_aux_loss_coef:g}")
        words.append(f"--expert-bias-rate {self.expert_bias_rate:g}")
        return " ".join(words)

    def what(self) -> str:
        """The setting in words."""
        if self.router_aux_loss == "none":
            what = "no auxiliary loss"
        else:
            what = (
                f"{self.router_aux_loss} auxiliary loss x {self.router_aux_loss_coef:g}"
            )
        if self.expert_bias_rate > 0:
            what += f", bias update at rate {self.expert_bias_rate:g}"
        return what

    def describe(self) -> str:
        """The setting and where it came from, for the log."""
        return f"{self.what()} ({self.source})"


def resolve(
    args: argparse.Namespace,
    config: Any,
    resume: _checkpoints.Checkpoint | None,
) -> Balancing:
    """The run's balancing (``[Note: balanced by default]``), written into
    ``args``; for a MoE ``config`` also turns ``output_router_logits`` off
    when the setting has no loss.  Raises :class:`UsageError` for flags that
    contradict each other or the checkpoint being resumed."""
    given = {f: getattr(args, f) for f in _FIELDS if getattr(args, f) is not None}
    recorded = None
    if resume is not None and not args.compare_sequential:
        recorded = read_record(resume.path)  # (a comparison resumes nothing)
    if recorded is not None:
        assert resume is not None
        _check_against_record(given, recorded, resume, args.run_dir)
        balancing = Balancing(
            **recorded.values(), source=f"as trained until step {resume.step}"
        )
    else:
        balancing = _from_flags(given, _default(args, config), config)
    _check(balancing)
    for f, value in balancing.values().items():
        setattr(args, f, value)
    if balancing.router_aux_loss == "none" and getattr(
        config, "output_router_logits", False
    ):
        config.output_router_logits = False  # the stages would add the pooled loss
    logger.debug("balancing: %s", balancing.describe())
    return balancing


def _default(args: argparse.Namespace, config: Any) -> Balancing:
    if args.model_type is not None:
        if args.compare_sequential:
            return Balancing(source="--compare-sequential compares without balancing")
        recipe = RECIPES.get(args.model_type)
        if recipe is None or not hf.num_routed_experts(config):
            return Balancing(source=f"{args.model_type} has no experts")
        if not hf.has_fused_experts():  # transformers 4.x: no routers apart
            return Balancing(source="transformers 4.x records no router logits")
        return Balancing(**recipe, source=f"the {args.model_type} recipe's default")
    if getattr(config, "output_router_logits", False):
        return Balancing(
            "pooled",
            getattr(config, "router_aux_loss_coef", None),
            source="the model's config: output_router_logits",
        )
    return Balancing(source="the model's config")


def _from_flags(given: dict[str, Any], default: Balancing, config: Any) -> Balancing:
    if not given:
        return default
    mode = given.get("router_aux_loss", default.router_aux_loss)
    coef = given.get("router_aux_loss_coef")
    if coef is None and mode == default.router_aux_loss:
        coef = default.router_aux_loss_coef
    elif coef is None and mode in ("pooled", "per_layer"):
        coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None and mode == "sequence":
        raise UsageError(
            "--router-aux-loss sequence needs --router-aux-loss-coef (DeepSeek-V3's alpha)"
        )
    rate = given.get("expert_bias_rate", default.expert_bias_rate)
    changed = ", ".join(f"--{f.replace('_', '-')}" for f in given)
    source = f"{changed} over {default.source}"
    return Balancing(mode, coef, rate, source=source)


def _check(balancing: Balancing) -> None:
    if balancing.router_aux_loss != "none" and balancing.router_aux_loss_coef is None:
        raise UsageError(
            f"--router-aux-loss {balancing.router_aux_loss} ({balancing.source}): the model's config has no "
            "router_aux_loss_coef; give --router-aux-loss-coef"
        )
    if (
        balancing.router_aux_loss == "none"
        and balancing.router_aux_loss_coef is not None
    ):
        raise UsageError(
            f"--router-aux-loss-coef {balancing.router_aux_loss_coef:g} without an auxiliary loss "
            f"({balancing.source}): give --router-aux-loss too"
        )


def _check_against_record(
    given: dict[str, Any],
    recorded: Balancing,
    resume: _checkpoints.Checkpoint,
    run_dir: str,
) -> None:
    saved = recorded.values()
    conflicts = [f for f, value in given.items() if value != saved[f]]
    if conflicts:
        asked = " ".join(f"--{f.replace('_', '-')} {given[f]}" for f in conflicts)
        raise UsageError(
            f"the checkpoint of step {resume.step} of --run-dir {run_dir} was trained with {recorded.flags()}; "
            f"this command gives {asked}. A resumed run keeps the balancing it was trained with: drop "
            "the flag to resume, or start afresh with --no-resume (it removes the run's checkpoints) or "
            "another --run-dir"
        )


def read_record(checkpoint: str) -> Balancing | None:
    """The balancing a checkpoint was trained with (``None``: it has no
    record).  Raises :class:`UsageError` for a record that cannot be read."""
    path = os.path.join(checkpoint, BALANCING_FILE)
    if not os.path.isfile(path):
        logger.debug("%s has no balancing record", checkpoint)
        return None
    try:
        with open(path) as f:
            values = json.load(f)
        return Balancing(**{f: values[f] for f in _FIELDS})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{path}: cannot read the balancing the checkpoint was trained with: {e!r}"
        ) from e


class RunPlan(Protocol):
    """What the run-time functions here read of ``_plan.RunPlan`` (described,
    not imported: ``_plan`` imports this module for :func:`resolve`)."""

    args: argparse.Namespace
    config: Any
    num_experts: int
    balancing: Balancing | None


def write_record(checkpoint: str, plan: RunPlan) -> None:
    """Record the run's balancing in a checkpoint being written (rank 0)."""
    values = {f: getattr(plan.args, f) for f in _FIELDS}
    with open(os.path.join(checkpoint, BALANCING_FILE), "w") as f:
        json.dump(values, f, indent=1)


def print_setting(plan: RunPlan) -> None:
    """The start's line about balancing (MoE models only)."""
    if plan.num_experts and plan.balancing is not None:
        print(f"train: expert balancing: {plan.balancing.describe()}", flush=True)


def per_layer(load: Any) -> dict[str, float] | None:
    """max / mean load of every MoE layer of the step's
    :class:`hf.ExpertLoad` (``None``: a dense model), by layer index."""
    if load is None:
        return None
    ratios = load.imbalance().tolist()
    return {str(layer): float(r) for layer, r in zip(load.layers, ratios)}


def collapse_threshold(num_experts: int, top_k: int | None) -> float | None:
    """The max/mean load above which a layer counts as collapsed
    (``[Note: collapsed routers]``); ``None`` where a layer cannot be
    unbalanced (every token to every expert)."""
    if not num_experts:
        return None
    if top_k is None:
        return COLLAPSED
    if top_k >= num_experts:
        return None
    return min(COLLAPSED, 1 + 0.9 * (num_experts / top_k - 1))


class CollapseWatch:
    """Rank 0's watch over the worst MoE layer's load: says once, with the
    flags that would help, when it stays collapsed (``[Note: collapsed
    routers]``)."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        top_k = getattr(plan.config, "num_experts_per_tok", None)
        self.threshold = collapse_threshold(plan.num_experts, top_k)
        self.after = plan.args.warmup_steps
        self.streak = 0
        self.warned = False

    def observe(self, record: StepRecord) -> str | None:
        """Count the step; returns (and prints) the warning the first time
        the worst layer has stayed collapsed for ``COLLAPSED_STEPS`` steps."""
        if self.threshold is None or record.imbalance is None or self.warned:
            return None
        collapsed = record.step > self.after and record.imbalance > self.threshold
        self.streak = self.streak + 1 if collapsed else 0
        if self.streak < COLLAPSED_STEPS:
            return None
        self.warned = True
        message = self._message(record)
        _say(message)
        return message

    def _message(self, record: StepRecord) -> str:
        layers = record.imbalance_per_layer or {}
        threshold = self.threshold or math.inf
        worst = [i for i, r in layers.items() if r > threshold]
        setting = Balancing(**{f: getattr(self.plan.args, f) for f in _FIELDS})
        return (
            f"train: warning: the routers stay collapsed: the worst MoE layer's expert load has been "
            f"max/mean > {threshold:.2f} for {self.streak} steps (step {record.step}: "
            f"{record.imbalance:.2f}; layers {', '.join(worst) or '?'}), i.e. a few experts get nearly "
            f"every token; balancing: {setting.what()}. {self._advice()}"
        )

    def _advice(self) -> str:
        args = self.plan.args
        if hf.has_expert_bias(hf.meta_causal_lm(self.plan.config)):
            rate = args.expert_bias_rate
            flag = (
                f"a larger --expert-bias-rate than {rate:g}"
                if rate > 0
                else "--expert-bias-rate 1e-2"
            )
            return f"Try {flag} (DeepSeek-V3's auxiliary-loss-free balancing), started afresh."
        if args.router_aux_loss == "per_layer":
            return (
                f"Try a larger --router-aux-loss-coef than {args.router_aux_loss_coef:g}, "
                "or a lower --lr, started afresh."
            )
        why = (
            " (the pooled loss balances the layers taken together, not each one)"
            if args.router_aux_loss == "pooled"
            else ""
        )
        return f"Try --router-aux-loss per_layer --router-aux-loss-coef 0.02{why}, started afresh."


def _say(message: str) -> None:
    """Print above rank 0's progress bar, if there is one."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(message, flush=True)
        return
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()
