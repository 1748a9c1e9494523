#!/usr/bin/env python3
"""Benchmark ``torch_pipelining_ext.stage_split`` against deep-copy-then-prune.

Deep-copy-then-prune is what trainers commonly do today: for every stage,
``copy.deepcopy`` the whole model, then delete what the stage does not keep.
``build_stage_module`` copies only what the stage keeps.  Measured side by side in
one run:

* **meta**: a DeepSeek-V3-671B-shaped model (61 layers: 3 dense + 58 MoE with
  256 routed experts as grouped 3-D weights, ~6.7e11 parameters) on the meta
  device, split into 16 stages; wall time of building all 16 stages (ours
  includes validating the whole split).
* **cpu**: a ~1.4B-parameter bf16 Llama-shaped model on CPU.  Each measurement
  runs in a fresh subprocess; the extra peak RSS is ``VmHWM`` after the split
  minus ``VmRSS`` before it (the high-water mark is reset through
  ``/proc/self/clear_refs`` first).  One rank building only its stage (stage 1
  of 4), and one process building all 4 and all 8 stages.  For information,
  ``move=True`` (all 8 stages, moving modules out of the original) is
  measured after the 8-stage copy in the same process, the peak reset first.

Every stage tensor is checked to equal the original tensor with the same FQN,
and the stages' key sets are checked to be disjoint and to cover the model.

The last line is machine-readable::

    meta_time_ratio=<ours / deep-copy-then-prune, 16 meta stages>
    one_stage_rss_ratio=<our extra peak RSS / the stage's size>
    all_stages_rss_ratio=<our extra peak RSS / the model's size, worst of 4 and 8 stages>

(on one line).  Targets: <= 0.1, <= 1.2 and <= 1.1.

Usage: ``python tools/bench_split.py`` (about 1-3 minutes, ~9 GB peak RAM).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn as nn


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_pipelining_ext.stage_split import (
    build_stage_modules,
    generate_module_names_per_stage,
    build_stage_module,
)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_experts = FeedForward(dim, hidden)
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts), persistent=False
        )


class MLA(nn.Module):
    """DeepSeek-V3 multi-head latent attention projections."""

    def __init__(
        self, dim=7168, n_heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128
    ) -> None:
        super().__init__()
        self.wq_a = nn.Linear(dim, q_lora, bias=False)
        self.q_norm = nn.RMSNorm(q_lora)
        self.wq_b = nn.Linear(q_lora, n_heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora + rope, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora)
        self.wkv_b = nn.Linear(kv_lora, n_heads * (nope + v), bias=False)
        self.wo = nn.Linear(n_heads * v, dim, bias=False)


class DeepSeekV3Block(nn.Module):
    def __init__(
        self,
        layer_id: int,
        dim=7168,
        n_dense=3,
        inter=18432,
        moe_inter=2048,
        n_experts=256,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = MLA(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        if layer_id < n_dense:
            self.feed_forward = FeedForward(dim, inter)
        else:
            self.moe = MoE(dim, moe_inter, n_experts)


class DeepSeekV3(nn.Module):
    def __init__(self, n_layers=61, dim=7168, vocab=129280) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {str(i): DeepSeekV3Block(i, dim) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", torch.zeros(4096, 32), persistent=False)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=False))
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)


class Llama1B4(nn.Module):
    """~1.37e9 parameters: dim 2048, 24 layers, SwiGLU 5632, vocab 32000."""

    def __init__(self, n_layers=24, dim=2048, hidden=5632, vocab=32000) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {str(i): LlamaBlock(dim, hidden) for i in range(n_layers)}
        )
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


# ---------------------------------------------------------------------------
# Deep-copy-then-prune (the approach compared against)
# ---------------------------------------------------------------------------


def _prune(
    module: nn.Module, keep: Sequence[str], prefix: tuple[str, ...] = ()
) -> None:
    """Remove from ``module`` (in place) everything not under a kept FQN."""
    keep_paths = [tuple(k.split(".")) for k in keep]

    def visit(mod: nn.Module, path: tuple[str, ...]) -> None:
        for key in list(mod._modules):
            child_path = path + (key,)
            if any(child_path[: len(k)] == k for k in keep_paths):
                continue  # kept whole
            if (
                any(k[: len(child_path)] == child_path for k in keep_paths)
                and mod._modules[key] is not None
            ):
                visit(mod._modules[key], child_path)
                continue
            if isinstance(mod, _CONTAINERS):
                del mod._modules[key]
            else:
                mod._modules[key] = None
        for key in list(mod._parameters):
            if path + (key,) not in keep_paths:
                mod._parameters[key] = None
        for key in list(mod._buffers):
            if (
                path + (key,) not in keep_paths
                and key not in mod._non_persistent_buffers_set
            ):
                mod._buffers[key] = None

    visit(module, prefix)


def deepcopy_then_prune(
    model: nn.Module, names_per_stage: Sequence[Sequence[str]], stage_ids
) -> list[nn.Module]:
    out = []
    for s in stage_ids:
        stage = copy.deepcopy(model)
        _prune(stage, names_per_stage[s])
        out.append(stage)
    return out


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _check_stages(
    model: nn.Module, stages: Sequence[nn.Module], complete: bool, compare_values: bool
) -> None:
    full = model.state_dict()
    seen: set[str] = set()
    for stage in stages:
        sd = stage.state_dict()
        overlap = seen & set(sd)
        if overlap:
            raise AssertionError(f"keys in two stages: {sorted(overlap)[:5]}")
        seen |= set(sd)
        for key, t in sd.items():
            if key not in full:
                raise AssertionError(f"stage tensor {key!r} is not in the model")
            ref = full[key]
            if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                raise AssertionError(
                    f"{key!r}: {t.shape}/{t.dtype}/{t.device} vs {ref.shape}/{ref.dtype}/{ref.device}"
                )
            if compare_values and not torch.equal(t, ref):
                raise AssertionError(f"stage tensor {key!r} differs from the original")
    if complete and seen != set(full):
        raise AssertionError(f"{len(set(full) - seen)} model tensors are in no stage")


def worker_meta() -> dict:
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = DeepSeekV3()
    n_params = sum(p.numel() for p in model.parameters())
    costs = [1.0] * 3 + [1.5] * 58  # MoE layers dearer than dense ones
    names = generate_module_names_per_stage(16, 61, layer_costs=costs)
    ids = range(16)

    def timed(fn, repeat):
        best = float("inf")
        result = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
        return best, result

    ours_t, ours = timed(lambda: build_stage_modules(model, names, ids), 3)
    base_t, base = timed(lambda: deepcopy_then_prune(model, names, ids), 1)
    _check_stages(model, ours, complete=True, compare_values=False)
    for a, b in zip(ours, base):
        if list(a.state_dict()) != list(b.state_dict()):
            raise AssertionError(
                "our stage and the deep-copy-then-prune stage hold different keys"
            )
    if any(not t.is_meta for s in ours for t in s.state_dict().values()):
        raise AssertionError("a meta split produced a non-meta tensor")
    return dict(n_params=n_params, ours_s=ours_t, base_s=base_t, ratio=ours_t / base_t)


def _real_llama() -> nn.Module:
    """The ~1.4B bf16 model with every byte written (so it is resident), made
    quickly: windows of one random pool at per-tensor offsets, so that no two
    tensors hold the same values."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama1B4().to(torch.bfloat16)
    model.to_empty(device="cpu")
    tensors = list(model.state_dict().values())
    pool = torch.randn(
        max(t.numel() for t in tensors) + 1_000_003, dtype=torch.bfloat16
    )
    with torch.no_grad():
        for i, t in enumerate(tensors):
            offset = (i * 7919) % 1_000_003
            t.view(-1).copy_(pool[offset : offset + t.numel()])
    del pool
    return model


