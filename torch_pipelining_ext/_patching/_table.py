"""The patch table: every change ``torch_pipelining_ext`` makes to torch, in order.

Read this file to know what the package does to your torch.  Each entry names
its targets, the replacement (``make(original) -> new``), the feature probe
that decides whether torch already has the behaviour, and the upstream file
the code is written for.  Undo is uniform: ``unpatch()`` puts back the very
objects that were there before.  Nothing outside this table assigns to torch
attributes.

Order matters: a patch runs after the patches it ``requires``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch_pipelining_ext._patching._registry import _PatchRegistry, Patch, Target


__all__: list[str] = []

_PIPELINING = "torch.distributed.pipelining"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"


def _probe(name: str) -> Callable[[], tuple[str, str]]:
    """The probe ``name`` of ``_probes.py``, imported when it runs."""

    def run() -> tuple[str, str]:
        from torch_pipelining_ext._patching import _probes

        return getattr(_probes, name)()

    return run


def _patches() -> list[Patch]:
    # Imports are local (inside each probe and make) so that a feature module
    # failing to import on an unrecognised torch only removes its own patches:
    # _PatchRegistry._apply_one records the failure as that patch's reason.
    patches: list[Patch] = []
    patches.extend(_schedule_runtime_patches())
    patches.extend(_fsdp_stage_patches())
    patches.extend(_split_backward_patches())
    patches.append(_overlap_patch())
    patches.append(_stage_split_patch())
    return patches


def _obj(module: str, name: str) -> Any:
    """``torch_pipelining_ext.<module>.<name>``, imported when a patch is applied."""
    return getattr(importlib.import_module(f"torch_pipelining_ext.{module}"), name)


def _install(module: str, name: str) -> Callable[[Any], Any]:
    """Replacement: the package's object ``module.name``."""
    return lambda original: _obj(module, name)


def _wrap(module: str, factory: str) -> Callable[[Any], Any]:
    """Replacement: ``module.factory(original)``."""
    return lambda original: _obj(module, factory)(original)


def _new(module: str, cls: str) -> Callable[[Any], Any]:
    """Replacement: a new instance of the package's class ``module.cls``."""
    return lambda original: _obj(module, cls)()


def _targets(
    module: str, owner: str = "", /, **makes: Callable[[Any], Any]
) -> tuple[Target, ...]:
    """One target per keyword: ``module.owner.<keyword>`` becomes ``make(original)``."""
    prefix = f"{owner}." if owner else ""
    return tuple(
        Target(module, prefix + attr, make=make) for attr, make in makes.items()
    )


# --- schedule runtime: shared schedule state, custom functions on torch 2.9 ---
# torch_pipelining_ext/_backward_counter.py, _gloo_p2p.py, _pipeline_context.py, _compat_29.py,
# _step_context.py, _schedule_runtime.py, _grad_scaling.py, _compute_comms.py
# Upstream: torch/distributed/pipelining/schedules.py and stage.py.  On torch 2.10+
# the custom-function runtime is upstream; patched there are the counter, the step
# context, per-step gradient scaling, REDUCE_GRAD for compute_comms schedules and the
# (legacy-path) stage handshake.  Each probe decides.
_RUNTIME = "_PipelineScheduleRuntime"
_STAGE_BASE = "_PipelineStageBase"
_RUNTIME_STATE_NAMES = (
    "_comp_type_to_function_map",
    "fwd_recv_ops",
    "bwd_recv_ops",
    "unshard_ops",
    "unsharded_stages",
)


def _schedule_runtime_patches() -> list[Patch]:
    return [*_transport_patches(), *_compat_29_patches(), *_runtime_patches()]


