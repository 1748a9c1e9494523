"""``python -m torch_pipelining_ext.train``: see :mod:`torch_pipelining_ext.train`."""

import sys

from torch_pipelining_ext.train import main


if __name__ == "__main__":
    sys.exit(main())
