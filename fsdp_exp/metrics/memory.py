"""What a rank holds in memory: its shards of model states, its process's host memory, CUDA's allocator."""

from __future__ import annotations

import resource

import psutil
import torch
from torch import nn
from torch.distributed.tensor import DTensor

GIB = 2**30


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of ``t`` that lives on this rank (a DTensor's local shard)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim_state": sum(local_bytes(v) for v in state),
    }
    out["model_states"] = out["params"] + out["grads"] + out["optim_state"]
    return out


def host_bytes() -> dict[str, int]:
    # ru_maxrss is in KiB on Linux.
    return {"host_rss": psutil.Process().memory_info().rss,
            "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def cuda_bytes(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
        "peak_active": stats.get("active_bytes.all.peak", 0),
    }


def cuda_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}
