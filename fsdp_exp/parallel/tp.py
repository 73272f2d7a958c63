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
from fsdp_exp.parallel import float8
from fsdp_exp.parallel.wrap import blocks


def styles(
    plan: TensorParallelPlan, sequence_parallel: bool, loss_parallel: bool = False, float8: bool = False
) -> tuple[dict, dict]:
    """(root plan, block plan): module name -> torch's parallel style, for ``parallelize_module``. ``float8``:
    the block's styles are torchao's float8 ones (tensorwise float8 training), which cast a projection's input
    to float8 before its all-gather, so that tensor parallel's activation gathers move 1 byte an element; the
    root's ends stay torch's (the output projection is kept high precision, the embedding is no linear)."""
    colwise, rowwise, prepare = _float8_styles() if float8 else (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
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
        name: colwise() if style == COLWISE else rowwise(output_layouts=residual) for name, style in plan.block.items()
    }
    if sequence_parallel:
        root_plan.update({name: SequenceParallel() for name in plan.sequence_parallel_root})
        block_plan.update({name: SequenceParallel() for name in plan.sequence_parallel_block})
        # Gather the sequence before the column-parallel projections.
        block_plan.update(
            {
                name: prepare(
                    input_layouts=(Shard(1), *[None] * (n - 1)), desired_input_layouts=(Replicate(), *[None] * (n - 1))
                )
                for name, n in plan.gathered_inputs.items()
            }
        )
    return root_plan, block_plan


def _plain_output(module: nn.Module, inputs, output):
    """The root's rowwise embedding hands the first block an ``AsyncCollectiveTensor`` (its all-reduce not waited
    for yet), the later blocks get plain tensors: compiled block by block, each type is a graph of its own (the
    first block's call compiles once for the wrapper, every later one again for the plain tensor), and the graph
    compiled for the wrapper lost the first step's gradient through the embedding (the step's gradient norm 0.641
    against eager's 0.818 on the tiny Llama at tp=2, fp32; the every-pair test's open mismatch). A plain copy (the
    clone waits for the all-reduce and stays in autograd) gives every block one input type, one compilation and
    eager's gradients to the last bit."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else None  # clone: waits, keeps autograd


def loss_context(cfg: RunConfig):
    """Where the loss is taken and its backward runs: torch's ``loss_parallel`` when the logits stay
    sharded over the vocabulary (its cross-entropy on the local shards, a few scalars per token reduced
    over the TP group), else nothing."""
    if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def apply(model: nn.Module, cfg: RunConfig, tp_mesh: DeviceMesh) -> dict:
    """After float8's conversion (its styles need the ``Float8Linear`` layers in place), before FSDP2."""
    sp, f8 = cfg.parallel.sequence_parallel, float8.tensor_parallel_styles(cfg)
    tp_plan = spec_for(cfg.model).tensor_parallel_plan(cfg.model)
    root_plan, block_plan = styles(tp_plan, sp, cfg.parallel.loss_parallel)
    float8_plan = styles(tp_plan, sp, cfg.parallel.loss_parallel, float8=True)[1] if f8 else {}
    root_plan = _present(model, root_plan)
    parallelize_module(model, tp_mesh, root_plan)
    if cfg.compile:  # the embedding's output, the first block's input (not the logits: a copy of those is costly)
        for name in spec_for(cfg.model).input_modules_of(cfg.model):
            if name in root_plan:
                model.get_submodule(name).register_forward_hook(_plain_output)
    names = blocks(model, cfg)
    applied_block: dict = {}
    for name in names:
        block = model.get_submodule(name)
        # A layer kept high precision (float8's filter) keeps torch's style: torchao's refuse a plain nn.Linear,
        # and a float8 input cast before a plain layer would hand it a float8 tensor.
        plan = {k: float8_plan[k] if f8 and _all_float8(block.get_submodule(k)) else v for k, v in block_plan.items()}
        parallelize_module(block, tp_mesh, plan)
        applied_block = {k: type(v).__name__ for k, v in plan.items()}
    return {
        "api": "torch.distributed.tensor.parallel.parallelize_module",
        "tp": tp_mesh.size(),
        "sequence_parallel": sp,
        "loss_parallel": cfg.parallel.loss_parallel,
        "float8_styles": f8,
        "blocks": names,
        "block_plan": applied_block,
        "root_plan": {k: type(v).__name__ for k, v in root_plan.items()},
    }


def _float8_styles():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _all_float8(module: nn.Module) -> bool:
    """Every linear layer in ``module`` (itself included) is torchao's ``Float8Linear``, and it has one."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return False
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(isinstance(m, Float8Linear) for m in linears)


def _present(model: nn.Module, plan: dict) -> dict:
    """The entries of ``plan`` whose module this model runs: a pipeline stage holds ``nn.Identity`` in place
    of the root modules of other stages (``fsdp_exp.parallel.pipeline``), which no parallel style takes."""
    return {name: style for name, style in plan.items() if not isinstance(model.get_submodule(name), nn.Identity)}
