"""The peak TFLOPS of one rank's device: MFU's denominator (perf/mfu), and under float8 the FP8 one
(perf/mfu_fp8).

Where it comes from, in order: ``trainer.peak_tflops``; on CUDA the data-sheet table by device name
(fsdp_exp.metrics.flops); on a CPU a matmul measurement that every rank runs at once, cached by rank 0
only when the ranks got the cores they should (other programs' load must not become a later run's peak).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_exp.dist import broadcast_object, reduce_over_ranks
from fsdp_exp.metrics import flops


@dataclass(frozen=True)
class DevicePeak:
    tflops: Optional[float]  # in the compute dtype (precision.param_dtype)
    source: str  # where ``tflops`` comes from, in words (summary/peak_tflops_source)
    measurement: Optional[dict]  # the CPU measurement it was taken from, else None
    fp8_tflops: Optional[float]
    fp8_source: str


def device_peak(cfg, device: torch.device, ranks_per_node: int, world_size: int, is_main: bool) -> DevicePeak:
    """Both peaks of this rank's device; on a CPU without a cached measurement, a collective."""
    tflops, source, measurement = compute_peak_tflops(cfg, device, ranks_per_node, world_size, is_main)
    return DevicePeak(tflops, source, measurement, *fp8_peak_tflops(cfg, device))


def compute_peak_tflops(
    cfg, device: torch.device, ranks_per_node: int, world_size: int, is_main: bool
) -> tuple[Optional[float], str, Optional[dict]]:
    """(peak TFLOPS in the compute dtype, where it comes from, the CPU measurement or None)."""
    dtype = cfg.precision.param_dtype
    if cfg.trainer.peak_tflops is not None:
        return cfg.trainer.peak_tflops, "trainer.peak_tflops", None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = flops.lookup_peak_tflops(name, dtype)
        return peak, f"table: {name} {dtype}" if peak else f"unknown device {name}", None
    return measured_cpu_peak(dtype, device, ranks_per_node, world_size, is_main)


def fp8_peak_tflops(cfg, device: torch.device) -> tuple[Optional[float], str]:
    """Under precision.float8_recipe, the device's FP8 peak: MFU's second denominator, since the
    converted matmuls run on the FP8 tensor cores."""
    if cfg.precision.float8_recipe is None:
        return None, "float8 off"
    if device.type != "cuda":
        return None, "a CPU has no FP8 matmul peak"
    name = torch.cuda.get_device_name(device)
    peak = flops.lookup_peak_tflops(name, "fp8")
    return peak, f"table: {name} fp8" if peak else f"no FP8 peak known for {name}"


def measured_cpu_peak(
    dtype: str, device: torch.device, ranks_per_node: int, world_size: int, is_main: bool
) -> tuple[Optional[float], str, Optional[dict]]:
    """This CPU's matmul peak per rank: from the cache, or measured now by every rank at once and
    cached by rank 0. Rank 0 decides for all (a rank reading the cache after rank 0 wrote it must not
    skip the measurement the others run)."""
    key = flops.peak_key(torch.get_num_threads(), ranks_per_node, dtype)
    entry = broadcast_object(flops.read_cached_peak(key) if is_main else None)
    if entry is None:
        dist.barrier()  # start together: each rank measures while its peers compute too
        local = flops.measure_matmul_tflops(dtype)
        hi, mean = reduce_over_ranks([local["tflops"], -local["core_share"]], device)
        entry = {
            "tflops": mean[0],
            "n": local["n"],
            "dtype": dtype,
            "threads_per_rank": local["threads"],
            "ranks_per_node": ranks_per_node,
            "ranks_measured": world_size,
            "rank0_batches_tflops": local["batches_tflops"],
            "min_core_share": -hi[1],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        # What each rank can get when only this run computes: its threads, or its share of the cores
        # when the node's ranks ask for more threads than there are cores.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        fair = min(1.0, cores / (local["threads"] * ranks_per_node))
        entry["fair_core_share"] = fair
        if -hi[1] >= flops.MIN_CORE_SHARE * fair:
            if is_main:
                flops.write_cached_peak(key, entry)
            how = "measured now"
        else:  # other programs took cores: right for this run at best, never for later ones
            how = f"measured now, not cached: a rank got {-hi[1]:.0%} of its cores' time, {fair:.0%} expected"
    else:
        how = "cached"
    source = (
        f"CPU matmul peak per rank, {how}: {key}; {entry['n']}x{entry['n']} matmuls for 1 s, "
        f"mean over {entry['ranks_measured']} ranks (cache: {flops.cache_path()})"
    )
    return entry["tflops"], source, {"key": key, **entry}
