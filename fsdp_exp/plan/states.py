"""Model states: every parameter's per-rank size under the backend's layout, the states at rest
(parameters, gradients, AdamW's two moments, all in ``precision.storage_dtype``: fp32 unless FSDP2 stores bf16) and the parameters grouped by where they are
gathered (the root, each block's own unit, units nested in a block).

Reads the model family's inventory (``fsdp_exp.models.spec.Inventory``) and the backend's
``PlannerRules``; knows no parameter's name and no backend's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fsdp_exp.config.layout import efsdp_size
from fsdp_exp.models.spec import Inventory, ParamEntry, config_key
from fsdp_exp.parallel.backend import PlannerRules
from fsdp_exp.parallel.placement import shard_numel

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class ParamInfo:
    name: str
    numel: int  # global
    local_numel: float  # this rank's shard at rest (rank 0: the ceil chunk); a share of a flat unit
    gathered_numel: float  # the unsharded copy FSDP all-gathers (padded), 0 when nothing is gathered
    unit: str  # owning sharding unit ("" = the root)
    block: Optional[int]  # index of the block holding it, or None
    is_matrix: bool
    group: int = 1  # ranks its unit all-gathers over and reduce-scatters to (1: nothing is exchanged)


_UNITS: dict[tuple, list[str]] = {}


def unit_names(spec, cfg) -> list[str]:
    """The sharding units of the model under ``cfg.wrap`` (cached per model and wrap config)."""
    from fsdp_exp.parallel.wrap import unit_names as wrap_units

    key = (config_key(cfg.model), config_key(cfg.wrap))
    if key not in _UNITS:
        if len(_UNITS) >= 64:
            _UNITS.clear()
        _UNITS[key] = wrap_units(spec.meta_model(cfg.model), cfg)
    return _UNITS[key]


def expert_units(spec, cfg) -> tuple[str, ...]:
    """Under expert parallel (``parallel.ep`` > 1) each layer's routed experts are their own sharding unit,
    FSDP2-sharded over the ranks EP leaves them (``fsdp_exp.parallel.fsdp2``: before the wrap policy's units);
    none otherwise. Cached with the wrap's units."""
    if cfg.parallel.ep <= 1:
        return ()
    key = ("experts", config_key(cfg.model))
    if key not in _UNITS:
        _UNITS[key] = spec.expert_modules(spec.meta_model(cfg.model))
    return tuple(_UNITS[key])


def tp_shape(entry: ParamEntry, tp: int) -> tuple[int, ...]:
    """The parameter's shape on one tensor-parallel rank (rank 0: the ceil chunk)."""
    if tp == 1 or entry.tp_dim is None:
        return entry.shape
    shape = list(entry.shape)
    shape[entry.tp_dim] = math.ceil(shape[entry.tp_dim] / tp)
    return tuple(shape)


def param_infos(
    inventory: Inventory,
    units: list[str],
    rules: PlannerRules,
    shard: int,
    tp: int,
    experts: tuple[str, ...] = (),
    ep: int = 1,
) -> list[ParamInfo]:
    """Every parameter with its per-rank sizes under the backend's layout (``rules.param_layout``);
    ``units``: the sharding units (none when the backend gathers no units). Cached per layout (a search plans
    thousands of candidates of one model in a few layouts): read the list, never change it.

    ``experts`` (``expert_units``): under expert parallel over ``ep`` ranks, the routed-expert units. Their
    stacked weights (experts first) are split by expert over the EP group, then each rank's experts/ep are
    chunked over the ``shard / ep`` ranks left ("efsdp"): at rest a rank holds 1/shard of them as without EP,
    but their unit gathers experts/ep only, over the efsdp ranks (none where ep = shard).

    Under ``dim0`` a stacked weight whose experts the group does not divide is laid out on the dim that it
    divides, unpadded (``fsdp_exp.parallel.placement``: the rule FSDP2's ``fully_shard`` is handed)."""
    key = (id(inventory), tuple(units), rules.param_layout, rules.gathers_units, shard, tp, experts, ep)
    if key in _INFOS:
        return _INFOS[key][1]
    unit_set = set(units) | set(experts)
    expert_set = set(experts)
    infos = []
    for entry in inventory.params:
        shape = tp_shape(entry, tp)
        numel = math.prod(shape)
        owner = _owner(entry.name, unit_set)
        group = shard
        if owner in expert_set and ep > 1:  # this rank's experts (dim 0 / ep), then FSDP2 over the efsdp ranks
            shape = (shape[0] // ep, *shape[1:])
            group = efsdp_size(shard, ep)
        if rules.param_layout == "dim0":  # one dim chunked over the shard group (placement.shard_dim), padded
            local = shard_numel(shape, group)  # as torch.chunk does: dim 0, or a stacked weight's even dim
            gathered = local * group
        else:  # flat units (padded below), or replicas
            local, gathered = numel, (numel if rules.gathers_units else 0)
        infos.append(
            ParamInfo(entry.name, entry.numel, local, gathered, owner, entry.block, len(entry.shape) >= 2, group=group)
        )
    if rules.param_layout == "flat":  # one flat parameter per unit, padded to a multiple of the shard group
        for unit in {i.unit for i in infos}:
            members = [i for i in infos if i.unit == unit]
            total = sum(i.numel for i in members)
            per_rank = math.ceil(total / shard)
            for i in members:  # spread the flat shard over its members in proportion
                i.local_numel = per_rank * i.numel / total
                i.gathered_numel = per_rank * shard * i.numel / total
    if len(_INFOS) >= 256:
        _INFOS.clear()
    _INFOS[key] = (inventory, infos)  # holding the inventory keeps its id from being reused
    return infos


_INFOS: dict[tuple, tuple[Inventory, list[ParamInfo]]] = {}


def _owner(name: str, units: set[str]) -> str:
    """The innermost unit holding parameter ``name`` ("" = the root)."""
    parts = name.split(".")
    return next((prefix for k in range(len(parts) - 1, 0, -1) if (prefix := ".".join(parts[:k])) in units), "")


@dataclass
class ModelStates:
    """Parameters, gradients and optimizer state at rest, per rank, in bytes (each with ``total``)."""

    at_rest: dict  # wherever they live
    host: dict  # offloaded to the host
    on_device: dict
    resident: dict  # what counts towards the peak: a CPU run has one memory, offloaded or not
    optimizer_groups: tuple[list[int], list[int]]  # each tensor's stored shard bytes: matrices, the rest
    described: dict  # params / grads / optimizer: what they are, in words (the planner table's notes)


def model_states(
    infos: list[ParamInfo], offload: bool, kind: str, optimizer_shard: int = 1, storage_dtype: str = "fp32"
) -> ModelStates:
    """``optimizer_shard``: ranks the optimizer state is split over beyond the parameters' layout
    (DDP with ZeroRedundancyOptimizer: the data-parallel ranks). ``storage_dtype``: ``precision.storage_dtype``,
    the dtype of the stored parameters, hence of their gradients and of AdamW's moments (``zeros_like`` them)."""
    local = sum(i.local_numel for i in infos)
    e = DTYPE_BYTES[storage_dtype]
    at_rest = {"params": int(e * local), "grads": int(e * local), "optimizer": int(2 * e * local / optimizer_shard)}
    host = dict(at_rest) if offload else {"params": 0, "grads": 0, "optimizer": 0}
    on_device = {k: 0 for k in at_rest} if offload and kind == "cuda" else dict(at_rest)
    for states in (at_rest, host, on_device):
        states["total"] = states["params"] + states["grads"] + states["optimizer"]
    groups = (
        [int(e * i.local_numel) for i in infos if i.is_matrix],
        [int(e * i.local_numel) for i in infos if not i.is_matrix],
    )
    held = "whole on every rank" if local >= sum(i.numel for i in infos) else "this rank's shards"
    described = {
        "params": f"{storage_dtype}, {held}",
        "grads": f"{storage_dtype}, {held}, after backward",
        "optimizer": f"AdamW: two {storage_dtype} moments, "
        + (f"split over {optimizer_shard} ranks" if optimizer_shard > 1 else held),
    }
    return ModelStates(at_rest, host, on_device, at_rest if kind == "cpu" else on_device, groups, described)


def zero_model_states(
    infos: list[ParamInfo],
    stage: int,
    shard: int,
    param_dtype: str,
    offload_params: bool,
    offload_optimizer: bool,
    kind: str,
) -> ModelStates:
    """DeepSpeed's layout (``PlannerRules.zero_stage``), as its engine was measured to hold it
    (``fsdp_exp.parallel.deepspeed_memory``), per parameter with e = the compute dtype's bytes and P = the
    partition over the ``shard`` ranks (one flat partition at stages 1-2, each parameter's at stage 3):

    - params: e, whole at stages 0-2, P at stage 3;
    - grads: e at the accumulation boundary (whole at stage 0, P from stage 1 on: stage 1 reduces into
      the partition at the boundary, as stage 2) plus the fp32 copy of the partition the optimizer step
      makes (4, whenever it is a copy: stages 1-3, or stage 0 in bf16/fp16);
    - optimizer: AdamW's two fp32 moments (8) and the fp32 master copy (4; stages 1-3 clone it even in
      fp32), both P from stage 1 on.

    bf16 stage 3 is 20 bytes per parameter over P (the ZeRO paper's 16 plus the fp32 gradient copy);
    ZeRO-2 is 2 + 18 P, DeepSpeed's own estimate.

    Args:
        infos: every parameter's sizes (``param_infos``).
        stage: the ZeRO stage, 0-3 (``PlannerRules.zero_stage``).
        shard: ranks the partitions are split over.
        param_dtype: ``precision.param_dtype``, the dtype the engine holds the parameters in.
        offload_params: ``offload=params``: parameters and optimizer state on the host.
        offload_optimizer: ``offload=optimizer``: optimizer state on the host.
        kind: the device kind planned for (``cuda`` or ``cpu``; a CPU run has one memory).
    """
    e = DTYPE_BYTES[param_dtype]
    whole = [i.numel for i in infos]
    flat = math.ceil(sum(whole) / shard)
    share = [math.ceil(n / shard) for n in whole] if stage == 3 else [n * flat / sum(whole) for n in whole]
    sized = share if stage >= 1 else whole  # what the optimizer states and gradients are
    copies = stage >= 1 or e != 4  # fp32 master and step gradients are separate tensors
    params = e * sum(share if stage == 3 else whole)
    grads = e * sum(sized) + (4 * sum(sized) if copies else 0)
    optimizer = 8 * sum(sized) + (4 * sum(sized) if copies else 0)
    at_rest = {"params": int(params), "grads": int(grads), "optimizer": int(optimizer)}
    host = {
        "params": at_rest["params"] if offload_params else 0,
        "grads": 0,
        "optimizer": at_rest["optimizer"] if offload_params or offload_optimizer else 0,
    }
    on_device = {k: (at_rest[k] - host[k] if kind == "cuda" else at_rest[k]) for k in at_rest}
    for states in (at_rest, host, on_device):
        states["total"] = states["params"] + states["grads"] + states["optimizer"]
    groups = (
        [int(4 * n) for n, i in zip(sized, infos) if i.is_matrix],
        [int(4 * n) for n, i in zip(sized, infos) if not i.is_matrix],
    )
    part = f"partitioned over {shard} ranks" if shard > 1 else "whole"
    described = {
        "params": f"{param_dtype}, " + (part if stage == 3 else "whole on every rank"),
        "grads": f"{param_dtype}, "
        + (part if stage >= 1 else "whole")
        + (" + the fp32 copy the step makes" if copies else ""),
        "optimizer": "AdamW: two fp32 moments"
        + (" + fp32 master" if copies else "")
        + (f", {part}" if stage >= 1 else ", whole"),
    }
    return ModelStates(at_rest, host, on_device, at_rest if kind == "cpu" else on_device, groups, described)


@dataclass
class Gathered:
    """Parameter elements by where they are gathered (``own``, ``nested*``, ``block_*``: per block)."""

    own: list[int]  # the block's own unit (gathered, padded)
    nested: list[list[str]]  # units nested in the block (MoE experts, wrap=size parts)
    nested_numel: list[list[int]]
    block_numel: list[int]  # the block's own unit and its nested ones
    largest_nested: list[int]
    # elements the largest nested unit all-gathers (0 where its group is one rank: expert parallel with ep = shard)
    nested_all_gather: list[int]
    # the block's units' elements that go through a reduce-scatter: a nested unit of one rank (expert parallel
    # with ep = shard) reduces nothing (measured: no reduce-scatter buffer)
    block_reduced_numel: list[int]
    block_local_bytes: list[int]  # the block's fp32 shards at rest
    root_numel: int  # the root and units that span blocks: gathered throughout
    root_early_numel: int  # root parameters whose gradients come before the blocks' backward
    full_numel: int  # every parameter, unsharded
    block_full_numel: list[int]
    block_matrix_numel: list[int]
    root_early_full_numel: int
    output_full_numel: int


def gathered(infos: list[ParamInfo], inventory: Inventory) -> Gathered:
    """Cached per (cached) ``param_infos`` list: read it, never change it."""
    key = (id(infos), id(inventory))
    if key not in _GATHERED:
        if len(_GATHERED) >= 256:
            _GATHERED.clear()
        _GATHERED[key] = (infos, inventory, _gathered(infos, inventory))
    return _GATHERED[key][2]


_GATHERED: dict[tuple, tuple[list[ParamInfo], Inventory, Gathered]] = {}


def _gathered(infos: list[ParamInfo], inventory: Inventory) -> Gathered:
    blocks = inventory.blocks
    n = len(blocks)
    in_block: list[list[ParamInfo]] = [[] for _ in range(n)]  # every parameter of block j
    block_units: list[list[ParamInfo]] = [[] for _ in range(n)]  # those owned by a unit inside block j
    root_level: list[ParamInfo] = []  # the root's, or of units that span blocks: gathered throughout
    for i in infos:  # (sums below keep the parameters' order: FSDP1's shares are floats)
        if i.block is not None:
            in_block[i.block].append(i)
        if i.block is not None and (i.unit == blocks[i.block] or i.unit.startswith(blocks[i.block] + ".")):
            block_units[i.block].append(i)
        else:
            root_level.append(i)

    def total(members, attr: str, e: float = 1) -> int:
        return int(e * sum(getattr(i, attr) for i in members))

    own = [total([i for i in block_units[j] if i.unit == blocks[j]], "gathered_numel") for j in range(n)]
    nested = [sorted({i.unit for i in block_units[j] if i.unit != blocks[j]}) for j in range(n)]
    nested_numel = [
        [total([i for i in block_units[j] if i.unit == u], "gathered_numel") for u in nested[j]] for j in range(n)
    ]
    early = inventory.input_params  # the input embeddings' gradients come last
    return Gathered(
        own=own,
        nested=nested,
        nested_numel=nested_numel,
        block_numel=[own[j] + sum(nested_numel[j]) for j in range(n)],
        largest_nested=[max(sizes, default=0) for sizes in nested_numel],
        block_reduced_numel=[
            own[j]
            + sum(
                size
                for u, size in zip(nested[j], nested_numel[j])
                if any(i.group > 1 for i in block_units[j] if i.unit == u)
            )
            for j in range(n)
        ],
        nested_all_gather=[
            max(
                (
                    size
                    for u, size in zip(nested[j], nested_numel[j])
                    if any(i.group > 1 for i in block_units[j] if i.unit == u)
                ),
                default=0,
            )
            for j in range(n)
        ],
        block_local_bytes=[total(block_units[j], "local_numel", 4) for j in range(n)],
        root_numel=total(root_level, "gathered_numel"),
        root_early_numel=total([i for i in root_level if i.name not in early], "gathered_numel"),
        full_numel=sum(i.numel for i in infos),
        block_full_numel=[sum(i.numel for i in members) for members in in_block],
        block_matrix_numel=[sum(i.numel for i in members if i.is_matrix) for members in in_block],
        root_early_full_numel=sum(i.numel for i in infos if i.block is None and i.name not in early),
        output_full_numel=sum(i.numel for i in infos if i.name in inventory.output_params),
    )