def _transport_patches() -> list[Patch]:
    return [
        Patch(
            name="stage_init_handshake",
            targets=_targets(
                _STAGE,
                _STAGE_BASE,
                _get_init_p2p_neighbors_ops=_wrap(
                    "_gloo_p2p", "_make_get_init_p2p_neighbors_ops"
                ),
            ),
            probe=_probe("_probe_init_p2p_handshake"),
            description="stage init handshake: float32 tensors, no send to the own rank (gloo)",
            upstream="stage.py _get_init_p2p_neighbors_ops (float32 since 2.10; no handshake in 2.15)",
        ),
        Patch(
            name="p2p_to_own_rank",
            targets=_targets(
                _SCHEDULES, _batch_p2p=_wrap("_gloo_p2p", "_make_batch_p2p")
            ),
            probe=_probe("_probe_self_p2p"),
            description="a P2P batch's sends to the own rank are copied into its receives (gloo)",
            upstream="schedules.py _batch_p2p (PipelineScheduleMulti loop with adjacent stages on one rank)",
        ),
        Patch(
            name="schedule_backward_counter",
            targets=_targets(
                _SCHEDULES,
                _RUNTIME,
                backward_counter=_new("_backward_counter", "_BackwardCounterAttribute"),
            ),
            probe=_probe("_probe_backward_counter"),
            description="schedule.backward_counter: Counter-compatible, thread-safe record_backward()",
            upstream="schedules.py _PipelineScheduleRuntime.backward_counter (2.10 cycle)",
        ),
    ]


def _lazy_state(name: str) -> Callable[[Any], Any]:
    """Replacement: the schedule attribute ``name``, created on first use per schedule."""

    def make(original: object) -> object:
        return _obj("_compat_29", "_LazyScheduleAttribute")(
            name, _obj("_compat_29", "_RUNTIME_STATE")[name]
        )

    return make


def _compat_29_patches() -> list[Patch]:
    return [
        Patch(
            name="runtime_custom_functions",
            targets=(
                *_targets(
                    _SCHEDULES,
                    _PipelineContext=_install("_pipeline_context", "_PipelineContext"),
                ),
                *_targets(
                    _SCHEDULES,
                    _RUNTIME,
                    register_custom_function=_install(
                        "_compat_29", "register_custom_function"
                    ),
                    _assert_unsharded=_install("_compat_29", "_assert_unsharded"),
                    # fwd_recv_ops, bwd_recv_ops, unshard_ops, unsharded_stages,
                    # _comp_type_to_function_map
                    **{name: _lazy_state(name) for name in _RUNTIME_STATE_NAMES},
                ),
            ),
            probe=_probe("_probe_custom_functions"),
            description="register_custom_function, _PipelineContext and the recv/unshard state on the schedule",
            upstream="schedules.py register_custom_function / _PipelineContext (2.10 cycle)",
        ),
        Patch(
            name="runtime_step_loop",
            targets=_targets(
                _SCHEDULES,
                _RUNTIME,
                _step_microbatches=_install("_compat_29", "_runtime_step_microbatches"),
            ),
            probe=_probe("_probe_step_loop"),
            description="step loop that dispatches custom functions and runs every action through run_action",
            upstream="schedules.py _PipelineScheduleRuntime._step_microbatches (2.10 cycle)",
            requires=("schedule_backward_counter", "runtime_custom_functions"),
        ),
        Patch(
            name="runtime_keep_overlap_f_b",
            targets=_targets(
                _SCHEDULES, _add_send_recv=_install("_compat_29", "_add_send_recv")
            ),
            probe=_probe("_probe_overlap_lowering"),
            description="lowering keeps OVERLAP_F_B actions (sends of both sub-actions follow it)",
            upstream="schedules.py _add_send_recv (2.10 cycle)",
            requires=("runtime_step_loop",),
        ),
    ]


