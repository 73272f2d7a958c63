"""What a rank holds in memory: its shards of model states, its process's host memory, CUDA's allocator."""

from __future__ import annotations

import resource

import psutil
import torch
from torch import nn
from torch.distributed.tensor import DTensor


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


class ModelStateBytes:
    """``model_state_bytes``, cheap enough for every step: a DTensor's ``to_local()`` costs tens of
    microseconds, so each parameter's local size is read once; a gradient or optimizer-state tensor
    of the parameter's global shape and dtype has the parameter's local size (same placements: FSDP2's
    sharded gradients and AdamW's moments); anything else is measured each time."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.params = list(model.parameters())
        self.optimizer = optimizer
        self.sizes = {id(p): local_bytes(p) for p in self.params}

    def _like(self, p: torch.Tensor, t: torch.Tensor) -> int:
        same = t.shape == p.shape and t.dtype == p.dtype and isinstance(t, DTensor) == isinstance(p, DTensor)
        return self.sizes[id(p)] if same else local_bytes(t)

    def __call__(self) -> dict[str, int]:
        grads = optim = 0
        for p in self.params:
            if p.grad is not None:
                grads += self._like(p, p.grad)
            for v in self.optimizer.state.get(p, {}).values():
                if torch.is_tensor(v) and v.ndim > 0:
                    optim += self._like(p, v)
        params = sum(self.sizes.values())
        return {"params": params, "grads": grads, "optim_state": optim, "model_states": params + grads + optim}


_PROCESS = None


def host_bytes() -> dict[str, int]:
    global _PROCESS
    if _PROCESS is None:  # one psutil handle per process (making one costs more than reading it)
        _PROCESS = psutil.Process()
    # ru_maxrss is in KiB on Linux.
    return {
        "host_rss": _PROCESS.memory_info().rss,
        "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


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
