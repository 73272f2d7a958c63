"""Model registry: architecture name -> how to build it, which module is a block, its FLOPs per token.

Models are plain ``nn.Module``s; everything parallel is applied from outside by fsdp_exp.parallel,
which needs to know the block class (the unit of wrapping) from the spec here.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fsdp_exp.config import ModelConfig
from fsdp_exp.models.llama import Llama, TransformerBlock


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[ModelConfig], nn.Module]
    block_class: type[nn.Module]


REGISTRY: dict[str, ModelSpec] = {
    "llama": ModelSpec(build=Llama, block_class=TransformerBlock),
}


def build_meta(cfg: ModelConfig) -> nn.Module:
    """Build the model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return REGISTRY[cfg.name].build(cfg)


def count_params(cfg: ModelConfig, *, exclude_embeddings: bool = False) -> int:
    model = build_meta(cfg)
    seen, total = set(), 0
    for name, p in model.named_parameters():  # named_parameters already skips tied duplicates
        if id(p) in seen or (exclude_embeddings and name.startswith("tok_embeddings.")):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def matrix_parameter_names(model: nn.Module) -> set[str]:
    """Canonical names of the parameters that are matrices (weight decay applies to these only)."""
    return {canonical_name(n) for n, p in model.named_parameters() if p.ndim >= 2}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 N + 12 L d S (forward + backward, no recompute).

    N counts parameters without the input embedding (a lookup, no matmul); the output projection
    is a matmul and counts. 12 L d S is attention's score and value products (PaLM appendix B).
    """
    n = count_params(cfg, exclude_embeddings=True)
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len


# Path components that wrappers (activation checkpointing, FSDP1, torch.compile) insert into
# parameter names; dropping them gives the name the plain model has.
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def full_param_init(model: nn.Module, name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: a function of (seed, name) only."""
    name = canonical_name(name)
    std = model.init_std(name)
    full = torch.empty(shape, dtype=torch.float32, device=device)
    if std is None:
        return full.fill_(1.0)
    gen = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return full.normal_(0.0, std, generator=gen)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Fill every parameter from (seed, its name) alone, so any sharding gets the same values.

    Each full parameter is drawn on the parameter's device, one at a time, and each rank keeps its
    own shard of it (``distribute_tensor`` with ``src_data_rank=None`` slices locally, no traffic).
    No rank ever holds more than one unsharded parameter. ``model`` is the plain model (or FSDP2's
    in-place sharded one); wrapper backends call ``full_param_init`` themselves.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        full = full_param_init(model, name, param.shape, seed, local.device)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(full.to(local.dtype))
    model.init_buffers(device)
