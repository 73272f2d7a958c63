"""Tensor parallel for the Llama blocks (Megatron-style), composed with FSDP2 on a (dp, tp) mesh.

Attention: wq/wk/wv column-parallel (each rank holds n_heads/tp heads), wo row-parallel. SwiGLU:
w1/w3 column-parallel, w2 row-parallel. Embedding row-parallel, output column-parallel with
replicated logits. With ``parallel.sequence_parallel`` the norms and the residual stream between
the TP regions are sharded over the sequence as well. Applied on the meta device, before FSDP2.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from fsdp_exp.config import RunConfig
from fsdp_exp.parallel.wrap import blocks


def apply(model: nn.Module, cfg: RunConfig, tp_mesh: DeviceMesh) -> dict:
    sp = cfg.parallel.sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between TP regions
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)

    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sp:
        block_plan.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gather the sequence before the column-parallel projections.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    names = blocks(model, cfg)
    for name in names:
        parallelize_module(model.get_submodule(name), tp_mesh, block_plan)
    return {"api": "torch.distributed.tensor.parallel.parallelize_module", "tp": tp_mesh.size(),
            "sequence_parallel": sp, "blocks": names,
            "block_plan": {k: type(v).__name__ for k, v in block_plan.items()},
            "root_plan": {k: type(v).__name__ for k, v in root_plan.items()}}
