"""FSDP2 (``torch.distributed.fsdp.fully_shard``): translate the config's vocabulary into its arguments.

    sharding=full     -> reshard_after_forward=True  on a 1-D mesh (shard,)
    sharding=grad_op  -> reshard_after_forward=False on a 1-D mesh (shard,)
    sharding=hybrid   -> reshard_after_forward=True  on a 2-D mesh (replicate, shard)
    sharding=no_shard -> reshard_after_forward=False on a 2-D mesh (world, 1): pure replication

Returns the "applied settings": for each FSDP unit, the exact arguments handed to ``fully_shard`` and
the prefetch lists set on it, so a run's record proves what reached the API.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp_exp.config import RunConfig
from fsdp_exp.parallel.common import describe, dtype_of

RESHARD_AFTER_FORWARD = {"full": True, "grad_op": False, "hybrid": True, "no_shard": False}


def mp_policy(cfg: RunConfig) -> MixedPrecisionPolicy:
    p = cfg.precision
    return MixedPrecisionPolicy(
        param_dtype=dtype_of(p.param_dtype),
        reduce_dtype=dtype_of(p.reduce_dtype),
        output_dtype=dtype_of(p.output_dtype) if p.output_dtype else None,
        cast_forward_inputs=True,
    )


def offload_policy(cfg: RunConfig, device_type: str) -> OffloadPolicy:
    if not cfg.offload.params:
        return OffloadPolicy()
    pin = cfg.offload.pin_memory if cfg.offload.pin_memory is not None else device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=pin)


def apply(model: nn.Module, blocks: list[tuple[str, nn.Module]], cfg: RunConfig, mesh: DeviceMesh) -> dict:
    """Shard ``model`` in place. ``blocks`` are (qualified name, module) of the wrap units below the root."""
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=RESHARD_AFTER_FORWARD[cfg.sharding.strategy],
        mp_policy=mp_policy(cfg),
        offload_policy=offload_policy(cfg, mesh.device_type),
    )
    units: list[dict] = []
    wrapped: list[tuple[str, FSDPModule]] = []
    if cfg.wrap.policy == "block":
        for name, block in blocks:
            fully_shard(block, **kwargs)
            wrapped.append((name, block))
            units.append({"module": name, "fully_shard": describe(kwargs)})
    fully_shard(model, **kwargs)
    units.append({"module": "<root>", "fully_shard": describe(kwargs)})

    prefetch = _set_prefetch(wrapped, cfg.prefetch.forward, cfg.prefetch.backward)
    for unit in units:
        unit.update(prefetch.get(unit["module"], {}))
    return {
        "backend": "fsdp2",
        "api": "torch.distributed.fsdp.fully_shard",
        "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
        "num_units": len(units),
        "units": units,
    }


def _set_prefetch(wrapped: list[tuple[str, FSDPModule]], forward: int, backward: int | None) -> dict:
    """Explicit prefetch lists: block i gathers the next ``forward`` blocks early in forward and the
    previous ``backward`` blocks (nearest first) early in backward."""
    applied: dict[str, dict] = {}
    for i, (name, module) in enumerate(wrapped):
        entry = {}
        targets = wrapped[i + 1:i + 1 + forward]
        if targets:
            module.set_modules_to_forward_prefetch([m for _, m in targets])
        entry["forward_prefetch"] = [n for n, _ in targets]
        if backward is not None:
            targets = list(reversed(wrapped[max(0, i - backward):i]))
            if targets:
                module.set_modules_to_backward_prefetch([m for _, m in targets])
            entry["backward_prefetch"] = [n for n, _ in targets]
        else:
            entry["backward_prefetch"] = "implicit"
        applied[name] = entry
    return applied
