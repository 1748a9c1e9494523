"""Every feature probe of the patch table, in one place.

A probe runs the behaviour a patch fixes (or reads the torch internals the
patch replaces) on the installed torch and returns ``(PatchNeeded, reason)``
or ``(AlreadyUpstream, reason)``; it raises when it cannot recognise those
internals, and the patch is then skipped (``_registry.py``).  Feature modules
do not know about probes or the registry.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _schedules
from torch.nn import Parameter

from torch_pipelining_ext._patching._registry import (
    AlreadyUpstream,
    NotSupported,
    PatchNeeded,
)


__all__: list[str] = []


def _with_dist(fn: Any, fake_dist: Any) -> Callable[..., Any]:
    """``fn`` with its global ``dist`` replaced by ``fake_dist`` (torch's own module untouched)."""
    return types.FunctionType(
        fn.__code__,
        {**fn.__globals__, "dist": fake_dist},
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )


def _expect_params(fn: Callable[..., Any], qualname: str, expected: list[str]) -> None:
    """Raise unless ``fn`` (torch's ``qualname``) takes exactly the ``expected`` parameters."""
    params = list(inspect.signature(fn).parameters)
    if params != expected:
        raise RuntimeError(f"unrecognised {qualname}{tuple(params)}")


# --- _backward_counter.py ---


def _probe_backward_counter() -> tuple[str, str]:
    """Is the schedule's backward counter already thread safe with ``record_backward``?"""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    if hasattr(
        getattr(_PipelineScheduleRuntime, "backward_counter", None), "record_backward"
    ):
        return AlreadyUpstream, "backward_counter has record_backward"
    if hasattr(_PipelineScheduleRuntime, "register_custom_function"):
        return (
            PatchNeeded,
            "schedule.backward_counter is a plain Counter: += from two threads loses counts",
        )
    return (
        PatchNeeded,
        "no backward_counter on the schedule for custom functions to share",
    )


# --- _fsdp_stage.py ---


def _probe_backward_params() -> tuple[str, str]:
    """Does torch's split backward take FSDP-managed parameters after unsharding them?"""
    import inspect

    from torch.distributed.pipelining.stage import _PipelineStageBase

    fn = _PipelineStageBase.backward_maybe_with_nosync
    params = list(inspect.signature(fn).parameters)
    if params[:3] != ["self", "backward_type", "bwd_kwargs"]:
        raise RuntimeError(f"unrecognised backward_maybe_with_nosync{tuple(params)}")
    names = _code_names(fn.__code__)
    if "parameters" not in names:
        raise RuntimeError(
            "backward_maybe_with_nosync no longer reads submod.parameters()"
        )
    if "unshard" in names:
        return (
            AlreadyUpstream,
            "backward_maybe_with_nosync unshards FSDP modules before the split backward",
        )
    return (
        PatchNeeded,
        "split backward takes submod.parameters() before FSDP's pre-backward unshard",
    )


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


# --- _gloo_p2p.py ---


class _ProbeOp:
    """Stands in for a ``dist.P2POp`` in :func:`_probe_self_p2p`."""

    def __init__(self, op: str, peer: int) -> None:
        self.op, self.peer, self.group_peer = op, peer, peer
        self.tensor = torch.zeros(1)
        self.group = types.SimpleNamespace(group_name="probe")
        self.tag = 0


def _probe_self_p2p() -> tuple[str, str]:
    """Run torch's ``_batch_p2p``, with a recording ``dist``, on a batch that
    sends to and receives from the calling rank (rank 0 here): does it hand
    those ops to the backend?"""
    from torch.distributed.pipelining import schedules

    fn = schedules._batch_p2p
    issued: list[Any] = []

    def batch_isend_irecv(ops: list[Any]) -> list[Any]:
        issued.extend(ops)
        return []

    fake_dist = types.SimpleNamespace(
        isend="isend",
        irecv="irecv",
        batch_isend_irecv=batch_isend_irecv,
        get_rank=lambda *args, **kwargs: 0,
    )
    _with_dist(fn, fake_dist)([_ProbeOp("isend", 0), _ProbeOp("irecv", 0)])
    if not issued:
        return (
            AlreadyUpstream,
            "_batch_p2p keeps sends to the own rank away from the backend",
        )
    return (
        PatchNeeded,
        "_batch_p2p hands sends to the own rank to the backend (gloo: 'Pair is not connected')",
    )


class _RecordedP2POp:
    """Stands in for ``dist.P2POp`` in the probe: records the op, talks to nobody."""

    recorded: list[tuple[torch.dtype, Any]]

    def __init__(
        self,
        op: Any,
        tensor: torch.Tensor,
        *args: Any,
        group_peer: Any = None,
        **kwargs: Any,
    ) -> None:
        self.recorded.append((tensor.dtype, group_peer))


class _ProbeStage:
    """The inputs of the handshake builder for a V-schedule middle stage.

    Stage 1 of three, on group rank 1 with stage 2 (the V's turn), stage 0 on
    group rank 0.  The attributes set here decide which ops are built; any
    other attribute the builder reads (the process groups, which torch 2.14
    keeps per direction) is only handed to ``P2POp`` and reads as ``None``.
    """

    stage_index = 1
    stage_index_to_group_rank = {0: 0, 1: 1, 2: 1}
    group_rank = 1
    is_first = False
    is_last = False
    device = torch.device("cpu")

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _recorded_handshake() -> list[tuple[torch.dtype, Any]] | None:
    """The (dtype, peer) of each op torch's handshake builder makes for a middle
    stage whose next stage is on the same rank (V-schedule); None without a handshake."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    fn = getattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", None)
    if fn is None:
        return None

    class _Recorder(_RecordedP2POp):
        recorded = []

    fake_dist = types.SimpleNamespace(P2POp=_Recorder, isend="isend", irecv="irecv")
    _with_dist(fn, fake_dist)(_ProbeStage())
    if not _Recorder.recorded:
        raise RuntimeError(
            "_get_init_p2p_neighbors_ops built no P2P ops for a middle stage"
        )
    return _Recorder.recorded


def _probe_init_p2p_handshake() -> tuple[str, str]:
    """Run torch's handshake builder, with a recording ``P2POp``, for a middle
    stage whose next stage is on the same rank (V-schedule)."""

    recorded = _recorded_handshake()
    if recorded is None:
        return AlreadyUpstream, "not applicable: torch has no stage-init P2P handshake"
    stage = _ProbeStage()
    problems = []
    dtypes = {dtype for dtype, _ in recorded}
    if len(dtypes) > 1:
        problems.append(f"mixes {sorted(str(d) for d in dtypes)}")
    if any(peer == stage.group_rank for _, peer in recorded):
        problems.append("sends to its own rank")
    if not problems:
        return (
            AlreadyUpstream,
            "handshake uses one dtype and skips same-rank neighbours",
        )
    return PatchNeeded, f"stage init handshake {' and '.join(problems)}; gloo aborts"


# --- _grad_scaling.py ---


def _probe_scale_grads() -> tuple[str, str]:
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    _expect_params(
        _PipelineStageBase.scale_grads,
        "_PipelineStageBase.scale_grads",
        ["self", "grad_scale_factor"],
    )
    bases = (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti)
    missing = [cls.__name__ for cls in bases if "step" not in vars(cls)]
    if missing:
        raise RuntimeError(f"no step() of their own: {', '.join(missing)}")
    reason = "scale_grads also divides the gradients carried over from earlier steps"
    return PatchNeeded, reason


def _probe_metadata_cleanup() -> tuple[str, str]:
    from torch.distributed.pipelining.stage import PipelineStage

    cleanup = getattr(PipelineStage, "_post_metadata_inference_cleanup", None)
    if cleanup is None:
        return AlreadyUpstream, "no metadata-inference cleanup"
    if ".grad = None" not in inspect.getsource(cleanup):
        return AlreadyUpstream, "the metadata-inference cleanup keeps gradients"
    return PatchNeeded, "the metadata-inference cleanup clears FSDP gradients"


# --- _schedule_runtime.py ---


def _probe_action_functions() -> tuple[str, str]:
    """Probe of ``runtime_action_functions``: the step loop (torch's, or ours on 2.9) must dispatch the map."""
    from torch_pipelining_ext import _schedule_runtime  # local: see _table.py

    runtime = _schedules._PipelineScheduleRuntime
    if not callable(getattr(runtime, "register_custom_function", None)):
        raise AttributeError(
            "_PipelineScheduleRuntime.register_custom_function is missing"
        )
    loop = inspect.unwrap(runtime._step_microbatches)
    if _schedule_runtime._FUNCTION_MAP not in inspect.getsource(loop):
        raise RuntimeError(
            "_PipelineScheduleRuntime._step_microbatches does not look up custom functions"
        )
    # the send waits run by the package need torch's tracker of pending sends
    if hasattr(_schedules._ComputationType, "WAIT_SEND_F"):
        from torch.distributed.pipelining import stage

        for owner, name in (
            (_schedules, "_PendingSendTracker"),
            (stage._PipelineStageBase, "release_fwd_send_outputs"),
        ):
            if not hasattr(owner, name):
                raise AttributeError(f"torch has WAIT_SEND_F but no {name}")
    return (
        PatchNeeded,
        "the step loop runs its own nested _perform_action: a subclass's perform_action sees no action",
    )


def _probe_custom_functions() -> tuple[str, str]:

    runtime = _schedules._PipelineScheduleRuntime
    if hasattr(runtime, "register_custom_function"):
        return (
            AlreadyUpstream,
            "_PipelineScheduleRuntime.register_custom_function exists",
        )
    for name in ("_step_microbatches", "_prepare_schedule_with_comms"):
        if not hasattr(runtime, name):
            raise RuntimeError(f"_PipelineScheduleRuntime has no {name}")
    return (
        PatchNeeded,
        "no register_custom_function on _PipelineScheduleRuntime",
    )


def _probe_public_names() -> tuple[str, str]:
    """Probe of ``runtime_public_names``: ``PipelineContext`` and ``PipelineAction`` as upstream patch 0011 adds them."""
    import dataclasses

    context = getattr(_schedules, "PipelineContext", None)
    action = getattr(_schedules, "PipelineAction", None)
    if context is None and action is None:
        if not hasattr(_schedules, "_Action"):
            raise AttributeError("schedules has no _Action")
        return PatchNeeded, "schedules has no PipelineContext / PipelineAction"
    fields = {f.name for f in dataclasses.fields(context)} if context else set()
    if (
        context is getattr(_schedules, "_PipelineContext", None)
        and action is _schedules._Action
        and {"return_outputs", "loss_kwargs"} <= fields
        and {"PipelineContext", "PipelineAction"} <= set(_schedules.__all__)
    ):
        return AlreadyUpstream, "schedules has PipelineContext and PipelineAction"
    raise RuntimeError(
        "schedules has PipelineContext or PipelineAction, but not as upstream "
        "patch 0011 adds them"
    )


def _probe_step_loop() -> tuple[str, str]:
    from torch_pipelining_ext import _compat_29  # local: see _table.py

    runtime = _schedules._PipelineScheduleRuntime
    upstream_register = getattr(
        runtime, "register_custom_function", _compat_29.register_custom_function
    )
    if (
        upstream_register is not _compat_29.register_custom_function
    ):  # not the one installed from this module
        return AlreadyUpstream, "torch's step loop dispatches custom functions"
    _expect_params(
        _schedules.PipelineScheduleMulti._initialize_stages,
        "PipelineScheduleMulti._initialize_stages",
        ["self", "args", "kwargs"],
    )
    _expect_params(
        runtime._step_microbatches,
        "_PipelineScheduleRuntime._step_microbatches",
        ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses"],
    )
    return (
        PatchNeeded,
        "torch's step loop has no custom functions and scales grads only after FULL_BACKWARD",
    )


def _probe_overlap_lowering() -> tuple[str, str]:
    """Lower a one-rank, two-stage schedule with an OVERLAP_F_B; does it survive?"""

    A, F, B = _schedules._Action, _schedules.FORWARD, _schedules.FULL_BACKWARD
    overlap = A(-1, _schedules.OVERLAP_F_B, None, (A(0, F, 1), A(1, B, 0)))
    compute = {
        0: [
            A(0, F, 0),
            A(1, F, 0),
            overlap,
            A(1, F, 1),
            A(1, B, 1),
            A(0, B, 0),
            A(0, B, 1),
        ]
    }
    lowered = _schedules._add_send_recv(
        compute, stage_to_rank=lambda s: 0, num_stages=2
    )
    if any(a.computation_type == _schedules.OVERLAP_F_B for a in lowered[0]):
        return AlreadyUpstream, "_add_send_recv keeps OVERLAP_F_B"
    return PatchNeeded, "_add_send_recv flattens OVERLAP_F_B into its sub-actions"


def _probe_step_context() -> tuple[str, str]:

    loop = _schedules._PipelineScheduleRuntime._step_microbatches
    inspect.signature(loop).bind(None)  # raises if the loop needs other arguments
    return (
        PatchNeeded,
        "custom functions get a new context per call, without the step's options; errors do not name the rank",
    )


def _probe_compute_comms_reduce_grad() -> tuple[str, str]:
    """Does ``_prepare_schedule_with_comms`` add REDUCE_GRAD to compute_comms schedules?

    Reads the method's ``format == "compute_comms"`` branch: torch's lowering
    (``_add_reduce_grad``) runs only for compute-only schedules.
    """
    from torch_pipelining_ext import _pipeline_context  # local: see _table.py

    if _pipeline_context._reduce_grad_type() is None:
        return (
            AlreadyUpstream,
            "not applicable: torch has no REDUCE_GRAD action, the last backward reduces",
        )
    method = _schedules._PipelineScheduleRuntime._prepare_schedule_with_comms
    _expect_params(
        method,
        "_PipelineScheduleRuntime._prepare_schedule_with_comms",
        ["self", "actions", "format"],
    )
    branch = _compute_comms_branch(method)
    calls = {
        node.func.attr
        if isinstance(node.func, ast.Attribute)
        else getattr(node.func, "id", "")
        for node in ast.walk(ast.Module(body=branch, type_ignores=[]))
        if isinstance(node, ast.Call)
    }
    if any("reduce_grad" in name for name in calls):
        return AlreadyUpstream, "compute_comms schedules get REDUCE_GRAD"
    return (
        PatchNeeded,
        "a compute_comms schedule without REDUCE_GRAD never reduces or scales gradients",
    )


def _compute_comms_branch(method: Callable[..., Any]) -> list[ast.stmt]:
    """The body of ``if format == "compute_comms":`` in ``method``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            operands = [node.test.left, *node.test.comparators]
            names = {n.id for n in operands if isinstance(n, ast.Name)}
            consts = {n.value for n in operands if isinstance(n, ast.Constant)}
            if names == {"format"} and consts == {"compute_comms"}:
                return node.body
    raise RuntimeError(
        '_prepare_schedule_with_comms has no `if format == "compute_comms"` branch'
    )


# --- _split_backward.py ---


def _split_backward(
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    params: list[Parameter],
    extra_inputs: tuple[Any, ...] = (),
) -> tuple[torch.Tensor, ...]:
    """The weight gradients that torch's split backward computes for ``loss_of(x)``."""
    from torch.distributed.pipelining import _backward

    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    for p in params:
        p.grad = None
    _, groups = _backward.stage_backward_input(
        [loss_of(x)], None, [x, *extra_inputs], iter(params)
    )
    _backward.stage_backward_weight(iter(params), groups)
    return tuple(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)


def _reference(
    loss_of: Callable[[torch.Tensor], torch.Tensor], params: list[Parameter]
) -> tuple[torch.Tensor, ...]:
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    return torch.autograd.grad(loss_of(x), params)


def _param(*rows: list[float]) -> Parameter:
    return Parameter(torch.tensor(rows, dtype=torch.float64))


class _TwoOutputs(torch.autograd.Function):
    """``(x @ w, 2 * x @ w)``: one autograd node with two outputs of one shape."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x, w)
        y = x @ w
        return y, 2 * y

    @staticmethod
    def backward(
        ctx: Any, g0: torch.Tensor, g1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        g = g0 + 2 * g1
        return g @ w.T, x.T @ g


def _weight_grad_cases() -> dict[
    str, tuple[Callable[[torch.Tensor], torch.Tensor], list[Parameter]]
]:
    w = _param([0.4, -0.2, 0.1], [0.7, 0.3, -0.5], [0.2, 0.6, 0.9])
    w1 = _param([0.3, -0.8, 0.5], [0.1, 0.4, -0.6], [0.9, 0.2, 0.7])
    v = _param([0.5, -0.3, 0.2], [0.8, 0.1, -0.4], [-0.6, 0.7, 0.3])

    def two_outputs(x: torch.Tensor) -> torch.Tensor:
        a, b = _TwoOutputs.apply(torch.tanh(x), w1)
        return (a @ v).sum() + (b * b).sum()

    return {
        "a parameter used twice on one path": (lambda x: (x @ w @ w).sum(), [w]),
        "an intermediate with two outputs": (two_outputs, [w1, v]),
    }


def _probe_stage_backward_weight() -> tuple[str, str]:
    """Does torch's split backward give autograd's weight gradients in the failing cases?"""

    wrong = []
    with torch.enable_grad():
        for case, (loss_of, params) in _weight_grad_cases().items():
            try:
                got = _split_backward(loss_of, params)
            except RuntimeError as e:
                wrong.append(f"{case} ({type(e).__name__})")
                continue
            if not all(
                torch.allclose(g, r)
                for g, r in zip(got, _reference(loss_of, params), strict=True)
            ):
                wrong.append(f"{case} (wrong gradient)")
    if wrong:
        return PatchNeeded, "stage_backward_weight is wrong for " + ", ".join(wrong)
    return (
        AlreadyUpstream,
        "stage_backward_weight is right for shared weights and multi-output intermediates",
    )


def _probe_stage_backward_input() -> tuple[str, str]:
    """Does torch's ``stage_backward_input`` accept a stage input that is not a tensor?"""

    w = _param([0.4, -0.2, 0.1], [0.7, 0.3, -0.5], [0.2, 0.6, 0.9])
    with torch.enable_grad():
        _split_backward(
            lambda x: (x @ w).sum(), [w]
        )  # raises where the internals changed: patch skipped
        try:
            _split_backward(lambda x: (x @ w).sum(), [w], extra_inputs=(object(),))
        except (AttributeError, TypeError) as e:
            return (
                PatchNeeded,
                f"stage_backward_input raises on a non-tensor stage input ({type(e).__name__}: {e})",
            )
    return AlreadyUpstream, "stage_backward_input skips non-tensor stage inputs"


# --- overlap/_handler.py ---


def _probe_overlap() -> tuple[str, str]:
    """Feature probe of the ``overlap_f_b`` patch; raises on unrecognised internals."""

    s = _schedules
    runtime = s._PipelineScheduleRuntime
    for name in (
        "OVERLAP_F_B",
        "FORWARD",
        "FULL_BACKWARD",
        "BACKWARD_INPUT",
        "BACKWARD_WEIGHT",
    ):
        getattr(s, name)
    if not callable(getattr(runtime, "register_custom_function", None)):
        raise AttributeError(
            "_PipelineScheduleRuntime.register_custom_function is missing"
        )
    fork_rng_params = inspect.signature(torch.random.fork_rng).parameters
    for name in ("devices", "enabled", "device_type"):
        if name not in fork_rng_params:
            raise AttributeError(f"torch.random.fork_rng has no {name!r} parameter")
    return PatchNeeded, "torch runs OVERLAP_F_B's sub-actions one after the other"


# --- stage_split.py ---


def _upstream_probe() -> tuple[str, str]:
    """Feature probe for the ``stage_split`` patch."""
    import importlib.util

    import torch.distributed.pipelining as pipelining

    if not hasattr(pipelining, "PipelineStage"):
        raise RuntimeError("torch.distributed.pipelining has no PipelineStage")
    for attr in ("stage_split", "build_stage_module"):
        if hasattr(pipelining, attr):
            return AlreadyUpstream, f"torch.distributed.pipelining.{attr} exists"
    if importlib.util.find_spec("torch.distributed.pipelining.stage_split") is not None:
        return AlreadyUpstream, "torch.distributed.pipelining.stage_split is importable"
    return PatchNeeded, "torch.distributed.pipelining has no stage_split module"


# --- _checkpoint.py ---


def _probe_checkpoint_split_backward() -> tuple[str, str]:
    """Does a selectively checkpointed region survive torch's split backward?"""
    import functools

    from torch.utils import checkpoint

    caching, cached = checkpoint.create_selective_checkpoint_contexts(
        [torch.ops.aten.mm.default]
    )
    if not isinstance(cached, checkpoint._CachedTorchDispatchMode) or (
        getattr(cached, "storage", None) is not getattr(caching, "storage", ())
    ):
        raise RuntimeError("unrecognised create_selective_checkpoint_contexts")
    # two weights, each used once: a weight used twice on one path meets
    # another bug of torch's weight pass (split_backward_weight's probe)
    w1 = _param([0.4, -0.2, 0.1], [0.7, 0.3, -0.5], [0.2, 0.6, 0.9])
    w2 = _param([0.3, -0.8, 0.5], [0.1, 0.4, -0.6], [0.9, 0.2, 0.7])
    context_fn = functools.partial(
        checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        y = checkpoint.checkpoint(
            lambda x: torch.tanh(x @ w1) @ w2,
            x,
            use_reentrant=False,
            context_fn=context_fn,
        )
        return y.sum()

    with torch.enable_grad():
        try:
            grads = _split_backward(loss_of, [w1, w2])
        except RuntimeError as e:
            if "backward an extra time" not in str(e):
                raise  # unrecognised: the patch is skipped
            return (
                PatchNeeded,
                "selective checkpointing raises under a split backward "
                "(the second recompute of a region finds its cache consumed)",
            )
        if not _all_close(grads, _reference(loss_of, [w1, w2])):
            return (
                PatchNeeded,
                "selective checkpointing gives wrong gradients under a split backward",
            )
    return AlreadyUpstream, "selective checkpointing recomputes a region twice"


def _all_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    """Every tensor of ``got`` close to its twin in ``want`` (float64 probes)."""
    return len(got) == len(want) and all(
        torch.allclose(g, w, rtol=1e-7, atol=1e-7) for g, w in zip(got, want)
    )


def _probe_weight_pass_recompute() -> tuple[str, str]:
    """Does torch's weight pass recompute a checkpointed region once, whatever its parameter groups?"""
    from torch.utils import checkpoint

    if not hasattr(checkpoint, "GraphExecGroup"):
        return (
            NotSupported,
            "torch.utils.checkpoint has no GraphExecGroup (an older torch): the weight "
            "pass recomputes a checkpointed region once per parameter group",
        )
    w1 = _param([0.4, -0.2, 0.1], [0.7, 0.3, -0.5], [0.2, 0.6, 0.9])
    w2 = _param([0.3, -0.8, 0.5], [0.1, 0.4, -0.6], [0.9, 0.2, 0.7])
    runs: list[None] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        runs.append(None)
        return torch.tanh(x @ w1) @ w2

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return checkpoint.checkpoint(region, x, use_reentrant=False).sum()

    with torch.enable_grad():
        _split_backward(loss_of, [w1, w2])
    weight_pass = len(runs) - 2  # less the forward and the input pass's recompute
    if weight_pass > 1:
        return (
            PatchNeeded,
            f"the weight pass recomputes a checkpointed region {weight_pass} times, "
            "once per parameter group",
        )
    return AlreadyUpstream, "the weight pass recomputes a checkpointed region once"
