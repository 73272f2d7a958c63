"""Tensor parallel (Megatron-style), composed with FSDP2 on a (dp, tp) mesh, applied on the meta
device before FSDP2.

Which module is column- or row-parallel is the model family's (``ModelSpec.tensor_parallel_plan``,
for Llama: wq/wk/wv and w1/w3 colwise, wo and w2 rowwise, the embedding rowwise, the output colwise);
the memory planner reads the same plan. The output projection's logits stay sharded over the vocabulary
(``parallel.loss_parallel``, the default: torch's ``loss_parallel`` takes the loss on the shards) or are
gathered to every rank. Here it becomes torch's styles.
With ``parallel.sequence_parallel`` the norms and the residual stream between the TP regions are
sharded over the sequence as well.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_exp.config import RunConfig
from fsdp_exp.models import spec_for
from fsdp_exp.models.spec import COLWISE, TensorParallelPlan
from fsdp_exp.parallel.wrap import blocks


def styles(plan: TensorParallelPlan, sequence_parallel: bool, loss_parallel: bool = False) -> tuple[dict, dict]:
    """(root plan, block plan): module name -> torch's parallel style, for ``parallelize_module``."""
    residual = Shard(1) if sequence_parallel else Replicate()  # the residual stream between TP regions
    # The logits: sharded over the vocabulary as the colwise projection makes them (a DTensor, for the loss
    # under loss_context), or gathered to every rank.
    logits = (
        dict(output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else dict(output_layouts=Replicate(), use_local_output=True)
    )
    root_plan = {
        # The ends of the residual stream: colwise gives the logits, rowwise takes replicated inputs (token ids).
        name: ColwiseParallel(input_layouts=residual, **logits)
        if style == COLWISE
        else RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        for name, style in plan.root.items()
    }
    block_plan = {
        name: ColwiseParallel() if style == COLWISE else RowwiseParallel(output_layouts=residual)
        for name, style in plan.block.items()
    }
    if sequence_parallel:
        root_plan.update({name: SequenceParallel() for name in plan.sequence_parallel_root})
        block_plan.update({name: SequenceParallel() for name in plan.sequence_parallel_block})
        # Gather the sequence before the column-parallel projections.
        block_plan.update(
            {
                name: PrepareModuleInput(
                    input_layouts=(Shard(1), *[None] * (n - 1)), desired_input_layouts=(Replicate(), *[None] * (n - 1))
                )
                for name, n in plan.gathered_inputs.items()
            }
        )
    return root_plan, block_plan


def loss_context(cfg: RunConfig):
    """Where the loss is taken and its backward runs: torch's ``loss_parallel`` when the logits stay
    sharded over the vocabulary (its cross-entropy on the local shards, a few scalars per token reduced
    over the TP group), else nothing."""
    if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def apply(model: nn.Module, cfg: RunConfig, tp_mesh: DeviceMesh) -> dict:
    sp = cfg.parallel.sequence_parallel
    root_plan, block_plan = styles(spec_for(cfg.model).tensor_parallel_plan(cfg.model), sp, cfg.parallel.loss_parallel)
    root_plan = _present(model, root_plan)
    parallelize_module(model, tp_mesh, root_plan)
    names = blocks(model, cfg)
    for name in names:
        parallelize_module(model.get_submodule(name), tp_mesh, block_plan)
    return {
        "api": "torch.distributed.tensor.parallel.parallelize_module",
        "tp": tp_mesh.size(),
        "sequence_parallel": sp,
        "loss_parallel": cfg.parallel.loss_parallel,
        "blocks": names,
        "block_plan": {k: type(v).__name__ for k, v in block_plan.items()},
        "root_plan": {k: type(v).__name__ for k, v in root_plan.items()},
    }


def _present(model: nn.Module, plan: dict) -> dict:
    """The entries of ``plan`` whose module this model runs: a pipeline stage holds ``nn.Identity`` in place
    of the root modules of other stages (``fsdp_exp.parallel.pipeline``), which no parallel style takes."""
    return {name: style for name, style in plan.items() if not isinstance(model.get_submodule(name), nn.Identity)}
