"""The patch machinery: the registry (``_registry.py``) and the patch table (``_table.py``).

Feature modules never import this package; the table imports them.
"""

from torch_pipelining_ext._patching._registry import (
    _PatchRegistry,
    AlreadyUpstream,
    Patch,
    PatchNeeded,
    PatchRecord,
    PatchStatus,
    Target,
)


__all__ = [
    "AlreadyUpstream",
    "Patch",
    "PatchNeeded",
    "PatchRecord",
    "PatchStatus",
    "Target",
    "_PatchRegistry",
]
