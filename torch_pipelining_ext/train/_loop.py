"""One rank's run: resume or start, warm up, train, checkpoint, export.

Private helper of :mod:`torch_pipelining_ext.train`.  :func:`run_rank` is
what every rank runs (through ``launcher.launch``); :class:`Trainer` walks
the run through the states of :class:`TrainerState`.  Rank 0 alone writes
the run directory's files (``metrics.jsonl``, the plot, renames of
checkpoints and of the export); every rank writes its share of each
checkpoint and of the export.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from torch_pipelining_ext import hf, launcher
from torch_pipelining_ext.train import (
    _balance,
    _checkpoints,
    _data,
    _eval,
    _metrics,
    _plot,
    _runlog,
    _state,
)
from torch_pipelining_ext.train._plan import RunPlan
from torch_pipelining_ext.train._pipeline import Pipeline


__all__: list[str] = []

logger = logging.getLogger(__name__)

_PACE_STEPS = 10  # the ETA follows the mean time of this many recent steps


class TrainerState(enum.Enum):
    """Where a rank's run is."""

    BUILDING = "building"  # stages, schedule, optimizers
    RESUMING = "resuming"  # loading the latest checkpoint
    INFERRING_SHAPES = (
        "inferring shapes"  # torch's first-step shape inference, leaving no trace
    )
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    EXPORTING = "exporting"
    DONE = "done"


def run_rank(rank: int, plan: RunPlan) -> dict[str, Any]:
    """Everything one rank does; returns (on rank 0) the run's summary."""
    device = rank_device(plan, rank)
    parallel = launcher.parallel_layout(
        plan.layout.pp, plan.layout.dp, plan.layout.ep, device_type=device.type
    )
    trainer = Trainer(plan, parallel, device, rank)
    trainer.start()
    trainer.infer_shapes()
    trainer.train()
    return trainer.finish()


def rank_device(plan: RunPlan, rank: int) -> torch.device:
    """This rank's device (``--device cuda``: the GPU of its local rank)."""
    if plan.args.device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


