"""A GPU and its network as the cost model sees them, and presets of common ones."""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Mapping

from torch_pipelining_ext.sim._inputs import check_number


__all__ = ["HARDWARE_PRESETS", "Hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A GPU and its network, as the cost model sees them.  Every field may be overridden.

    Args:
        name: for messages.
        bf16_tflops: dense bf16 tensor-core peak (TFLOP/s, datasheet, no sparsity).
        achieved_fraction: fraction of the peak a training step's matmuls reach.
        hbm_bytes: device memory.
        intra_node_a2a_gbps: all-to-all bandwidth per GPU inside a node (GB/s, one direction).
        inter_node_a2a_gbps: all-to-all bandwidth per GPU across nodes (GB/s, one direction).
        gpus_per_node: GPUs sharing the intra-node fabric.
        p2p_latency: pipeline send/recv latency (s).
        a2a_latency: fixed cost of one all-to-all (s).
        fp8_tflops: dense FP8 tensor-core peak (TFLOP/s, datasheet; 0: no FP8).
    """

    name: str
    bf16_tflops: float
    achieved_fraction: float
    hbm_bytes: float
    intra_node_a2a_gbps: float
    inter_node_a2a_gbps: float
    gpus_per_node: int = 8
    p2p_latency: float = 20e-6
    a2a_latency: float = 30e-6
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (0: none)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"Hardware.name must be a str, got {self.name!r}")
        for name in (
            "bf16_tflops",
            "achieved_fraction",
            "hbm_bytes",
            "intra_node_a2a_gbps",
            "inter_node_a2a_gbps",
        ):
            check_number(f"Hardware.{name}", getattr(self, name), positive=True)
        if self.achieved_fraction > 1:
            raise ValueError(
                f"Hardware.achieved_fraction must be in (0, 1], got {self.achieved_fraction!r}"
            )
        check_number(
            "Hardware.gpus_per_node", self.gpus_per_node, positive=True, integer=True
        )
        check_number("Hardware.p2p_latency", self.p2p_latency)
        check_number("Hardware.a2a_latency", self.a2a_latency)
        check_number("Hardware.fp8_tflops", self.fp8_tflops)

    def with_overrides(self, **overrides: Any) -> Hardware:
        """A copy with the fields in ``overrides`` replaced."""
        return dataclasses.replace(self, **overrides)


# [Note: hardware presets]
# Datasheet numbers (dense bf16 without sparsity, HBM capacity, NVLink per-GPU
# one-direction bandwidth = half of the bidirectional figure, one 400 Gb/s NIC
# per GPU = 50 GB/s for H100/H200, 800 Gb/s = 100 GB/s for B200).  H800 is the
# export H100 with NVLink cut to 400 GB/s bidirectional (200 GB/s one way);
# the DeepSeek-V3 report uses 400 Gb/s InfiniBand per GPU on it.  Dense FP8 is
# twice dense bf16.  The achieved fraction of H100, H200 and B200 (0.4) is a
# typical MFU of large MoE training, not a measured value; override it with
# your own.  H800's (0.31) is calibrated on one public trace, DeepSeek's
# profile of a DualPipe chunk pair of DeepSeek-V3 with FP8 GEMMs
# (``tools/calibrate_trace.py --fit``: the fraction that makes the predicted
# attention and MLP compute equal the measured kernel time; docs/simulator.md
# has the table).  That run's matmuls are FP8; the same fraction is assumed
# for bf16.
HARDWARE_PRESETS: Mapping[str, Hardware] = {
    "H100": Hardware("H100", 989.0, 0.4, 80e9, 450.0, 50.0, fp8_tflops=1979.0),
    "H800": Hardware("H800", 989.0, 0.31, 80e9, 200.0, 50.0, fp8_tflops=1979.0),
    "H200": Hardware("H200", 989.0, 0.4, 141e9, 450.0, 50.0, fp8_tflops=1979.0),
    "B200": Hardware("B200", 2250.0, 0.4, 180e9, 900.0, 100.0, fp8_tflops=4500.0),
}
