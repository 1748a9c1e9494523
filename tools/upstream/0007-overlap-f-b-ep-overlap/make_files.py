"""Build the new files of patch 0007 from the package's modules.

    python make_files.py EP_OVERLAP_PY OVERLAP_PY OUT_DIR
    black -l 88 OUT_DIR/_overlap.py OUT_DIR/ep_overlap.py

EP_OVERLAP_PY / OVERLAP_PY: torch_pipelining_ext/ep_overlap.py and
_overlap.py (e.g. ``git show HEAD:torch_pipelining_ext/_overlap.py``); OUT_DIR:
torch/distributed/pipelining of a torch 2.15.0 copy with patches 0001-0006.

The package keeps its per-schedule state in ``_schedule_state._ScheduleState``
(a module upstream does not have) and closes the worker thread in its step
wrapper.  Upstream, ``_overlap.py`` keeps the little it needs on the schedule
itself (``_OverlapState``, the schedule's ``_overlap_state`` attribute), and
``_PipelineScheduleRuntime._step_microbatches`` calls ``_close_worker`` when a
step ends (the ``schedules.py`` part of the patch, written by hand).
"""
import re
import sys

ep_src, ov_src, out_dir = sys.argv[1:4]
ep = open(ep_src).read()
ov = open(ov_src).read()


def replace(text, old, new, count=1):
    if text.count(old) != count:
        raise SystemExit(f"expected {count}x {old[:70]!r}, found {text.count(old)}")
    return text.replace(old, new)


# ---- ep_overlap.py ----------------------------------------------------------
ep = replace(ep, '''Upstream target: a new public module ``torch/distributed/pipelining/ep_overlap.py``.

While this package is patched, an ``OVERLAP_F_B`` action of a
``_PipelineScheduleRuntime`` (``ScheduleDualPipeV``, or a CSV schedule) runs
the forward of one microbatch on the calling thread and the backward of
another on a worker thread (``_overlap.py``).''', '''With :func:`overlap_f_b` registered for ``OVERLAP_F_B``
(``schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)``),
an ``OVERLAP_F_B`` action of a ``_PipelineScheduleRuntime``
(``ScheduleDualPipeV``, or a CSV schedule) runs the forward of one microbatch
on the calling thread and the backward of another on a worker thread
(``_overlap.py``; design: [Note: concurrent OVERLAP_F_B] there).''')
ep = ep.replace("TORCH_PIPELINING_EXT_OVERLAP_TIMEOUT", "TORCH_PIPELINING_OVERLAP_TIMEOUT")
ep = replace(ep, '''"the sequential handler would. Use preserve_rng_state=True, or run OVERLAP_F_B "
                            "sequentially (TORCH_PIPELINING_EXT_OVERLAP=0)."''', '''"the sequential handler would. Use preserve_rng_state=True, or run OVERLAP_F_B "
                            "sequentially (do not register ep_overlap.overlap_f_b)."''')
ep = replace(ep, "    # So fork_rng on the backward side opens an \"RNG window\" (the patch table\n    # routes it here).",
             "    # So fork_rng on the backward side opens an \"RNG window\" (rng_window;\n    # torch.random.fork_rng is to call it, a follow-up of this change).")
ep = replace(ep, '''__all__ = [
    "CommWaitTimeoutError",''', '''__all__ = [
    "CommWaitTimeoutError",
    "overlap_f_b",''')
# public entry point, defined at the end (imports _overlap lazily: no cycle)
ep = ep.rstrip() + '''


def overlap_f_b(action: Any, ctx: Any) -> None:
    """Custom function that runs an ``OVERLAP_F_B`` action's sub-actions concurrently.

    Register it on a schedule to opt in::

        schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)

    See [Note: concurrent OVERLAP_F_B] in ``torch/distributed/pipelining/_overlap.py``.
    """
    from torch.distributed.pipelining._overlap import overlap_f_b as _overlap_f_b

    _overlap_f_b(action, ctx)
'''
assert "torch_pipelining_ext" not in ep and "TORCH_PIPELINING_EXT" not in ep, [
    l for l in ep.splitlines() if "PIPELINING_EXT" in l or "pipelining_ext" in l
]

