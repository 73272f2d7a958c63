"""Peak FLOPS by device and compute dtype, and model FLOPs utilization.

Dense (no sparsity) tensor-core peaks from the vendors' data sheets, in TFLOPS. ``fp32`` is plain
FP32 (PyTorch's default matmul precision does not use TF32). The longest matching name wins, so
"H100 PCIe" is not taken for "H100".
"""

from __future__ import annotations

from typing import Optional

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def lookup_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """Peak TFLOPS for a device name as CUDA reports it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    matches = [key for key in PEAK_TFLOPS if key.lower() in device_name.lower()]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(dtype)


def mfu(tflops_achieved: float, peak_tflops: Optional[float]) -> Optional[float]:
    return tflops_achieved / peak_tflops if peak_tflops else None
