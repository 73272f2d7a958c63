"""Model families: the registry (``model.name`` -> its ``ModelSpec``, see ``fsdp_exp.models.spec``)
and what every family shares: building on meta, counting parameters, FLOPs per token, canonical
parameter names and the seeded initialization that gives the same values at any world size.

Models are plain ``nn.Module``s; everything parallel is applied from outside by fsdp_exp.parallel,
which reads what it needs (the block class, the tensor-parallel plan) from the family's spec.
A new family is one module with a ``ModelSpec`` subclass and one line in ``REGISTRY``, plus its config
schema in ``fsdp_exp.config.schema.MODEL_SCHEMAS`` (which its presets name: ``schema/<name>@_here_``) and,
for the planner, its activation model in ``fsdp_exp.plan.activations.PROFILES``.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from fsdp_exp.errors import closest, did_you_mean, fail
from fsdp_exp.models.hf import HF
from fsdp_exp.models.llama_spec import LLAMA
from fsdp_exp.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdp_exp.config.schema import ModelConfig

REGISTRY: dict[str, ModelSpec] = {
    LLAMA.name: LLAMA,
    HF.name: HF,  # any Hugging Face causal LM (transformers is optional: fsdp_exp[hf])
}


def get_spec(name: str) -> ModelSpec:
    """The family ``model.name`` names; an unknown name is refused with a "did you mean"."""
    if name not in REGISTRY:
        hint = did_you_mean(closest(name, REGISTRY), "model.name={}", after=" ")
        fail(
            f"model.name={name!r} is not a known architecture ({', '.join(sorted(REGISTRY))}).",
            f"{hint}pick a preset with model=llama_tiny|llama7b|... or pass model.name=llama",
        )
    return REGISTRY[name]


def fetch_model_files(cfg: "ModelConfig") -> None:
    """The launcher's part, before preflight (which does no network I/O): what the model config names
    from afar (a hub name's config.json) into its local cache (the family's ``fetch``)."""
    get_spec(cfg.name).fetch(cfg)


def spec_for(cfg: "ModelConfig") -> ModelSpec:
    return get_spec(cfg.name)


def spec_of(model: "nn.Module") -> ModelSpec:
    """The family of a built model (the plain model, or FSDP2's in-place sharded one)."""
    for spec in REGISTRY.values():
        if isinstance(model, spec.model_class):
            return spec
    raise TypeError(f"{type(model).__name__} is not a model of a registered family ({', '.join(REGISTRY)})")


def build_meta(cfg: "ModelConfig") -> "nn.Module":
    """Build the model on the meta device: shapes only, no memory. A fresh one each call (to wrap)."""
    import torch

    with torch.device("meta"):
        return spec_for(cfg).build(cfg)


def count_params(cfg: "ModelConfig", *, exclude_embeddings: bool = False) -> int:
    """Parameters of the model (tied ones once); without the input embeddings when asked."""
    inventory = spec_for(cfg).inventory(cfg)
    return sum(p.numel for p in inventory.params if not (exclude_embeddings and p.name in inventory.input_params))


def matrix_parameter_names(model: "nn.Module") -> set[str]:
    """Canonical names of the parameters that are matrices (weight decay applies to these only)."""
    return {canonical_name(n) for n, p in model.named_parameters() if p.ndim >= 2}


def flops_per_token(cfg: "ModelConfig", seq_len: int) -> int:
    """Training FLOPs per token (forward + backward, no recompute): the family's formula."""
    return spec_for(cfg).flops_per_token(cfg, seq_len)


# Path components that wrappers (activation checkpointing, FSDP1, torch.compile) insert into
# parameter names; dropping them gives the name the plain model has.
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


def full_param_init(
    model: "nn.Module", name: str, shape: "torch.Size", seed: int, device: "torch.device"
) -> "torch.Tensor":
    """The full (unsharded) initial value of parameter ``name``: a function of (seed, name) only."""
    spec = spec_of(model)
    name = spec.init_name(model, canonical_name(name))
    return spec.full_param(model, name, shape, _param_seed(seed, name), device)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_weights(model: "nn.Module", seed: int, device: "torch.device") -> None:
    """Fill every parameter from (seed, its name) alone, so any sharding gets the same values.

    Each full parameter is drawn on the parameter's device, one at a time, and each rank keeps its
    own shard of it (``distribute_tensor`` with ``src_data_rank=None`` slices locally, no traffic).
    No rank ever holds more than one unsharded parameter. ``model`` is the plain model (or FSDP2's
    in-place sharded one); wrapper backends call ``full_param_init`` themselves.
    """
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    spec_of(model).retie(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            full = full_param_init(model, name, param.shape, seed, local.device)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local.copy_(full.to(local.dtype))
    spec_of(model).init_buffers(model, device)
