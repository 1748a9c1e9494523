"""``python -m torch_pipelining_ext.demo``: see :mod:`torch_pipelining_ext.demo.train`."""

import sys

from torch_pipelining_ext.demo.train import main


if __name__ == "__main__":
    sys.exit(main())
