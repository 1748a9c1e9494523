"""Deprecated former name of :mod:`torch_pipelining_ext.sim`.

``import torch_pipelining_ext.simulate`` warns (``DeprecationWarning``) and
gives the very module :mod:`torch_pipelining_ext.sim`.  Import
:mod:`torch_pipelining_ext.sim` instead.
"""

import sys
import warnings

from torch_pipelining_ext import sim as _sim


warnings.warn(
    "torch_pipelining_ext.simulate is deprecated and will be removed: "
    "import torch_pipelining_ext.sim (the same module)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _sim
