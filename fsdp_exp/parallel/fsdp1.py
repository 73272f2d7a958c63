"""FSDP1 (``FullyShardedDataParallel``): the same vocabulary, translated to its arguments.

    sharding=full -> FULL_SHARD, grad_op -> SHARD_GRAD_OP, no_shard -> NO_SHARD,
    hybrid -> HYBRID_SHARD, always with the 2-D (replicate, shard) device mesh: without one, FSDP1
    silently falls back to a shard group of one rank and never syncs gradients across nodes.

FSDP1 wraps the model in a new module. It is built on the meta device; ``param_init_fn``
materializes one module at a time as FSDP1 reaches it and fills each parameter from the seed by its
name, so every unit is whole on a rank only while FSDP1 flattens and shards it.
"""

from __future__ import annotations

import functools
import warnings

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.config import RunConfig
from fsdp_exp.models import canonical_name, full_param_init, spec_for, spec_of
from fsdp_exp.parallel.backend import Backend, PlannerRules
from fsdp_exp.parallel.common import (
    describe,
    dtype_of,
    refuse_bf16_storage,
    refuse_fsdp2_only_knobs,
    refuse_zero_only_knobs,
    unit_label,
)
from fsdp_exp.parallel.digests import tensor_hash
from fsdp_exp.parallel.wrap import unit_names

if TYPE_CHECKING:
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

# torch.distributed.fsdp is imported where it is used: loading it takes seconds, and the config checks,
# the planner and the docs ask this module only about the config.

# sharding strategy -> the member of FSDP1's ShardingStrategy it becomes
STRATEGY_NAMES = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD", "hybrid": "HYBRID_SHARD"}


def sharding_strategy(strategy: str) -> ShardingStrategy:
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy[STRATEGY_NAMES[strategy]]


def mixed_precision(cfg: RunConfig) -> MixedPrecision | None:
    from torch.distributed.fsdp import MixedPrecision

    p = cfg.precision
    if p.param_dtype == p.reduce_dtype == "fp32" and p.buffer_dtype in (None, "fp32"):
        return None  # nothing to cast
    return MixedPrecision(
        param_dtype=dtype_of(p.param_dtype),
        reduce_dtype=dtype_of(p.reduce_dtype),
        buffer_dtype=dtype_of(p.buffer_dtype) if p.buffer_dtype else None,
        cast_forward_inputs=p.cast_forward_inputs,
    )


def backward_prefetch(cfg: RunConfig) -> BackwardPrefetch | None:
    from torch.distributed.fsdp import BackwardPrefetch

    if cfg.prefetch.backward == 0:
        return None
    return BackwardPrefetch.BACKWARD_POST if cfg.prefetch.backward_timing == "post" else BackwardPrefetch.BACKWARD_PRE


def auto_wrap_policy(model: nn.Module, cfg: RunConfig):
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, size_based_auto_wrap_policy

    policy = cfg.wrap.policy
    if policy == "none":
        return None
    if policy == "block":
        return ModuleWrapPolicy({spec_for(cfg.model).block_class_of(cfg.model)})
    if policy == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.wrap.min_num_params)
    chosen = {id(model.get_submodule(name)) for name in unit_names(model, cfg)}  # experts, then blocks
    return CustomPolicy(lambda module: id(module) in chosen)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")


