"""What the stages of a Hugging Face MoE record of its routing.

Private helper of :mod:`torch_pipelining_ext.hf`; see ``[Note: HF routing
records]``.  The auxiliary losses (``_router_aux.py``) and the expert-load
statistics (``_expert_load.py``) are built on these records.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

import torch
import torch.nn as nn


if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__: list[str] = []

# [Note: HF routing records]
# A transformers 5.x MoE layer calls its router (a module whose output holds
# the router logits, the class transformers' own OutputRecorder names for
# ``router_logits``) and then its fused experts module with
# ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, the
# tokens flattened in (batch, position) order.  A forward hook on the router
# and a forward pre-hook on the experts copy the logits (with their autograd
# graph) and the top-k indices (what the experts really compute, whatever
# the routing rule: softmax top-k, DeepSeek-V3's group-limited top-k of
# sigmoid scores plus ``e_score_correction_bias``) into a recorder of the
# thread that runs the stage forward, one layer call at a time.  Outside that
# call the recorder is off, so an activation-checkpointing recomputation (in
# backward) and the other side of an overlapped OVERLAP_F_B (another thread)
# record nothing, and every layer is counted once per microbatch.

# Router score functions of the families whose routing the auxiliary losses
# know: softmax for those with transformers' load_balancing_loss_func (checked
# by the presence of that function), sigmoid for DeepSeek-V3-style routers.
_SIGMOID_ROUTERS = frozenset({"deepseek_v3", "glm4_moe"})


@dataclass(frozen=True)
class Routing:
    """How one model routes: the router class and the index of the logits in
    its output (``None`` where transformers records no router logits), the
    number of routed experts ``E``, ``top_k``, the score function
    (``"softmax"``, ``"sigmoid"`` or ``None`` when not known) and whether
    transformers has ``load_balancing_loss_func`` for it."""

    router_cls: type | None
    logits_index: int
    num_experts: int
    top_k: int
    score: str | None
    has_balancing_loss: bool


@dataclass
class LayerRecord:
    """What one MoE layer's call recorded: the router logits ``[T, E]`` (with
    their graph) and the experts' top-k indices ``[T, k]``."""

    logits: torch.Tensor | None = None
    indices: torch.Tensor | None = None


class _Recorder(threading.local):
    record: LayerRecord | None = None


_recorder = _Recorder()


_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def fused_experts_problem(module: nn.Module, hidden_size: int) -> str | None:
    """Why ``module`` (named ``experts``) is not a fused experts module this
    expert parallelism can shard, or ``None`` if it is."""
    params = dict(module.named_parameters())
    if set(params) != {"gate_up_proj", "down_proj"}:
        return f"parameters {sorted(params)}, expected exactly gate_up_proj and down_proj (no biases)"
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if (
        gate_up.dim() != 3
        or down.dim() != 3
        or gate_up.shape[2] != hidden_size
        or down.shape[1] != hidden_size
    ):
        return f"gate_up_proj {list(gate_up.shape)} / down_proj {list(down.shape)} are not [E, 2I, H] / [E, H, I]"
    if gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2]:
        return f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} do not match"
    names = tuple(inspect.signature(type(module).forward).parameters)[1:4]
    if names != _FORWARD_ARGS:
        return f"its forward takes {names}, expected {_FORWARD_ARGS}"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    return None


def experts_modules(module: nn.Module) -> list[nn.Module]:
    """The fused experts modules under ``module``: named ``experts``, one
    module with 3-D ``gate_up_proj`` whose forward takes the tokens, their
    top-k indices and weights."""
    found = []
    for name, m in module.named_modules():
        if name.rsplit(".", 1)[-1] != "experts" or isinstance(m, nn.ModuleList):
            continue
        gate_up = getattr(m, "gate_up_proj", None)
        if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:
            if len(inspect.signature(type(m).forward).parameters) >= 4:
                found.append(m)
    return found


def model_routing(model: PreTrainedModel, layers_prefix: str) -> Routing | None:
    """The routing of ``model``, ``None`` if no layer has fused experts (a
    dense model, or a MoE of transformers 4.x)."""
    config = model.config
    experts = experts_modules(model.get_submodule(layers_prefix))
    if not experts:
        return None
    base = model.get_submodule(model.base_model_prefix)
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    modeling = sys.modules[type(model).__module__]
    has_loss = hasattr(modeling, "load_balancing_loss_func")
    model_type = getattr(config, "model_type", None)
    score = "sigmoid" if model_type in _SIGMOID_ROUTERS else None
    if score is None and has_loss:
        score = "softmax"
    gate_up = experts[0].gate_up_proj
    assert isinstance(gate_up, torch.Tensor)  # what experts_modules found
    return Routing(
        router_cls=getattr(recorder, "target_class", None),
        logits_index=getattr(recorder, "index", 0),
        num_experts=gate_up.shape[0],
        top_k=config.num_experts_per_tok,
        score=score,
        has_balancing_loss=has_loss,
    )


def install_hooks(part: nn.Module, routing: Routing) -> None:
    """Record the router logits and the experts' top-k indices of ``part``
    into the recorder of the thread running its forward."""

    def logits(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        record = _recorder.record
        if record is not None:
            record.logits = _only_one(record.logits, output[routing.logits_index])

    def indices(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        record = _recorder.record
        if record is not None:
            if len(args) > 1:
                top_k = args[1]
            else:  # the forward's second parameter, by name
                top_k = kwargs[tuple(inspect.signature(module.forward).parameters)[1]]
            record.indices = _only_one(record.indices, top_k)

    if routing.router_cls is not None:
        for m in part.modules():
            if isinstance(m, routing.router_cls):
                m.register_forward_hook(logits)
    for m in experts_modules(part):
        m.register_forward_pre_hook(indices, with_kwargs=True)


def _only_one(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    if old is not None:
        raise RuntimeError(
            "a decoder layer called its router or experts twice in one forward; the routing records "
            "(auxiliary loss, expert load) expect one call per MoE layer"
        )
    return new


def record_layer(call: Callable[[], Any]) -> tuple[Any, LayerRecord]:
    """Run ``call()`` (one layer) recording its routing on this thread."""
    record = LayerRecord()
    _recorder.record = record
    try:
        out = call()
    finally:
        _recorder.record = None
    return out, record
