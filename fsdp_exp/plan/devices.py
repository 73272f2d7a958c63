"""The devices a plan can be checked against, the allocator margin on each kind, and the verdict.

Usable bytes are roughly what ``torch.cuda.get_device_properties(...).total_memory`` reports for each
GPU (a little under the marketing size; ``torch.cuda.mem_get_info()`` tells the exact figure of a
given machine). ``cpu_host`` is this machine's RAM, shared by all its ranks.

Each GPU entry also carries what the step-time model of ``fsdp_exp.tune`` reads (``DevicePerf``): the
peak dense FLOPS per dtype (the vendors' data sheets, as ``fsdp_exp.metrics.flops.PEAK_TFLOPS`` holds
them), the device memory's bandwidth, and per link (between the GPUs of a node, between nodes, to the
host) a bandwidth and a per-step latency, each with its source. ``cpu_host`` has none here: on a CPU
they are measured (``fsdp_exp.tune.probe``) and cached.
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
class Link:
    """One way ranks exchange bytes. ``gbps``: GB/s one rank sends (and receives) in each direction, as a
    ring collective's bandwidth term sees it; ``latency_us``: the cost of one ring step, whatever its size."""

    gbps: float
    latency_us: float
    source: str


@dataclass(frozen=True)
class DevicePerf:
    """What the step-time model (``fsdp_exp.tune.perf``) knows of a device; every figure names its source.

    ``efficiency``: the share of the peak the model's matmuls reach (a prior; ``tune.calibrate_from``
    fits it); ``overlap``: the share of overlappable communication that compute hides (NCCL's kernels
    take SMs from compute); ``dispatch_us``: the host's cost per operator (kernel launch), ``async_dispatch``:
    whether it overlaps the device's work (CUDA streams) or adds to it (eager CPU); ``step_overhead_ms``: a
    fixed cost per step (data, logging, the small all-reduces of the loss and the gradient norm).
    """

    peak_tflops: dict  # dtype -> dense TFLOPS of one device
    memory_gbps: float  # the device memory's bandwidth: the optimizer step streams the states through it
    intra: Link  # between the ranks of one node
    inter: Link  # between nodes, per rank
    host: Link  # device <-> host memory, per rank (offload=params)
    host_memory_gbps: float  # one node's host memory bandwidth, shared by its ranks (the CPU optimizer of offload)
    efficiency: float
    overlap: float
    dispatch_us: float
    async_dispatch: bool
    step_overhead_ms: float
    source: str  # where the peak FLOPS and memory bandwidth come from


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # cuda | cpu
    bytes: int
    description: str
    perf: Optional[DevicePerf] = None  # None: measured where it runs (cpu_host)


def _gib(x: float) -> int:
    return int(x * GIB)


# Links. NCCL's ring collectives reach about 80% of a link's one-way rate (nccl-tests' "busbw" on DGX
# systems), which is the figure given; latencies are per ring step, from nccl-tests' small-message times
# (an 8-GPU NVLink all-gather of a few KiB takes ~20 us: 7 steps), and assumed where a note says so.
NVLINK3 = Link(240.0, 3.0, "NVLink 3: 600 GB/s both ways = 300 GB/s each way (A100 data sheet), x0.8 NCCL")
NVLINK4 = Link(360.0, 3.0, "NVLink 4: 900 GB/s both ways = 450 GB/s each way (H100/H200 data sheets), x0.8 NCCL")
NVLINK5 = Link(720.0, 3.0, "NVLink 5: 1.8 TB/s both ways = 900 GB/s each way (B200 data sheet), x0.8 NCCL")
PCIE4_P2P = Link(20.0, 8.0, "PCIe Gen4 x16 through the host bridge: 32 GB/s each way, ~20 achieved (assumed)")
IB_HDR = Link(20.0, 6.0, "InfiniBand HDR, one 200 Gb/s NIC per GPU (DGX A100) = 25 GB/s, x0.8")
IB_NDR = Link(40.0, 6.0, "InfiniBand NDR, one 400 Gb/s NIC per GPU (DGX H100/H200/B200) = 50 GB/s, x0.8")
CLOUD_100G = Link(1.25, 15.0, "100 Gb/s Ethernet per 8-GPU instance (AWS g5.48xlarge, GCP g2-standard-96) "
                              "= 1.56 GB/s per GPU, x0.8 (assumed)")
PCIE4_HOST = Link(25.0, 10.0, "PCIe Gen4 x16: 32 GB/s each way, ~25 achieved with pinned memory")
PCIE5_HOST = Link(50.0, 10.0, "PCIe Gen5 x16: 64 GB/s each way, ~50 achieved with pinned memory")