def _measure(fn) -> tuple[list[nn.Module], int, float, bool]:
    """Run ``fn``; return its stages, the extra peak RSS and the seconds taken."""
    rss_before = _status("VmRSS")
    peak_reset = _reset_peak()
    hwm_before = _status("VmHWM")
    t0 = time.perf_counter()
    stages = fn()
    elapsed = time.perf_counter() - t0
    extra = _status("VmHWM") - (rss_before if peak_reset else hwm_before)
    return stages, extra, elapsed, peak_reset


def worker_cpu(method: str, num_stages: int, which: str) -> list[dict]:
    model = _real_llama()
    model_bytes = _nbytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    names = generate_module_names_per_stage(num_stages, len(model.layers))
    ids = [1] if which == "one" else list(range(num_stages))
    if method == "ours":
        fn = (
            (lambda: [build_stage_module(model, names[1])])
            if which == "one"
            else (lambda: build_stage_modules(model, names, ids))
        )
    else:
        fn = lambda: deepcopy_then_prune(model, names, ids)  # noqa: E731
    stages, extra, elapsed, peak_reset = _measure(fn)
    _check_stages(model, stages, complete=which == "all", compare_values=True)
    common = dict(
        num_stages=num_stages,
        which=which,
        n_params=n_params,
        model_bytes=model_bytes,
        peak_reset=peak_reset,
    )
    results = [
        dict(
            common,
            method=method,
            stage_bytes=sum(_nbytes(s) for s in stages),
            extra_peak=extra,
            seconds=elapsed,
        )
    ]
    if method == "ours" and which == "all" and num_stages == 8:
        # move=True allocates nothing, so it can follow in the same process
        # (the peak is reset first); it empties the original model.
        del stages
        original = model.state_dict(keep_vars=True)  # the tensors themselves, no copies
        moved, extra, elapsed, _ = _measure(
            lambda: build_stage_modules(model, names, ids, move=True)
        )
        if any(True for _ in model.parameters()):
            raise AssertionError("move=True left parameters in the original model")
        moved_sd = {
            k: v for s in moved for k, v in s.state_dict(keep_vars=True).items()
        }
        if set(moved_sd) != set(original):
            raise AssertionError(
                "the moved stages do not hold exactly the model's tensors"
            )
        for k, v in moved_sd.items():
            if v is not original[k]:
                raise AssertionError(f"move=True replaced tensor {k!r}")
        results.append(
            dict(
                common,
                method="ours_move",
                stage_bytes=sum(_nbytes(s) for s in moved),
                extra_peak=extra,
                seconds=elapsed,
            )
        )
    return results