def _runtime_patches() -> list[Patch]:
    return [
        Patch(
            name="runtime_step_context",
            targets=_targets(
                _SCHEDULES,
                _RUNTIME,
                _step_microbatches=_wrap("_step_context", "_make_step_context"),
            ),
            probe=_probe("_probe_step_context"),
            description="custom functions see return_outputs/loss_kwargs; step errors name rank, time step, action",
            upstream="schedules.py _PipelineScheduleRuntime._step_microbatches / _PipelineContext",
            # the one wrapper of the step: on torch 2.9 it wraps our loop, so it is applied after it
            requires=("runtime_step_loop",),
        ),
        Patch(
            name="runtime_action_functions",
            targets=_targets(
                _SCHEDULES,
                _RUNTIME,
                # every schedule's custom-function map starts with perform_action
                # for each customizable type
                _comp_type_to_function_map=_new(
                    "_schedule_runtime", "_FunctionMapWithDefaults"
                ),
                # registering a function over a default one replaces it without a warning
                register_custom_function=_wrap(
                    "_schedule_runtime", "_make_register_custom_function"
                ),
                # the per-action methods of upstream patches 0007 and 0008
                _local_stages=_install("_schedule_runtime", "stage_index_to_stage"),
                perform_action=_install("_schedule_runtime", "_perform_action_method"),
                prepare_compute_action=_install(
                    "_schedule_runtime", "_prepare_compute_action_method"
                ),
            ),
            probe=_probe("_probe_action_functions"),
            description="every compute, UNSHARD, RESHARD and gradient-reduction action runs perform_action "
            "(plain or inside OVERLAP_F_B: one implementation)",
            upstream="schedules.py _PipelineScheduleRuntime._step_microbatches: _perform_action as per-action functions",
            # perform_action reads the step's return_outputs/loss_kwargs; on torch 2.9 our loop dispatches the map
            requires=(
                "runtime_custom_functions",
                "runtime_step_loop",
                "runtime_step_context",
            ),
        ),
        Patch(
            name="scale_grads_per_step",
            targets=_targets(
                _STAGE,
                _STAGE_BASE,
                clear_runtime_states=_wrap(
                    "_grad_scaling", "_make_clear_runtime_states"
                ),
                scale_grads=_wrap("_grad_scaling", "_make_scale_grads"),
            ),
            probe=_probe("_probe_scale_grads"),
            description="scale_grads scales only the step's gradients (accumulation over steps)",
            upstream="stage.py _PipelineStageBase.scale_grads",
            env_disable="TORCH_PIPELINING_EXT_DISABLE_SCALE_GRADS_FIX",
        ),
        Patch(
            name="compute_comms_reduce_grad",
            targets=_targets(
                _SCHEDULES,
                _RUNTIME,
                _prepare_schedule_with_comms=_wrap(
                    "_compute_comms", "_make_prepare_comms"
                ),
            ),
            probe=_probe("_probe_compute_comms_reduce_grad"),
            description="compute_comms schedules get REDUCE_GRAD after each stage's last backward",
            upstream="schedules.py _PipelineScheduleRuntime._prepare_schedule_with_comms (_add_reduce_grad)",
        ),
    ]


# --- FSDP2 in pipeline stages: split-backward parameters (torch_pipelining_ext/_fsdp_stage.py) ---
def _fsdp_stage_patches() -> list[Patch]:
    return [
        Patch(
            name="fsdp_split_backward_params",
            targets=_targets(
                _STAGE,
                _STAGE_BASE,
                backward_maybe_with_nosync=_wrap(
                    "_fsdp_stage", "_make_backward_maybe_with_nosync"
                ),
            ),
            probe=_probe("_probe_backward_params"),
            description="split (I/W) backward of nested fully_shard stages uses the unsharded parameters",
            upstream="stage.py _PipelineStageBase.backward_maybe_with_nosync",
            env_disable="TORCH_PIPELINING_EXT_DISABLE_FSDP_FIX",
        ),
    ]


# --- split (I/W) backward: torch_pipelining_ext/_split_backward.py ---
_BACKWARD = "torch.distributed.pipelining._backward"


