"""Moved to :mod:`torch_pipelining_ext.train.timeline` (the trainer's
``--compare-sequential --trace``); the former names stay importable here."""

from torch_pipelining_ext.train.timeline import (
    EP_COMM_RANGE,
    phases_from_chrome_trace,
    plot_timeline,
    SUB_ACTION_RANGE,
)


__all__ = ["phases_from_chrome_trace", "plot_timeline"]

# the former private names of the two range patterns
_EP_COMM = EP_COMM_RANGE
_SUB_ACTION = SUB_ACTION_RANGE
