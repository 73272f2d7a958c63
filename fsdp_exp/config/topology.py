"""The topology of a run: what it looks like once ``auto`` values are resolved against the hardware."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_exp.errors import fail


@dataclass(frozen=True)
class Topology:
    """What the run looks like once ``auto`` values are resolved against the hardware."""

    device_type: str  # "cpu" | "cuda"
    nproc_per_node: int
    nnodes: int
    world_size: int
    dp_size: int  # data-parallel ranks, the batch's shards: world / (pp x cp x tp)
    tp_size: int  # tensor-parallel ranks per data-parallel rank
    # The run's DeviceMesh, outermost first: [pp,] the backend's data-parallel dims ((shard,), (replicate,
    # shard), or (dp,) under pp), [cp,] [tp,]; fsdp_exp/parallel/mesh.py builds it and its sub-meshes.
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    micro_batch_size: int
    grad_accum_steps: int
    cp_size: int = 1  # context-parallel ranks per sequence (they read the same sequences)
    ep_size: int = 1  # expert-parallel ranks per MoE layer, borrowed from the shard x cp ranks

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index (which share of the batch) of global ``rank``: the mesh is laid out
        rank = ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i."""
        return rank // (self.tp_size * self.cp_size) % self.dp_size

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> Topology:
        """The topology ``as_dict`` wrote (run.json["topology"]: JSON turned its tuples into lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def resolve_nproc(value: str, cuda_devices: int) -> int:
    if value == "auto":
        return cuda_devices if cuda_devices > 0 else 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        fail(
            f"trainer.nproc_per_node={value!r} is neither 'auto' nor a positive whole number.",
            "pass trainer.nproc_per_node=auto or e.g. trainer.nproc_per_node=2",
        )
    return n


def largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)
