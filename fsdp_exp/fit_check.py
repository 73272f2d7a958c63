"""Does the run fit the memory this node may really use? The planner answers before any rank starts.

``check_fit`` runs in the launcher's ``prepare``, after ``preflight.validate`` and above it (the
planner validates every variant it tries, so it cannot sit inside validate). It compares one rank's
planned peak with what the node has (free GPU memory, or host RAM shared by the node's ranks, as
``fsdp_exp.env`` reads it). The planner is not exact, so only a need beyond its measured error band
(``ErrorBand``, from the published record) is refused (exit 2), naming what it needs, what the node
has, and only the changes the planner, asked again, says would fit; within the band the run starts
with a "borderline" warning. ``trainer.check_fit=false`` runs it anyway. Under torchrun or SLURM every
rank checks before the process group starts, so all ranks of a node that cannot fit leave at once.
How each device's memory is read: the docs page planning.md ("The fit check").
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

from fsdp_exp.preflight import validate
from fsdp_exp.config.schema import RunConfig
from fsdp_exp.config.topology import Topology
from fsdp_exp.config.variants import apply_changes, group_options, variant_of
from fsdp_exp.env import HostMemory, cuda_device_count, cuda_free_memory, host_memory
from fsdp_exp.errors import fail
from fsdp_exp.units import GIB

# Changes that lower one rank's memory, tried in this order (each only where it changes the config).
CPU_CHANGES = ("precision=bf16", "ac=full", "trainer.micro_batch_size=1", "sharding=full", "trainer.nproc_per_node=1")
CUDA_CHANGES = ("sharding=full", "precision=bf16", "ac=full", "offload=params", "trainer.micro_batch_size=1")
# GPU layouts a CPU host's refusal offers for planning: (GPUs per node, nodes).
GPU_LAYOUTS = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8))


@dataclass(frozen=True)
class ErrorBand:
    """How far over a device the planner's need may be for a run that still fits: the largest
    ``need / device - 1`` among the published runs that ran (the calibration part of the published record, as
    ``python benchmarks/published.py`` reads it), below the smallest among the runs published as out of memory. Within the band the planner cannot
    tell; beyond it every published run of the record was refused rightly."""

    over: float
    ran: int  # published runs that ran, behind the figure
    oom_least: Optional[float]  # the smallest need / device - 1 among the published out-of-memory runs
    source: str

    def verdict(self, need: int, capacity: int) -> str:
        if need <= capacity:
            return "fits"
        return "borderline" if need <= capacity * (1 + self.over) else "refused"

    def describe(self) -> str:
        oom = (
            f"; the published out-of-memory runs start at {_pct(self.oom_least)}" if self.oom_least is not None else ""
        )
        return (
            f"refuses beyond {_pct(self.over)} over the device (the planner's error band: the {self.ran} published "
            f"runs that ran needed at most that much more than the device, as the planner counts{oom})"
        )


def _pct(x: float) -> str:
    return f"+{round(100 * x, 1):g}%"


def band_from(ran_over: list[float], oom_over: list[float], source: str) -> ErrorBand:
    """The band the record supports: up to the largest ``need / device - 1`` of a published run that ran (every
    one of them starts), rounded up to the next half percent, and below the smallest of a run published as out of
    memory (every one of them is refused); a record where the two overlap supports no band."""
    over = math.ceil(max(ran_over) * 200) / 200 if ran_over else 0.0
    oom = min(oom_over) if oom_over else None
    if oom is not None and over >= oom:
        raise ValueError(f"the record supports no band: a run that ran is planned at +{over:.1%}, an OOM at +{oom:.1%}")
    return ErrorBand(over=max(over, 0.0), ran=len(ran_over), oom_least=oom, source=source)


# The calibration part of the published record as the planner counts it (python benchmarks/published.py, overall
# "planner need / device - 1"), 2026-12-03: the 301 runs that ran needed at most +8.9% (torchtitan's Llama 2 13B
# without AC, micro-batch 2 at 4096, its loss in one slice), the runs
# published as out of memory at least +38.8%. tests/integration/test_plan.py derives it from the record again
# (``band_from``) and fails when the planner or the record moves it.
PLANNER_BAND = ErrorBand(over=0.09, ran=301, oom_least=0.388, source="benchmarks/published.py")


def error_band() -> ErrorBand:
    return PLANNER_BAND


@dataclass(frozen=True)
class NodeMemory:
    """What one rank's device has on this node: a CPU host's usable RAM (all of the node's ranks share it)
    or the least free memory among the node's GPUs; ``host`` is the RAM either way."""

    kind: str  # cpu | cuda
    device_bytes: int
    described: str
    host: HostMemory


def node_memory(topology: Topology, rank_of_node: Optional[int] = None) -> NodeMemory:
    """``rank_of_node``: this process is that rank of the node (torchrun, SLURM); None: it launches them."""
    host = host_memory()
    if topology.device_type != "cuda":
        return NodeMemory("cpu", host.usable, f"this CPU host has {host.describe()}", host)
    devices = (rank_of_node,) if rank_of_node is not None else tuple(range(topology.nproc_per_node))
    free = cuda_free_memory(devices, in_process=rank_of_node is not None)
    least = min(range(len(devices)), key=lambda i: free[i][0])
    return NodeMemory(
        "cuda", free[least][0], f"cuda:{devices[least]} has {_gib(free[least][0])} free of {_gib(free[least][1])}", host
    )


def check_fit(
    cfg: RunConfig, topology: Topology, *, world_size: Optional[int] = None, rank_of_node: Optional[int] = None
) -> None:
    """Refuse (ConfigError) a run the planner says cannot fit this node; ``world_size``: an outside
    launcher's, as given to validate."""
    if not cfg.trainer.check_fit:
        return
    from fsdp_exp.plan import plan

    try:
        result = plan(cfg, topology)
        node = node_memory(topology, rank_of_node)
    except Exception as exc:  # noqa: BLE001 - the check is a help; a config it cannot judge still runs
        print(
            f"fsdp_exp: the memory check could not judge this run ({type(exc).__name__}: {exc}); it runs unchecked.",
            file=sys.stderr,
        )
        return
    need = _need(result, topology, node.kind)
    if _fits(need, node):
        return
    band = error_band()
    if node.kind == "cuda" and need[1] <= node.host.usable:
        if band.verdict(need[0], node.device_bytes) == "borderline":
            print(
                f"fsdp_exp: borderline: each rank needs {_gib(need[0])} as the planner counts and {node.described}"
                f", within the planner's error band ({_pct(band.over)} on the published record: "
                f"{band.describe()}); it runs, and may run out of memory.",
                file=sys.stderr,
            )
            return
        sure = f" Beyond the planner's error band, so the refusal is as sure as the record makes it: {band.describe()}."
    else:
        sure = ""
    fail(_problem(result.per_rank_bytes["total"], need, topology, node) + sure, _fixes(cfg, node, world_size))


def _need(result, topology: Topology, kind: str) -> tuple[int, int]:
    """(bytes of the rank's device it needs: on a CPU host, for all of the node's ranks; bytes of host RAM
    the node's ranks keep offloaded beside their GPUs)."""
    per_rank = result.per_rank_bytes["total"]
    if kind == "cpu":  # the planner counts offloaded states in a CPU rank's own peak: one memory
        return per_rank * topology.nproc_per_node, 0
    return per_rank, result.model_states["host"]["total"] * topology.nproc_per_node


def _fits(need: tuple[int, int], node: NodeMemory) -> bool:
    return need[0] <= node.device_bytes and need[1] <= node.host.usable


def _problem(per_rank: int, need: tuple[int, int], topology: Topology, node: NodeMemory) -> str:
    n = topology.nproc_per_node
    if node.kind == "cpu":
        who = f"the {n} ranks of this run on this node need" if n > 1 else "this run's rank needs"
        each = f"{_gib(per_rank)} each, " if n > 1 else ""
        return (
            f"does not fit: {who} {_gib(need[0])} of memory ({each}as python -m fsdp_exp.plan predicts), "
            f"and {node.described}."
        )
    short = []
    if need[0] > node.device_bytes:
        short.append(
            f"each rank of this run needs {_gib(per_rank)} of GPU memory (as python -m fsdp_exp.plan "
            f"predicts, with its margin), and {node.described}"
        )
    if need[1] > node.host.usable:
        short.append(
            f"offload=params keeps {_gib(need[1])} of the node's {n} ranks in host RAM, and this host "
            f"has {node.host.describe()}"
        )
    return "does not fit: " + "; ".join(short) + "."


def _fixes(cfg: RunConfig, node: NodeMemory, world_size: Optional[int]) -> str:
    """The changes the planner says would fit this node, and how to run anyway."""
    fitting = [f"{' '.join(changes)} ({_gib(need[0])})" for changes, need in _fitting_changes(cfg, node, world_size)]
    parts = []
    if node.kind == "cpu":
        parts.append(
            "On a CPU host all ranks share one RAM: more ranks or offload=params do not lower what the run needs."
        )
    if fitting:
        parts.append("The planner says these would fit here: " + "; ".join(fitting) + ".")
    else:
        parts.append("No change the planner tried fits here.")
    if node.kind == "cpu":
        gpus = _gpu_layouts(cfg)
        if gpus:
            parts.append(f"On GPUs it would fit {gpus}.")
    parts.append("Or pass trainer.check_fit=false to run it anyway.")
    return " ".join(parts)


def _fitting_changes(cfg: RunConfig, node: NodeMemory, world_size: Optional[int]):
    """[(changes, need)] for the changes the planner says fit this node: single changes, else all of them
    at once; the model with fewer blocks; and the largest model preset that fits."""
    from fsdp_exp.plan import plan

    cuda_devices = cuda_device_count()

    def need_of(changes: tuple[str, ...]) -> Optional[tuple[int, int]]:
        variant = variant_of(cfg, changes)
        if variant is None:
            return None
        try:
            topology = validate(variant, cuda_devices=cuda_devices, world_size=world_size)
            return _need(plan(variant, topology), topology, node.kind)
        except Exception:  # noqa: BLE001 - a change that cannot run here is no suggestion
            return None

    changes = list(CPU_CHANGES if node.kind == "cpu" else CUDA_CHANGES)
    if world_size is None and node.kind == "cuda":  # the ranks are ours to choose
        if cfg.trainer.nproc_per_node != str(cuda_devices):
            changes.insert(0, f"trainer.nproc_per_node={cuda_devices}")
    if world_size is not None:
        changes = [c for c in changes if not c.startswith("trainer.nproc_per_node")]
    singles = {c: need_of((c,)) for c in changes}
    applicable = [c for c, need in singles.items() if need is not None]
    found = [((c,), need) for c, need in singles.items() if need is not None and _fits(need, node)]
    if not found and len(applicable) > 1:
        need = need_of(tuple(applicable))
        if need is not None and _fits(need, node):
            found.append((tuple(applicable), need))
    if not found and world_size is None and node.kind == "cuda":  # more nodes shard further
        for nodes in (2, 4, 8):
            need = need_of((f"trainer.nnodes={cfg.trainer.nnodes * nodes}",))
            if need is not None and _fits(need, node):
                found.append(((f"trainer.nnodes={cfg.trainer.nnodes * nodes}",), need))
                break
    shallower = _most_layers_that_fit(cfg, need_of, node)
    if shallower is not None:
        found.append(shallower)
    models = []
    for preset in group_options("model"):
        variant = variant_of(cfg, (f"model={preset}",))
        if variant is None:
            continue
        need = need_of((f"model={preset}",))
        if need is not None and _fits(need, node):
            from fsdp_exp.models import count_params

            models.append((count_params(variant.model), preset, need))
    if models:
        _, preset, need = max(models)
        found.append(((f"model={preset}",), need))
    return found


def _most_layers_that_fit(cfg: RunConfig, need_of, node: NodeMemory):
    """(changes, need) for the same model with the most blocks that fit (its width kept: what one would
    try here before the real run elsewhere), by bisection on the block count; None if not even one fits
    or the family cannot say how to change its depth."""
    from fsdp_exp.models import spec_for

    spec = spec_for(cfg.model)
    depth = len(spec.inventory(cfg.model).blocks)
    if depth < 2 or spec.depth_override(cfg.model, 1) is None:
        return None
    best, low, high = None, 1, depth - 1
    while low <= high:
        middle = (low + high) // 2
        changes = (spec.depth_override(cfg.model, middle),)
        need = need_of(changes)
        if need is not None and _fits(need, node):
            best, low = (changes, need), middle + 1
        else:
            high = middle - 1
    return best


def _gpu_layouts(cfg: RunConfig) -> Optional[str]:
    """For a run refused on a CPU host: the fewest GPUs it would fit (and the smallest GPU that would
    do at 8 per node), as the planner says for the GPUs it knows; None if none would do."""
    from fsdp_exp.plan import device_table, plan

    gpus = sorted((d for d in device_table().values() if d.kind == "cuda"), key=lambda d: d.bytes)
    offers = []
    for per_node, nodes in GPU_LAYOUTS:
        variant = apply_changes(cfg, (f"trainer.nproc_per_node={per_node}", f"trainer.nnodes={nodes}"))
        try:
            per_rank = plan(variant, validate(variant, cuda_devices=per_node), device_kind="cuda").per_rank_bytes[
                "total"
            ]
        except Exception:  # noqa: BLE001 - a layout this config cannot take
            continue
        device = next((d for d in gpus if per_rank <= d.bytes), None)
        if device is not None:
            offers.append((per_node, nodes, device, per_rank))
    if not offers:
        return None
    chosen = [offers[0]] + [o for o in offers if o[:2] == (8, 1) and o[2] != offers[0][2]][:1]
    text = " or ".join(
        f"{p * n} x {d.name}" + (f" ({n} nodes)" if n > 1 else "") + f" ({_gib(need)} per GPU)"
        for p, n, d, need in chosen
    )
    p, n, d, _ = chosen[-1]
    return f"{text}: see python -m fsdp_exp.plan <these overrides> plan.device={d.name} trainer.nproc_per_node={p}" + (
        f" trainer.nnodes={n}" if n > 1 else ""
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
