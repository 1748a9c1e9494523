"""What a run leaves for people besides ``metrics.jsonl``: the resolved
configuration and versions (``config.json``), each rank's peak memory per
step, and TensorBoard's event files.

Private helper of :mod:`torch_pipelining_ext.train`; see ``[Note: run
configuration]`` and ``[Note: peak memory]``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist

from torch_pipelining_ext.train import _data


if TYPE_CHECKING:
    from torch_pipelining_ext.train._plan import RunPlan


__all__: list[str] = []

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
_GIT_TIMEOUT_S = 10.0
_MIB = float(1 << 20)

# [Note: run configuration]
# Rank 0 writes the run's resolved configuration once per start: every flag
# after its defaults were applied, the layout, the model's whole config (a
# --model-type's tiny config included), the data (token file, its size, the
# held-out sequences), and the versions of Python, torch, transformers,
# numpy and this package, with the git revision of the package's checkout
# (and whether it has uncommitted changes) when the package is a file git
# tracks; otherwise "git" is null and "git_omitted" says why.  A fresh start
# writes run_dir/config.json (and removes the configurations of an earlier
# run of the directory); a resumed start keeps it and writes
# config-resumed-step-NNNNNNNN.json, so that every start of the run is on
# record.  Both are written under a temporary name and renamed.


def package_versions() -> dict[str, str | None]:
    """The versions that make a run's numbers what they are."""
    import numpy

    import torch_pipelining_ext

    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": hf_version,
        "numpy": numpy.__version__,
        "torch_pipelining_ext": torch_pipelining_ext.__version__,
    }


def git_revision() -> tuple[dict[str, Any] | None, str | None]:
    """``({"revision", "dirty"}, None)`` where the package is a file of a git
    checkout, else ``(None, why not)``."""
    import torch_pipelining_ext

    init = os.path.abspath(torch_pipelining_ext.__file__)
    root = os.path.dirname(os.path.dirname(init))

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "-C", root, *argv],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=True,
        )
        return done.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", init)  # tracked, not just inside a tree
        revision = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except FileNotFoundError:
        return None, "git is not installed"
    except subprocess.TimeoutExpired:
        return None, f"git did not answer within {_GIT_TIMEOUT_S:g} s"
    except subprocess.CalledProcessError:
        return None, f"the package ({root}) is not a file of a git checkout"
    return {"revision": revision, "dirty": dirty}, None


def resolved_config(plan: RunPlan, step: int) -> dict[str, Any]:
    """``config.json``'s content (``[Note: run configuration]``)."""
    args, layout = plan.args, plan.layout
    git, omitted = git_revision()
    info: dict[str, Any] = {
        "started_at_step": step,
        "resumed_from": plan.resume.path if plan.resume is not None else None,
        "args": _jsonable(vars(args)),
        "layout": {
            "world_size": layout.world_size,
            "pp": layout.pp,
            "dp": layout.dp,
            "ep": layout.ep,
            "num_stages": layout.num_stages,
        },
        "model_config": json.loads(plan.config.to_json_string()),
        "data": {
            "token_file": plan.stream.path,
            "token_dtype": plan.stream.dtype,
            "tokens": plan.stream.num_tokens,
            "held_out_sequences": _data.held_out_sequences(args),
        },
        "versions": package_versions(),
        "git": git,
    }
    if omitted is not None:
        info["git_omitted"] = omitted
    return info


def config_path(run_dir: str, resumed_step: int | None) -> str:
    if resumed_step is None:
        return os.path.join(run_dir, CONFIG_FILE)
    return os.path.join(run_dir, f"config-resumed-step-{resumed_step:08d}.json")


def write_config(plan: RunPlan, step: int) -> str:
    """Write the start's configuration into the run directory (rank 0);
    returns its path."""
    run_dir = plan.args.run_dir
    resumed = plan.resume is not None
    if not resumed:  # a fresh run: an earlier run's configurations go
        for name in os.listdir(run_dir):
            if name.startswith("config-resumed-step-") and name.endswith(".json"):
                os.remove(os.path.join(run_dir, name))
    path = config_path(run_dir, step if resumed else None)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(resolved_config(plan, step), f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(partial, path)
    return path


def _jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, (str, int, float, bool, list, type(None))):
            value = repr(value)
        out[key] = value
    return out


# [Note: peak memory]
# Every step each rank measures its own peaks: the CPU's resident set (Linux:
# VmHWM of /proc/self/status, reset at the step's start by writing 5 to
# /proc/self/clear_refs; where that cannot be reset, getrusage's ru_maxrss,
# the peak since the process started: a debug line says so) and, on CUDA, torch.cuda.max_memory_allocated (reset with
# reset_peak_memory_stats).  One all_gather of two numbers per step brings
# them to rank 0, which logs them per rank (MiB) in metrics.jsonl.


class MemoryProbe:
    """A rank's peak memory over each step (``[Note: peak memory]``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = os.path.isfile("/proc/self/status") and _reset_rss_peak()
        if not self.resettable:
            logger.debug(
                "peak RSS cannot be reset here: logged as the peak since start"
            )

    def start_step(self) -> None:
        if self.resettable:
            _reset_rss_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> tuple[float, float | None]:
        """(peak resident set, peak device memory allocated or ``None``), MiB."""
        rss = _vm_hwm() if self.resettable else None
        if rss is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rss = peak / _MIB if sys.platform == "darwin" else peak * 1024 / _MIB
        device = None
        if self.device.type == "cuda":
            device = torch.cuda.max_memory_allocated(self.device) / _MIB
        return rss, device

    def gather(self) -> dict[str, Any]:
        """Every rank's peaks of the step (a collective; meaningful on rank 0):
        the fields of a :class:`_metrics.StepRecord`."""
        rss, device = self.peaks()
        mine = torch.tensor(
            [rss, -1.0 if device is None else device],
            dtype=torch.float64,
            device=self.device,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        values = torch.stack(every).cpu().tolist()
        return {
            "peak_rss_mib": [round(v[0], 3) for v in values],
            "peak_device_mib": None
            if device is None
            else [round(v[1], 3) for v in values],
        }


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _vm_hwm() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / _MIB  # kB
    except OSError:
        pass
    return None


class TensorBoardLog:
    """``--tensorboard DIR``: the scalars of every ``metrics.jsonl`` record as
    TensorBoard events (rank 0).  A resumed run purges the events after its
    checkpoint's step, as ``metrics.jsonl`` drops its records."""

    def __init__(self, log_dir: str, from_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=from_step + 1)

    def append(self, values: Mapping[str, Any]) -> None:
        step = int(values["step"])
        for tag, value in scalars(values).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a ``metrics.jsonl`` record, TensorBoard's tags: each
    number under its field's name, the items of a list or mapping under
    ``field/index`` (the per-rank fields: ``peak_rss_mib/0`` is rank 0's);
    ``None``, booleans and ``step`` (the x axis) left out."""
    out: dict[str, float] = {}

    def add(tag: str, value: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                add(f"{tag}/{i}", v)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                add(f"{tag}/{k}", v)

    for key, value in values.items():
        if key != "step":
            add(key, value)
    return out