# ---- _overlap.py ------------------------------------------------------------
head_end = ov.index('"""', 3) + 3
ov = '''"""Concurrent OVERLAP_F_B for ``_PipelineScheduleRuntime``; see [Note: concurrent OVERLAP_F_B]."""''' + ov[head_end:]
ov = replace(ov, "from torch_pipelining_ext import _schedule_state, ep_overlap\nfrom torch_pipelining_ext.ep_overlap import",
             "from . import ep_overlap\nfrom .ep_overlap import")
ov = replace(ov, "import os\n", "")  # only the environment switch used it
ov = replace(ov, "import torch\nfrom torch.autograd", "import torch\nimport torch.distributed as dist\nfrom torch.autograd")
ov = ov.replace('OVERLAP_PATCH_NAME = "overlap_f_b"  # its entry in _patches.py\n', "")
ov = replace(ov, '''OVERLAP_ENV = "TORCH_PIPELINING_EXT_OVERLAP"


def overlap_enabled() -> bool:
    """False when ``$TORCH_PIPELINING_EXT_OVERLAP`` is ``0`` (opt out globally)."""
    return os.environ.get(OVERLAP_ENV, "1").strip() != "0"
''', "__NOTE__")
ov = replace(ov, "    sequentially, as does every pair once ``unpatch()`` has been called.\n", "    sequentially.\n")
ov = replace(ov, "    from torch_pipelining_ext import _schedule_runtime\n\n    schedule = ctx.schedule_ref",
             "    schedule = ctx.schedule_ref")
ov = replace(ov, " or not _patch_applied() or ", " or ")
# the sequential path (the package's helper, or its loop)
if "_schedule_runtime.sequential_overlap_f_b(action, ctx)" in ov:
    ov = replace(ov, "        _schedule_runtime.sequential_overlap_f_b(action, ctx)\n",
                 "        for sub in action.sub_actions:\n            schedule.perform_action(sub, ctx)\n")
else:
    ov = replace(ov, "            _schedule_runtime.run_action(ctx, sub)", "            schedule.perform_action(sub, ctx)")
ov = replace(ov, "    computes = [_schedule_runtime.prepare_compute_action(ctx, sub) for sub in action.sub_actions]",
             "    computes = [schedule.prepare_compute_action(sub, ctx) for sub in action.sub_actions]")
ov = replace(ov, "    stages = _schedule_runtime.stage_index_to_stage(schedule)\n    streams",
             "    stages = schedule._local_stages()\n    streams")
