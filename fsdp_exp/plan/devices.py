"""The devices a plan can be checked against, the allocator margin on each kind, and the verdict.

Usable bytes are roughly what ``torch.cuda.get_device_properties(...).total_memory`` reports for each
GPU (a little under the marketing size; ``torch.cuda.mem_get_info()`` tells the exact figure of a
given machine). ``cpu_host`` is this machine's RAM, shared by all its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 2**30

# Allocator margin on CUDA: the caching allocator reserves more than it hands out (fragmentation,
# rounding to blocks), and the CUDA context, NCCL and cuBLAS workspaces sit outside the allocator.
CUDA_MARGIN_FRACTION = 0.10
CUDA_FIXED_OVERHEAD = 1 * GIB


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # cuda | cpu
    bytes: int
    description: str


def _gib(x: float) -> int:
    return int(x * GIB)


DEVICES: dict[str, Device] = {
    "l4_24gb": Device("l4_24gb", "cuda", _gib(22.0), "NVIDIA L4 (24 GB)"),
    "a10g_24gb": Device("a10g_24gb", "cuda", _gib(22.0), "NVIDIA A10G (24 GB)"),
    "a100_40gb": Device("a100_40gb", "cuda", _gib(39.4), "NVIDIA A100 40GB"),
    "a100_80gb": Device("a100_80gb", "cuda", _gib(79.1), "NVIDIA A100 80GB"),
    "h100_80gb": Device("h100_80gb", "cuda", _gib(79.1), "NVIDIA H100 80GB"),
    "h200_141gb": Device("h200_141gb", "cuda", _gib(139.8), "NVIDIA H200 141GB"),
    "b200_192gb": Device("b200_192gb", "cuda", _gib(178.4), "NVIDIA B200 192GB"),
    "cpu_host": Device("cpu_host", "cpu", 0, "this machine's RAM (psutil), shared by its ranks"),
}


def device_table() -> dict[str, Device]:
    """``DEVICES`` with ``cpu_host`` filled in from this machine."""
    import psutil

    table = dict(DEVICES)
    table["cpu_host"] = Device("cpu_host", "cpu", psutil.virtual_memory().total, DEVICES["cpu_host"].description)
    return table


def local_cuda_device() -> Optional[Device]:
    """This machine's first GPU, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Device("cuda:0", "cuda", props.total_memory, props.name)


def allocator_margin(kind: str, peak: int, margin: Optional[float]) -> tuple[int, str]:
    """(bytes, the rule in words) added to the peak: ``plan.margin`` when given, else the kind's."""
    if margin is not None:
        return int(margin * peak), f"plan.margin={margin:g} of the peak"
    if kind == "cpu":
        return 0, "0 on a CPU (no caching allocator)"
    return (int(CUDA_MARGIN_FRACTION * peak) + CUDA_FIXED_OVERHEAD,
            f"{CUDA_MARGIN_FRACTION:.0%} of the peak + {CUDA_FIXED_OVERHEAD / GIB:.0f} GiB "
            "(caching allocator, CUDA context, NCCL and cuBLAS workspaces)")


def fits(result, device: Device) -> dict:
    """Whether a ``Plan`` fits ``device``: a host's RAM is shared by its ranks, a GPU is one rank's."""
    need = result.per_rank_bytes["total"]
    ranks = result.world_size if device.kind == "cpu" else 1
    return {"name": device.name, "description": device.description, "bytes": device.bytes,
            "ranks_sharing": ranks, "needed_bytes": need * ranks, "fits": need * ranks <= device.bytes,
            "headroom_bytes": device.bytes - need * ranks}
