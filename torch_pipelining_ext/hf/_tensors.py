"""Which tensors a module holds, where, and replacing them.

Private helper of :mod:`torch_pipelining_ext.hf`: the places that hold each
parameter or buffer (so that a tensor tied in several modules is replaced in
all of them at once), and the materialisation of a meta stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn


if TYPE_CHECKING:
    from transformers import PreTrainedModel


__all__: list[str] = []

# (module, "_parameters" or "_buffers", attribute, FQN)
Place = tuple[nn.Module, str, str, str]


def tensor_slots(module: nn.Module) -> dict[int, tuple[torch.Tensor, list[Place]]]:
    """Every parameter and buffer of ``module`` (by identity) with the places
    that hold it."""
    slots: dict[int, tuple[torch.Tensor, list[Place]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(mod, table).items():
                if t is None:
                    continue
                fqn = f"{mod_name}.{key}" if mod_name else key
                slots.setdefault(id(t), (t, []))[1].append((mod, table, key, fqn))
    return slots


def replace(places: list[Place], new: torch.Tensor, old: torch.Tensor) -> None:
    """Put ``new`` in every place that held ``old`` (a parameter stays one)."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for mod, table, key, _ in places:
        getattr(mod, table)[key] = new


def init_weights(
    hf_part: PreTrainedModel, device: torch.device, dtype: torch.dtype | None
) -> None:
    """Materialise meta tensors of a split HF model on ``device`` and run the
    model's own ``_init_weights`` on every submodule."""
    for old, places in tensor_slots(hf_part).values():
        if old.is_meta:
            target = (
                dtype if dtype is not None and old.is_floating_point() else old.dtype
            )
            replace(places, torch.empty(old.shape, dtype=target, device=device), old)
        elif old.device != device:
            replace(places, old.to(device), old)
    with torch.no_grad():
        for module in hf_part.modules():
            hf_part._init_weights(module)


def state_keys(model: nn.Module) -> frozenset[str]:
    """The keys of ``model.state_dict()`` with tied names repeated (persistent
    buffers included, non-persistent ones left out)."""
    keys = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                keys.add(f"{mod_name}.{b_name}" if mod_name else b_name)
    return frozenset(keys)
