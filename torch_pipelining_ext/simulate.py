"""The former name of :mod:`torch_pipelining_ext.sim`, kept importable.

``import torch_pipelining_ext.simulate`` gives the very module
:mod:`torch_pipelining_ext.sim`.
"""

import sys

from torch_pipelining_ext import sim as _sim


sys.modules[__name__] = _sim
