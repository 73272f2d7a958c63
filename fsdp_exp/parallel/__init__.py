"""Parallelism, applied in a fixed order like a recipe (``apply_recipe``): float8 training (float8.py), tensor
parallel, expert parallel, context parallel, activation checkpointing, compile, then the data-parallel backend
(``backend_for(cfg)``: FSDP2, FSDP1, DDP or DeepSpeed, see backend.py), which also materializes the model and
initializes it identically on every rank. A backend whose units must hold the checkpointed region (FSDP1,
``checkpoints_inside_units``) has its blocks checkpointed after it wrapped them instead. Each step records what
it handed to torch ("applied"); the backend then reads back what torch holds (``applied["inspected"]``).
Under pipeline parallel every stage runs the same recipe on its slice of the mesh (parallel/pipeline.py), so a
parallelism that composes without stages composes with them.

The result binds the backend to this run's model, config and device, so that the training step asks it
for the optimizer, gradient sync, autocast, backward, clipping, the loss scaler and the optimizer step
without knowing which backend it is (a backend whose engine owns the step overrides them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_exp.config.schema import EVERY_MICRO_BATCH
from fsdp_exp.parallel.backend import Backend, backend_for

if TYPE_CHECKING:  # importing this package stays cheap: the backends import torch when they are used
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_exp.config import RunConfig
    from fsdp_exp.parallel.context import ContextShards


@dataclass
class Parallelized:
    """The model to train, what was applied to it, and its backend's part of the training step."""

    model: "nn.Module"
    applied: dict
    backend: Backend
    cfg: "RunConfig"
    device: "torch.device"
    grad_sync: str  # trainer.grad_sync as the backend resolved it: every_micro_batch | last_micro_batch
    context: "ContextShards | None" = None  # parallel.cp > 1: this rank's positions of every sequence
    owns_step = False  # a pipeline's engine runs the whole step (parallel/pipeline.py: PipelineParallelized)

    def sequence_shard(self, inputs: "torch.Tensor", targets: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """This rank's share of each sequence under context parallel (parallel/context.py), else all of it."""
        return (inputs, targets) if self.context is None else self.context(inputs, targets)

    def packed_shard(self, packed: dict) -> dict:
        """The model's packed-document inputs (attention_mask.packed_inputs) on this rank: under context
        parallel each token's rotary position goes with the token (this rank's share), while the document
        numbers stay whole: the mask is built over the whole sequence, which all-to-all attention sees."""
        if self.context is None or "positions" not in packed:
            return packed
        return {**packed, "positions": self.context.shard_tokens(packed["positions"])}

    def gradient_sync(self, last: bool):
        """A context for one micro-batch's backward (``last``: the step's last one): its gradients are
        reduced under grad_sync=every_micro_batch, or when it is the last; accumulated locally otherwise."""
        reduce = last or self.grad_sync == EVERY_MICRO_BATCH
        return self.backend.gradient_sync(self.model, reduce, last)

    def autocast(self):
        return self.backend.autocast(self.cfg, self.device)

    def loss_parallel(self):
        """A context for one micro-batch's forward and backward: the loss taken on vocabulary-sharded
        logits under tensor parallel's loss parallel (parallel/tp.py), a no-op otherwise."""
        from fsdp_exp.parallel import tp

        return tp.loss_context(self.cfg)

    def clip_grad_norm(self, max_norm: float) -> "torch.Tensor":
        return self.backend.clip_grad_norm(self.model, max_norm)

    def grad_scaler(self):
        return self.backend.grad_scaler(self.device)

    def build_optimizer(self, decay_names: set[str]):
        return self.backend.build_optimizer(self.model, self.cfg, decay_names)

    def zero_grad(self, optimizer) -> None:
        self.backend.zero_grad(self.model, optimizer)

    def backward(self, loss: "torch.Tensor", scaler) -> None:
        self.backend.backward(self.model, loss, scaler)

    def optimizer_step(self, optimizer, scaler, max_norm: float) -> "torch.Tensor":
        grad_norm = self.backend.optimizer_step(self.model, optimizer, scaler, max_norm)
        if self.cfg.precision.float8_all_gather:  # the next all-gathers' float8 scales, from the updated weights
            from fsdp_exp.parallel import float8

            float8.precompute_scales(self.model)
        return grad_norm


def parallelize(model: "nn.Module", cfg: "RunConfig", mesh: "DeviceMesh", device: "torch.device") -> Parallelized:
    """``model`` is on the meta device; the result is sharded, materialized and initialized. Under
    parallel.pp > 1 the stages are cut from the config and each runs this same recipe (parallel/pipeline.py)."""
    if cfg.parallel.pp > 1:
        from fsdp_exp.parallel.pipeline import parallelize_pipeline

        return parallelize_pipeline(cfg, mesh, device)
    backend = backend_for(cfg)
    model, applied, shards = apply_recipe(model, cfg, mesh, device)
    # What torch holds, read back from the wrapped model (tests compare it with the config).
    grad_sync = backend.grad_sync(cfg)
    applied["grad_sync"] = {"trainer.grad_sync": cfg.trainer.grad_sync, "resolved": grad_sync}
    applied["inspected"] = backend.inspect(model)
    return Parallelized(
        model=model, applied=applied, backend=backend, cfg=cfg, device=device, grad_sync=grad_sync, context=shards
    )


def apply_recipe(
    model: "nn.Module", cfg: "RunConfig", mesh: "DeviceMesh", device: "torch.device", first_block: int = 0
) -> tuple["nn.Module", dict, "ContextShards | None"]:
    """The recipe, in its one order: float8, tensor parallel, expert parallel, context parallel, activation
    checkpointing, compile, then the backend's data-parallel wrap (which materializes and seeds the weights).
    ``model`` is the whole model, or one pipeline stage of it (``first_block``: the index in the full model of
    the stage's first block, so that ``ac.every`` counts the model's blocks); ``mesh`` is the run's mesh, from
    which each parallelism takes its own dims (a stage's sub-meshes: its pp coordinate's slice). Returns the
    model to train, what each step applied, and this rank's share of every sequence under context parallel."""
    from fsdp_exp.parallel import ac, compile, context, float8, tp
    from fsdp_exp.parallel.mesh import cp_mesh as context_mesh, dense_dp_mesh

    applied: dict = {}
    # float8 first: tensor parallel's float8 styles shard the converted layers, and AC and compile wrap them
    # (torchtitan converts the model before it parallelizes it)
    if float8.enabled(cfg):
        applied["float8"] = float8.apply(model, cfg)
    if cfg.parallel.tp > 1:
        applied["tp"] = tp.apply(model, cfg, mesh["tp"])
    if cfg.parallel.ep > 1:  # the experts' weights onto the EP group, before AC wraps the blocks
        from fsdp_exp.models import spec_for
        from fsdp_exp.parallel import expert
        from fsdp_exp.parallel.mesh import expert_meshes

        ep_mesh, efsdp_mesh = expert_meshes(mesh, cfg.parallel.ep)
        applied["ep"] = expert.apply(model, spec_for(cfg.model).expert_modules(model), ep_mesh, efsdp_mesh)
    cp_mesh = context_mesh(mesh)
    if cp_mesh is not None:  # after TP (the local heads), before AC and compile (which then take the exchange along)
        method = context.resolve_method(cfg.parallel.cp_method, device.type)
        applied["cp"] = context.wrap_attention(model, cp_mesh, method, cfg.trainer.seq_len)
    backend = backend_for(cfg)
    checkpointed = ac.chosen(model, cfg, first_block) if cfg.ac.mode != "none" else None
    compiles = cfg.compile and not backend.compiles_itself
    # Under tensor parallel each block is compiled before it is checkpointed (checkpoint(compiled block)):
    # torch cannot compile a checkpointed region whose saved tensors are DTensors (its AOT autograd finds
    # the DeviceMesh among them and fails an assertion from the second step on).
    compile_first = cfg.parallel.tp > 1
    if compiles and compile_first:
        applied["compile"] = {**compile.apply(model, cfg), "order": "inside the activation checkpoint"}
    if checkpointed is not None and not backend.checkpoints_inside_units:
        applied["ac"] = ac.apply(model, cfg, targets=checkpointed)
    if compiles and not compile_first:
        applied["compile"] = compile.apply(model, cfg)
    # The data-parallel dims (tensor parallel has used its own), with cp folded into the shard dim.
    model, dp_applied = backend.apply(model, cfg, dense_dp_mesh(mesh), device)
    if checkpointed is not None and backend.checkpoints_inside_units:  # the blocks, where the wrapping put them
        applied["ac"] = {**ac.apply(model, cfg, targets=checkpointed), "order": "after the backend's wrapping"}
    shards = context.shard_positions(model, cp_mesh, cfg.trainer.seq_len) if cp_mesh is not None else None
    return model, {**dp_applied, **applied}, shards
