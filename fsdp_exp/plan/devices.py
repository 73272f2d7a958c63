"""The devices a plan can be checked against, the allocator margin on each kind, and the verdict.

Usable bytes are roughly what ``torch.cuda.get_device_properties(...).total_memory`` reports for each
GPU (a little under the marketing size; ``torch.cuda.mem_get_info()`` tells the exact figure of a
given machine). ``cpu_host`` is this machine's RAM, shared by all its ranks.

Each GPU entry also carries what the step-time model of ``fsdp_exp.tune`` reads (``DevicePerf``): the
peak dense FLOPS per dtype (the vendors' data sheets, as ``fsdp_exp.metrics.flops.PEAK_TFLOPS`` holds
them; ``fp8`` only where the GPU has FP8 tensor cores), the device memory's bandwidth, and per link (between the GPUs of a node, between nodes, to the
host) a bandwidth and a per-step latency, each with its source. ``cpu_host`` has none here: on a CPU
they are measured (``fsdp_exp.tune.probe``) and cached.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from fsdp_exp.units import GIB

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
    # True: ``gbps`` is a whole node's (all its network cards together; a network between nodes). NCCL runs one
    # ring per card, so a group holding r of the node's ranks gets r / ranks-per-node of it (fsdp_exp.tune.perf).
    per_node: bool = False


@dataclass(frozen=True)
class DevicePerf:
    """What the step-time model (``fsdp_exp.tune.perf``) knows of a device; every figure names its source.

    ``efficiency``: the share of the peak the model's matmuls reach (on a GPU the device's achievable share,
    ``KernelPrior``, times the software's share fitted on the published A100 record, ``SOFTWARE``;
    ``tune.calibrate_from`` fits it per device); ``overlap``: the share of overlappable communication that
    compute hides (NCCL's kernels
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
    kernels: bool = False
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    gemm_half_dim: float = 0.0
    unit_us: dict = field(default_factory=dict)  # param layout -> microseconds per unit and collective
    tdp_w: Optional[float] = None
    # The share of ``peak_tflops["fp8"]`` a float8 matmul reaches (precision=float8), as ``efficiency`` is of the
    # bf16 peak; 0 on a device without FP8 tensor cores (no "fp8" peak).
    fp8_efficiency: float = 0.0
    # A CPU's: dtype -> the share of ``efficiency`` a step in that dtype reaches against fp32's, measured on a block's
    # forward and backward by the probe (fsdp_exp.tune.probe: a bf16 step gains far less than the bf16 peak says)
    dtype_scale: dict = field(default_factory=dict)
    # A mixture of experts' grouped matmuls reach m / (m + this) of the large-shape rate with m rows (tokens) per
    # expert (fsdp_exp.tune.experts_perf.grouped_seconds): GROUPED_HALF_TOKENS_GPU / _CPU below say where each
    # comes from
    grouped_gemm_half_tokens: float = 0.0


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
# (an 8-GPU NVLink all-gather of a few KiB takes ~20 us: 7 steps), and assumed where a note says so. Checked
# against published nccl-tests busbw (docs.alayanew.com, "NCCL-tests in practice", 2026): 8 x A100 SXM4 230-250 GB/s
# (NVLINK3's 240); 8 x H100 SXM5 all-reduce 460-480 GB/s, above the ring's 450 GB/s because NVLS reduces in the
# switch, which FSDP's all-gathers and reduce-scatters here do not get (the model leaves NVLS out): 360 kept.
NVLINK3 = Link(240.0, 3.0, "NVLink 3: 600 GB/s both ways = 300 GB/s each way (A100 data sheet), x0.8 NCCL")
NVLINK4 = Link(360.0, 3.0, "NVLink 4: 900 GB/s both ways = 450 GB/s each way (H100/H200 data sheets), x0.8 NCCL")
NVLINK5 = Link(720.0, 3.0, "NVLink 5: 1.8 TB/s both ways = 900 GB/s each way (B200 data sheet), x0.8 NCCL")
NVLINK_BRIDGE = Link(
    160.0,
    4.0,
    "H100 PCIe with NVLink bridges: 600 GB/s both ways between pairs; beyond a pair "
    "PCIe Gen5 (64 GB/s each way); taken as 200 GB/s each way, x0.8 (assumed)",
)
PCIE4_P2P = Link(20.0, 8.0, "PCIe Gen4 x16 through the host bridge: 32 GB/s each way, ~20 achieved (assumed)")
PCIE4_HOST = Link(25.0, 10.0, "PCIe Gen4 x16: 32 GB/s each way, ~25 achieved with pinned memory")
PCIE5_HOST = Link(50.0, 10.0, "PCIe Gen5 x16: 64 GB/s each way, ~50 achieved with pinned memory")

# Networks between nodes, a whole node's figure (``plan.network=<name>``): every card of the node together,
# one way, x0.8 for NCCL (as the links above). Latency: one network hop of a ring step.
NETWORKS: dict[str, Link] = {
    "ib_hdr_8x200g": Link(160.0, 6.0, "InfiniBand HDR, 8 x 200 Gb/s per node (DGX A100) = 200 GB/s, x0.8", True),
    "ib_ndr_8x400g": Link(
        320.0, 6.0, "InfiniBand NDR, 8 x 400 Gb/s per node (DGX H100/H200/B200) = 400 GB/s, x0.8", True
    ),
    "roce_8x200g": Link(
        160.0,
        8.0,
        "RoCE, 1600 Gb/s per node (8 x 200 Gb/s; llm-foundry's A100 tables) = 200 GB/s, "
        "x0.8; latency assumed above InfiniBand's",
        True,
    ),
    "roce_8x400g": Link(320.0, 8.0, "RoCE, 3200 Gb/s per node (8 x 400 Gb/s) = 400 GB/s, x0.8; latency assumed", True),
    "efa_3200g": Link(
        280.0, 15.0, "AWS EFA, 3200 Gb/s per p5 node = 400 GB/s, x0.7 (EFA's NCCL plugin; assumed)", True
    ),
    "eth_100g": Link(
        10.0, 15.0, "100 Gb/s Ethernet per node (AWS g5.48xlarge, GCP g2-standard-96) = 12.5 GB/s, x0.8 (assumed)", True
    ),
}


def with_network(perf: "DevicePerf", name: str) -> "DevicePerf":
    """``perf`` between nodes over network ``name`` (``plan.network``)."""
    from fsdp_exp.errors import fail

    if name not in NETWORKS:
        fail(f"plan.network={name!r} is not a known network.", f"pass one of {', '.join(NETWORKS)}")
    return dataclasses.replace(perf, inter=NETWORKS[name])


def with_power(perf: "DevicePerf", watts: float) -> "DevicePerf":
    """``perf`` under a board power limit (``plan.device_power_w``): a GPU that may draw less than its rated power
    lowers its clocks. Dynamic power grows about as the cube of the clock (the voltage follows the clock in the
    DVFS range), so the peak FLOPS scale by (limit / rated)^(1/3) below the rating, and not above it. Memory
    bandwidth and links are left as they are (their clocks are not the SMs')."""
    if not perf.tdp_w or watts >= perf.tdp_w:
        return perf
    scale = (watts / perf.tdp_w) ** (1 / 3)
    return dataclasses.replace(
        perf,
        peak_tflops={k: v * scale for k, v in perf.peak_tflops.items()},
        tdp_w=watts,
        source=perf.source + f"; power-limited to {watts:g} W (peak x{scale:.3f})",
    )


@dataclass(frozen=True)
class KernelPrior:
    """What one device's kernels reach of its data-sheet peak on their own, measured by public microbenchmarks
    (a prior per device, with its source): ``gemm``, the best large bf16 GEMM (cuBLAS); ``attention``, the fused
    causal attention kernel the published runs of that device used, forward and backward."""

    gemm: float
    attention: float
    source: str
    fp8_gemm: Optional[float] = None  # the best large FP8 GEMM's share of the FP8 peak (None: as ``gemm``, assumed)


# Achievable shares of the data-sheet peak. GEMM: stas00/ml-engineering, compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table" (mamf-finder.py, bf16, best shape): A100 SXM 267.9 of 312 (85.9%,
# CUDA 12.1), A100 PCIe 256.4 of 312 (82.2%), H100 SXM 792.1 of 989 (80.1%, CUDA 12.1; its boost clock is not held
# under a 700 W GEMM load), GH200 821.0 of 989 (83.0%); the same repository's H200-to-B200 upgrade guide: H100/H200
# SXM 794.5 of 989 (80.3%), B200 SXM 1745 of 2250 (77.6%). Attention: the kernel of the published runs, by date.
# llm-foundry's tables (2023-2024) and torchtitan's (2024) ran FlashAttention-2 (flash-attn 2.x; torch SDPA's flash
# backend is FA2 from torch 2.2), FlashAttention-3 (Hopper only, July 2024) none of them. FA2 reaches 50-73% of the
# A100's peak in forward (Dao 2023, arXiv:2307.08691), forward and backward together about 0.6; on an H100 FA2
# reaches about 35% of the peak (Shah et al. 2024, the FlashAttention-3 paper, arXiv:2407.08608, against FA3's 75%).
FA2_A100, FA2_HOPPER = 0.60, 0.35
A100_SXM = KernelPrior(0.859, FA2_A100, "GEMM: A100 SXM MAMF 267.9/312 (ml-engineering); attention: FA2 on A100")
A100_PCIE_LIKE = KernelPrior(
    0.822,
    FA2_A100,
    "no published figure for this device: assumed as the A100 PCIe (MAMF 256.4/312, ml-engineering) and FA2 on A100",
)
# FP8 GEMM (E4M3, cuBLASLt, what torch._scaled_mm calls): tile-lang's benchmark/matmul_fp8/README.md, M = N = 8192
# on an H800 SXM (the H100 SXM's SMs and clocks, FP8 peak 1979): 1507 TFLOPS at K = 8192 (76.1%), 1541 at K = 16384
# (77.9%); a public cuBLASLt E4M3 8192^3 cross-check on H100 SXM reached 1609 (81.3%). Taken: 0.76, the K = 8192 shape
# (Llama's matmuls have K of 4096 to 14336). A Hopper's FP8 GEMMs reach a little less of their peak than its bf16 ones.
HOPPER_FP8_GEMM = 0.76
HOPPER = KernelPrior(
    0.801,
    FA2_HOPPER,
    "GEMM: H100 SXM MAMF 792.1/989 (ml-engineering; H200 794.5/989 likewise), "
    "FP8 1507/1979 (tile-lang, H800 SXM, 8192^2 x 8192); attention: FA2 on H100 "
    "(FA3 paper)",
    HOPPER_FP8_GEMM,
)
HOPPER_PCIE = KernelPrior(
    0.801,
    FA2_HOPPER,
    "no published figure for the PCIe board: assumed as the H100 SXM's (MAMF 792.1/989, FP8 0.76) and FA2 on H100",
    HOPPER_FP8_GEMM,
)
BLACKWELL = KernelPrior(
    0.776,
    0.25,
    "GEMM: B200 SXM MAMF 1745/2250 (ml-engineering; FP8 assumed the same share of "
    "its 4500, no published figure found); attention assumed 0.25: "
    "FA2 has no Blackwell kernels of its own (Ampere-style MMA on sm_100; "
    "ml-engineering calls it very slow there), no published share found",
)

# The software's share of what the kernels can reach, fitted on the published record (python -m fsdp_exp.tune
# tune.calibrate_from=benchmarks/published, the calibration part: llm-foundry's and torchtitan's A100 tables, 231
# runs; mean |log(predicted / published)| minimised) where a data sheet cannot tell it: the A100's fitted shares of
# the peak, 0.71 for the matmuls and 0.32 for attention (counting a causal kernel's FLOPs), over the A100's
# priors: what a training step loses to shapes, fusion and launch gaps beyond the best microbenchmark. A device's
# efficiency is its prior times this; the A100's figures are the fitted ones again. Refitted (0.70 -> 0.71, mean
# |log| 0.0461 -> 0.0442) when llm-foundry's rows took composer's BACKWARD_POST (exposed backward re-gathers).
FITTED_A100 = {"efficiency": 0.71, "attention_efficiency": 0.32}
SOFTWARE = {
    "gemm": FITTED_A100["efficiency"] / A100_SXM.gemm,
    "attention": FITTED_A100["attention_efficiency"] / A100_SXM.attention,
}
# Fitted with them, and left at what the record put them: ``gemm_half_dim`` (0: beyond the roofline and the
# memory-bound operators, the record shows no shape penalty) and ``unit_us`` (0 for both layouts: the runs'
# FSDP software hides behind their device work). ``memory_efficiency`` is a prior (STREAM-like copies reach
# about 80% of HBM's rate).
FITTED_SHAPES = {"gemm_half_dim": 0.0, "memory_efficiency": 0.8, "unit_us": {"flat": 0.0, "dim0": 0.0}}

# Grouped matmuls with few rows per group. On a GPU: tile quantization. Hopper's and Ampere's grouped GEMM kernels
# (CUTLASS's, which torch._grouped_mm runs on sm90) tile each group's rows in blocks of 128; the counts the router
# gives the experts are uneven, so each group's last tile is on average half empty: 64 rows of padding per group,
# m / (m + 64) of the rate (NVIDIA's "Matrix Multiplication Background" guide calls this tile quantization). It
# adds to the roofline, which already makes few-row experts memory-bound (each expert's weight read per micro-batch).
GROUPED_HALF_TOKENS_GPU = 64.0
# On a CPU, measured: benchmarks/grouped_mm.py on this 2-core machine (torch 2.13's CPU fallback, one matmul per
# group, 16 groups of (m, 512) x (512, 256)), the rate against m = 1024 fitted to m / (m + h): h = 10.25 in fp32,
# 34 in bf16 (2026-12-03, other jobs running: the points scatter, the fall below 32 rows is clear). fp32's is
# kept: the CPU's runs are fp32 by default.
GROUPED_HALF_TOKENS_CPU = 10.25


# Attention kernels a published run may name instead of FlashAttention-2, as a multiple of FA2's rate on the same
# device (``with_attention_kernel``). cuDNN's fused attention (TransformerEngine's DotProductAttention on Hopper; torch
# SDPA's cuDNN backend) on an H100 SXM at head dim 128 and 4k tokens: forward (causal) 518 TFLOPS against FA2's 319,
# backward 499 against 310 (the FlashAttention-3 paper, Shah et al. 2024, arXiv:2407.08608, its H100 benchmarks). A
# forward and its backward (2.5 x the forward's FLOPs) take 1 / 1.61 of FA2's time. FlexAttention is left at FA2's
# rate (its authors put it at about 90% of FA2 in forward and 85% in backward on an A100; no Hopper figure found).
ATTENTION_KERNELS = {
    "fa2": 1.0,
    "flex": 1.0,
    "cudnn": (1 / 319 + 2.5 / 310) / (1 / 518 + 2.5 / 499),
}


def with_attention_kernel(perf: "DevicePerf", kernel: str) -> "DevicePerf":
    """``perf`` with attention run by ``kernel`` (``ATTENTION_KERNELS``) instead of FlashAttention-2, the kernel of
    the runs the device's attention efficiency was fitted on: the same software share of a faster kernel."""
    scale = ATTENTION_KERNELS[kernel]
    if scale == 1.0:
        return perf
    return dataclasses.replace(
        perf,
        attention_efficiency=perf.attention_efficiency * scale,
        source=perf.source + f"; attention by {kernel} (x{scale:.2f} FA2's rate)",
    )


def kernel_efficiencies(prior: KernelPrior, has_fp8: bool = False) -> dict:
    """``DevicePerf``'s efficiencies of a device: its kernels' prior times the software's fitted share (the FP8
    matmuls' the same share of theirs: the training step around them is the same software)."""
    fp8 = prior.fp8_gemm if prior.fp8_gemm is not None else prior.gemm
    return {
        "efficiency": prior.gemm * SOFTWARE["gemm"],
        "attention_efficiency": prior.attention * SOFTWARE["attention"],
        "fp8_efficiency": fp8 * SOFTWARE["gemm"] if has_fp8 else 0.0,
    }


def _gpu(
    description: str,
    memory_gbps: float,
    intra: Link,
    inter: Link,
    host: Link,
    host_memory_gbps: float,
    memory_source: str,
    kernels: KernelPrior,
    tdp_w: Optional[float] = None,
    power_w: Optional[float] = None,
) -> DevicePerf:
    from fsdp_exp.metrics.flops import PEAK_TFLOPS, lookup_peak_tflops

    # "fp8": the FP8 tensor cores' dense peak (Ada, Hopper, Blackwell); absent on an A100 or A10G, which have none
    peaks = {dtype: lookup_peak_tflops(description, dtype) for dtype in ("fp32", "bf16", "fp16", "fp8")}
    perf = DevicePerf(
        peak_tflops={dtype: peak for dtype, peak in peaks.items() if peak},
        memory_gbps=memory_gbps,
        intra=intra,
        inter=inter,
        host=host,
        host_memory_gbps=host_memory_gbps,
        overlap=0.9,
        dispatch_us=5.0,
        async_dispatch=True,
        step_overhead_ms=2.0,
        source=f"peak dense TFLOPS: the vendor's data sheet (fsdp_exp/metrics/flops.py, "
        f"{len(PEAK_TFLOPS)} devices); memory: {memory_source}; kernel efficiencies: the device's achievable "
        f"share of the peak ({kernels.source}) x the software's share fitted on the published A100 record "
        f"(fsdp_exp/plan/devices.py SOFTWARE)",
        kernels=True,
        grouped_gemm_half_tokens=GROUPED_HALF_TOKENS_GPU,
        tdp_w=tdp_w,
        **kernel_efficiencies(kernels, bool(peaks["fp8"])),
        **FITTED_SHAPES,
    )
    return with_power(perf, power_w) if power_w else perf


CLOUD = NETWORKS["eth_100g"]
DGX_A100_HOST = "host: 2x EPYC 7742, 16 channels DDR4-3200 = 410 GB/s (DGX A100)"
DGX_H100_HOST = "host: 2x Xeon 8480C, 16 channels DDR5-4800 = 614 GB/s (DGX H100)"
DEVICES: dict[str, Device] = {
    "l4_24gb": Device(
        "l4_24gb",
        "cuda",
        _gib(22.0),
        "NVIDIA L4 (24 GB)",
        _gpu(
            "NVIDIA L4",
            300.0,
            PCIE4_P2P,
            CLOUD,
            PCIE4_HOST,
            200.0,
            "300 GB/s GDDR6 (L4 data sheet)",
            A100_PCIE_LIKE,
            72.0,
        ),
    ),
    "a10g_24gb": Device(
        "a10g_24gb",
        "cuda",
        _gib(22.0),
        "NVIDIA A10G (24 GB)",
        _gpu(
            "NVIDIA A10G",
            600.0,
            PCIE4_P2P,
            CLOUD,
            PCIE4_HOST,
            200.0,
            "600 GB/s GDDR6 (A10G data sheet)",
            A100_PCIE_LIKE,
            300.0,
        ),
    ),
    "a100_40gb": Device(
        "a100_40gb",
        "cuda",
        _gib(39.4),
        "NVIDIA A100 40GB",
        _gpu(
            "NVIDIA A100",
            1555.0,
            NVLINK3,
            NETWORKS["ib_hdr_8x200g"],
            PCIE4_HOST,
            400.0,
            f"1,555 GB/s HBM2 (A100 40GB SXM data sheet, 400 W); {DGX_A100_HOST}",
            A100_SXM,
            400.0,
        ),
    ),
    "a100_80gb": Device(
        "a100_80gb",
        "cuda",
        _gib(79.1),
        "NVIDIA A100 80GB",
        _gpu(
            "NVIDIA A100",
            2039.0,
            NVLINK3,
            NETWORKS["ib_hdr_8x200g"],
            PCIE4_HOST,
            400.0,
            f"2,039 GB/s HBM2e (A100 80GB SXM data sheet, 400 W); {DGX_A100_HOST}",
            A100_SXM,
            400.0,
        ),
    ),
    "h100_80gb": Device(
        "h100_80gb",
        "cuda",
        _gib(79.1),
        "NVIDIA H100 80GB",
        _gpu(
            "NVIDIA H100",
            3350.0,
            NVLINK4,
            NETWORKS["ib_ndr_8x400g"],
            PCIE5_HOST,
            600.0,
            f"3.35 TB/s HBM3 (H100 SXM data sheet, 700 W); {DGX_H100_HOST}",
            HOPPER,
            700.0,
        ),
    ),
    "h100_96gb_500w": Device(
        "h100_96gb_500w",
        "cuda",
        _gib(94.5),
        "NVIDIA H100 96GB HBM2e (500 W)",
        _gpu(
            "NVIDIA H100",
            2460.0,
            NVLINK4,
            NETWORKS["roce_8x400g"],
            PCIE5_HOST,
            600.0,
            "the H100 SXM with 96 GB of HBM2e (six 16 GB stacks at 3.2 Gb/s x 1024 bits = 2.46 TB/s; derived, not a "
            "data sheet) at a 500 W power limit, as torchtitan's H100 tables describe their cluster",
            HOPPER,
            700.0,
            500.0,
        ),
    ),
    "h100_pcie": Device(
        "h100_pcie",
        "cuda",
        _gib(79.1),
        "NVIDIA H100 PCIe 80GB",
        _gpu(
            "NVIDIA H100 PCIe",
            2000.0,
            NVLINK_BRIDGE,
            CLOUD,
            PCIE5_HOST,
            600.0,
            "2.0 TB/s HBM2e (H100 PCIe data sheet, 350 W)",
            HOPPER_PCIE,
            350.0,
        ),
    ),
    "h200_141gb": Device(
        "h200_141gb",
        "cuda",
        _gib(139.8),
        "NVIDIA H200 141GB",
        _gpu(
            "NVIDIA H200",
            4800.0,
            NVLINK4,
            NETWORKS["ib_ndr_8x400g"],
            PCIE5_HOST,
            600.0,
            "4.8 TB/s HBM3e (H200 SXM data sheet, 700 W); host as DGX H100",
            HOPPER,
            700.0,
        ),
    ),
    "b200_192gb": Device(
        "b200_192gb",
        "cuda",
        _gib(178.4),
        "NVIDIA B200 192GB",
        _gpu(
            "NVIDIA B200",
            8000.0,
            NVLINK5,
            NETWORKS["ib_ndr_8x400g"],
            PCIE5_HOST,
            700.0,
            "8 TB/s HBM3e (B200 data sheet, 1000 W); host: 2x Xeon 8570, 16 channels DDR5-5600 = 717 GB/s (DGX B200)",
            BLACKWELL,
            1000.0,
        ),
    ),
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
    same_form = [d for d in matches if ("PCIe" in d.description) == ("PCIe" in name)]  # SXM and PCIe boards differ
    matches = same_form or matches
    if not matches:
        return None
    return min(matches, key=lambda d: abs(d.bytes - total_bytes) if total_bytes else 0)


def allocator_margin(kind: str, peak: int, margin: Optional[float]) -> tuple[int, str]:
    """(bytes, the rule in words) added to the peak: ``plan.margin`` when given, else the kind's."""
    if margin is not None:
        return int(margin * peak), f"plan.margin={margin:g} of the peak"
    if kind == "cpu":
        return 0, "0 on a CPU (no caching allocator)"
    return (
        int(CUDA_MARGIN_FRACTION * peak) + CUDA_FIXED_OVERHEAD,
        f"{CUDA_MARGIN_FRACTION:.0%} of the peak + {CUDA_FIXED_OVERHEAD / GIB:.0f} GiB "
        "(caching allocator, CUDA context, NCCL and cuBLAS workspaces)",
    )


def fits(result, device: Device) -> dict:
    """Whether a ``Plan`` fits ``device``: a host's RAM is shared by its ranks, a GPU is one rank's."""
    need = result.per_rank_bytes["total"]
    ranks = result.world_size if device.kind == "cpu" else 1
    return {
        "name": device.name,
        "description": device.description,
        "bytes": device.bytes,
        "ranks_sharing": ranks,
        "needed_bytes": need * ranks,
        "fits": need * ranks <= device.bytes,
        "headroom_bytes": device.bytes - need * ranks,
    }


def nearest_device(name: str) -> Optional[str]:
    """The device a mistyped ``plan.device`` most likely meant: the first of the table whose name starts with it
    (``h100`` -> ``h100_80gb``, the table listing each GPU's common form first), else the closest spelling."""
    from fsdp_exp.errors import closest

    table = device_table()
    return next((d for d in table if d.startswith(name.lower())), None) or closest(name, table)
