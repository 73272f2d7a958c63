"""The topology of a run: what it looks like once ``auto`` values are resolved against the hardware."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fsdp_exp.config.layout import Layout, largest_divisor_at_most  # noqa: F401 (re-exported)
from fsdp_exp.config.schema import TRAINER_DEVICES
from fsdp_exp.errors import fail


@dataclass(frozen=True)
class Topology:
    """What the run looks like once ``auto`` values are resolved against the hardware: where its ranks are, its
    ``Layout`` (the parallel degrees and every size derived from them) and how a rank's batch is cut."""

    device_type: str  # "cpu" | "cuda"
    nproc_per_node: int
    nnodes: int
    layout: Layout
    micro_batch_size: int
    grad_accum_steps: int

    # The layout's numbers under the names the run record (run.json["topology"]) and its readers use.
    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.layout.mesh_shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.layout.mesh_dim_names

    def dp_rank(self, rank: int) -> int:
        return self.layout.dp_rank(rank)

    def with_batch(self, micro_batch_size: int, grad_accum_steps: int) -> "Topology":
        return dataclasses.replace(self, micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps)

    def as_dict(self) -> dict:
        """run.json["topology"]: the layout's sizes by their record names beside the layout itself."""
        return {
            "device_type": self.device_type,
            "nproc_per_node": self.nproc_per_node,
            "nnodes": self.nnodes,
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "tp_size": self.tp_size,
            "mesh_shape": self.mesh_shape,
            "mesh_dim_names": self.mesh_dim_names,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "cp_size": self.cp_size,
            "ep_size": self.ep_size,
            "layout": self.layout.as_dict(),
        }

    @classmethod
    def from_dict(cls, fields: dict) -> Topology:
        """The topology ``as_dict`` wrote (older records have no "layout": their mesh describes it)."""
        layout = (
            Layout.from_dict(fields["layout"])
            if "layout" in fields
            else Layout.from_mesh(fields["mesh_shape"], fields["mesh_dim_names"], fields.get("ep_size", 1))
        )
        return cls(
            fields["device_type"],
            fields["nproc_per_node"],
            fields["nnodes"],
            layout,
            fields["micro_batch_size"],
            fields["grad_accum_steps"],
        )


def resolve_where(t, cuda_devices: int, world_size: Optional[int] = None) -> tuple[str, int, int]:
    """(device type, ranks per node, world) of the trainer group against this machine: ``world_size`` is given
    when ranks come from outside (torchrun, SLURM), else it is ``trainer.nproc_per_node`` x ``trainer.nnodes``."""
    if t.device not in TRAINER_DEVICES:
        fail(f"trainer.device={t.device!r} is not one of {', '.join(TRAINER_DEVICES)}.", "pass trainer.device=auto")
    device_type = "cuda" if (t.device == "cuda" or (t.device == "auto" and cuda_devices > 0)) else "cpu"
    if device_type == "cuda" and cuda_devices == 0:
        fail("trainer.device=cuda but this machine has no CUDA device.", "pass trainer.device=cpu (or auto)")
    nproc = resolve_nproc(t.nproc_per_node, cuda_devices if device_type == "cuda" else 0)
    if t.nnodes < 1:
        fail(f"trainer.nnodes={t.nnodes} must be at least 1.", "pass trainer.nnodes=1")
    if device_type == "cuda" and nproc > cuda_devices:
        fail(
            f"trainer.nproc_per_node={nproc} asks for more ranks than the {cuda_devices} GPUs here.",
            f"pass trainer.nproc_per_node={cuda_devices} (or auto)",
        )
    return device_type, nproc, world_size if world_size is not None else nproc * t.nnodes


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
