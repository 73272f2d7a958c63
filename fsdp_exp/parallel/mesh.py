"""The run's DeviceMesh and its sub-meshes: the one place a mesh is made, so that every parallelism
finds its dimension where the others expect it.

Dims, outermost first (torchtitan's order): ``pp``, the backend's data-parallel dims (``shard``,
``replicate x shard``, or ``dp`` inside pipeline stages), ``cp``, ``tp``. A rank's coordinates follow
from its number: rank = ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i, so a TP group is consecutive
ranks (one node's NVLink), then a CP group, then the data-parallel ranks.

What each parallelism applies itself on:

- tensor parallel: ``mesh["tp"]``;
- context parallel: ``cp_mesh(mesh)``, the ranks that split one sequence;
- FSDP (dense weights): ``dense_dp_mesh(mesh)``, the data-parallel dims with ``cp`` folded into the
  shard dim, since CP ranks hold the same weights and see different tokens (their gradients are summed
  by the same reduce-scatter);
- expert parallel: ``expert_meshes(mesh, ep)``. The ``shard x cp`` ranks (S of them) are cut into
  S/ep x ep, ep innermost: an EP group is ep consecutive ranks of them (inside one node where it can be),
  and the experts' weights are FSDP-sharded over the S/ep ranks left ("efsdp"), replicated over
  ``replicate``.

The sizes are the ``Layout``'s (fsdp_exp/config/layout.py, torch-free): preflight builds it once, the planner
and the step-time model read it from the same ``Topology``; ``build_meshes`` makes every mesh of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.layout import DP_DIMS, Layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_exp.config.topology import Topology


@dataclass(frozen=True)
class Meshes:
    """Every DeviceMesh a rank works on, built at once from the run's ``Layout`` (``build_meshes``)."""

    world: "DeviceMesh"  # the run's mesh: [pp,] data-parallel dims, [cp,] [tp]
    dense_dp: "DeviceMesh"  # what FSDP / DDP shard or replicate the dense weights over (cp folded in)
    cp: Optional["DeviceMesh"]
    tp: Optional["DeviceMesh"]
    pp: Optional["DeviceMesh"]
    ep: Optional["DeviceMesh"]  # the expert-parallel group, and what the experts' weights are sharded over
    efsdp: Optional["DeviceMesh"]


def build_meshes(layout: "Layout", device_type: str) -> Meshes:
    """Every mesh of ``layout`` (every rank calls this once, in the same order: it makes the groups)."""
    world = build(device_type, layout.mesh_shape, layout.mesh_dim_names)
    names = _names(world)
    ep, efsdp = expert_meshes(world, layout.ep) if layout.ep > 1 else (None, None)
    return Meshes(
        world,
        dense_dp_mesh(world),
        cp_mesh(world),
        world["tp"] if "tp" in names else None,
        world["pp"] if "pp" in names else None,
        ep,
        efsdp,
    )


def build_mesh(topology: "Topology") -> "DeviceMesh":
    """The run's mesh, as preflight resolved it (every rank calls this once, in the same order)."""
    return build(topology.device_type, topology.layout.mesh_shape, topology.layout.mesh_dim_names)


def build(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> "DeviceMesh":
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def _names(mesh: "DeviceMesh") -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def cp_mesh(mesh: "DeviceMesh") -> Optional["DeviceMesh"]:
    """The 1-D context-parallel group of this rank, or None without CP."""
    return mesh["cp"] if "cp" in _names(mesh) else None


def dense_dp_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    """What FSDP (or DDP) shards / replicates the dense weights over: the data-parallel dims, with cp
    folded into the innermost of them (shard x cp becomes one dim, named ``shard_cp`` or ``dp_cp``)."""
    names = _names(mesh)
    dp = tuple(n for n in names if n in DP_DIMS)
    if "cp" not in names:
        return mesh[dp] if dp != names else mesh
    inner = dp[-1]
    folded = mesh[(inner, "cp")]._flatten(f"{inner}_cp")
    if len(dp) == 1:
        return folded
    return mesh[(*dp[:-1], f"{inner}_cp")]


def expert_meshes(mesh: "DeviceMesh", ep: int) -> tuple["DeviceMesh", "DeviceMesh"]:
    """(ep_mesh, efsdp_mesh) of this rank: the 1-D expert-parallel group (ep consecutive ranks of
    shard x cp) and what the experts' weights are FSDP-sharded over (the shard x cp ranks left, with
    ``replicate`` in front under HSDP). Every rank must call it, in the same order: it makes new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    names = _names(mesh)
    ranks = mesh.mesh  # the global ranks laid out in the mesh's dims
    inner = [n for n in names if n in ("shard", "dp", "cp")]
    if not inner:
        raise ValueError(f"expert parallel needs a data-parallel shard dim; the mesh has {names}")
    # Move the dims to (outer..., shard[, cp], tp?) then merge shard x cp and cut it into (efsdp, ep).
    outer = [n for n in names if n in ("pp", "replicate")]
    tail = [n for n in names if n == "tp"]
    order = [names.index(n) for n in (*outer, *inner, *tail)]
    ranks = ranks.permute(order)
    sizes = [mesh.mesh.shape[names.index(n)] for n in outer]
    tail_sizes = [mesh.mesh.shape[names.index(n)] for n in tail]
    layout = Layout.from_mesh(tuple(mesh.mesh.shape), names, ep)
    if layout.shard_cp % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {layout.shard_cp} shard x cp ranks")
    ranks = ranks.reshape(*sizes, layout.efsdp, ep, *tail_sizes)
    em = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*outer, "efsdp", "ep", *tail))
    efsdp_dims = tuple(n for n in outer if n == "replicate") + ("efsdp",)
    return em["ep"], em[efsdp_dims]
