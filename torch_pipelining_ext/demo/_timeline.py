"""Moved to :mod:`torch_pipelining_ext.train.timeline` (the trainer's
``--compare-sequential --trace``); the former names stay importable here."""

from torch_pipelining_ext.train.timeline import (
    phases_from_chrome_trace,
    plot_timeline,
)


__all__ = ["phases_from_chrome_trace", "plot_timeline"]
