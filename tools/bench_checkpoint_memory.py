"""Peak activation memory per pipeline rank under ScheduleDualPipeV: no checkpointing, full, selective.

Two gloo/CPU ranks, four stages of the DeepSeek-style MoE transformer of the
tests (``model_registry.MoETransformer``: embeddings and a dense layer, then
one MoE layer per stage), every transformer block checkpointed (non-reentrant)
in the ``full`` and ``selective`` modes.  ``selective`` keeps what torchtitan
keeps for DeepSeek-V3: the attention kernel's outputs, ``max`` and every
other ``mm`` (the odd ones, counted apart in forward and recompute); the rest
is recomputed.  DualPipeV splits each backward into an input and a weight
pass, which stock torch refuses for selective checkpointing; the package's
``checkpoint_split_backward`` patch runs it, and ``checkpoint_weight_pass_recompute``
recomputes a region once per weight pass rather than once per parameter
group.

Memory is counted by :class:`_LiveBytes`, a dispatch mode: the bytes of the
tensor storages created under it and still alive, over the second step of
each mode (the first one infers shapes and allocates the gradients, which the
second accumulates into in place).  So the peak is that of activations, the
selective cache, received tensors and temporaries; parameters and gradients
are not in it.  (torch's ``MemTracker`` refuses a module that runs more than
once in its context, as a stage does once per microbatch.)  OVERLAP_F_B runs
sequentially (``TORCH_PIPELINING_EXT_OVERLAP=0``) so that every action runs
on the thread the mode is active on.  Prints a table per rank and a
machine-readable last line::

    none_mib=… full_mib=… selective_mib=… selective_vs_none=… selective_vs_full=…

(each the largest over the ranks).

    python tools/bench_checkpoint_memory.py [--dim 128] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
from pathlib import Path


_ROOT = Path(__file__).resolve().parents[1]
N_STAGES, N_MICROBATCHES = 4, 4
MODES = ("none", "full", "selective")
STAGE_MODULES = [
    ["tok_embeddings", "layers.0"],
    ["layers.1"],
    ["layers.2"],
    ["layers.3", "norm", "output"],
]


def _deepseek_context() -> tuple[object, object]:
    """torchtitan's selective checkpointing policy for DeepSeek-V3 (CPU kernels included)."""
    import torch
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    aten = torch.ops.aten
    keep = {
        aten.mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max.default,
    }
    mm_counts: collections.Counter[bool] = collections.Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is aten.mm.default:
            mm_counts[ctx.is_recompute] += 1
            if mm_counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if op in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _live_bytes_mode() -> object:
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map_only
    from torch.utils.weak import WeakIdKeyDictionary

    class _LiveBytes(TorchDispatchMode):
        """Bytes of the storages of the op outputs created under it that are alive, and their peak."""

        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self._storages = WeakIdKeyDictionary()

        def _track(self, t: torch.Tensor) -> None:
            storage = t.untyped_storage()
            if storage in self._storages:  # a view, an in-place op
                return
            n = storage.nbytes()

            def freed(_: object, n: int = n) -> None:
                self.live -= n

            self._storages[storage] = weakref.ref(storage, freed)
            self.live += n
            self.peak = max(self.peak, self.live)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self._track, out)
            return out

    return _LiveBytes()


def _worker(rank: int, args: argparse.Namespace) -> list[dict[str, int]]:
    """This rank's peak per mode; returns every rank's, by rank."""
    sys.path[:0] = [str(_ROOT), str(_ROOT / "test" / "distributed" / "pipelining")]
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    from torch.utils.checkpoint import checkpoint

    import torch_pipelining_ext  # noqa: F401  (applies the patches)
    from model_registry import MoEModelArgs, MoETransformer
    from torch_pipelining_ext.stage_split import build_stage_module

    margs = MoEModelArgs(
        vocab_size=256,
        dim=args.dim,
        n_heads=4,
        n_dense_layers=1,
        n_moe_layers=3,
        n_experts=4,
        top_k=2,
        moe_hidden=2 * args.dim,
        dense_hidden=4 * args.dim,
    )
    stage_ids = [rank, N_STAGES - 1 - rank]
    gen = torch.Generator().manual_seed(0)
    rows = N_MICROBATCHES * args.mb_size
    tokens = torch.randint(0, margs.vocab_size, (rows, args.seq_len), generator=gen)
    labels = torch.randint(0, margs.vocab_size, (rows, args.seq_len), generator=gen)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    result = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = MoETransformer(margs)
        parts = [build_stage_module(model, STAGE_MODULES[i]) for i in stage_ids]
        for part in parts:
            for block in part.layers.values():
                if mode != "none":
                    kwargs = {"use_reentrant": False}
                    if mode == "selective":
                        kwargs["context_fn"] = _deepseek_context
                    block.forward = functools.partial(
                        checkpoint, block.forward, **kwargs
                    )
        stages = [
            PipelineStage(part, i, N_STAGES, "cpu") for part, i in zip(parts, stage_ids)
        ]
        os.environ["TORCH_PIPELINING_EXT_OVERLAP"] = "0"  # read when it is built
        try:
            schedule = ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=loss_fn)
        finally:
            os.environ.pop("TORCH_PIPELINING_EXT_OVERLAP", None)

        def step() -> None:
            if rank == 0:
                schedule.step(tokens, target=labels, losses=[])
            else:
                schedule.step(target=labels, losses=[])
            for part in parts:
                part.zero_grad(set_to_none=False)

        step()  # shape inference, lazy state, gradients
        tracker = _live_bytes_mode()
        with tracker:
            step()
        result[mode] = tracker.peak
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return everyone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--mb-size", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(_ROOT))
    from torch_pipelining_ext import launcher

    results = launcher.launch(_worker, 2, args, threads_per_rank=1)
    mib = 2.0**20
    print(
        f"ScheduleDualPipeV, 2 ranks x 2 stages, {N_MICROBATCHES} microbatches of "
        f"{args.mb_size} x {args.seq_len} tokens, dim {args.dim}; peak MiB of "
        "activations and temporaries per rank"
    )
    print(f"{'rank':>4}" + "".join(f"  {m:>10}" for m in MODES))
    for rank, r in enumerate(results):
        print(f"{rank:>4}" + "".join(f"  {r[m] / mib:>10.2f}" for m in MODES))
    peak = {m: max(r[m] for r in results) / mib for m in MODES}
    print(
        " ".join(f"{m}_mib={peak[m]:.2f}" for m in MODES)
        + f" selective_vs_none={peak['selective'] / peak['none']:.3f}"
        + f" selective_vs_full={peak['selective'] / peak['full']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
