"""Activation checkpointing, applied to the transformer blocks before sharding (after it for a backend whose
units must hold the checkpointed region, FSDP1: ``Backend.checkpoints_inside_units``).

``ac=full`` recomputes every block in backward; ``ac=selective`` every ``ac.every``-th block. With
``ac.ops`` (op-level selective checkpointing, torch's selective checkpoint API) the checkpointed blocks
save some ops' outputs and recompute the rest: ``every_other_matmul`` (``ac=selective_op``, torchtitan's
per-op policy) saves the 1st, 3rd, 5th... matmul of a block, ``every_matmul`` every matmul; both save
attention's and the collectives' outputs. What each keeps is ``fsdp_exp.ops.OpSaver``'s to say, in a
leaf module, so the planner's activation profiles (``fsdp_exp.plan.activations``) and the step-time
model (``fsdp_exp.tune.work``) follow the same rule. The policies op by op: the docs page vocabulary.md
("Named policies").
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_exp.config import RunConfig
from fsdp_exp.ops import OpSaver
from fsdp_exp.parallel.wrap import blocks


def _policy(savers: dict, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    saves = savers[ctx.is_recompute].saves(func)
    return CheckpointPolicy.MUST_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE


# The profiler's range markers (``record_function``): FSDP2 opens one in each hook of a unit, and an expert
# parallel block holds the experts' own unit (fsdp_exp.parallel.expert), whose hooks run more markers in the
# recompute than in the forward (its state differs in backward). torch's selective contexts count every op
# by invocation and refuse one the forward did not count ("invocation index 5 encountered during backward but
# not found in storage"); a marker holds no tensor, so it runs as is in both, uncounted.
PROFILER_MARKS = frozenset(
    getattr(torch.ops.profiler, name).default
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if hasattr(torch.ops.profiler, name)
) | frozenset(
    [torch.ops.profiler._record_function_exit._RecordFunction]
    if hasattr(torch.ops.profiler, "_record_function_exit")
    else []
)


class _PassMarks:
    """Mixed into torch's two selective-checkpoint modes: ``PROFILER_MARKS`` bypass their counting."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PROFILER_MARKS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


_passing_classes: dict[type, type] = {}


def _passing_marks(mode):
    cls = type(mode)
    if cls not in _passing_classes:
        _passing_classes[cls] = type(f"MarksPassing{cls.__name__}", (_PassMarks, cls), {})
    mode.__class__ = _passing_classes[cls]
    return mode


def _op_level_context(ops: str):
    """A fresh pair of savers (forward, recompute) for each checkpointed call of a block."""
    saving, recomputing = create_selective_checkpoint_contexts(
        partial(_policy, {False: OpSaver(ops), True: OpSaver(ops)})
    )
    return _passing_marks(saving), _passing_marks(recomputing)


def chosen(model: nn.Module, cfg: RunConfig, first_block: int = 0) -> dict[str, nn.Module]:
    """The blocks of ``model`` to checkpoint, by name. ``first_block``: the index in the full model of
    ``model``'s first block (a pipeline stage's), so that a stage checkpoints the blocks the unsplit model
    would: ``ac.every`` counts the model's blocks, not the stage's."""
    names = blocks(model, cfg)
    every = 1 if cfg.ac.mode == "full" else cfg.ac.every
    return {name: model.get_submodule(name) for i, name in enumerate(names, first_block) if i % every == 0}


def apply(model: nn.Module, cfg: RunConfig, first_block: int = 0, targets: dict[str, nn.Module] | None = None) -> dict:
    """Wrap the chosen blocks of ``model`` in place (``chosen``). ``targets``: blocks chosen before a
    backend wrapped ``model`` (FSDP1, whose units must hold the checkpointed region, see
    ``Backend.checkpoints_inside_units``): each is found where the wrapping put it and wrapped there."""
    targets = chosen(model, cfg, first_block) if targets is None else targets
    kwargs = {"preserve_rng_state": False}
    if cfg.ac.ops != "none":
        kwargs["context_fn"] = partial(_op_level_context, cfg.ac.ops)
    owners = {id(child): (owner, attr) for owner in model.modules() for attr, child in owner.named_children()}
    for block in targets.values():
        owner, attr = owners[id(block)]
        setattr(owner, attr, checkpoint_wrapper(block, **kwargs))
    return {
        "mode": cfg.ac.mode,
        "every": 1 if cfg.ac.mode == "full" else cfg.ac.every,
        "ops": cfg.ac.ops,
        "checkpointed": list(targets),
        "api": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
        "kwargs": {
            "preserve_rng_state": False,
            "context_fn": f"create_selective_checkpoint_contexts(OpSaver({cfg.ac.ops!r}))"
            if "context_fn" in kwargs
            else None,
        },
    }
