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
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.config import RunConfig
from fsdp_exp.models import canonical_name, init_weights
from fsdp_exp.parallel.backend import Backend, PlannerRules
from fsdp_exp.parallel.common import describe, dtype_of, refuse_zero_only_knobs, unit_label
from fsdp_exp.parallel.placement import shard_dim
from fsdp_exp.parallel.wrap import top_level, unit_names

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

# torch.distributed.fsdp and DTensor are imported where they are used: loading them takes seconds, and
# the config checks, the planner and the docs ask this module only about the config.

RESHARD_AFTER_FORWARD = {"full": True, "grad_op": False, "hybrid": True, "no_shard": False}
MESH = {
    "full": "1-D mesh (shard)",
    "grad_op": "1-D mesh (shard)",
    "hybrid": "2-D mesh (replicate, shard)",
    "no_shard": "2-D mesh (world, 1)",
}


def reshard_after_forward(cfg: RunConfig) -> bool | int:
    value = cfg.sharding.reshard_after_forward.lower()
    if value == "auto" and cfg.parallel.pp > 1:
        # Pipeline stages keep their units unsharded between the micro-batches of a step (torchtitan's default
        # under PP): resharding would all-gather every unit again for each micro-batch.
        return False
    if value == "auto":
        return RESHARD_AFTER_FORWARD[cfg.sharding.strategy]
    if value in ("true", "false"):
        return value == "true"
    return int(value)


def mp_policy(cfg: RunConfig, root: bool) -> MixedPrecisionPolicy:
    """``output_dtype`` goes to the root only: inner units' outputs feed modules that compute in
    ``param_dtype`` and are not themselves units (the final norm and output projection)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = cfg.precision
    return MixedPrecisionPolicy(
        param_dtype=dtype_of(p.param_dtype),
        reduce_dtype=dtype_of(p.reduce_dtype),
        output_dtype=dtype_of(p.output_dtype) if p.output_dtype and root else None,
        cast_forward_inputs=p.cast_forward_inputs,
    )


def offload_policy(cfg: RunConfig, device_type: str) -> OffloadPolicy:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not cfg.offload.params:
        return OffloadPolicy()
    pin = cfg.offload.pin_memory if cfg.offload.pin_memory is not None else device_type == "cuda"
    return CPUOffloadPolicy(pin_memory=pin)


def _placement(mesh: DeviceMesh):
    """``fully_shard``'s ``shard_placement_fn`` over ``mesh`` (its last dim is the shard group): the dim
    ``fsdp_exp.parallel.placement`` picks for each parameter's local tensor (an expert-parallel DTensor's
    experts of this rank), ``None`` (FSDP2's default ``Shard(0)``) for dim 0."""
    from torch.distributed.tensor import DTensor, Shard

    group = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter):
        shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
        dim = shard_dim(tuple(shape), group)
        return Shard(dim) if dim else None

    return placement


def _off_dim0(module: nn.Module) -> dict[str, str]:
    """The parameters of a sharded model that FSDP2 holds on a dim other than 0, for the run record."""
    from torch.distributed.tensor import DTensor

    found = {}
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            dims = [p.dim for p in param.placements if p.is_shard()]
            if dims and dims[0]:  # the first shard placement is FSDP's (the mesh's outer dims come first)
                found[canonical_name(name)] = str(param.placements)
    return found


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


