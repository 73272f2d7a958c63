"""When a configuration does not fit: the cheapest combination of memory options that does, as one command.

The planner's price list (``cli.price_options``) says what each change alone would save; a large model often needs
several at once (Llama-3 8B in fp32 on 8 H100: no single change fits it). ``find_fit`` plans every combination of
the memory options below, one value per dimension (the run's own value included), and keeps the cheapest that fits.

"Cheapest" is a stated order, not a timing (the step-time model lives above the planner, in ``fsdp_exp.tune``;
``python -m fsdp_exp.tune`` weighs the fitting ones by predicted tokens/s): each change has a price in ``PRICES``, a
combination costs the sum, and ties go to fewer changes, then to the smaller need. bf16 costs nothing (on a GPU its
matmuls are faster than fp32's); sharding and a smaller micro-batch cost a little (more collectives, smaller
matmuls); recomputing activations costs its forward again (selective less than full); offloading moves the
parameters over PCIe every step; more ranks cost hardware, the most of all. A mixture of experts also tries
expert parallel (``parallel.ep``): each rank then gathers experts/ep of each layer instead of all of them.

The model-parallel savers take their ranks from the data-parallel ones, so they are priced per doubling as the
micro-batch is per halving: each halves the tokens (context parallel, ``parallel.cp``: every sequence split over
cp ranks, its collectives alongside attention) or the layers (pipeline stages, ``parallel.pp``) a rank holds.
Context parallel costs what a halving of the micro-batch costs (1 per doubling; docs/context_parallel.md: at
32K tokens CP 8 without recomputation is predicted faster than full AC without CP); a pipeline stage adds its
bubble, idle time that nothing hides, so it costs what full AC does (2 per doubling). Both keep each rank's
micro-batch what it was (``trainer.micro_batch_size`` pinned where the run left it to the ranks), since fewer
data-parallel ranks would otherwise hand each one more sequences at once.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.layout import EP_CANDIDATES, degree_values, ep_values

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.plan.devices import Device

PRICES = {
    "precision": {"bf16": 0},
    "sharding": {"full": 1},
    "ac": {"selective_op": 1, "full": 2},
    "offload": {"params": 4},
}
MICRO_BATCH_PRICE = 1  # per halving of the micro-batch
RANKS_PRICE = 6  # per doubling of the nodes
MORE_NODES = (2, 4)  # the node counts tried, as multiples of the run's
# A mixture of experts' expert parallel: its all-to-alls replace the experts' all-gathers over the EP ranks; one
# price for every ep, so that among equal prices the smallest need (the largest ep that fits) wins.
EP_PRICE = 1
# Context parallel and pipeline stages, per doubling of the degree (the module's docstring says why).
CP_PRICE = 1
PP_PRICE = 2


def _dimensions(cfg: "RunConfig", group_node, dp: int) -> list[list[tuple[str, int, object]]]:
    """Each dimension's values as (override, price, how to apply it); the first is the run's own (no override)."""
    dims: list[list[tuple[str, int, object]]] = []
    for group, options in PRICES.items():
        values = [("", 0, None)]
        for option, price in options.items():
            node = group_node(group, option)
            if node is not None and node != getattr(cfg, group):
                values.append((f"{group}={option}", price, (group, node)))
        dims.append(values)
    t = cfg.trainer
    micro, values = t.micro_batch_size, [("", 0, None)]
    per_rank = micro or (t.global_batch_size // dp if dp and t.global_batch_size % dp == 0 else None)
    if per_rank:
        halvings, m = 0, per_rank
        while m > 1:
            m, halvings = m // 2, halvings + 1
            values.append((f"trainer.micro_batch_size={m}", halvings * MICRO_BATCH_PRICE, ("micro_batch_size", m)))
    dims.append(values)
    nodes = [("", 0, None)]
    for times in MORE_NODES:
        if t.global_batch_size % (times * t.nnodes) == 0:
            price = RANKS_PRICE * (times.bit_length() - 1)
            nodes.append((f"trainer.nnodes={t.nnodes * times}", price, ("nnodes", t.nnodes * times)))
    dims.append(nodes)
    if getattr(cfg.model, "n_experts", 0) and cfg.parallel.ep == 1:
        # ep must divide the shard ranks (preflight refuses the others, and the search skips what it refuses)
        dims.append(
            [("", 0, None)] + [(f"parallel.ep={ep}", EP_PRICE, ("ep", ep)) for ep in ep_values(max(dp, 1)) if ep > 1]
        )
    return dims + _model_parallel_dimensions(cfg, dp)


def _model_parallel_dimensions(cfg: "RunConfig", dp: int) -> list[list[tuple[str, int, object]]]:
    """Context parallel and pipeline stages, each a degree that divides the data-parallel ranks it takes; what
    preflight refuses (a family without CP, a sequence 2 x cp does not cut, cp with pp) drops out when tried."""
    dims = []
    for key, price in (("cp", CP_PRICE), ("pp", PP_PRICE)):
        if getattr(cfg.parallel, key) != 1:
            continue  # the run chose its degree
        values = [("", 0, None)]
        for degree in degree_values(dp):
            if 1 < degree <= max(EP_CANDIDATES):  # the layout's degrees up to the largest the searches try
                values.append((f"parallel.{key}={degree}", price * (degree.bit_length() - 1), (key, degree)))
        if len(values) > 1:
            dims.append(values)
    return dims


def _pinned_micro_batch(cfg: "RunConfig", picks, dp: int) -> Optional[int]:
    """The micro-batch a rank trains now, where ``picks`` take data-parallel ranks for context parallel or
    pipeline stages and set no micro-batch, and the run leaves it to the ranks (None otherwise): fewer
    data-parallel ranks would hand each one more sequences at once, undoing what the saver saves."""
    keys = {how[0] for _, _, how in picks if how is not None}
    t = cfg.trainer
    if not keys & {"cp", "pp"} or "micro_batch_size" in keys or t.micro_batch_size or not dp:
        return None
    return t.global_batch_size // dp if t.global_batch_size % dp == 0 else None


def _overrides(cfg: "RunConfig", picks, dp: int) -> list[str]:
    """The overrides that make a combination, in the dimensions' order (a pinned micro-batch last)."""
    pinned = _pinned_micro_batch(cfg, picks, dp)
    return [p[0] for p in picks if p[0]] + ([f"trainer.micro_batch_size={pinned}"] if pinned else [])


