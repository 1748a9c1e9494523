# mypy: allow-untyped-defs
"""Which tensors a module holds, and where.

Private helper of :mod:`torch_pipelining_ext.hf`: the places that hold each
parameter or buffer (so that a tensor tied in several modules is replaced in
all of them at once), the groups of names of tied parameters and the keys of
a full state dict.
"""

from __future__ import annotations

import torch
import torch.nn as nn


__all__: list[str] = []

# (module, "_parameters" or "_buffers", attribute, FQN)
Place = tuple[nn.Module, str, str, str]
TiedGroup = tuple[tuple[str, ...], torch.Size, torch.dtype]


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


def tied_groups(model: nn.Module) -> list[TiedGroup]:
    """The FQN groups of parameters that are one tensor, with its shape and dtype."""
    by_id: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    return [(tuple(names), tensors[i].shape, tensors[i].dtype) for i, names in by_id.items() if len(names) > 1]


def state_keys(model: nn.Module) -> frozenset[str]:
    """The keys of ``model.state_dict()`` with tied names repeated (persistent
    buffers included, non-persistent ones left out)."""
    keys = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                keys.add(f"{mod_name}.{b_name}" if mod_name else b_name)
    return frozenset(keys)