def _split_backward_patches() -> list[Patch]:
    def sb(name: str) -> Any:
        from torch_pipelining_ext import _split_backward

        return getattr(_split_backward, name)

    def weight(original: object) -> object:
        return sb("stage_backward_weight")

    wrappers: dict[Any, object] = {}

    def input_(
        original: object,
    ) -> object:  # one wrapper for both names of the function
        if original not in wrappers:
            wrappers[original] = sb("_make_stage_backward_input")(original)
        return wrappers[original]

    return [
        Patch(
            name="split_backward_weight",
            # stage.py calls the name it imported from _backward.py
            targets=(
                Target(_BACKWARD, "stage_backward_weight", make=weight),
                Target(_STAGE, "stage_backward_weight", make=weight),
            ),
            probe=_probe("_probe_stage_backward_weight"),
            description="BACKWARD_WEIGHT counts a parameter used twice on one path once, "
            "and routes each output's gradient of a multi-output node",
            upstream="_backward.py stage_backward_weight (pytorch issues 180952, 170277)",
        ),
        Patch(
            name="split_backward_non_tensor_inputs",
            targets=(
                Target(_BACKWARD, "stage_backward_input", make=input_),
                Target(_STAGE, "stage_backward_input", make=input_),
            ),
            probe=_probe("_probe_stage_backward_input"),
            description="BACKWARD_INPUT accepts non-tensor stage inputs (a FlexAttention BlockMask kwarg)",
            upstream="_backward.py stage_backward_input (torchtitan issue 3584)",
        ),
    ]


# --- OVERLAP_F_B overlap: torch_pipelining_ext/overlap/ (installed by overlap/_install.py) ---
def _overlap_patch() -> Patch:
    return Patch(
        name="overlap_f_b",
        targets=(
            # the runtime's default map, with the overlap handler for OVERLAP_F_B
            # (registering another OVERLAP_F_B function, the opt-out, replaces it
            # without a warning)
            *_targets(
                _SCHEDULES,
                _RUNTIME,
                _comp_type_to_function_map=_new(
                    "overlap._install", "_FunctionMapWithOverlap"
                ),
            ),
            # checkpoint recomputation on the backward thread draws the sequential
            # handler's random numbers
            *_targets(
                "torch.random", fork_rng=_wrap("overlap._install", "_make_fork_rng")
            ),
            # the stage method of upstream patch 0001 that the handler calls
            *_targets(
                _STAGE,
                _STAGE_BASE,
                _unshard_fsdp_modules=_install("_fsdp_stage", "unshard_stage"),
            ),
        ),
        probe=_probe("_probe_overlap"),
        description="OVERLAP_F_B runs forward and backward concurrently; ep_overlap marks coordinate EP comm "
        "(TORCH_PIPELINING_EXT_OVERLAP=0: sequential)",
        upstream="schedules.py OVERLAP_F_B of _PipelineScheduleRuntime; new ep_overlap.py",
        # runtime_step_context ends each step by joining the step's backward thread;
        # runtime_action_functions is the map this one extends
        requires=(
            "schedule_backward_counter",
            "runtime_custom_functions",
            "runtime_keep_overlap_f_b",
            "runtime_step_context",
            "runtime_action_functions",
        ),
    )


# --- stage_split: torch.distributed.pipelining.stage_split (new public module) ---
def _stage_split_patch() -> Patch:

    def module(original: object) -> object:
        import torch_pipelining_ext.stage_split as stage_split

        return stage_split

    return Patch(
        name="stage_split",
        targets=(
            # `from torch.distributed.pipelining.stage_split import build_stage_module`
            Target("sys", "modules", make=module, key=f"{_PIPELINING}.stage_split"),
            # `torch.distributed.pipelining.stage_split.build_stage_module`
            Target(_PIPELINING, "stage_split", make=module),
        ),
        probe=_probe("_upstream_probe"),
        description="build_stage_module / pipeline_module_split: build pipeline stages by module FQN",
        upstream="torch/distributed/pipelining/stage_split.py (new)",
    )


_REGISTRY = _PatchRegistry(_patches())