def _apply(cfg: "RunConfig", picks, dp: int) -> "RunConfig":
    changes, trainer, parallel = {}, {}, {}
    pinned = _pinned_micro_batch(cfg, picks, dp)
    if pinned:
        trainer["micro_batch_size"] = pinned
    for _, _, how in picks:
        if how is None:
            continue
        key, value = how
        if key in ("micro_batch_size", "nnodes"):
            trainer[key] = value
        elif key in ("ep", "cp", "pp"):
            parallel[key] = value
        else:
            changes[key] = value
    if trainer:
        changes["trainer"] = dataclasses.replace(cfg.trainer, **trainer)
    if parallel:
        changes["parallel"] = dataclasses.replace(cfg.parallel, **parallel)
    return dataclasses.replace(cfg, **changes)


def find_fit(
    cfg: "RunConfig",
    dp: int,
    device: "Device",
    cuda_devices: int,
    margin: Optional[float],
    expert_imbalance: float = 1.0,
) -> Optional[dict]:
    """The cheapest combination of memory options with which ``cfg`` fits ``device``: {"changes", "price",
    "needed_bytes", "device_bytes", "tried"}; None when none of them fits (or ``cfg`` fits as it is)."""
    from fsdp_exp.config.variants import apply_changes
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.plan.devices import fits
    from fsdp_exp.plan.predict import plan
    from fsdp_exp.preflight import validate

    nodes: dict[tuple[str, str], object] = {}

    def group_node(group: str, option: str):
        if (group, option) not in nodes:
            try:
                nodes[(group, option)] = getattr(apply_changes(cfg, (f"{group}={option}",)), group)
            except Exception:  # noqa: BLE001 - an option this config cannot take is not offered
                nodes[(group, option)] = None
        return nodes[(group, option)]

    combos = []
    for picks in itertools.product(*_dimensions(cfg, group_node, dp)):
        changes = _overrides(cfg, picks, dp)
        if changes:
            # the count is of savers chosen: a micro-batch pinned beside context parallel is no saver of its own
            combos.append((sum(p[1] for p in picks), sum(1 for p in picks if p[0]), changes, picks))
    combos.sort(key=lambda c: (c[0], c[1]))
    best, best_level, tried = None, None, 0
    for price, count, changes, picks in combos:
        if best_level is not None and (price, count) > best_level:
            break  # every later combination costs more than the one found
        variant = _apply(cfg, picks, dp)
        try:
            topology = validate(variant, cuda_devices=cuda_devices)
        except ConfigError:
            continue
        tried += 1
        result = plan(variant, topology, device_kind=device.kind, margin=margin, expert_imbalance=expert_imbalance)
        verdict = fits(result, device)
        if verdict["fits"] and (best is None or verdict["needed_bytes"] < best["needed_bytes"]):
            best = {
                "changes": changes,
                "price": price,
                "needed_bytes": verdict["needed_bytes"],
                "device_bytes": verdict["bytes"],
            }
            best_level = (price, count)
    if best is not None:
        best["tried"] = tried
    return best
