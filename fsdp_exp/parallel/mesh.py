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

``layout`` is the pure part (no torch): preflight calls it to say what the mesh will be, the planner and
the step-time model read the same ``Topology``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_exp.config.topology import Topology

DP_DIMS = ("replicate", "shard", "dp")  # the names the backends give their data-parallel dims


def layout(
    dp_shape: tuple[int, ...], dp_names: tuple[str, ...], *, pp: int = 1, cp: int = 1, tp: int = 1
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of the run's mesh around the backend's data-parallel dims."""
    shape, names = tuple(dp_shape), tuple(dp_names)
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    if cp > 1:
        shape, names = (*shape, cp), (*names, "cp")
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    return shape, names


def build_mesh(topology: "Topology") -> "DeviceMesh":
    """The run's mesh, as preflight resolved it (every rank calls this once, in the same order)."""
    return build(topology.device_type, topology.mesh_shape, topology.mesh_dim_names)


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
    import torch
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
    span = int(torch.tensor([mesh.mesh.shape[names.index(n)] for n in inner]).prod())
    if span % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {span} shard x cp ranks")
    ranks = ranks.reshape(*sizes, span // ep, ep, *tail_sizes)
    em = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*outer, "efsdp", "ep", *tail))
    efsdp_dims = tuple(n for n in outer if n == "replicate") + ("efsdp",)
    return em["ep"], em[efsdp_dims]
