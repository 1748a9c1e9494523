"""``python -m torch_pipelining_ext.plan``: the planner of :mod:`torch_pipelining_ext.sim.plan`.

Imported, this module is :mod:`torch_pipelining_ext.sim.plan` itself.
"""

import sys

from torch_pipelining_ext.sim import plan as _plan


if __name__ == "__main__":
    sys.exit(_plan.main())
sys.modules[__name__] = _plan
