"""Sharding backends. Each exposes ``apply(model, blocks, cfg, mesh) -> applied settings``."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.config import RunConfig
from fsdp_exp.models import REGISTRY


def wrap_units(model: nn.Module, cfg: RunConfig) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that become their own sharding units under wrap=block, in forward order."""
    block_class = REGISTRY[cfg.model.name].block_class
    return [(name, m) for name, m in model.named_modules() if isinstance(m, block_class)]


def parallelize(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh) -> dict:
    """Apply the configured sharding backend in place; return the applied settings."""
    if cfg.sharding.backend == "fsdp2":
        from fsdp_exp.parallel import fsdp2

        return fsdp2.apply(model, wrap_units(model, cfg), cfg, mesh)
    raise ValueError(f"unknown sharding backend {cfg.sharding.backend!r}")  # validate() refuses it first