ov = replace(ov, '''    from torch_pipelining_ext import _fsdp_stage, _schedule_runtime

    fwd, bwd = action.sub_actions
    if fwd.stage_index != bwd.stage_index:
        return False
    stage = _schedule_runtime.stage_index_to_stage(schedule).get(fwd.stage_index)
    return stage is not None and _fsdp_stage.stage_uses_fsdp(stage)
''', '''    from torch.distributed.fsdp import FSDPModule

    fwd, bwd = action.sub_actions
    if fwd.stage_index != bwd.stage_index:
        return False
    stage = schedule._local_stages().get(fwd.stage_index)
    return stage is not None and isinstance(stage.submod, FSDPModule)
''')
ov = re.sub(r"\n\ndef _patch_applied\(\) -> bool:\n.*?(?=\n\n\n)", "", ov, flags=re.S)
# per-schedule state: the package's _schedule_state module becomes a small
# state object here, kept on the schedule; the package's step wrapper becomes
# a call in _PipelineScheduleRuntime._step_microbatches (_close_worker)
ov = replace(ov, "    global_rank = _schedule_state.global_rank(schedule)\n", "    global_rank = _global_rank(schedule)\n")
ov = replace(ov, '''

def overlap_f_b(action: _Action, ctx: Any) -> None:
''', '''

def _global_rank(schedule: Any) -> int:
    """This process's rank in the default group (``schedule.rank``, the pipeline rank, without one)."""
    return dist.get_rank() if dist.is_initialized() else getattr(schedule, "rank", 0)


def overlap_f_b(action: _Action, ctx: Any) -> None:
''')
ov = replace(ov, '''    of a step; it is held by the schedule's ``_ScheduleState``, whose
    ``end_step`` closes and joins it when the step ends, however it ends.
''', '''    of a step; it is held by the schedule's :class:`_OverlapState`, and
    ``_PipelineScheduleRuntime._step_microbatches`` closes and joins it
    (:func:`_close_worker`) when the step ends, however it ends.
''')
ov = replace(ov, '''def _worker_for(schedule: Any, global_rank: int) -> _BackwardWorker:
    """The backward thread of ``schedule``'s step in progress, started on first use."""
    state = _schedule_state.schedule_state(schedule)
    if state.backward_worker is None or not state.backward_worker.alive:
''', '''@dataclasses.dataclass
class _OverlapState:
    """What concurrent OVERLAP_F_B keeps on a schedule, as its ``_overlap_state``.

    Attributes:
        backward_worker: the backward thread of the step in progress.
        stage_streams: stage index -> accelerator stream of the overlapped
            actions, created on first use and kept across steps.
    """

    backward_worker: _BackwardWorker | None = None
    stage_streams: dict[int, Any] | None = None


def _overlap_state(schedule: Any) -> _OverlapState:
    """``schedule``'s :class:`_OverlapState`, created on first use."""
    state = getattr(schedule, "_overlap_state", None)
    if state is None:
        state = schedule._overlap_state = _OverlapState()
    return state


def _close_worker(schedule: Any) -> None:
    """Close and join the backward thread of ``schedule``'s step, if it has one: the step ended."""
    state = getattr(schedule, "_overlap_state", None)
    if state is None or state.backward_worker is None:
        return
    worker, state.backward_worker = state.backward_worker, None
    worker.close_after_step(type(schedule).__name__)


def _worker_for(schedule: Any, global_rank: int) -> _BackwardWorker:
    """The backward thread of ``schedule``'s step in progress, started on first use."""
    state = _overlap_state(schedule)
    if state.backward_worker is None or not state.backward_worker.alive:
''')
ov = replace(ov, "        state = _schedule_state.schedule_state(schedule)\n", "        state = _overlap_state(schedule)\n")
# installation: descriptor, register wrapper and probe go; the fork_rng hook stays (for the follow-up)
start = ov.index("# --------------------------------------------------------------------------- #\n# Installation")
keep = ov.index("def _rng_devices(")
probe = ov.index("def _probe_overlap(")
ov = ov[:start] + '''# --------------------------------------------------------------------------- #
# Random numbers: the torch.random.fork_rng hook (follow-up, see the note)      #
# --------------------------------------------------------------------------- #


''' + ov[keep:probe].rstrip() + "\n"
note_src = open(ov_src).read()
doc_start = note_src.find("What overlaps:")
if doc_start < 0:
    doc_start = note_src.index("Running one action::")
doc = note_src[doc_start:note_src.index('"""', doc_start)]
doc = doc.replace(" (:mod:`torch_pipelining_ext.ep_overlap`)", "")
doc = doc.replace("``_schedule_runtime.prepare_compute_action``", "``_PipelineScheduleRuntime.prepare_compute_action``")
doc = doc.replace(":class:`~torch_pipelining_ext.ep_overlap._CommCoordinator`", "``ep_overlap._CommCoordinator``")
doc = doc.replace("(:mod:`torch_pipelining_ext.ep_overlap`)", "(``ep_overlap``)")
doc = doc.replace("to the previous stage, last-backward", "to the previous stage)")
doc = doc.replace("work on torches without REDUCE_GRAD)", "")
doc = replace(doc, """in the schedule's ``_schedule_state._ScheduleState`` and joined when the step
ends, however it ends (``_ScheduleState.end_step``): no thread outlives a step.""",
              """in the schedule's ``_OverlapState`` and joined when the step ends, however
it ends (``_PipelineScheduleRuntime._step_microbatches`` calls
``_close_worker``): no thread outlives a step.""")
note = "# [Note: concurrent OVERLAP_F_B]\n#\n# ``schedule.register_custom_function(OVERLAP_F_B, ep_overlap.overlap_f_b)``\n# runs the forward sub-action of each OVERLAP_F_B on the calling thread and\n# the backward sub-action on a worker thread.\n#\n" + "\n".join(
    ("# " + l).rstrip() for l in doc.rstrip().splitlines()) + "\n"
ov = ov.replace("__NOTE__", note)
assert "torch_pipelining_ext" not in ov and "PIPELINING_EXT" not in ov, [
    l for l in ov.splitlines() if "PIPELINING_EXT" in l or "pipelining_ext" in l
]
open(f"{out_dir}/ep_overlap.py", "w").write(ep)
open(f"{out_dir}/_overlap.py", "w").write(ov)
