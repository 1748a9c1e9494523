"""Deprecated former name of :mod:`torch_pipelining_ext.overlap`.

``import torch_pipelining_ext.ep_overlap`` warns (``DeprecationWarning``) and
gives the very module :mod:`torch_pipelining_ext.overlap` (one module object,
one state).  Import :mod:`torch_pipelining_ext.overlap` instead.
"""

import sys
import warnings

from torch_pipelining_ext import overlap as _overlap


warnings.warn(
    "torch_pipelining_ext.ep_overlap is deprecated and will be removed: "
    "import torch_pipelining_ext.overlap (the same module)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _overlap
