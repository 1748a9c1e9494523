"""Toy models shared by the pipelining tests (mirrors upstream's ``model_registry.py``).

Sections are grouped by the feature that introduced them; every model is small
enough for four gloo ranks on two CPU cores.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class MLPStage(nn.Module):
    """A stack of Linear+ReLU blocks; the unit pipeline stage used by schedule tests."""

    def __init__(self, d_hid: int, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d_hid, d_hid) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x
