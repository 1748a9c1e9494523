"""Split a model into pipeline stages by module names (public API).

The implementation, written as it would land upstream, is
``torch_pipelining_ext._stage_split``: while the ``stage_split`` patch is
applied, ``torch.distributed.pipelining.stage_split`` is that module.  This
module hands on its names and keeps the package's deprecated ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch.nn as nn

from torch_pipelining_ext._stage_split import *  # noqa: F403
from torch_pipelining_ext._stage_split import __all__ as _upstream_names


# every name of the upstream module, and the deprecated one
__all__ = [*_upstream_names, "split_module"]  # noqa: PLE0604


def split_module(
    model: nn.Module, module_names: Sequence[str], *, move: bool = False
) -> nn.Module:
    """Deprecated name of :func:`build_stage_module`.

    It clashed with ``torch.fx.passes.split_module``.
    """
    warnings.warn(
        "stage_split.split_module is deprecated and will be removed: use "
        "stage_split.build_stage_module (same arguments)",
        FutureWarning,
        stacklevel=2,
    )
    return build_stage_module(model, module_names, move=move)
