"""Read back, from the live wrapped model, the settings each sharding unit actually has.

The applied settings record what fsdp_exp handed to torch; this reads what torch holds (module
classes and the wrappers' own state), so a test can prove a knob reached the API without trusting
the config. It reaches into torch internals on purpose and only here; if a torch release moves them,
this module is the one to adapt.
"""

from __future__ import annotations

from torch import nn

from fsdp_exp.models import canonical_name
from fsdp_exp.parallel.common import describe


def _name(name: str) -> str:
    return canonical_name(name) or "<root>"


def inspect_fsdp2(model: nn.Module) -> list[dict]:
    from torch.distributed.fsdp import FSDPModule

    states = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            states[id(module._get_fsdp_state())] = _name(name)
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_groups[0] if state._fsdp_param_groups else None
        unit = {"module": _name(name),
                "forward_prefetch": [states[id(s)] for s in state._states_to_forward_prefetch],
                "backward_prefetch": [states[id(s)] for s in state._states_to_backward_prefetch]}
        if group is not None:
            post = group.post_forward_mesh_info
            unit.update(
                num_params=len(group.fsdp_params),
                mesh_shape=list(group.mesh_info.mesh.mesh.shape),
                reshard_after_forward=False if post is None else (
                    True if post.shard_mesh_size == group.mesh_info.shard_mesh_size else post.shard_mesh_size),
                mp_policy=describe(group.mp_policy),
                offload=type(group.offload_policy).__name__,
            )
        units.append(unit)
    return units


def inspect_fsdp1(model: nn.Module) -> list[dict]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDP):
            continue
        handle = module._handle
        units.append({
            "module": _name(name),
            "sharding_strategy": module.sharding_strategy.name,
            "mixed_precision": describe(module.mixed_precision),
            "backward_prefetch": module.backward_prefetch.name if module.backward_prefetch else None,
            "forward_prefetch": module.forward_prefetch,
            "limit_all_gathers": module.limit_all_gathers,
            "use_orig_params": module._use_orig_params,
            "offload_params": module.cpu_offload.offload_params,
            "shard_group_size": module.process_group.size(),
            "num_params": len(handle.flat_param._fqns) if handle is not None else 0,
        })
    return units


def inspect_ddp(model: nn.Module) -> list[dict]:
    hooks = [hook.__name__ for hook, _state in getattr(model, "_comm_hooks", [])]
    return [{"module": "<root>", "class": type(model).__name__, "comm_hooks": hooks,
             "process_group_size": model.process_group.size(), "num_params": len(list(model.parameters()))}]


def inspect(model: nn.Module, backend: str) -> list[dict]:
    return {"fsdp2": inspect_fsdp2, "fsdp1": inspect_fsdp1, "ddp": inspect_ddp}[backend](model)
