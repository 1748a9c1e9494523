"""``python -m torch_pipelining_ext.plan``: the planner of :mod:`torch_pipelining_ext.sim.plan`.

Imported, this module is :mod:`torch_pipelining_ext.sim.plan` itself.
"""

import sys

from torch_pipelining_ext.sim import plan as _plan


if __name__ == "__main__":
    _plan.main()  # exits 2 on bad arguments
sys.modules[__name__] = _plan
