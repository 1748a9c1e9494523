"""The former name of :mod:`torch_pipelining_ext.overlap`, kept importable.

``import torch_pipelining_ext.ep_overlap`` gives the very module
:mod:`torch_pipelining_ext.overlap` (one module object, one state).
"""

import sys

from torch_pipelining_ext import overlap as _overlap


sys.modules[__name__] = _overlap
