"""FSDP2 (``torch.distributed.fsdp.fully_shard``): translate the config's vocabulary into its arguments.

    sharding=full     -> reshard_after_forward=True  on a 1-D mesh (shard,)
    sharding=grad_op  -> reshard_after_forward=False on a 1-D mesh (shard,)
    sharding=hybrid   -> reshard_after_forward=True  on a 2-D mesh (replicate, shard)
    sharding=no_shard -> reshard_after_forward=False on a 2-D mesh (world, 1): pure replication

``fully_shard`` shards in place: the model stays on the meta device until every unit is sharded,
then each rank materializes only its shards and fills them from the seed (models.init_weights).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_exp.config import RunConfig
from fsdp_exp.models import init_weights
from fsdp_exp.parallel.common import describe, dtype_of
from fsdp_exp.parallel.wrap import top_level, unit_names

RESHARD_AFTER_FORWARD = {"full": True, "grad_op": False, "hybrid": True, "no_shard": False}


def reshard_after_forward(cfg: RunConfig) -> bool | int:
    value = cfg.sharding.reshard_after_forward.lower()
    if value == "auto":
        return RESHARD_AFTER_FORWARD[cfg.sharding.strategy]
    if value in ("true", "false"):
        return value == "true"
    return int(value)


def mp_policy(cfg: RunConfig, root: bool) -> MixedPrecisionPolicy:
    """``output_dtype`` goes to the root only: inner units' outputs feed modules that compute in
    ``param_dtype`` and are not themselves units (the final norm and output projection)."""
    p = cfg.precision
    return MixedPrecisionPolicy(
        param_dtype=dtype_of(p.param_dtype),
        reduce_dtype=dtype_of(p.reduce_dtype),
        output_dtype=dtype_of(p.output_dtype) if p.output_dtype and root else None,
        cast_forward_inputs=p.cast_forward_inputs,
    )


def offload_policy(cfg: RunConfig, device_type: str) -> OffloadPolicy:
    if not cfg.offload.params:
        return OffloadPolicy()
    pin = cfg.offload.pin_memory if cfg.offload.pin_memory is not None else device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=pin)


def apply(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
    """Shard ``model`` (on meta) in place, materialize this rank's shards, initialize them."""
    common = dict(mesh=mesh, mp_policy=mp_policy(cfg, root=False), offload_policy=offload_policy(cfg, mesh.device_type))
    reshard = reshard_after_forward(cfg)
    units = unit_names(model, cfg)
    chain = top_level(units)
    applied_units: list[dict] = []
    for name in units:
        # The last unit in forward is the first in backward: resharding it would all-gather it again at once.
        keep_last = name == chain[-1] and reshard is not False and not cfg.sharding.reshard_last_block
        kwargs = {**common, "reshard_after_forward": False if keep_last else reshard}
        fully_shard(model.get_submodule(name), **kwargs)
        applied_units.append({"module": name, "fully_shard": describe(kwargs)})
    root_kwargs = {**common, "mp_policy": mp_policy(cfg, root=True), "reshard_after_forward": reshard}
    fully_shard(model, **root_kwargs)
    applied_units.append({"module": "<root>", "fully_shard": describe(root_kwargs)})

    prefetch = _set_prefetch(model, chain, cfg.prefetch.forward, cfg.prefetch.backward)
    for unit in applied_units:
        unit.update(prefetch.get(unit["module"], {}))

    # CPU offload keeps the shards on the host; the device moves them in for compute.
    model.to_empty(device="cpu" if cfg.offload.params else device)
    init_weights(model, cfg.trainer.seed, device)
    return model, {
        "backend": "fsdp2",
        "api": "torch.distributed.fsdp.fully_shard",
        "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
        "num_units": len(applied_units),
        "units": applied_units,
    }, Runtime()


def _set_prefetch(model: nn.Module, chain: list[str], forward: int, backward: int | None) -> dict:
    """Explicit prefetch lists over the top-level units: unit i gathers the next ``forward`` units early
    in forward and the previous ``backward`` units (nearest first) early in backward."""
    applied: dict[str, dict] = {}
    modules = [model.get_submodule(name) for name in chain]
    for i, (name, module) in enumerate(zip(chain, modules)):
        ahead = list(range(i + 1, min(len(chain), i + 1 + forward)))
        if ahead:
            module.set_modules_to_forward_prefetch([modules[j] for j in ahead])
        entry = {"forward_prefetch": [chain[j] for j in ahead]}
        if backward is None:
            entry["backward_prefetch"] = "implicit"
        else:
            behind = list(range(i - 1, max(-1, i - 1 - backward), -1))
            if behind:
                module.set_modules_to_backward_prefetch([modules[j] for j in behind])
            entry["backward_prefetch"] = [chain[j] for j in behind]
        applied[name] = entry
    return applied


class Runtime:
    """What the training step needs from the backend."""

    @staticmethod
    def gradient_sync(model: nn.Module, enabled: bool):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    @staticmethod
    def autocast():
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts parameters instead

    @staticmethod
    def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global L2 norm over all gradients, then clip. Gradients can live on different meshes (with
        tensor parallel, norm weights are sharded by FSDP only, matrices by FSDP and TP), and DTensor
        cannot combine norms across meshes: take each mesh's norm, then combine the plain numbers."""
        params = [p for p in model.parameters() if p.grad is not None]
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
        norms = []
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.stack(norms).square().sum().sqrt()
        coef = max_norm / (total.item() + 1e-6)  # the same rule as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for grads in by_mesh.values():  # a plain float scales each mesh's gradients in place
                torch._foreach_mul_(grads, coef)
        return total

    @staticmethod
    def grad_scaler(device: torch.device):
        import warnings

        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # The found-inf flag is a 1-element tensor that DTensor ops replicate implicitly; that is the
        # intent, so the warning it triggers on every step is noise.
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
        return ShardedGradScaler(device=device.type)  # all-reduces inf checks over the shards
