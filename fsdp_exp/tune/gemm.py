"""The linear layers' matmuls timed by shape on a GPU (``DevicePerf.kernels``): what the step-time model's
kernel classes (``fsdp_exp.tune.perf.kernel_seconds``) and float8's converted matmuls
(``fsdp_exp.tune.float8_perf``) both read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.plan.devices import DevicePerf


def gemm_seconds(gemms: tuple, perf: "DevicePerf", rate: float, operand_bytes: int, output_bytes: int) -> float:
    """Linear-layer matmuls: each at the large-shape rate less its shape's penalty (a smallest dimension of
    ``gemm_half_dim`` halves it: short matmuls fill fewer of the SMs' tiles), and never faster than moving its
    operands once through the device's memory (the roofline)."""
    bandwidth = perf.memory_gbps * 1e9 * perf.memory_efficiency
    total = 0.0
    for m, k, n, flops in gemms:
        calls = flops / (2 * m * k * n)
        compute = flops / rate * (1 + perf.gemm_half_dim / min(m, k, n))
        total += max(compute, calls * (operand_bytes * (m * k + k * n) + output_bytes * m * n) / bandwidth)
    return total
