"""Parallelism, applied in a fixed order like a recipe: tensor parallel, activation checkpointing,
compile, then the data-parallel backend (FSDP2, FSDP1 or DDP), which also materializes the model and
initializes it identically on every rank. Each step records what it handed to torch ("applied").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.config import RunConfig


@dataclass
class Parallelized:
    model: nn.Module
    applied: dict
    runtime: Any  # the backend's Runtime: gradient_sync, autocast, clip_grad_norm, grad_scaler


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != "tp")
    return mesh[names] if len(names) < len(mesh.mesh_dim_names or ()) else mesh


def parallelize(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device) -> Parallelized:
    """``model`` is on the meta device; the result is sharded, materialized and initialized."""
    from fsdp_exp.parallel import ac, compile, ddp, fsdp1, fsdp2, tp
    from fsdp_exp.parallel.inspect import inspect

    applied: dict = {}
    if cfg.parallel.tp > 1:
        applied["tp"] = tp.apply(model, cfg, mesh["tp"])
    if cfg.ac.mode != "none":
        applied["ac"] = ac.apply(model, cfg)
    if cfg.compile:
        applied["compile"] = compile.apply(model, cfg)
    backend = {"fsdp2": fsdp2, "fsdp1": fsdp1, "ddp": ddp}[cfg.sharding.backend]
    model, dp_applied, runtime = backend.apply(model, cfg, data_parallel_mesh(mesh), device)
    # What torch holds, read back from the wrapped model (tests compare it with the config).
    applied = {**dp_applied, **applied, "inspected": inspect(model, cfg.sharding.backend)}
    return Parallelized(model=model, applied=applied, runtime=runtime)
