"""DDP (``DistributedDataParallel``): the baseline every sweep compares against.

Every rank holds the whole model; gradients are all-reduced in buckets during backward. Mixed
precision is DDP's usual kind: ``torch.autocast`` to ``precision.param_dtype`` for compute, and a
communication hook that compresses gradients to ``precision.reduce_dtype`` when it is bf16/fp16.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from fsdp_exp.config import RunConfig
from fsdp_exp.models import init_weights
from fsdp_exp.parallel.common import describe, dtype_of

COMM_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


def apply(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
    model.to_empty(device=device)
    init_weights(model, cfg.trainer.seed, device)
    kwargs = dict(device_ids=[device.index] if device.type == "cuda" else None, process_group=mesh.get_group(),
                  forward_sync_buffers=False)  # buffers are derived (rotary tables), identical everywhere
    wrapped = DistributedDataParallel(model, **kwargs)
    hook = COMM_HOOKS.get(cfg.precision.reduce_dtype)
    if hook is not None:
        wrapped.register_comm_hook(mesh.get_group(), hook)
    runtime = Runtime(dtype_of(cfg.precision.param_dtype), device.type)
    return wrapped, {
        "backend": "ddp",
        "api": "torch.nn.parallel.DistributedDataParallel",
        "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
        "num_units": 1,
        "units": [{"module": "<root>"}],
        "DistributedDataParallel": describe({**kwargs, "process_group": f"{mesh.size()} ranks"}),
        "comm_hook": hook.__name__ if hook else None,
        "autocast": describe(runtime.compute_dtype) if cfg.precision.param_dtype != "fp32" else None,
    }, runtime


class Runtime:
    def __init__(self, compute_dtype: torch.dtype, device_type: str):
        self.compute_dtype, self.device_type = compute_dtype, device_type

    @staticmethod
    def gradient_sync(model: nn.Module, enabled: bool):
        return contextlib.nullcontext() if enabled else model.no_sync()

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    @staticmethod
    def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # gradients are already whole

    @staticmethod
    def grad_scaler(device: torch.device):
        return torch.amp.GradScaler(device.type)  # every rank sees the same all-reduced gradients
