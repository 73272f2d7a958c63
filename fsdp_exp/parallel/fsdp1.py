"""FSDP1 (``FullyShardedDataParallel``): the same vocabulary, translated to its arguments.

    sharding=full -> FULL_SHARD, grad_op -> SHARD_GRAD_OP, no_shard -> NO_SHARD,
    hybrid -> HYBRID_SHARD, always with the 2-D (replicate, shard) device mesh: without one, FSDP1
    silently falls back to a shard group of one rank and never syncs gradients across nodes.

FSDP1 wraps the model in a new module. It is built on the meta device; ``param_init_fn``
materializes one module at a time as FSDP1 reaches it and fills each parameter from the seed by its
name, so every unit is whole on a rank only while FSDP1 flattens and shards it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy

from fsdp_exp.config import RunConfig
from fsdp_exp.models import REGISTRY, full_param_init
from fsdp_exp.parallel.common import describe, dtype_of
from fsdp_exp.parallel.wrap import unit_names

STRATEGY = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP,
            "no_shard": ShardingStrategy.NO_SHARD, "hybrid": ShardingStrategy.HYBRID_SHARD}


def mixed_precision(cfg: RunConfig) -> MixedPrecision | None:
    p = cfg.precision
    if p.param_dtype == p.reduce_dtype == "fp32" and p.buffer_dtype in (None, "fp32"):
        return None  # nothing to cast
    return MixedPrecision(param_dtype=dtype_of(p.param_dtype), reduce_dtype=dtype_of(p.reduce_dtype),
                          buffer_dtype=dtype_of(p.buffer_dtype) if p.buffer_dtype else None,
                          cast_forward_inputs=p.cast_forward_inputs)


def backward_prefetch(cfg: RunConfig) -> BackwardPrefetch | None:
    if cfg.prefetch.backward == 0:
        return None
    return BackwardPrefetch.BACKWARD_POST if cfg.prefetch.backward_timing == "post" else BackwardPrefetch.BACKWARD_PRE


def auto_wrap_policy(model: nn.Module, cfg: RunConfig):
    policy = cfg.wrap.policy
    if policy == "none":
        return None
    if policy == "block":
        return ModuleWrapPolicy({REGISTRY[cfg.model.name].block_class})
    if policy == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.wrap.min_num_params)
    chosen = {id(model.get_submodule(name)) for name in unit_names(model, cfg)}  # experts, then blocks
    return CustomPolicy(lambda module: id(module) in chosen)


def apply(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
    seed = cfg.trainer.seed
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}

    @torch.no_grad()
    def param_init_fn(module: nn.Module) -> None:
        pending = [(attr, names[id(p)]) for attr, p in module.named_parameters(recurse=False) if p.is_meta]
        module.to_empty(device=device, recurse=False)
        for attr, full_name in pending:
            param = getattr(module, attr)
            param.copy_(full_param_init(model, full_name, param.shape, seed, device))

    kwargs = dict(
        sharding_strategy=STRATEGY[cfg.sharding.strategy],
        auto_wrap_policy=auto_wrap_policy(model, cfg),
        mixed_precision=mixed_precision(cfg),
        cpu_offload=CPUOffload(offload_params=cfg.offload.params),
        backward_prefetch=backward_prefetch(cfg),
        forward_prefetch=cfg.prefetch.forward > 0,
        limit_all_gathers=cfg.prefetch.limit_all_gathers if cfg.prefetch.limit_all_gathers is not None else True,
        use_orig_params=cfg.sharding.use_orig_params if cfg.sharding.use_orig_params is not None else True,
        sync_module_states=bool(cfg.sharding.sync_module_states),
        device_id=device,
    )
    if cfg.sharding.strategy == "hybrid":
        kwargs["device_mesh"] = mesh  # 2-D (replicate, shard): never let FSDP1 guess the groups
    wrapped = FullyShardedDataParallel(model, param_init_fn=param_init_fn, **kwargs)
    wrapped.module.init_buffers(device)
    units = [name or "<root>" for name, m in wrapped.named_modules() if isinstance(m, FullyShardedDataParallel)]
    return wrapped, {
        "backend": "fsdp1",
        "api": "torch.distributed.fsdp.FullyShardedDataParallel",
        "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
        if "device_mesh" in kwargs else {"process_group": "default (all ranks)"},
        "num_units": len(units),
        "units": [{"module": _clean(u)} for u in units],
        "FullyShardedDataParallel": describe({**kwargs, "param_init_fn": "materialize + seed-by-name init"}),
    }, Runtime()


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")


class Runtime:
    @staticmethod
    def gradient_sync(model: nn.Module, enabled: bool):
        return contextlib.nullcontext() if enabled else model.no_sync()

    @staticmethod
    def autocast():
        return contextlib.nullcontext()

    @staticmethod
    def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)  # reduces the norm over the shards

    @staticmethod
    def grad_scaler(device: torch.device):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