class FSDP1(Backend):
    name = "fsdp1"
    api = "torch.distributed.fsdp.FullyShardedDataParallel"
    float8_refusal = (
        "torchao documents float8 training under FSDP2 (per-parameter sharding), not FSDP1's flat "
        "parameters, and fsdp_exp has not checked it there."
    )
    strategies = tuple(STRATEGY_NAMES)
    checkpoints_inside_units = True  # FSDP(checkpoint(block)): see BackendChecks.checkpoints_inside_units
    tracks_memory = False  # torch's MemTracker cannot hook FSDP1's parameters (views into flat parameters)
    column_title = "FSDP1 (`FullyShardedDataParallel`)"

    # -------------------------------------------------------------------------------- BackendChecks
    def check(self, cfg: RunConfig, device_type: str) -> None:
        refuse_fsdp2_only_knobs(self, cfg)
        refuse_zero_only_knobs(self, cfg)
        refuse_bf16_storage(self, cfg)
        s, pf = cfg.sharding, cfg.prefetch
        if pf.forward > 1 or (pf.backward or 0) > 1:
            self.refuse(
                f"prefetch depth forward={pf.forward} backward={pf.backward}",
                "FSDP1 prefetches exactly one unit (forward_prefetch, backward_prefetch).",
                "pass prefetch.forward and prefetch.backward of 0 or 1, or sharding.backend=fsdp2",
            )
        if device_type == "cpu" and s.sync_module_states:
            self.refuse(
                "sharding.sync_module_states=true on CPU",
                "torch's FSDP1 refuses to broadcast CPU parameters.",
                "drop it (fsdp_exp initializes every rank identically) or run on CUDA",
            )
        if device_type == "cpu" and cfg.offload.params:
            self.refuse(
                "offload=params on CPU-only torch",
                "FSDP1's CPUOffload pins host memory, which needs CUDA.",
                "pass offload=none, or sharding.backend=fsdp2 (its CPUOffloadPolicy runs unpinned)",
            )
        if s.use_orig_params is False and cfg.optim.weight_decay > 0:
            self.refuse(
                "sharding.use_orig_params=false with weight decay",
                "flat parameters mix matrices and norm weights, so weight decay could not skip the norms.",
                "pass optim.weight_decay=0, or drop sharding.use_orig_params=false",
            )
        if cfg.ac.ops != "none" and cfg.wrap.policy in ("size", "experts"):
            # A unit inside a checkpointed block gathers its parameters in the forward but not in the
            # recomputation (FSDP1 skips a unit's pre-forward there), so op-level checkpointing, which
            # replays the block's ops one by one, finds ops it never saw.
            self.refuse(
                f"ac.ops={cfg.ac.ops} with wrap={cfg.wrap.policy}",
                "FSDP1's units inside a checkpointed block run other ops in the recomputation than in the "
                "forward, which op-level checkpointing cannot replay.",
                "pass wrap=block, ac=full or ac=selective (whole blocks), or sharding.backend=fsdp2",
            )
        if cfg.compile and s.use_orig_params is False:
            self.refuse(
                "compile=true with sharding.use_orig_params=false",
                "torch.compile needs the original parameters.",
                "drop sharding.use_orig_params=false",
            )

    # --------------------------------------------------------------------------------- BackendBuild
    def apply(self, model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
        """Wrap ``model`` (on meta); ``param_init_fn`` materializes and seeds each module as FSDP1 reaches it."""
        from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

        seed = cfg.trainer.seed
        names = {id(p): n for n, p in model.named_parameters()}  # a tied tensor: by its first name, as init_weights
        # A tied parameter (one tensor in two modules) is materialized once; the second module gets the
        # same tensor again, where its own to_empty would have made it a copy of its own.
        materialized: dict[int, nn.Parameter] = {}

        @torch.no_grad()
        def param_init_fn(module: nn.Module) -> None:
            pending = [(attr, p) for attr, p in module.named_parameters(recurse=False) if p.is_meta]
            module.to_empty(device=device, recurse=False)
            for attr, meta in pending:
                if id(meta) in materialized:
                    setattr(module, attr, materialized[id(meta)])
                    continue
                param = getattr(module, attr)
                param.copy_(full_param_init(model, names[id(meta)], param.shape, seed, device))
                materialized[id(meta)] = param

        kwargs = dict(
            sharding_strategy=sharding_strategy(cfg.sharding.strategy),
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
        spec_of(wrapped.module).init_buffers(wrapped.module, device)
        units = [name or "<root>" for name, m in wrapped.named_modules() if isinstance(m, FullyShardedDataParallel)]
        return wrapped, {
            "backend": self.name,
            "api": self.api,
            "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())}
            if "device_mesh" in kwargs
            else {"process_group": "default (all ranks)"},
            "num_units": len(units),
            "units": [{"module": _clean(u)} for u in units],
            "FullyShardedDataParallel": describe({**kwargs, "param_init_fn": "materialize + seed-by-name init"}),
        }

    # ---------------------------------------------------------------------------------- BackendStep
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)  # reduces the norm over the shards

    # ---------------------------------------------------------------------------- BackendInspection
    def inspect(self, model: nn.Module) -> list[dict]:
        """Per wrapped unit: the FullyShardedDataParallel settings it holds and its flat parameter's size."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = []
        for name, module in model.named_modules():
            if not isinstance(module, FullyShardedDataParallel):
                continue
            handle = module._handle
            units.append(
                {
                    "module": unit_label(name),
                    "sharding_strategy": module.sharding_strategy.name,
                    "mixed_precision": describe(module.mixed_precision),
                    "backward_prefetch": module.backward_prefetch.name if module.backward_prefetch else None,
                    "forward_prefetch": module.forward_prefetch,
                    "limit_all_gathers": module.limit_all_gathers,
                    "use_orig_params": module._use_orig_params,
                    "offload_params": module.cpu_offload.offload_params,
                    "shard_group_size": module.process_group.size(),
                    "num_params": len(handle.flat_param._fqns) if handle is not None else 0,
                }
            )
        return units

    def init_digests(self, model: nn.Module, seed: int) -> list[dict]:
        """FSDP1 keeps each unit's parameters in one flat parameter; this rank holds a contiguous piece of
        it, i.e. a ``[start, end]`` range of some of the flattened original tensors."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = model.module
        rows = []
        for prefix, unit in model.named_modules():
            if not isinstance(unit, FullyShardedDataParallel) or unit._handle is None:
                continue
            flat = unit._handle.flat_param
            base = canonical_name(prefix)
            for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
                if not info.in_shard:
                    continue
                name = canonical_name(f"{base}.{fqn}" if base else fqn)
                local = flat.data[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                start, end = info.intra_param_start_idx, info.intra_param_end_idx
                full = full_param_init(root, name, shape, seed, local.device).flatten()[start : end + 1]
                rows.append(
                    {
                        "name": name,
                        "slice": f"flat [{start}, {end}]",
                        "hash": tensor_hash(local),
                        "expected": tensor_hash(full.to(local.dtype)),
                    }
                )
        return rows

    # ------------------------------------------------------------------------- BackendCheckpointing
    def quiet_checkpoint_warnings(self) -> None:
        # FSDP1's sharded state dicts go through ShardedTensor, which warns on every tensor at save/load.
        warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor")

    def full_state_dict(self, model: nn.Module) -> dict:
        """On a CPU device FSDP1's offload of each gathered tensor "to the CPU" frees it under the
        state-dict hook, which then crashes (SIGSEGV) cloning it: there every rank gathers without
        offload, and only rank 0 keeps the result. Elsewhere as every backend (rank 0 only, on the CPU)."""
        from fsdp_exp.export import full_state_dict

        return full_state_dict(model, cpu_offload=model.compute_device.type != "cpu")

    # ------------------------------------------------------------------------------ BackendPlanning
    def planner_rules(self, cfg: RunConfig) -> PlannerRules:
        return PlannerRules(
            param_layout="flat",
            gathers_units=True,
            autocast=False,
            root_output_dtype=None,
            reshard_after_forward=cfg.sharding.strategy in ("full", "hybrid"),
            gradient_buckets=False,
            offloads=True,
            notes=("FSDP1's peak follows FSDP2's schedule (torch's tracker cannot measure FSDP1)",),
        )

    # ---------------------------------------------------------------------------------- BackendDocs
    def vocabulary(self) -> dict[str, str]:
        rows = {
            f"sharding={strategy}": f"`ShardingStrategy.{name}`"
            + (" with the 2-D `device_mesh`" if strategy == "hybrid" else "")
            for strategy, name in STRATEGY_NAMES.items()
        }
        return {
            **rows,
            "precision.param_dtype": "`MixedPrecision(param_dtype)`",
            "precision.reduce_dtype": "`MixedPrecision(reduce_dtype)`",
            "precision.buffer_dtype": "`MixedPrecision(buffer_dtype)`",
            "precision.cast_forward_inputs": "`MixedPrecision(cast_forward_inputs)`",
            "precision.loss_scaler=dynamic": "`ShardedGradScaler`",
            "offload=params": "`CPUOffload(offload_params=True)` (CUDA only)",
            "prefetch.forward=k": "`forward_prefetch=k>0` (k <= 1)",
            "prefetch.backward=k": "`backward_prefetch`: 0 = None, else by timing (k <= 1)",
            "prefetch.backward_timing": "`BackwardPrefetch.BACKWARD_PRE` / `BACKWARD_POST`",
            "prefetch.limit_all_gathers": "`limit_all_gathers`",
            "wrap=block": "`ModuleWrapPolicy({block})`",
            "wrap=size": "`size_based_auto_wrap_policy(min_num_params)`",
            "wrap=experts": "`CustomPolicy` (experts, then blocks)",
            "wrap=none": "no `auto_wrap_policy`",
            "sharding.use_orig_params": "`use_orig_params` (default true)",
            "sharding.sync_module_states": "`sync_module_states` (CUDA only)",
            "ac=full / selective / selective_op": "`checkpoint_wrapper` on blocks inside their units, after wrapping",
            "trainer.grad_sync=every_micro_batch": "no `no_sync()`: each backward reduce-scatters (auto)",
            "trainer.grad_sync=last_micro_batch": "`no_sync()` until the last micro-batch",
            "compile=true": "same (needs use_orig_params)",
        }


BACKEND = FSDP1()
