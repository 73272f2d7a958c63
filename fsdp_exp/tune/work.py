"""What one training step computes, per token: the model's FLOPs, what activation checkpointing adds, and
how many operators the host dispatches.

- **Model FLOPs** are the family's formula (``ModelSpec.flops_per_token``: forward and backward), the
  numerator of the MFU every run reports.
- **Recompute**: one forward of the model on the meta device (the family's cached meta model, batch 1,
  ``trainer.seq_len`` tokens; no memory, no compute) under torch's ``FlopCounterMode`` gives every
  module's forward FLOPs. A checkpointed block recomputes its forward in backward except its last
  matmul: non-reentrant checkpointing stops as soon as every tensor backward needs is back, and the
  last matmul's input is saved before it runs (``fsdp_exp.metrics.flops``, which counts the same thing
  exactly by running the backward too, is the yardstick of the tests). ``ac.ops=every_matmul`` saves
  every matmul and attention output, so it recomputes no FLOPs that count; ``every_other_matmul``
  (``ac=selective_op``) recomputes the matmuls its rule does not save (fsdp_exp.parallel.ac.OpSaver, run
  on the same forward).
- **Operators**: the same forward counts the aten operators each block and the whole model dispatch
  (batch-independent). A backward dispatches about twice a forward's (an assumption: two gradients per
  matmul); a recomputed block dispatches its forward again.

Counting a 70B model's forward takes about a second; it is cached per model config and sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig

BACKWARD_OPS_PER_FORWARD_OP = 2.0


@dataclass(frozen=True)
class Work:
    flops_per_token: float  # model FLOPs of a training step (forward + backward), per token
    forward_flops_per_token: float  # as counted: every matmul and attention of one forward
    block_forward_flops: tuple[float, ...]  # per token, each block's forward
    block_last_matmul_flops: tuple[float, ...]  # per token, each block's last matmul in forward
    forward_ops: int  # operators one forward dispatches (batch-independent)
    block_forward_ops: tuple[int, ...]
    # per token, each block's matmuls that ac.ops=every_other_matmul does not save (recomputed in backward)
    block_unsaved_matmul_flops: tuple[float, ...] = ()

    def checkpointed(self, cfg: "RunConfig") -> list[int]:
        """The blocks activation checkpointing wraps (the rule of fsdp_exp.parallel.ac)."""
        if cfg.ac.mode == "none":
            return []
        every = 1 if cfg.ac.mode == "full" else cfg.ac.every
        return [j for j in range(len(self.block_forward_flops)) if j % every == 0]

    def recompute_flops_per_token(self, cfg: "RunConfig") -> float:
        if cfg.ac.ops == "every_matmul":
            return 0.0
        if cfg.ac.ops == "every_other_matmul":
            return sum(self.block_unsaved_matmul_flops[j] for j in self.checkpointed(cfg))
        return sum(self.block_forward_flops[j] - self.block_last_matmul_flops[j] for j in self.checkpointed(cfg))

    def ops_per_micro_batch(self, cfg: "RunConfig") -> tuple[float, float]:
        """(forward, backward) operators of one micro-batch, the backward with its recompute."""
        recomputed = sum(self.block_forward_ops[j] for j in self.checkpointed(cfg))
        return float(self.forward_ops), BACKWARD_OPS_PER_FORWARD_OP * self.forward_ops + recomputed


_CACHE: dict[tuple, Work] = {}


def work(cfg: "RunConfig") -> Work:
    """The model's ``Work`` at ``cfg.trainer.seq_len`` (cached per model config and sequence length)."""
    from fsdp_exp.models.spec import config_key

    key = (config_key(cfg.model), cfg.trainer.seq_len)
    if key not in _CACHE:
        if len(_CACHE) >= 16:
            _CACHE.clear()
        _CACHE[key] = _count(cfg)
    return _CACHE[key]


def _count(cfg: "RunConfig") -> Work:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_exp.models import spec_for
    from fsdp_exp.parallel.ac import LINEAR_MATMULS, OpSaver

    spec = spec_for(cfg.model)
    model = spec.meta_model(cfg.model)  # shared: hooks are removed again below
    blocks = spec.inventory(cfg.model).blocks
    seq = cfg.trainer.seq_len
    unsaved = [0.0] * len(blocks)
    running: dict = {}  # the block running now and its OpSaver

    def count_unsaved(func, args) -> None:
        if "block" in running and func in LINEAR_MATMULS and not running["saver"].saves(func):
            a, b = args[-2], args[-1]
            unsaved[running["block"]] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / seq

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.count += 1
            out = func(*args, **(kwargs or {}))
            count_unsaved(func, args)
            return out

    block_ops = [0] * len(blocks)

    def entered(j: int) -> None:  # a block's operators: the count after its forward less the count before
        block_ops[j] = -CountOps.count
        running.update(block=j, saver=OpSaver("every_other_matmul"))

    def left(j: int) -> None:
        block_ops[j] += CountOps.count
        running.clear()

    handles = []
    for j, name in enumerate(blocks):
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda *_, j=j: entered(j)))
        handles.append(module.register_forward_hook(lambda *_, j=j: left(j)))
    tokens = torch.zeros((1, seq), dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), spec.shapes_only(), FlopCounterMode(display=False) as counter, CountOps():
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    block_flops, last = [], []
    for name in blocks:
        prefix = f"{root}.{name}"
        inside = [k for k in counts if k.startswith(prefix + ".")]
        leaves = [k for k in inside if not any(other.startswith(k + ".") for other in inside)]
        block_flops.append(counts.get(prefix, 0) / seq)
        last.append(counts[leaves[-1]] / seq if leaves else 0.0)  # leaves appear in the order they first ran
    return Work(flops_per_token=float(spec.flops_per_token(cfg.model, seq)),
                forward_flops_per_token=counter.get_total_flops() / seq,
                block_forward_flops=tuple(block_flops), block_last_matmul_flops=tuple(last),
                forward_ops=CountOps.count, block_forward_ops=tuple(block_ops),
                block_unsaved_matmul_flops=tuple(unsaved))