def _run_worker(args: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        res = (
            [worker_meta()]
            if kind == "meta"
            else worker_cpu(rest[0], int(rest[1]), rest[2])
        )
        print(json.dumps(res))
        return

    gib = 1024**3
    t_start = time.perf_counter()
    (meta,) = _run_worker(["meta"])
    print(
        f"[meta] DeepSeek-V3-shaped, {meta['n_params']:.3e} params, 16 stages: "
        f"build_stage_module {meta['ours_s'] * 1e3:.1f} ms, deep-copy-then-prune {meta['base_s'] * 1e3:.1f} ms "
        f"(ratio {meta['ratio']:.4f})",
        flush=True,
    )

    rows = []
    for method, n, which in [
        ("ours", 4, "one"),
        ("deepcopy_prune", 4, "one"),
        ("ours", 4, "all"),
        ("deepcopy_prune", 4, "all"),
        ("ours", 8, "all"),
        ("deepcopy_prune", 8, "all"),
    ]:
        for r in _run_worker(["cpu", method, str(n), which]):
            denom = r["stage_bytes"] if which == "one" else r["model_bytes"]
            r["ratio"] = r["extra_peak"] / denom
            rows.append(r)
            what = "stage 1 of 4" if which == "one" else f"all {n} stages"
            print(
                f"[cpu ] {r['method']:15s} {what:13s}: extra peak RSS {r['extra_peak'] / gib:6.2f} GiB = "
                f"{r['ratio']:.3f} x {'stage' if which == 'one' else 'model'} "
                f"({denom / gib:.2f} GiB), {r['seconds']:.2f} s",
                flush=True,
            )
    if not all(r["peak_reset"] for r in rows):
        print(
            "[warn] /proc/self/clear_refs unavailable: extra peak = VmHWM after - VmHWM before"
        )
    model_gib = rows[0]["model_bytes"] / gib
    print(
        f"[cpu ] model: {rows[0]['n_params']:.3e} params, {model_gib:.2f} GiB bf16; "
        "every stage tensor equals the original with the same FQN"
    )
    one = next(r for r in rows if r["method"] == "ours" and r["which"] == "one")
    all_ratio = max(
        r["ratio"] for r in rows if r["method"] == "ours" and r["which"] == "all"
    )
    print(f"[done] {time.perf_counter() - t_start:.0f} s")
    print(
        f"meta_time_ratio={meta['ratio']:.4f} one_stage_rss_ratio={one['ratio']:.3f} "
        f"all_stages_rss_ratio={all_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
