"""Which aten ops a block dispatches to, by the part they play in op-level selective checkpointing (``ac.ops``):
the matmuls, the attention kernels, the collectives inside a block; and ``OpSaver``, the rule that picks which
outputs a checkpointed block saves.

A leaf (torch only): the run applies the rule (``fsdp_exp.parallel.ac``), the planner measures what it keeps
(``fsdp_exp.plan.activations.hf``) and the step-time model counts what it recomputes (``fsdp_exp.tune.work``),
all from this one list.
"""

from __future__ import annotations

import torch


def _existing(namespace, names: tuple[str, ...]) -> frozenset:
    """The default overloads of the ops this torch build has (cudnn's or a collective may be missing)."""
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# The ops a linear layer dispatches to (addmm: with a bias). torchtitan's models have no biases, so its rule,
# which counts aten.mm, counts the same matmuls there.
# A mixture of experts' grouped matmul (fsdp_exp.models.moe) is its experts' linear layers, and counts as one.
LINEAR_MATMULS = _existing(torch.ops.aten, ("mm", "addmm", "_grouped_mm"))
BATCHED_MATMULS = _existing(torch.ops.aten, ("bmm",))
# SDPA's kernels (their output and log-sum-exp): CUDA's flash, memory-efficient and cuDNN ones, the CPU's flash.
ATTENTION = _existing(
    torch.ops.aten,
    (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention_for_cpu",
    ),
)
# Collectives inside a block (tensor parallel's): repeating them in backward would cost communication.
COLLECTIVES = _existing(torch.ops._c10d_functional, ("reduce_scatter_tensor", "all_reduce", "all_to_all_single"))
ALWAYS_SAVED = ATTENTION | COLLECTIVES


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x M x K x N of a grouped matmul whatever its groups: each output element is a dot product over the
    shared dimension (a 2-D x 2-D weight gradient: one (M, N) product per group over that group's share of K)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * torch.Size(out_shape).numel() * a_shape[-1]


# FLOP formulas torch's FlopCounterMode lacks (it counts no grouped matmul): the experts' matmuls of a mixture
# of experts. Pass as ``FlopCounterMode(custom_mapping=EXTRA_FLOP_FORMULAS)``.
# Keyed by the op's overload packet, as the counter looks them up.
EXTRA_FLOP_FORMULAS = {op.overloadpacket: _grouped_mm_flops for op in _existing(torch.ops.aten, ("_grouped_mm",))}


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