class Trainer:
    """A rank's run of a :class:`RunPlan` (see ``[Note: trainer state]``)."""

    def __init__(
        self,
        plan: RunPlan,
        parallel: launcher.ParallelLayout,
        device: torch.device,
        rank: int,
    ) -> None:
        self.plan, self.args, self.rank = plan, plan.args, rank
        self.state = TrainerState.BUILDING
        self.checkpoints = _checkpoints.RunCheckpoints(self.args.run_dir)
        self.pipe = Pipeline(plan, parallel, device, resuming=plan.resume is not None)
        self.data = _data.Sequences(
            plan.stream, self.args.seq_len, self.args.seed, not self.args.no_shuffle,
            held_out=_data.held_out_sequences(self.args),
        )  # fmt: skip
        self.evaluator = (
            _eval.Evaluator(self.pipe, self.data, self.args.eval_batches)
            if self.args.eval_every
            else None
        )
        self.memory = _runlog.MemoryProbe(device)
        self.tensorboard: _runlog.TensorBoardLog | None = None
        self.step = 0
        self.position = 0
        self.layout = f"pp{plan.layout.pp}_dp{plan.layout.dp}_ep{plan.layout.ep}"
        self.metrics: _metrics.MetricsLog | None = None
        self.progress: _metrics.Progress | None = None
        self.times: list[float] = []
        self.balance = _balance.CollapseWatch(plan)

    def _enter(self, state: TrainerState) -> None:
        logger.debug("rank %d: %s -> %s", self.rank, self.state.value, state.value)
        self.state = state

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        """Resume the plan's checkpoint, or start afresh; rank 0 prepares the
        run directory."""
        if self.plan.resume is not None:
            self._enter(TrainerState.RESUMING)
            self._load(self.plan.resume)
        else:
            _state.seed_rank(self.args.seed, 0, self.rank)
        if self.rank == 0:
            if self.plan.resume is None:
                self.checkpoints.clear()
            self.checkpoints.prune(self.args.keep)  # leftovers of a crash
            self.metrics = _metrics.MetricsLog(self.args.run_dir, self.step)
            _runlog.write_config(self.plan, self.step)  # [Note: run configuration]
            if self.args.tensorboard:
                self.tensorboard = _runlog.TensorBoardLog(
                    self.args.tensorboard, self.step
                )
            self._log_start()
            self.progress = _metrics.Progress(
                self.args.steps, self.step, not self.args.no_progress
            )
        dist.barrier()

    def _load(self, checkpoint: _checkpoints.Checkpoint) -> None:
        step, position = (
            torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64),
        )
        state: dict[str, Any] = {
            _state.STEP: step,
            _state.POSITION: position,
            _state.LR_SCHEDULE: self.pipe.lr,
        }
        rng = _state.rng_keys(self.rank, self.layout)
        saved = set(_checkpoint_keys(checkpoint.path))
        same_layout = all(k in saved for k in rng)
        if same_layout:
            state.update(rng)
        hf.load_checkpoint(
            checkpoint.path, self.pipe.parts, self.pipe.optimizers, state=state
        )
        self.step, self.position = int(step), int(position)
        if same_layout:
            _state.set_rng(rng, self.rank, self.layout)
        else:  # another layout: every rank's random streams start anew
            _state.seed_rank(self.args.seed, self.step, self.rank)
        logger.info(
            "rank %d resumed step %d from %s", self.rank, self.step, checkpoint.path
        )

    def _log_start(self) -> None:
        plan, args = self.plan, self.args
        what = (
            f"resumed from {plan.resume.path} (step {self.step})"
            if plan.resume
            else "started afresh"
        )
        model = args.model or f"tiny {args.model_type}"
        print(
            f"train: {model} ({plan.config.model_type}, {plan.config.num_hidden_layers} layers"
            + (f", {plan.num_experts} experts" if plan.num_experts else "")
            + f"), {plan.layout.world_size} ranks pp={plan.layout.pp} x dp={plan.layout.dp} x ep={plan.layout.ep}, Schedule{args.schedule}"
            + (" (overlap off)" if args.no_overlap else "")
            + f", {args.microbatches} microbatches, {args.dtype}; data: {plan.stream.num_tokens:,} tokens, "
            f"{self.data.num_sequences:,} sequences of {args.seq_len}"
            + (f" ({self.data.held_out:,} more held out)" if self.data.held_out else "")
            + f"; {what}",
            flush=True,
        )
        _balance.print_setting(plan)
        if self.step >= args.steps:
            print(
                f"train: step {self.step} reached: --steps {args.steps} leaves nothing to train",
                flush=True,
            )

    # -- shape inference -----------------------------------------------------

    def infer_shapes(self) -> None:
        """Run torch's first-step shape inference before the first step, so
        that it leaves no trace (``[Note: trainer state]``): one step's forward
        and backward on the next batch, inside ``fork_rng``, the gradients
        dropped and its expert load discarded; the optimizers do not step."""
        if self.step >= self.args.steps:
            return  # nothing to train
        self._enter(TrainerState.INFERRING_SHAPES)
        ids = self._batch()
        devices = [self.pipe.device] if self.pipe.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.pipe.device.type):
            self.pipe.forward_backward(ids)
        self.pipe.zero_grad()
        if self.pipe.moe:
            hf.expert_load(self.pipe.parts, dist.group.WORLD)

    def _batch(self) -> torch.Tensor:
        data = self.pipe.data
        return self.data.batch(
            self.position, self.args.batch_size, data.get_local_rank(), data.size()
        ).to(self.pipe.device)

    # -- training ------------------------------------------------------------

    def train(self) -> None:
        self._enter(TrainerState.TRAINING)
        every = self.args.checkpoint_every
        while self.step < self.args.steps:
            self.memory.start_step()
            start = time.perf_counter()
            losses = self.pipe.forward_backward(self._batch())
            norm, lr, load = self.pipe.update()
            self.step += 1
            self.position += self.args.batch_size
            loss = self.pipe.global_loss(losses)
            seconds = time.perf_counter() - start
            extra: dict[str, Any] = self.memory.gather()  # [Note: peak memory]
            if self._evaluating():
                result = self.evaluate()
                extra.update(eval_loss=result.loss, eval_perplexity=result.perplexity)
            self._record(loss, norm, lr, load, seconds, extra)
            if every and self.step % every == 0 and self.step < self.args.steps:
                self.save()
        if self.plan.resume is None or self.step != self.plan.resume.step:
            self.save()  # the last step's checkpoint: nothing of the run lost

    def _evaluating(self) -> bool:
        """Whether this step (just done) ends with an evaluation: every
        ``--eval-every`` steps and after the last; always after a training
        step of this process (``[Note: evaluation leaves training alone]``)."""
        every = self.args.eval_every
        return bool(every) and (self.step % every == 0 or self.step == self.args.steps)

    def evaluate(self) -> _eval.EvalResult:
        """The held-out loss of the weights of this step (every rank)."""
        assert self.evaluator is not None  # --eval-every
        return self.evaluator.evaluate()

    def _record(
        self,
        loss: float,
        norm: float,
        lr: float,
        load: Any,
        seconds: float,
        extra: dict[str, Any],
    ) -> None:
        if self.rank != 0:
            return
        self.times = (self.times + [seconds])[-_PACE_STEPS:]
        tokens = self.args.batch_size * self.args.seq_len
        record = _metrics.StepRecord(
            step=self.step, loss=loss, lr=lr, grad_norm=norm, tokens=tokens,
            step_time_s=seconds, tokens_per_s=tokens / seconds,
            tokens_per_s_per_rank=tokens / seconds / self.plan.layout.world_size,
            imbalance=None if load is None else float(load.imbalance().max()),
            imbalance_per_layer=_balance.per_layer(load),
            data_position=self.position,
            eta_s=(self.args.steps - self.step) * sum(self.times) / len(self.times),
            **extra,
        )  # fmt: skip
        assert self.metrics is not None and self.progress is not None  # rank 0: start()
        values = self.metrics.append(record)
        if self.tensorboard is not None:
            self.tensorboard.append(values)
        self.progress.update(record, self.args.steps)
        self.balance.observe(record)  # says once if the routers stay collapsed

    # -- checkpoints ---------------------------------------------------------

    def save(self) -> None:
        """A checkpoint of this step (``[Note: checkpoint directories]``)."""
        self._enter(TrainerState.CHECKPOINTING)
        path = self.checkpoints.path(self.step, _checkpoints.CheckpointState.PARTIAL)
        if self.rank == 0:
            self.checkpoints.begin(self.step)
        dist.barrier()
        state: dict[str, Any] = {
            _state.STEP: torch.tensor(self.step),
            _state.POSITION: torch.tensor(self.position),
            _state.LR_SCHEDULE: self.pipe.lr,
            **_state.rng_keys(self.rank, self.layout),
        }
        hf.save_checkpoint(path, self.pipe.parts, self.pipe.optimizers, state=state)
        dist.barrier()  # every rank's files are there
        if self.rank == 0:
            self._describe(path)
            _balance.write_record(path, self.plan)
            self.checkpoints.commit(self.step)
            self.checkpoints.prune(self.args.keep)
        dist.barrier()
        self._enter(TrainerState.TRAINING)

    def _describe(self, path: str) -> None:
        """``trainer.json``: what the checkpoint is, for people (the state
        itself is in the checkpoint)."""
        info = {
            "step": self.step,
            "data_position": self.position,
            "layout": {
                "pp": self.plan.layout.pp,
                "dp": self.plan.layout.dp,
                "ep": self.plan.layout.ep,
            },
            "model_type": self.plan.config.model_type,
            "schedule": self.args.schedule,
            **_data.checkpoint_info(self.args),  # [Note: held-out data]
        }
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump(info, f, indent=1)

    # -- the end -------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Export (and check the export), draw the plot; the run's summary."""
        exported = None
        if self.args.export:
            self._enter(TrainerState.EXPORTING)
            exported = self._export()
        self._enter(TrainerState.DONE)
        if self.rank != 0:
            return {}
        assert self.metrics is not None and self.progress is not None  # rank 0: start()
        self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        records = self.metrics.records
        png = os.path.join(self.args.run_dir, _plot.PLOT_FILE)
        drawn = _plot.plot_run(records, png, self._title())
        latest = self.checkpoints.latest()
        assert latest is not None  # train() saved one, or the run resumed from one
        return {
            "steps": self.step,
            "final_loss": records[-1]["loss"] if records else None,
            "first_loss": records[0]["loss"] if records else None,
            "plot": png if drawn else None,
            "export": exported,
            "export_unchecked": self.args.no_verify_export,
            "checkpoint": latest.path,
        }

    def _title(self) -> str:
        plan = self.plan
        return (
            f"{plan.config.model_type}, pp={plan.layout.pp} x dp={plan.layout.dp} x ep={plan.layout.ep}, "
            f"Schedule{self.args.schedule}, {self.args.dtype}"
        )

    def _export(self) -> str:
        """The trained model as a Hugging Face checkpoint: written to a
        partial directory, reloaded with ``from_pretrained`` and compared with
        the trained weights, then renamed (never a half export under the
        name)."""
        final = os.path.abspath(self.args.export)
        partial = final.rstrip(os.sep) + ".partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        hf.save_pretrained(self.pipe.parts, partial, process_group=None)
        dist.barrier()
        if not self.args.no_verify_export:
            _verify_export(self.pipe.parts, partial)
        if self.rank == 0:
            if os.path.exists(final):  # --overwrite-export
                shutil.rmtree(final)
            os.replace(partial, final)
        dist.barrier()
        return final


