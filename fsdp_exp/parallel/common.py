"""Helpers shared by the parallel backends: dtype names, and JSON-ready descriptions of API arguments."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch.distributed.device_mesh import DeviceMesh

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