def _gpu(description: str, memory_gbps: float, intra: Link, inter: Link, host: Link, host_memory_gbps: float,
         memory_source: str) -> DevicePerf:
    from fsdp_exp.metrics.flops import PEAK_TFLOPS, lookup_peak_tflops

    peaks = {dtype: lookup_peak_tflops(description, dtype) for dtype in ("fp32", "bf16", "fp16")}
    return DevicePerf(
        peak_tflops={dtype: peak for dtype, peak in peaks.items() if peak}, memory_gbps=memory_gbps,
        intra=intra, inter=inter, host=host, host_memory_gbps=host_memory_gbps,
        # A prior, not a promise: dense bf16 training of large transformers commonly reports 40-55% MFU.
        efficiency=0.5, overlap=0.9, dispatch_us=5.0, async_dispatch=True, step_overhead_ms=2.0,
        source=f"peak dense TFLOPS: the vendor's data sheet (fsdp_exp/metrics/flops.py, "
               f"{len(PEAK_TFLOPS)} devices); memory: {memory_source}")


DEVICES: dict[str, Device] = {
    "l4_24gb": Device("l4_24gb", "cuda", _gib(22.0), "NVIDIA L4 (24 GB)", _gpu(
        "NVIDIA L4", 300.0, PCIE4_P2P, CLOUD_100G, PCIE4_HOST, 200.0, "300 GB/s GDDR6 (L4 data sheet)")),
    "a10g_24gb": Device("a10g_24gb", "cuda", _gib(22.0), "NVIDIA A10G (24 GB)", _gpu(
        "NVIDIA A10G", 600.0, PCIE4_P2P, CLOUD_100G, PCIE4_HOST, 200.0, "600 GB/s GDDR6 (A10G data sheet)")),
    "a100_40gb": Device("a100_40gb", "cuda", _gib(39.4), "NVIDIA A100 40GB", _gpu(
        "NVIDIA A100", 1555.0, NVLINK3, IB_HDR, PCIE4_HOST, 400.0, "1,555 GB/s HBM2 (A100 data sheet); host: "
        "2x EPYC 7742, 16 channels DDR4-3200 = 410 GB/s (DGX A100)")),
    "a100_80gb": Device("a100_80gb", "cuda", _gib(79.1), "NVIDIA A100 80GB", _gpu(
        "NVIDIA A100", 2039.0, NVLINK3, IB_HDR, PCIE4_HOST, 400.0, "2,039 GB/s HBM2e (A100 80GB SXM data sheet); "
        "host: 2x EPYC 7742, 16 channels DDR4-3200 = 410 GB/s (DGX A100)")),
    "h100_80gb": Device("h100_80gb", "cuda", _gib(79.1), "NVIDIA H100 80GB", _gpu(
        "NVIDIA H100", 3350.0, NVLINK4, IB_NDR, PCIE5_HOST, 600.0, "3.35 TB/s HBM3 (H100 SXM data sheet); host: "
        "2x Xeon 8480C, 16 channels DDR5-4800 = 614 GB/s (DGX H100)")),
    "h200_141gb": Device("h200_141gb", "cuda", _gib(139.8), "NVIDIA H200 141GB", _gpu(
        "NVIDIA H200", 4800.0, NVLINK4, IB_NDR, PCIE5_HOST, 600.0, "4.8 TB/s HBM3e (H200 data sheet); host as "
        "DGX H100")),
    "b200_192gb": Device("b200_192gb", "cuda", _gib(178.4), "NVIDIA B200 192GB", _gpu(
        "NVIDIA B200", 8000.0, NVLINK5, IB_NDR, PCIE5_HOST, 700.0, "8 TB/s HBM3e (B200 data sheet); host: 2x Xeon "
        "8570, 16 channels DDR5-5600 = 717 GB/s (DGX B200)")),
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


def table_device(name: str, total_bytes: Optional[int] = None) -> Optional["Device"]:
    """The device table's entry for a GPU as CUDA names it ("NVIDIA A100-SXM4-80GB"): the entries of that model
    (its name's second word, as a whole word), the one with the closest memory."""
    import re

    def model(d: Device) -> str:
        return re.escape(d.description.split()[1])  # "H100" of "NVIDIA H100 80GB"

    matches = [d for d in DEVICES.values() if d.perf and re.search(rf"\b{model(d)}\b", name)]
    if not matches:
        return None
    return min(matches, key=lambda d: abs(d.bytes - total_bytes) if total_bytes else 0)


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
