# Owner(s): ["oncall: distributed"]
"""Helpers shared by the multi-process tests of ``torch_pipelining_ext.hf``.

* :class:`HFMultiProcTest` -- :class:`~common_pipelining.PipelineMultiProcTest`
  with the job layouts of :func:`torch_pipelining_ext.launcher.parallel_layout`
  (``self.layout(pp=2, ep=2)``: the ``("pp", "dp", "ep")`` mesh, made once per
  rank process and layout, as the trainer, the demo and the tools lay their
  ranks out), process groups over some of the ranks, a directory shared by
  the ranks, and the global batch's share of this rank.
* :class:`TrainingRun` -- this rank's stages of a model in one layout, with an
  AdamW per stage module, stepped as a trainer steps them (labels counted over
  the data-parallel ranks, gradients reduced, clipped by the whole model's
  norm); :func:`reference_step`, the same step of the unsplit model.
* :func:`read_checkpoint` -- every tensor of a distributed checkpoint, whole;
  :func:`local_view` -- what of such a tensor a rank's state holds.
* :data:`HAS_TRANSFORMERS`, :data:`HAS_FUSED` -- whether the ``hf`` extra is
  installed, and whether its transformers has fused experts (5.x, which
  expert parallelism needs).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from common_pipelining import check_on_all_ranks, PipelineMultiProcTest

from torch_pipelining_ext import launcher


try:
    import transformers  # noqa: F401  (is the hf extra installed?)

    from torch_pipelining_ext import hf

    HAS_TRANSFORMERS = True
    HAS_FUSED = hf.has_fused_experts()
except ImportError:
    HAS_TRANSFORMERS = False
    HAS_FUSED = False


__all__ = [
    "HAS_FUSED",
    "HAS_TRANSFORMERS",
    "HFMultiProcTest",
    "MAX_NORM",
    "TrainingRun",
    "local_view",
    "read_checkpoint",
    "reference_backward",
    "reference_step",
]

LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.5  # below the tiny models' gradient norms: clipping scales


class HFMultiProcTest(PipelineMultiProcTest):
    """``world_size`` ranks (4) for the tests of ``torch_pipelining_ext.hf``."""

    world_size = 4
    _meshes: ClassVar[dict[Any, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._meshes = {}  # meshes and groups of this class's ranks

    def layout(self, pp: int = 1, dp: int = 1, ep: int = 1) -> Any:
        """The ``("pp", "dp", "ep")`` mesh of a layout of all the ranks (every
        rank calls it, in the same order: the first call is a collective)."""
        key = ("mesh", pp, dp, ep)
        if key not in self._meshes:
            self._meshes[key] = launcher.parallel_layout(pp=pp, dp=dp, ep=ep).mesh
        return self._meshes[key]

    def group(self, ranks: list[int]) -> Any:
        """A process group of ``ranks`` (every rank makes it, the first time)."""
        key = ("group", tuple(ranks))
        if key not in self._meshes:
            self._meshes[key] = dist.new_group(ranks)
        return self._meshes[key]

    def data_rank(self, mesh: Any) -> tuple[int, int]:
        """(this rank's index, number) among the ranks of ``mesh`` that train
        on different data (``dp x ep``)."""
        data = launcher.ParallelLayout.of(mesh).data_mesh
        return data.get_local_rank(), data.size()

    def local_batch(
        self, mesh: Any, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the global batch ``tensors``."""
        index, count = self.data_rank(mesh)
        rows = tensors[0].shape[0] // count
        return tuple(t[index * rows : (index + 1) * rows] for t in tensors)

    def shared_dir(self, prefix: str = "hf_test_") -> str:
        """A directory every rank sees, removed after the test."""
        obj = [tempfile.mkdtemp(prefix=prefix) if self.rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        if self.rank == 0:
            self.addCleanup(shutil.rmtree, obj[0], ignore_errors=True)
        return obj[0]

    def check_all(self, check: Any, group: Any = None) -> None:
        """Run ``check`` here; raise on every rank of ``group`` if it failed on any."""
        check_on_all_ranks(check, self.device, group)


class TrainingRun:
    """This rank's stages of ``model`` laid out by ``mesh``, an AdamW per stage
    module and a schedule; :meth:`step` trains on a global batch."""

    def __init__(
        self,
        model: Any,
        mesh: Any,
        schedule_cls: type,
        *,
        microbatches: int = 2,
        fsdp: bool | str = False,
        **build_kwargs: Any,
    ) -> None:
        self.mesh = mesh
        self.stages, self.parts = hf.pipeline_hf_causal_lm(
            model, mesh, schedule_cls, "cpu", **build_kwargs
        )
        if fsdp:  # over the data-parallel ranks, or over one dimension ("ep")
            hf.fully_shard_replicated(
                self.parts, mesh[fsdp] if isinstance(fsdp, str) else mesh
            )
        self.loss_fn = hf.CausalLMLoss(n_microbatches=microbatches)
        self.schedule = schedule_cls(
            self.stages[0] if len(self.stages) == 1 else self.stages,
            n_microbatches=microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )
        self.optimizers = [
            torch.optim.AdamW(part.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            for part in self.parts
        ]
        self.data = launcher.ParallelLayout.of(mesh).data_mesh
        self.has_last = any(s.is_last for s in self.stages)

    def local(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = tensors[0].shape[0] // self.data.size()
        start = self.data.get_local_rank() * rows
        return tuple(t[start : start + rows] for t in tensors)

    def backward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The step's forward and backward on the global ``batch`` (``(ids,
        labels)`` or ``(ids, mask, labels)``), gradients reduced; returns the
        global batch's loss on the ranks holding the last stage, else ``None``."""
        *inputs, labels = self.local(*batch)
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        self.loss_fn.set_labels(labels, group=self.data.get_group())
        losses: list[torch.Tensor] = []
        first = any(s.is_first for s in self.stages)
        self.schedule.step(*(inputs if first else ()), target=labels, losses=losses)
        if self.parts[0].tied_groups:
            hf.sync_tied_gradients(self.parts, self.mesh["pp"].get_group())
        hf.reduce_expert_parallel_gradients(self.parts, self.mesh)
        if not self.has_last:
            return None
        total = torch.stack(losses).sum().detach()
        dist.all_reduce(total, group=self.data.get_group())
        return total / self.data.size()

    def step(
        self, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """:meth:`backward`, then :meth:`clip_and_step`; returns the loss and
        the gradient norm before clipping."""
        return self.backward(batch), self.clip_and_step()

    def clip_and_step(self) -> torch.Tensor:
        """Clip by the whole model's norm (returned), then the optimizer step."""
        norm = hf.clip_grad_norm_(self.parts, MAX_NORM, mesh=self.mesh)
        for optimizer in self.optimizers:
            optimizer.step()
        return norm

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients (experts: its rows; FSDP2: gathered; none: zeros)."""
        out = {}
        for part in self.parts:
            for name, p in part.named_parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                out[name] = local_view(grad, self.parts, name)
        return out

    def params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (experts: its rows; FSDP2: gathered)."""
        return {
            key: local_view(value, self.parts, key)
            for key, value in hf.get_state_dict(self.parts)[0].items()
        }


def reference_step(
    model: Any, optimizer: Any, batch: tuple[torch.Tensor, ...], loss: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TrainingRun.step` of the unsplit ``model`` (``loss(model,
    batch)``, default Hugging Face's); returns the loss and the gradient norm."""
    value = reference_backward(model, optimizer, batch, loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return value, norm


def reference_backward(
    model: Any, optimizer: Any, batch: tuple[torch.Tensor, ...], loss: Any = None
) -> torch.Tensor:
    """:meth:`TrainingRun.backward` of the unsplit ``model``."""
    optimizer.zero_grad()
    if loss is None:
        value = model(input_ids=batch[0], labels=batch[-1]).loss
    else:
        value = loss(model, batch)
    value.backward()
    return value.detach()


def reference_optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the distributed checkpoint ``path``, whole, read by
    this rank alone (objects such as learning rates left out)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    whole = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if hasattr(md, "size")
    }
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # "assuming the intent is to load in a single process"
        dcp.load(whole, checkpoint_id=path, no_dist=True)
    return whole


def local_view(value: Any, parts: Any, key: str) -> torch.Tensor:
    """The tensor of a state dict of :func:`hf.get_state_dict` that this rank
    holds: an expert shard's rows, an FSDP2 parameter gathered (a collective
    over its mesh), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    experts = {
        f"{s.fqn}.{n}"
        for _, s in hf.expert_parallel_shards(parts)
        for n in ("gate_up_proj", "down_proj")
    }
    fqn = key.split(".", 1)[1].rsplit(".", 1)[0] if key.startswith("state.") else key
    return value.to_local() if fqn in experts else value.full_tensor()


def rows_of(whole: torch.Tensor, parts: Any, fqn: str) -> torch.Tensor:
    """The rows of the whole tensor ``fqn`` this rank holds (experts: its slice)."""
    if whole.dim() == 0:  # e.g. the optimizer's step
        return whole
    for part in parts:
        if fqn in part.expert_ranges:
            start, stop = part.expert_ranges[fqn]
            return whole[start:stop]
    return whole