def _checkpoint_keys(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(path).read_metadata().state_dict_metadata)


def _verify_export(parts: list[Any], path: str) -> None:
    """Every rank reloads the export with ``from_pretrained`` and compares
    the tensors it trained, bitwise; raises on every rank if any differs."""
    import transformers
    from torch.distributed.tensor import DTensor

    transformers.utils.logging.disable_progress_bar()  # one bar per rank otherwise
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    whole = model.state_dict()
    wrong = []
    for part in parts:
        for key, value in part.state_dict().items():
            if key in part.expert_ranges:  # this rank's experts, a shard of the whole
                start, stop = part.expert_ranges[key]
                mine, want = value.to_local(), whole[key][start:stop]
            else:
                mine = value.full_tensor() if isinstance(value, DTensor) else value
                want = whole.get(key)
            if want is None or not torch.equal(mine.detach().cpu().float(), want):
                wrong.append(key)
    found: list[Any] = [None] * dist.get_world_size()  # every rank's ``wrong``
    dist.all_gather_object(found, wrong)
    wrong = sorted({k for keys in found for k in keys})
    if wrong:
        raise RuntimeError(
            f"the export {path} reloaded with from_pretrained differs from the trained weights in "
            f"{len(wrong)} tensors: {wrong[:5]}"
        )
