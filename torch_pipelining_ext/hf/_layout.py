"""Where the parts of a Hugging Face decoder-only causal LM live.

Private helper of :mod:`torch_pipelining_ext.hf`.  A causal LM is read as
``<base>.<embed>`` (plus, for learned positions, ``<base>.<pos_embed>`` and an
embedding dropout), the layer list ``<base>.<layers>``, the final norm
``<base>.<norm>``, the head ``<head>`` and an optional parameter-free rotary
embedding ``<base>.<rotary>`` that every stage with layers needs.

The layout comes from transformers' own pipeline plans where the model
declares them (``config.base_model_pp_plan`` for the base model,
``_pp_plan`` for the head); otherwise it is detected from the module tree
(GPT-2 style: ``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn


if TYPE_CHECKING:
    from transformers import PretrainedConfig


__all__: list[str] = []

logger = logging.getLogger(__name__)

# Model types whose stage forwards were compared with the unsplit model
# (test/distributed/pipelining/test_hf_stages.py) on transformers 4.57 and 5.x.
# Others are compared on a tiny config of their type before stages are built.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "deepseek_v3",
        "gemma2",
        "gemma3_text",
        "glm4_moe",
        "gpt2",
        "gpt_oss",
        "llama",
        "mistral",
        "mixtral",
        "olmo2",
        "olmoe",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
    }
)


@dataclass(frozen=True)
class DecoderLayout:
    """Names of the parts of a decoder-only causal LM.

    ``base`` and ``head`` are children of the causal LM; every other name is
    a child of the base model.
    """

    base: str
    embed: str
    layers: str
    norm: str
    head: str
    num_layers: int
    pos_embed: str | None = None
    embed_dropout: str | None = None
    rotaries: tuple[str, ...] = ()  # Gemma3 on 4.57 has a global and a local one
    source: str = "pp_plan"  # or "detected"

    def fqn(self, name: str) -> str:
        return f"{self.base}.{name}"

    @property
    def layers_prefix(self) -> str:
        return self.fqn(self.layers)

    @property
    def input_modules(self) -> list[str]:
        return [
            self.fqn(n)
            for n in (self.embed, self.pos_embed, self.embed_dropout)
            if n is not None
        ]

    @property
    def output_modules(self) -> list[str]:
        return [self.fqn(self.norm), self.head]

    @property
    def replicated_modules(self) -> list[str]:
        return [self.fqn(r) for r in self.rotaries]


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _child_name(parent: nn.Module, child: nn.Module | None) -> str | None:
    if child is None:
        return None
    for name, m in parent._modules.items():
        if m is child:
            return name
    return None


def _is_rotary(name: str, module: nn.Module) -> bool:
    return not _owns_parameters(module) and (
        "rotary" in name.lower() or "inv_freq" in module._buffers
    )


def _rotary_or_refused(
    model: nn.Module, name: str, module: nn.Module, problem: str
) -> bool:
    """Whether a module outside the embedding, layers and norm is a rotary
    embedding (replicated into every stage); any other such module that holds
    parameters would be lost by the split, so it is refused with ``problem``."""
    if _is_rotary(name, module):
        return True
    if _owns_parameters(module):
        raise _unsupported(model, problem)
    return False


def _unsupported(model: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"cannot build pipeline stages from {type(model).__name__}: {what}. Supported are decoder-only causal LMs "
        "laid out as <base model>.<token embedding>, <base model>.<layer list>, <base model>.<final norm>, "
        "<lm head> (declared by config.base_model_pp_plan / _pp_plan, or detected)"
    )


def _num_layers(model: nn.Module, config: PretrainedConfig) -> int:
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise _unsupported(model, "its config has no integer num_hidden_layers")
    return n


def _base_model(model: nn.Module) -> tuple[str, nn.Module]:
    prefix = getattr(model, "base_model_prefix", None)
    name = prefix if isinstance(prefix, str) and prefix else None
    base = model._modules.get(name) if name else None
    if base is None:
        # a prefix that names no child (Gemma3ForCausalLM on 4.57): the one child that is a
        # PreTrainedModel is the base model
        from transformers import PreTrainedModel

        found = [
            (n, m) for n, m in model._modules.items() if isinstance(m, PreTrainedModel)
        ]
        if len(found) == 1:
            return found[0]
    if name is None or base is None:
        raise _unsupported(
            model,
            f"it has no base model submodule (base_model_prefix is {prefix!r}, children {list(model._modules)})",
        )
    return name, base


def _head_name(model: nn.Module) -> str:
    plan = (
        getattr(model, "_pp_plan", None) or getattr(type(model), "_pp_plan", None) or {}
    )
    for name, (_, outputs) in plan.items():
        if list(outputs) == ["logits"] and isinstance(
            model._modules.get(name), nn.Module
        ):
            return name
    getter = getattr(model, "get_output_embeddings", None)
    name = _child_name(model, getter() if callable(getter) else None)
    if name is None:
        raise _unsupported(
            model,
            "no output head found (no '_pp_plan' entry producing logits, no output embeddings)",
        )
    return name


def _from_pp_plan(
    model: nn.Module,
    base_name: str,
    base: nn.Module,
    plan: Mapping[str, tuple[Sequence[str], Sequence[str]]],
) -> DecoderLayout:
    embed = layers = norm = None
    for name, (inputs, outputs) in plan.items():
        module = base._modules.get(name)
        if module is None:
            raise _unsupported(
                model,
                f"base_model_pp_plan names {name!r}, which {base_name!r} does not have",
            )
        if list(inputs) == ["input_ids"]:
            embed = name
        elif isinstance(module, nn.ModuleList):
            layers = name
        elif layers is not None:
            norm = name
    if embed is None or layers is None or norm is None:
        found = (
            ("token embedding", embed),
            ("layer list", layers),
            ("final norm", norm),
        )
        missing = [what for what, v in found if v is None]
        raise _unsupported(
            model, f"base_model_pp_plan {plan} has no {', no '.join(missing)}"
        )
    rotaries = []
    for name, module in base._modules.items():
        if name in plan or module is None:
            continue
        problem = (
            f"{base_name}.{name} holds parameters but is not in base_model_pp_plan"
        )
        if _rotary_or_refused(model, name, module, problem):
            rotaries.append(name)
    return DecoderLayout(
        base=base_name,
        embed=embed,
        layers=layers,
        norm=norm,
        head=_head_name(model),
        num_layers=_num_layers(model, model.config),
        rotaries=tuple(rotaries),
        source="pp_plan",
    )


def _detected(model: nn.Module, base_name: str, base: nn.Module) -> DecoderLayout:
    config = model.config
    num_layers = _num_layers(model, config)
    getter = getattr(model, "get_input_embeddings", None)
    embed = _child_name(base, getter() if callable(getter) else None)
    if embed is None:
        raise _unsupported(
            model, f"no token embedding found among the children of {base_name!r}"
        )
    lists = [
        n
        for n, m in base._modules.items()
        if isinstance(m, nn.ModuleList) and len(m) == num_layers
    ]
    if len(lists) != 1:
        raise _unsupported(
            model,
            f"expected one nn.ModuleList of {num_layers} layers in {base_name!r}, found {lists or 'none'}",
        )
    layers = lists[0]
    names = list(base._modules)
    before, after = names[: names.index(layers)], names[names.index(layers) + 1 :]
    pos_embed = dropout = None
    rotaries: list[str] = []
    norms: list[str] = []
    for name in before:
        module = base._modules[name]
        if name == embed or module is None:
            continue
        if isinstance(module, nn.Embedding):
            if pos_embed is not None:
                raise _unsupported(
                    model, f"two position embeddings {pos_embed!r} and {name!r}"
                )
            pos_embed = name
        elif isinstance(module, nn.Dropout):
            dropout = name
        elif _rotary_or_refused(
            model,
            name,
            module,
            f"{base_name}.{name} ({type(module).__name__}) before the layers is not understood",
        ):
            rotaries.append(name)
    for name in after:
        module = base._modules[name]
        if module is None:
            continue
        if _is_rotary(name, module):
            rotaries.append(name)
        elif _owns_parameters(module):
            norms.append(name)
    if len(norms) != 1:
        raise _unsupported(
            model,
            f"expected one final norm after {base_name}.{layers}, found {norms or 'none'}",
        )
    return DecoderLayout(
        base=base_name,
        embed=embed,
        layers=layers,
        norm=norms[0],
        head=_head_name(model),
        num_layers=num_layers,
        pos_embed=pos_embed,
        embed_dropout=dropout,
        rotaries=tuple(rotaries),
        source="detected",
    )


def detect_layout(model: nn.Module) -> DecoderLayout:
    """The :class:`DecoderLayout` of a Hugging Face causal LM, or a
    ``ValueError`` naming what is missing."""
    config = getattr(model, "config", None)
    if config is None:
        raise _unsupported(
            model, "it has no .config (not a transformers PreTrainedModel?)"
        )
    base_name, base = _base_model(model)
    plan = getattr(config, "base_model_pp_plan", None)
    layout = (
        _from_pp_plan(model, base_name, base, plan)
        if plan
        else _detected(model, base_name, base)
    )
    for name, module in model._modules.items():
        if (
            name not in (layout.base, layout.head)
            and module is not None
            and _owns_parameters(module)
        ):
            raise _unsupported(
                model,
                f"{name!r} holds parameters and is neither the base model nor the head",
            )
    if any(p is not None for p in model._parameters.values()):
        raise _unsupported(model, f"parameters on the root ({list(model._parameters)})")
    logger.debug("%s layout (%s): %s", type(model).__name__, layout.source, layout)
    return layout
