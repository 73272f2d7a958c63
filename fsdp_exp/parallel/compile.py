"""torch.compile of each transformer block, in place (parameter names do not change)."""

from __future__ import annotations

from torch import nn

from fsdp_exp.config import RunConfig
from fsdp_exp.parallel.wrap import blocks


def apply(model: nn.Module, cfg: RunConfig) -> dict:
    names = blocks(model, cfg)
    for name in names:
        model.get_submodule(name).compile()
    return {"api": "nn.Module.compile", "modules": names}
