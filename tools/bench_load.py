"""Benchmark: loading one pipeline stage of a Hugging Face checkpoint.

Writes a ~1.1B-parameter bf16 Llama checkpoint (TinyLlama-shaped: hidden 2048,
22 layers, vocab 32000; random weights, sharded safetensors) to a temporary
directory, then loads stage 1 of 4 in two fresh processes, side by side:

* ``stage_load``: ``pipeline_hf_causal_lm(config, ..., checkpoint=...)``
  (torch_pipelining_ext.hf: the model on meta, this rank's stage split off,
  its tensors loaded) on a fake process group: only the stage's tensors are
  read;
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained`` of the whole
  model, then ``build_stage_module`` of stage 1 (and the whole model dropped).

Then the same ``stage_load`` of a ~3.5B-parameter bf16 Qwen3-MoE-shaped
checkpoint (16 layers, 32 experts of width 1024) stored per expert, as
transformers writes MoE checkpoints: on transformers 5.x each expert's
tensors are read straight into their slices of the fused ``gate_up_proj`` /
``down_proj`` parameters.

and the PP x EP case: stage 1 of 4 on expert-parallel rank 1 of 4, which
keeps and reads 8 of the 32 experts of each of its MoE layers.

Each ``stage_load`` runs once per reader (the same reads, through
``read_tensors`` of ``torch_pipelining_ext.hf._loading`` or a stand-in):

* ``per_read``: the package's reader, ``safetensors.safe_open`` opened for
  each read of at most 16 MiB;
* ``per_file``: ``safe_open`` opened once per file, every read of that file
  under it;
* ``dcp``: ``HuggingFaceStorageReader.read_data`` of
  ``torch.distributed.checkpoint`` (one ``safe_open`` per file), fed the
  same reads as ``ReadItem`` s;
* ``readinto``: the package's former reader, byte offsets from the JSON
  header and ``readinto`` straight into the destination's bytes.

The checkpoint's files are read once before each load (a warm page cache for
every reader).  For each, the extra peak RSS (from after the imports to the
loaded stage) is divided by the stage's bytes.  The stage's tensors are then
compared with the checkpoint.  The last line is::

    stage_load_rss_ratio=<..> from_pretrained_rss_ratio=<..> moe_stage_load_rss_ratio=<..> moe_ep_stage_load_rss_ratio=<..> <reader>_stage_load_rss_ratio=<..> ...

(the first four keys are the package's reader; then each other reader's
three ``stage_load`` ratios.)  Target: every ``stage_load`` ratio ``<= 1.1``.

Usage: ``python tools/bench_load.py [--dir DIR] [--keep] [--readers per_read,...]``
(needs the ``hf`` extra; about 9 GB of disk and 5 GB of RAM at peak; a
``--dir`` that holds the checkpoints of an earlier run is read, not written
again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_STAGES = 4
STAGE = 1
EP_SIZE = 4
EP_RANK = 1
SHARD_BYTES = 512 * 1024**2
READERS = ("per_read", "per_file", "dcp", "readinto")


def _config(model: str = "llama"):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if model == "moe":
        return Qwen3MoeConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1024,
            num_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _stored_shapes(model) -> dict:
    """Checkpoint keys and shapes: fused experts (transformers 5.x) stored per expert, as transformers saves them."""
    shapes = {}
    for k, t in model.state_dict().items():
        if k.endswith(".experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                half = (t.shape[1] // 2, t.shape[2])
                shapes[f"{base}{e}.gate_proj.weight"] = half
                shapes[f"{base}{e}.up_proj.weight"] = half
        elif k.endswith(".experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                shapes[f"{base}{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[k] = tuple(t.shape)
    return shapes


def write_checkpoint(directory: str, model_kind: str = "llama") -> dict:
    """Write the checkpoint one shard at a time (never the whole model in memory)."""
    import safetensors.torch
    import torch

    from torch_pipelining_ext.hf import meta_causal_lm

    torch.manual_seed(0)
    config = _config(model_kind)
    config.save_pretrained(directory)
    model = meta_causal_lm(config, dtype=torch.bfloat16)
    shapes = {k: torch.Size(s) for k, s in _stored_shapes(model).items()}
    pool = torch.randn(
        max(s.numel() for s in shapes.values()) + 1_000_003, dtype=torch.bfloat16
    )
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0
    files: list[tuple[str, dict]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            safetensors.torch.save_file(
                shard, os.path.join(directory, name), metadata={"format": "pt"}
            )
            files.append((name, shard))
            shard, shard_bytes = {}, 0

    for i, (key, shape) in enumerate(shapes.items()):
        offset = (i * 7919) % 1_000_003  # windows of one pool: no two tensors equal
        t = pool[offset : offset + shape.numel()].view(shape).clone()
        if shard_bytes + t.nbytes > SHARD_BYTES:
            flush()
        shard[key] = t
        weight_map[key] = f"model-{len(files) + 1:05d}.safetensors"
        shard_bytes += t.nbytes
        total += t.nbytes
    flush()
    n = len(files)
    renamed = {}
    for j, (name, _) in enumerate(files):
        new = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        os.rename(os.path.join(directory, name), os.path.join(directory, new))
        renamed[name] = new
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renamed[v] for k, v in weight_map.items()},
    }
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return dict(n_params=sum(s.numel() for s in shapes.values()), bytes=total, shards=n)


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


def _by_file(requests) -> dict:
    by_file: dict = {}
    for entry, out in requests:
        by_file.setdefault(entry.file, []).append((entry, out))
    return by_file


def _read_per_file(requests) -> None:
    """``safe_open`` once per file, every read of that file under it."""
    from safetensors import safe_open

    for file, items in _by_file(requests).items():
        with safe_open(file, framework="pt") as f:
            for entry, out in items:
                stop = entry.start + entry.shape[0]
                out.copy_(f.get_slice(entry.key)[entry.start : stop])


def _read_dcp(requests) -> None:
    """``HuggingFaceStorageReader.read_data``, given the same reads as
    ``ReadItem`` s and a planner that resolves each to its destination."""
    import torch
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = HuggingFaceStorageReader(str(requests[0][0].file.parent))
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    items, dest = [], {}
    for i, (entry, out) in enumerate(requests):
        zeros = [0] * len(entry.shape)
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(str(i)),
                dest_offsets=torch.Size(zeros),
                storage_index=MetadataIndex(entry.key, zeros),
                storage_offsets=torch.Size([entry.start, *zeros[1:]]),
                lengths=torch.Size(entry.shape),
            )
        )
        dest[str(i)] = out

    class Planner:
        def resolve_tensor(self, req):
            return dest[req.dest_index.fqn]

        def commit_tensor(self, req, tensor):
            pass

    reader.read_data(LoadPlan(items), Planner()).wait()


def _read_readinto(requests) -> None:
    """The former reader: byte offsets from the JSON header, ``readinto``
    the destination's bytes, one open per file."""
    import torch

    for file, items in _by_file(requests).items():
        with open(file, "rb", buffering=0) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            items.sort(key=lambda it: header[it[0].key]["data_offsets"][0])
            for entry, out in items:
                row = entry.nbytes // entry.shape[0]
                f.seek(8 + n + header[entry.key]["data_offsets"][0] + entry.start * row)
                view = memoryview(out.view(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    done += f.readinto(view[done:])


def _fake_pipeline(expert_parallel: bool):
    """Stage ``STAGE`` of ``NUM_STAGES`` (on expert-parallel rank ``EP_RANK`` of
    ``EP_SIZE``): a fake process group, as building and loading a stage issue
    no collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    ep_size, ep_rank = (EP_SIZE, EP_RANK) if expert_parallel else (1, 0)
    rank = STAGE * ep_size + ep_rank
    dist.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=NUM_STAGES * ep_size
    )
    if not expert_parallel:
        return dist.group.WORLD
    return init_device_mesh("cpu", (NUM_STAGES, ep_size), mesh_dim_names=("pp", "ep"))


def worker(
    method: str, directory: str, model_kind: str = "llama", reader: str = "per_read"
) -> dict:
    import torch
    import transformers

    from torch_pipelining_ext import hf, stage_split
    from torch_pipelining_ext.hf import _checkpoint

    if reader != "per_read":  # the package's loading, this reader's reads
        _checkpoint.read_tensors = {
            "per_file": _read_per_file,
            "dcp": _read_dcp,
            "readinto": _read_readinto,
        }[reader]

    torch.set_num_threads(1)
    config = _config(model_kind)
    if method in ("stage_load", "stage_load_ep"):
        mesh = _fake_pipeline(method == "stage_load_ep")
    rss_before = _status("VmRSS")
    peak_reset = _reset_peak()
    hwm_before = _status("VmHWM")
    t0, cpu0 = time.perf_counter(), time.process_time()
    if method in ("stage_load", "stage_load_ep"):
        # this rank's stage only, on the meta device, then its tensors read from the checkpoint
        _, (part,) = hf.pipeline_hf_causal_lm(
            config, mesh, "1F1B", "cpu", checkpoint=directory
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16
        )
        names = hf.hf_module_names_per_stage(model, NUM_STAGES)
        part = stage_split.build_stage_module(model, names[STAGE])
        del model
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    extra = _status("VmHWM") - (rss_before if peak_reset else hwm_before)
    # (a state dict shows an expert-parallel rank's experts as a shard of the whole tensor)
    sd = {
        k: v.to_local() if hasattr(v, "to_local") else v
        for k, v in part.state_dict().items()
    }
    stage_bytes = sum(t.nbytes for t in sd.values())

    # Every stage tensor equals the checkpoint's (read independently).
    from safetensors import safe_open

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]

    def stored(key):
        with safe_open(os.path.join(directory, weight_map[key]), framework="pt") as f:
            return f.get_tensor(key)

    for key, t in sd.items():
        experts = range(*getattr(part, "expert_ranges", {}).get(key, (0, t.shape[0])))
        if key.endswith(".experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            want = torch.stack(
                [
                    torch.cat(
                        [
                            stored(f"{base}{e}.gate_proj.weight"),
                            stored(f"{base}{e}.up_proj.weight"),
                        ]
                    )
                    for e in experts
                ]
            )
        elif key.endswith(".experts.down_proj"):
            base = key[: -len("down_proj")]
            want = torch.stack([stored(f"{base}{e}.down_proj.weight") for e in experts])
        else:
            want = stored(key)
        if t.dtype != torch.bfloat16 or not torch.equal(t, want):
            raise AssertionError(
                f"{method}: stage tensor {key!r} differs from the checkpoint"
            )
    return dict(
        method=method,
        reader=reader,
        stage_bytes=stage_bytes,
        n_tensors=len(sd),
        extra_peak=extra,
        seconds=elapsed,
        cpu_seconds=cpu,
        peak_reset=peak_reset,
    )


def _warm_page_cache(directory: str) -> None:
    """Read every file of the checkpoint once, so that each reader finds it
    in the page cache (the first one to run would otherwise pay the disk)."""
    buf = bytearray(64 * 1024**2)
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def _run_worker(
    method: str, directory: str, model_kind: str = "llama", reader: str = "per_read"
) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        method,
        "--dir",
        directory,
        "--model",
        model_kind,
        "--reader",
        reader,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"worker {method} ({reader}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_once(directory: str, model_kind: str) -> None:
    """Write the checkpoint unless ``directory`` holds one (an earlier run's)."""
    gib = 1024**3
    if os.path.isfile(os.path.join(directory, "model.safetensors.index.json")):
        print(f"[ckpt] {model_kind}: reading the checkpoint at {directory}", flush=True)
        return
    info = _run_worker("write", directory, model_kind)
    print(
        f"[ckpt] {model_kind}: {info['n_params']:.3e} params, {info['bytes'] / gib:.2f} GiB bf16 "
        f"in {info['shards']} safetensors shards at {directory}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", help="where to write the checkpoint (default: a temporary directory)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="llama", help=argparse.SUPPRESS)
    parser.add_argument("--reader", default="per_read", help=argparse.SUPPRESS)
    parser.add_argument("--moe-only", action="store_true", help="only the MoE cases")
    parser.add_argument(
        "--readers",
        default=",".join(READERS),
        help=f"comma-separated, from {','.join(READERS)} (default: all)",
    )
    args = parser.parse_args()
    if args.worker:
        if args.worker == "write":
            result = write_checkpoint(args.dir, args.model)
        else:
            result = worker(args.worker, args.dir, args.model, args.reader)
        print(json.dumps(result))
        return
    readers = args.readers.split(",")
    unknown = sorted(set(readers) - set(READERS))
    if unknown:
        parser.error(f"unknown readers {unknown}; choose from {list(READERS)}")

    directory = args.dir or tempfile.mkdtemp(prefix="bench_load_")
    os.makedirs(directory, exist_ok=True)
    moe_dir = os.path.join(directory, "moe")
    os.makedirs(moe_dir, exist_ok=True)
    gib = 1024**3
    t_start = time.perf_counter()
    cases = [
        ("stage_load", directory, "llama", "stage_load"),
        ("from_pretrained", directory, "llama", "from_pretrained"),
        ("stage_load", moe_dir, "moe", "moe_stage_load"),
        ("stage_load_ep", moe_dir, "moe", "moe_ep_stage_load"),
    ]
    if args.moe_only:
        cases = cases[2:]
    try:
        if not args.moe_only:
            _write_once(directory, "llama")
        _write_once(moe_dir, "moe")
        ratios: dict[str, float] = {}
        for method, where, model_kind, name in cases:
            for reader in ("per_read",) if method == "from_pretrained" else readers:
                _warm_page_cache(where)
                r = _run_worker(method, where, model_kind, reader)
                r["ratio"] = r["extra_peak"] / r["stage_bytes"]
                key = name if reader == "per_read" else f"{reader}_{name}"
                ratios[key] = r["ratio"]
                if not r["peak_reset"]:
                    print(
                        "[warn] /proc/self/clear_refs unavailable: extra peak = VmHWM after - VmHWM before"
                    )
                what = name if method == "from_pretrained" else f"{name} {reader}"
                print(
                    f"[load] {what:28s} stage {STAGE} of {NUM_STAGES} ({r['n_tensors']} tensors, "
                    f"{r['stage_bytes'] / gib:.2f} GiB): extra peak RSS {r['extra_peak'] / gib:.2f} GiB = "
                    f"{r['ratio']:.3f} x the rank's bytes, {r['seconds']:.1f} s ({r['cpu_seconds']:.1f} s CPU); "
                    "tensors equal the checkpoint",
                    flush=True,
                )
        print(f"[done] {time.perf_counter() - t_start:.0f} s")
        names = {name for *_, name in cases}  # the package's reader first
        keys = sorted(ratios, key=lambda k: k not in names)
        print(" ".join(f"{k}_rss_ratio={ratios[k]:.3f}" for k in keys))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
