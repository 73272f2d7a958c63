"""Activation checkpointing, applied to the transformer blocks before sharding.

``ac=full`` recomputes every block in backward; ``ac=selective`` every ``ac.every``-th block. With
``ac.ops`` (op-level selective checkpointing, torch's selective checkpoint API) the checkpointed blocks
save some ops' outputs and recompute the rest:

- ``every_other_matmul`` (``ac=selective_op``): torchtitan's per-op policy. Within one block, in forward
  order, the 1st, 3rd, 5th... matmul's output is saved and the 2nd, 4th... recomputed; every attention
  kernel's outputs and the outputs of reduce-scatters, all-reduces and all-to-alls are saved.
- ``every_matmul``: every matmul's output and the same attention and collective outputs; only
  elementwise ops, norms and the like are recomputed (no matmul FLOPs recomputed).

What each keeps is ``OpSaver``'s to say; the planner's activation profiles follow the same rule
(fsdp_exp/plan/activations/llama.py by arithmetic, plan/activations/hf.py by running ``OpSaver`` on the model).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_exp.config import RunConfig
from fsdp_exp.parallel.wrap import blocks


def _existing(namespace, names: tuple[str, ...]) -> frozenset:
    """The default overloads of the ops this torch build has (cudnn's or a collective may be missing)."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# The ops a linear layer dispatches to (addmm: with a bias). torchtitan's models have no biases, so its rule,
# which counts aten.mm, counts the same matmuls there.
LINEAR_MATMULS = _existing(torch.ops.aten, ("mm", "addmm"))
BATCHED_MATMULS = _existing(torch.ops.aten, ("bmm",))
# SDPA's kernels (their output and log-sum-exp): CUDA's flash, memory-efficient and cuDNN ones, the CPU's flash.
ATTENTION = _existing(torch.ops.aten, ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                       "_scaled_dot_product_cudnn_attention",
                                       "_scaled_dot_product_fused_attention_overrideable",
                                       "_scaled_dot_product_flash_attention_for_cpu"))
# Collectives inside a block (tensor parallel's): repeating them in backward would cost communication.
COLLECTIVES = _existing(torch.ops._c10d_functional, ("reduce_scatter_tensor", "all_reduce", "all_to_all_single"))
ALWAYS_SAVED = ATTENTION | COLLECTIVES


class OpSaver:
    """Decides, op by op in forward order, which outputs one checkpointed block saves under ``ac.ops``. One
    per block forward and one per its recompute, so that the alternation picks the same matmuls in both."""

    def __init__(self, ops: str):
        self.ops, self.matmuls = ops, 0

    def saves(self, func) -> bool:
        if func in ALWAYS_SAVED:
            return True
        if func in LINEAR_MATMULS:
            self.matmuls += 1
            return self.ops == "every_matmul" or self.matmuls % 2 == 1
        return self.ops == "every_matmul" and func in BATCHED_MATMULS


def _policy(savers: dict, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    saves = savers[ctx.is_recompute].saves(func)
    return CheckpointPolicy.MUST_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_context(ops: str):
    """A fresh pair of savers (forward, recompute) for each checkpointed call of a block."""
    return create_selective_checkpoint_contexts(partial(_policy, {False: OpSaver(ops), True: OpSaver(ops)}))


def apply(model: nn.Module, cfg: RunConfig) -> dict:
    names = blocks(model, cfg)
    every = 1 if cfg.ac.mode == "full" else cfg.ac.every
    chosen = [name for i, name in enumerate(names) if i % every == 0]
    kwargs = {"preserve_rng_state": False}
    if cfg.ac.ops != "none":
        kwargs["context_fn"] = partial(_op_level_context, cfg.ac.ops)
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, checkpoint_wrapper(getattr(owner, child), **kwargs))
    return {"mode": cfg.ac.mode, "every": every, "ops": cfg.ac.ops, "checkpointed": chosen,
            "api": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
            "kwargs": {"preserve_rng_state": False,
                       "context_fn": f"create_selective_checkpoint_contexts(OpSaver({cfg.ac.ops!r}))"
                       if "context_fn" in kwargs else None}}
