"""Hashes of the initial parameters, for the identical-init check (``debug.check_identical_init``).

Each backend reports, per tensor, which slice this rank holds, the hash of that slice and the hash the
seeded initialization (a function of seed and name only) says it must have; the checkpoint code gathers
the rows of every rank and compares them. This module holds the hash and the reading shared by the
backends that keep parameters as modules hold them (whole, or as DTensor shards); FSDP1 reads its flat
parameters itself (``fsdp_exp.parallel.fsdp1``).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from fsdp_exp.models import canonical_name, full_param_init


def tensor_hash(t: torch.Tensor) -> str:
    data = t.detach().float().cpu().contiguous()
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16] if data.numel() else "empty"


def parameter_digests(root: nn.Module, seed: int) -> list[dict]:
    """One row per parameter of ``root``: the whole tensor, or the DTensor shard (shape and offset)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rows = []
    for name, param in root.named_parameters():
        name = canonical_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        full = full_param_init(root, name, param.shape, seed, local.device)
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            where = f"shape {list(shape)} at {list(offset)}"
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        else:
            where = "whole"
        rows.append(
            {"name": name, "slice": where, "hash": tensor_hash(local), "expected": tensor_hash(full.to(local.dtype))}
        )
    return rows
