"""The dispatcher's operators of one namespace, as overloads (what ``_collectives`` and ``_draws`` look through)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


__all__: list[str] = []


def operators(namespace: str) -> Iterator[tuple[str, str, Any]]:
    """``(name with overload, base name, OpOverload)`` of every registered ``namespace::`` operator, sorted."""
    ops = getattr(torch.ops, namespace)
    for qualname in sorted(torch._C._dispatch_get_all_op_names()):
        prefix, _, name = qualname.partition("::")
        if prefix != namespace:
            continue
        base, _, overload = name.partition(".")
        packet = getattr(ops, base, None)
        op = getattr(packet, overload or "default", None) if packet else None
        if op is not None:
            yield name, base, op