class FSDP2(Backend):
    name = "fsdp2"
    api = "torch.distributed.fsdp.fully_shard"
    float8_refusal = None
    float8_all_gather = True  # torchao extends fully_shard's all-gather (fsdp_pre_all_gather)
    strategies = tuple(RESHARD_AFTER_FORWARD)
    stage_strategies = ("full", "hybrid")  # FSDP and HSDP inside pipeline stages (parallel/pipeline.py)
    column_title = "FSDP2 (`fully_shard`)"

    # -------------------------------------------------------------------------------- BackendChecks
    def check(self, cfg: RunConfig, device_type: str) -> None:
        s, p, pf = cfg.sharding, cfg.precision, cfg.prefetch
        refuse_zero_only_knobs(self, cfg)
        if pf.backward == 0:
            self.refuse(
                "prefetch.backward=0",
                "FSDP2 always prefetches at least one unit in backward (an empty "
                "prefetch list means its implicit one).",
                "pass prefetch.backward=null (FSDP2's implicit one unit) or a depth of 1 or more",
            )
        if pf.backward_timing != "pre":
            self.refuse(
                "prefetch.backward_timing=post",
                "FSDP2 issues backward prefetch before a unit's gradient computation only (FSDP1's BACKWARD_PRE).",
                "drop it, or pass sharding.backend=fsdp1",
            )
        if pf.limit_all_gathers is not None:
            self.refuse(
                "prefetch.limit_all_gathers",
                "FSDP2 always bounds in-flight all-gathers by its own stream synchronization; there is no switch.",
                "drop it; tune prefetch.forward / prefetch.backward",
            )
        for knob in ("use_orig_params", "sync_module_states"):
            if getattr(s, knob) is not None:
                self.refuse(
                    f"sharding.{knob}",
                    "FSDP2 always keeps the original parameters (as DTensors) and "
                    "fsdp_exp initializes every shard identically by seed.",
                    f"drop sharding.{knob}",
                )
        if p.buffer_dtype is not None:
            self.refuse(
                "precision.buffer_dtype",
                "FSDP2's MixedPrecisionPolicy has no buffer dtype (buffers keep their dtype).",
                "drop precision.buffer_dtype",
            )
        if s.reshard_after_forward.isdigit() and s.strategy == "no_shard":
            self.refuse(
                "an integer sharding.reshard_after_forward",
                "no_shard has nothing to reshard.",
                "pass sharding.reshard_after_forward=auto",
            )

    # --------------------------------------------------------------------------------- BackendBuild
    def apply(self, model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
        """Shard ``model`` (on meta) in place, materialize this rank's shards, initialize them."""
        from torch.distributed.fsdp import fully_shard

        common = dict(
            mesh=mesh, mp_policy=mp_policy(cfg, root=False), offload_policy=offload_policy(cfg, mesh.device_type)
        )
        reshard = reshard_after_forward(cfg)
        units = unit_names(model, cfg)
        if cfg.precision.storage_dtype != "fp32":
            # fully_shard keeps each parameter's dtype in its shard (MixedPrecisionPolicy casts only the gathered
            # copy): cast the parameters (not the buffers) first, so the shards, their gradients and AdamW's moments
            # are stored in that dtype. ``.data`` keeps tied parameters one tensor.
            dtype = dtype_of(cfg.precision.storage_dtype)
            for param in model.parameters():
                param.data = param.data.to(dtype)
        chain = top_level(units)
        applied_units: list[dict] = []
        # Expert parallel's experts first (parallel/expert.py): their own unit, over the ranks EP leaves them.
        for name, module in model.named_modules():
            if getattr(module, "efsdp_mesh", None) is not None:
                # Sharded over one rank (ep = the shard ranks), the experts' unit gathers nothing: its unsharded
                # parameters are a cast of this rank's own, made again in backward at no communication. Kept
                # past forward (grad_op) they would hold every layer's experts in param_dtype at once.
                alone = module.efsdp_mesh.size(module.efsdp_mesh.ndim - 1) == 1
                kwargs = {**common, "mesh": module.efsdp_mesh, "reshard_after_forward": True if alone else reshard}
                fully_shard(module, **kwargs, shard_placement_fn=_placement(module.efsdp_mesh))
                applied_units.append({"module": name, "fully_shard": describe(kwargs)})
        sharded = {unit["module"] for unit in applied_units}
        units = [name for name in units if canonical_name(name) not in {canonical_name(n) for n in sharded}]
        for name in units:
            # The last unit in forward is the first in backward: resharding it would all-gather it again.
            keep_last = name == chain[-1] and reshard is not False and not cfg.sharding.reshard_last_block
            kwargs = {**common, "reshard_after_forward": False if keep_last else reshard}
            fully_shard(model.get_submodule(name), **kwargs, shard_placement_fn=_placement(mesh))
            applied_units.append({"module": name, "fully_shard": describe(kwargs)})
        root_kwargs = {**common, "mp_policy": mp_policy(cfg, root=True), "reshard_after_forward": reshard}
        fully_shard(model, **root_kwargs, shard_placement_fn=_placement(mesh))
        applied_units.append({"module": "<root>", "fully_shard": describe(root_kwargs)})

        # Pipeline stages gather each unit once a step and keep it (reshard_after_forward=False): nothing to prefetch
        prefetch = (
            _set_prefetch(model, chain, cfg.prefetch.forward, cfg.prefetch.backward) if cfg.parallel.pp == 1 else {}
        )
        for unit in applied_units:
            unit.update(prefetch.get(unit["module"], {}))

        # CPU offload keeps the shards on the host; the device moves them in for compute.
        model.to_empty(device="cpu" if cfg.offload.params else device)
        init_weights(model, cfg.trainer.seed, device)
        return model, {
            "backend": self.name,
            "api": self.api,
            "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
            "num_units": len(applied_units),
            "units": applied_units,
            # stacked weights whose experts the group does not divide (fsdp_exp.parallel.placement)
            "sharded_off_dim0": _off_dim0(model),
        }

    # ---------------------------------------------------------------------------------- BackendStep
    def gradient_sync(self, model: nn.Module, reduce: bool, last: bool):
        # True: the post-backward reduce-scatters the unit's gradient and adds it to the sharded one, then
        # frees the unsharded one (parameters reshard after backward: FSDP2's default, never changed here).
        # False: the unsharded gradient stays and accumulates until a micro-batch that reduces.
        model.set_requires_gradient_sync(reduce)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global L2 norm over all gradients, then clip. Gradients can live on different meshes (with
        tensor parallel, norm weights are sharded by FSDP only, matrices by FSDP and TP), and DTensor
        cannot combine norms across meshes: take each mesh's norm, then combine the plain numbers."""
        from torch.distributed.tensor import DTensor

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

    def grad_scaler(self, device: torch.device):
        import warnings

        # The found-inf flag is a 1-element tensor that DTensor ops replicate implicitly; that is the
        # intent, so the warning it triggers on every step is noise.
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
        return super().grad_scaler(device)

    # ---------------------------------------------------------------------------- BackendInspection
    def inspect(self, model: nn.Module) -> list[dict]:
        """Per unit: its prefetch lists, mesh, resharding, mixed-precision and offload policies, read from
        FSDP2's own state (torch internals, on purpose and only here)."""
        from torch.distributed.fsdp import FSDPModule

        states = {}
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                states[id(module._get_fsdp_state())] = unit_label(name)
        units = []
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            group = state._fsdp_param_groups[0] if state._fsdp_param_groups else None
            unit = {
                "module": unit_label(name),
                "forward_prefetch": [states[id(s)] for s in state._states_to_forward_prefetch],
                "backward_prefetch": [states[id(s)] for s in state._states_to_backward_prefetch],
            }
            if group is not None:
                post = group.post_forward_mesh_info
                unit.update(
                    num_params=len(group.fsdp_params),
                    mesh_shape=list(group.mesh_info.mesh.mesh.shape),
                    reshard_after_forward=False
                    if post is None
                    else (True if post.shard_mesh_size == group.mesh_info.shard_mesh_size else post.shard_mesh_size),
                    mp_policy=describe(group.mp_policy),
                    # what the shards are stored in (precision.storage_dtype): fp32 masters, or the model's cast
                    sharded_dtypes=sorted(
                        {str(p.sharded_param.dtype).removeprefix("torch.") for p in group.fsdp_params}
                    ),
                    offload=type(group.offload_policy).__name__,
                )
            units.append(unit)
        return units

    def memory_tracker(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)  # tells sharded from unsharded, and the comm buffers

    # ------------------------------------------------------------------------------ BackendPlanning
    def planner_rules(self, cfg: RunConfig) -> PlannerRules:
        return PlannerRules(
            param_layout="dim0",
            gathers_units=True,
            autocast=False,
            root_output_dtype=cfg.precision.output_dtype,
            # an integer group still frees the unit's unsharded copy after forward
            reshard_after_forward=reshard_after_forward(cfg) is not False,
            gradient_buckets=False,
            offloads=True,
        )

    # ---------------------------------------------------------------------------------- BackendDocs
    def vocabulary(self) -> dict[str, str]:
        rows = {
            f"sharding={strategy}": f"`reshard_after_forward={reshard}`, {MESH[strategy]}"
            for strategy, reshard in RESHARD_AFTER_FORWARD.items()
        }
        return {
            **rows,
            "sharding.reshard_after_forward=N": "`reshard_after_forward=N` (reshard to groups of N ranks)",
            "sharding.reshard_last_block": "last block's `reshard_after_forward` (default: false)",
            "precision.param_dtype": "`MixedPrecisionPolicy(param_dtype)`",
            "precision.storage_dtype=bf16": "the model cast to bf16 before `fully_shard` (bf16 shards)",
            "precision.reduce_dtype": "`MixedPrecisionPolicy(reduce_dtype)`",
            "precision.output_dtype": "root's `MixedPrecisionPolicy(output_dtype)`",
            "precision.cast_forward_inputs": "`MixedPrecisionPolicy(cast_forward_inputs)`",
            "precision.loss_scaler=dynamic": "`ShardedGradScaler`",
            "offload=params": "`CPUOffloadPolicy(pin_memory)`",
            "prefetch.forward=k": "`set_modules_to_forward_prefetch` (next k units)",
            "prefetch.backward=k": "`set_modules_to_backward_prefetch` (previous k units); null = implicit; 0 refused",
            "prefetch.backward_timing": "pre only",
            "wrap=block": "`fully_shard` per transformer block, then the root",
            "wrap=size": "`fully_shard` per module by the size rule",
            "wrap=experts": "`fully_shard` per layer's stacked experts, then per block",
            "wrap=none": "`fully_shard` on the root only",
            "ac=full / selective / selective_op": "`checkpoint_wrapper` on blocks, before sharding",
            "trainer.grad_sync=every_micro_batch": "`set_requires_gradient_sync(True)` every micro-batch (auto)",
            "trainer.grad_sync=last_micro_batch": "`set_requires_gradient_sync(False)` until the last micro-batch",
            "compile=true": "`Module.compile()` per block, before sharding",
            "parallel.tp=N": "`parallelize_module` (Colwise / Rowwise; torchao's float8 styles under tensorwise float8) on a "
            "(dp, tp) mesh",
            "parallel.pp=N": "each `PipelineStage` runs the pp=1 recipe (TP, EP, CP, AC, compile, `fully_shard`) on "
            "its slice of a (pp, dp[, cp][, tp]) mesh, over (replicate, shard) of dp under `sharding=hybrid` "
            "(docs/pipeline.md)",
            "parallel.cp=N": "`fully_shard` over shard x cp; each attention kernel wrapped: all-to-all of heads for "
            "sequence, or torch's ring `_ContextParallel` on CUDA (docs/context_parallel.md)",
        }


BACKEND = FSDP2()
