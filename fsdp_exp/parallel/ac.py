"""Activation checkpointing, applied to the transformer blocks before sharding.

``ac=full`` recomputes every block in backward; ``ac=selective`` every ``ac.every``-th block; with
``ac.ops=matmul_save`` (``ac=selective_op``) the checkpointed blocks save the outputs of matmuls
and attention and recompute only the cheap elementwise ops (torch's selective checkpoint API).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_exp.config import RunConfig
from fsdp_exp.parallel.wrap import blocks

# Ops whose outputs are expensive to recompute: saved under op-level selective AC.
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply(model: nn.Module, cfg: RunConfig) -> dict:
    names = blocks(model, cfg)
    every = 1 if cfg.ac.mode == "full" else cfg.ac.every
    chosen = [name for i, name in enumerate(names) if i % every == 0]
    kwargs = {"preserve_rng_state": False}
    if cfg.ac.ops == "matmul_save":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, checkpoint_wrapper(getattr(owner, child), **kwargs))
    return {"mode": cfg.ac.mode, "every": every, "ops": cfg.ac.ops, "checkpointed": chosen,
            "api": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
            "kwargs": {"preserve_rng_state": False,
                       "context_fn": "create_selective_checkpoint_contexts(save matmuls)"
                       if "context_fn" in kwargs else None}}
