"""Helpers shared by the parallel backends: dtype names, JSON-ready descriptions of API arguments, unit
names as inspect reports them, and the refusal of the knobs only FSDP2 honours."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.errors import fail
from fsdp_exp.models import canonical_name

if TYPE_CHECKING:
    from fsdp_exp.parallel.backend import BackendChecks

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def describe(value):
    """A JSON-ready picture of an argument handed to a sharding API, precise enough to tell runs apart."""
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, DeviceMesh):
        return {"DeviceMesh": list(value.mesh.shape), "dim_names": list(value.mesh_dim_names or ())}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__name__: {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def unit_label(name: str) -> str:
    """A wrapped module's name as ``applied["inspected"]`` reports it (``<root>`` for the model)."""
    return canonical_name(name) or "<root>"


def refuse_fsdp2_only_knobs(backend: "BackendChecks", cfg) -> None:
    """FSDP1, DDP and DeepSpeed: refuse tensor parallel, pipeline stages (but for a backend that runs some of its
    strategies in stages: DDP), per-unit resharding and the root's output dtype (FSDP2's)."""
    s, tp = cfg.sharding, cfg.parallel.tp
    if tp > 1:
        fail(
            f"parallel.tp={tp} composes with FSDP2 only, not sharding.backend={backend.name}.",
            "pass sharding.backend=fsdp2 (or parallel.tp=1)",
        )
    if cfg.parallel.cp > 1:
        fail(
            f"parallel.cp={cfg.parallel.cp} composes with FSDP2 only, not sharding.backend={backend.name}: its "
            "context-parallel ranks must share one gradient reduction over shard x cp (FSDP2's mesh).",
            "pass sharding.backend=fsdp2 (or parallel.cp=1)",
        )
    if cfg.parallel.pp > 1 and not backend.stage_strategies:
        fail(
            f"parallel.pp={cfg.parallel.pp} runs FSDP2 (or DDP) inside each pipeline stage, "
            f"not sharding.backend={backend.name}.",
            "pass sharding=full (FSDP2), sharding=hybrid or sharding=ddp, or parallel.pp=1",
        )
    if s.reshard_after_forward.lower() != "auto":
        backend.refuse(
            f"sharding.reshard_after_forward={s.reshard_after_forward}",
            "FSDP1 and DDP take resharding from the strategy (FULL_SHARD reshards, SHARD_GRAD_OP keeps).",
            "pass sharding=full or sharding=grad_op, or sharding.backend=fsdp2",
        )
    if s.reshard_last_block is not None:
        backend.refuse(
            "sharding.reshard_last_block",
            "only FSDP2 sets resharding per unit.",
            "drop it, or pass sharding.backend=fsdp2",
        )
    if cfg.precision.output_dtype is not None:
        backend.refuse(
            "precision.output_dtype",
            "only FSDP2's MixedPrecisionPolicy casts the outputs.",
            "drop precision.output_dtype",
        )


def refuse_bf16_storage(backend: "BackendChecks", cfg) -> None:
    """FSDP1, DDP and DeepSpeed keep fp32 master parameters: refuse precision.storage_dtype other than fp32 (FSDP2
    casts the model before sharding it, ``fsdp2.FSDP2.apply``)."""
    if cfg.precision.storage_dtype != "fp32":
        backend.refuse(
            f"precision.storage_dtype={cfg.precision.storage_dtype}",
            "it keeps fp32 master parameters; fsdp_exp stores parameters in bf16 on FSDP2 only.",
            "pass precision.storage_dtype=fp32, or sharding.backend=fsdp2",
        )


def refuse_zero_only_knobs(backend: "BackendChecks", cfg) -> None:
    """FSDP2 and FSDP1: refuse ZeRO-1 (sharding=optimizer) and an optimizer-only offload, naming who has them."""
    if cfg.sharding.strategy == "optimizer":
        backend.refuse(
            "sharding=optimizer (ZeRO-1: optimizer state sharded only)",
            "FSDP shards the parameters and gradients with the optimizer state; it has no optimizer-only strategy.",
            "pass sharding=optimizer (DDP + ZeroRedundancyOptimizer) or sharding=zero1 (DeepSpeed), or "
            "sharding=grad_op for FSDP's closest (ZeRO-2)",
        )
    if cfg.offload.optimizer:
        backend.refuse(
            "offload=optimizer",
            "FSDP's CPU offload moves parameters, gradients and the optimizer step together (docs/vocabulary.md).",
            "pass offload=params, or sharding.backend=deepspeed",
        )
