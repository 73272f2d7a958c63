"""Which modules become their own sharding units (the wrap policy), as data both FSDP APIs share.

FSDP2 calls ``fully_shard`` on each unit, children before parents; FSDP1 gets the equivalent
``auto_wrap_policy`` object. Both are derived from the same rule, so ``wrap=size`` means the same
units under either API.
"""

from __future__ import annotations

from torch import nn

from fsdp_exp.config import RunConfig
from fsdp_exp.models import WRAPPER_COMPONENTS, spec_for


def blocks(model: nn.Module, cfg: RunConfig) -> list[str]:
    """Names of the transformer blocks (an activation-checkpoint wrapper stands for its block)."""
    block_class = spec_for(cfg.model).block_class_of(cfg.model)
    return [
        name
        for name, m in model.named_modules()
        if _unwrap(m).__class__ is block_class and name.rpartition(".")[2] not in WRAPPER_COMPONENTS
    ]


def unit_names(model: nn.Module, cfg: RunConfig) -> list[str]:
    """Qualified names of the units below the root, children before their parents."""
    policy = cfg.wrap.policy
    if policy == "none":
        return []
    if policy == "block":
        return blocks(model, cfg)
    if policy == "experts":
        expert_names = spec_for(cfg.model).expert_modules(model)
        units = []
        for block in blocks(model, cfg):
            units += [e for e in expert_names if e.startswith(block + ".")] + [block]
        return units
    return size_based_units(model, cfg.wrap.min_num_params)


def size_based_units(model: nn.Module, min_num_params: int) -> list[str]:
    """FSDP1's size_based_auto_wrap_policy as a list: visiting children first, a module becomes a unit
    when the parameters it holds outside units already chosen reach ``min_num_params``, unless it holds
    one end of a tied parameter only (an input embedding tied to the output projection): a tied tensor
    must stay in one unit."""
    from collections import Counter

    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    units: list[str] = []

    def splits_a_tie(module: nn.Module) -> bool:
        inside = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        return any(uses[key] > 1 and count < uses[key] for key, count in inside.items())

    def visit(name: str, module: nn.Module) -> int:
        unwrapped = sum(
            visit(f"{name}.{child_name}" if name else child_name, child)
            for child_name, child in module.named_children()
        )
        unwrapped += sum(p.numel() for p in module.parameters(recurse=False))
        if name and unwrapped >= min_num_params and not splits_a_tie(module):
            units.append(name)
            return 0
        return unwrapped

    visit("", model)
    return units


def top_level(units: list[str]) -> list[str]:
    """The units not nested in another unit, in forward order: the chain prefetching walks."""
    return [u for u in units if not any(u.startswith(other + ".") for other in units if other != u)]


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside an activation-checkpoint or compile wrapper."""
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        module = getattr(module, attr, module)
    return module
