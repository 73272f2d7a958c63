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
  (``ac=selective_op``) recomputes the matmuls its rule does not save (fsdp_exp.ops.OpSaver, run
  on the same forward).
- **Operators**: the same forward counts the aten operators each block and the whole model dispatch
  (batch-independent). A backward dispatches about twice a forward's (an assumption: two gradients per
  matmul); a recomputed block dispatches its forward again.
- **Kernel classes** (what the GPU timing of ``fsdp_exp.tune.perf`` reads): the same forward sorts the
  work by the kernel that does it. Matmuls (``mm``/``addmm``, the linear layers) by shape: each one's
  (K, N) with its FLOPs per token (M is the micro-batch's tokens); a mixture of experts' grouped matmuls
  (``_grouped_mm``, the routed experts) by (K, N, groups), their FLOPs per token counting every routed copy
  (M per group is what the router sends each expert: ``perf`` sets it from the tokens, top k and ep); attention (everything else the FLOP
  counter counts: SDPA, batched matmuls) as FLOPs per token; and the memory-bound operators (norms,
  activations, residual adds, casts, embeddings) as the elements they read and write per token, from
  their tensors' sizes (views move nothing).

Counting a 70B model's forward takes about a second; it is cached per model config and sequence length.
"""

from __future__ import annotations

import dataclasses
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
    gemms: tuple[tuple[int, int, float], ...] = ()  # (K, N, forward FLOPs per token) of the linear layers
    attention_flops_per_token: float = 0.0  # forward, as counted (over the whole sequence: not causal)
    memory_elements_per_token: float = 0.0  # forward: elements the memory-bound operators read and write
    logits_per_token: float = 0.0  # the output's elements per token (the vocabulary): what the loss reads
    # per token, each block's matmuls that ac.ops=every_other_matmul does not save (recomputed in backward)
    block_unsaved_matmul_flops: tuple[float, ...] = ()
    # A mixture of experts' routed experts (torch._grouped_mm): (K, N, groups, forward FLOPs per token) of each
    # grouped matmul shape, every routed copy of a token counted (top k per token), over all MoE layers
    grouped_gemms: tuple[tuple[int, int, int, float], ...] = ()
    routed_copies_per_token: float = 0.0  # rows of the experts' grouped matmuls per token: the router's top k
    # forward, per token: the part of ``memory_elements_per_token`` moved inside the mixture-of-experts layers (the
    # router's scores, the routed copies gathered, masked, weighted and scattered back, the experts' activation), as
    # the family's eager layer moves it (``fsdp_exp.tune.experts_perf.moe_memory_elements`` prices a fused layer)
    moe_memory_elements_per_token: float = 0.0
    moe_layers: int = 0  # the mixture-of-experts layers (``ModelSpec.expert_modules``)

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
    """The model's ``Work`` at ``cfg.trainer.seq_len`` (cached per model config, sequence length and attention
    span), its attention priced at the run's span (``by_documents``)."""
    from fsdp_exp.data import attention_span
    from fsdp_exp.models.spec import config_key

    span, _ = attention_span(cfg)
    key = (config_key(cfg.model), cfg.trainer.seq_len, span)
    if key not in _CACHE:
        if len(_CACHE) >= 16:
            _CACHE.clear()
        _CACHE[key] = by_documents(_count(cfg), cfg, span)
    return _CACHE[key]


def by_documents(w: Work, cfg: "RunConfig", span: float) -> Work:
    """``w`` (counted on the meta model, attention over the whole sequence) with attention's FLOPs priced at
    ``span`` (model.attention_mask=block_causal: each packed document's own causal work, fsdp_exp.data's
    attention_span): attention per token is linear in the sequence it attends over, so it scales by span / seq,
    the blocks' share alike (every block attends)."""
    from fsdp_exp.models import spec_for

    seq = cfg.trainer.seq_len
    if span >= seq:
        return w
    saved = w.attention_flops_per_token * (1.0 - span / seq)
    per_block = saved / max(1, len(w.block_forward_flops))
    return dataclasses.replace(
        w,
        flops_per_token=float(spec_for(cfg.model).flops_per_token(cfg.model, span)),
        forward_flops_per_token=w.forward_flops_per_token - saved,
        attention_flops_per_token=w.attention_flops_per_token - saved,
        block_forward_flops=tuple(f - per_block for f in w.block_forward_flops),
    )


def _count(cfg: "RunConfig") -> Work:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_exp.models import spec_for
    from fsdp_exp.ops import EXTRA_FLOP_FORMULAS, LINEAR_MATMULS, OpSaver

    spec = spec_for(cfg.model)
    model = spec.meta_model(cfg.model)  # shared: hooks are removed again below
    blocks = spec.inventory(cfg.model).blocks
    seq = cfg.trainer.seq_len

    gemms: dict[tuple, float] = {}  # (K, N) of a linear layer, (K, N, groups) of the experts' grouped matmul
    moved = [0.0]
    moe_moved = [0.0] * len(blocks)  # each block's memory-bound elements inside its mixture-of-experts layer
    routed = [0.0]
    unsaved = [0.0] * len(blocks)
    running: dict = {}  # the block running now and its OpSaver

    def count_unsaved(func, args) -> None:
        if "block" in running and func in LINEAR_MATMULS and not running["saver"].saves(func):
            a, b = (args[0], args[1]) if b_is_grouped(func, args) else (args[-2], args[-1])
            unsaved[running["block"]] += 2.0 * a.shape[0] * a.shape[1] * b.shape[-1] / seq

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.count += 1
            out = func(*args, **(kwargs or {}))
            before = moved[0]
            _classify(func, args, out, seq, gemms, moved)
            if running.get("moe") and "block" in running:
                moe_moved[running["block"]] += moved[0] - before
            if b_is_grouped(func, args):
                routed[0] = max(routed[0], args[0].shape[0] / seq)
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
    # the mixture-of-experts layers: the module holding each family's routed experts (``ModelSpec.expert_modules``)
    experts = spec.expert_modules(model)
    for name in experts:
        layer = model.get_submodule(name.rpartition(".")[0])
        handles.append(layer.register_forward_pre_hook(lambda *_: running.update(moe=True)))
        handles.append(layer.register_forward_hook(lambda *_: running.update(moe=False)))
    tokens = torch.zeros((1, seq), dtype=torch.long, device="meta")
    twin = _Repeats(model, blocks, gemms, moved)
    try:
        with (
            torch.no_grad(),
            spec.shapes_only(),
            FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter,
            CountOps(),
            twin,
        ):
            output = model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    for j in twin.skipped:  # each skipped block did what its twin did
        block_ops[j], unsaved[j] = block_ops[twin.index], unsaved[twin.index]
        moe_moved[j] = moe_moved[twin.index]
    if twin.skipped:
        CountOps.count += len(twin.skipped) * block_ops[twin.index]
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    block_flops, last = [], []
    for j, name in enumerate(blocks):
        prefix = f"{root}.{blocks[twin.index] if j in twin.skipped else name}"
        inside = [k for k in counts if k.startswith(prefix + ".")]
        leaves = [k for k in inside if not any(other.startswith(k + ".") for other in inside)]
        block_flops.append(counts.get(prefix, 0) / seq)
        last.append(counts[leaves[-1]] / seq if leaves else 0.0)  # leaves appear in the order they first ran
    total = counter.get_total_flops() / seq + (len(twin.skipped) * block_flops[twin.index] if twin.skipped else 0.0)
    return Work(
        flops_per_token=float(spec.flops_per_token(cfg.model, seq)),
        forward_flops_per_token=total,
        block_forward_flops=tuple(block_flops),
        block_last_matmul_flops=tuple(last),
        forward_ops=CountOps.count,
        block_forward_ops=tuple(block_ops),
        gemms=tuple((k[0], k[1], f) for k, f in gemms.items() if len(k) == 2),
        grouped_gemms=tuple((k[0], k[1], k[2], f) for k, f in gemms.items() if len(k) == 3),
        routed_copies_per_token=routed[0],
        attention_flops_per_token=max(0.0, total - sum(gemms.values())),
        memory_elements_per_token=moved[0] / seq,
        moe_memory_elements_per_token=sum(moe_moved) / seq,
        moe_layers=len(experts),
        block_unsaved_matmul_flops=tuple(unsaved),
        logits_per_token=_numel(output) / seq,
    )


class _Repeats:
    """Count a stack of identical blocks by two of them: every block after the second with the second's class and
        parameter shapes is not run (it returns the second's output at once, which has the shapes the next block
        takes) and is credited with what the second did: its operators, matmuls by shape and bytes moved. A 70B
        model's 80 blocks then cost as much to count as two. Blocks that differ only in what their parameters do not
    show (an alternating sliding window) count as their twin does: the meta device runs attention over the whole
    sequence either way."""

    index = 1

    def __init__(self, model, blocks: tuple, gemms: dict, moved: list):
        self.modules = [model.get_submodule(b) for b in blocks]
        self.gemms, self.moved = gemms, moved
        shape = [(type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in self.modules]
        self.skipped = [j for j in range(2, len(blocks)) if shape[j] == shape[1]]
        self.handles: list = []
        self.output = None

    def __enter__(self):
        if not self.skipped:
            return self
        before = {}
        twin = self.modules[self.index]

        def entered(*_):
            before.update(gemms=dict(self.gemms), moved=self.moved[0])

        def left(_module, _args, output):
            self.output = output
            self.delta_gemms = {k: v - before["gemms"].get(k, 0.0) for k, v in self.gemms.items()}
            self.delta_moved = self.moved[0] - before["moved"]

        self.handles = [twin.register_forward_pre_hook(entered), twin.register_forward_hook(left)]
        for j in self.skipped:
            self.modules[j].forward = lambda *args, **kwargs: self.output
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        for j in self.skipped:
            self.modules[j].__dict__.pop("forward", None)
        if self.skipped and self.output is not None and exc[0] is None:
            n = len(self.skipped)
            for key, flops in self.delta_gemms.items():
                self.gemms[key] = self.gemms.get(key, 0.0) + n * flops
            self.moved[0] += n * self.delta_moved


def b_is_grouped(func, args) -> bool:
    """Whether an operator is the experts' grouped matmul (its weights a stack: (groups, K, N))."""
    return func.__name__.startswith("_grouped_mm") and args[1].dim() == 3


def _numel(output) -> float:
    """Elements of a model's output (its logits: a tensor, or the first tensor of a tuple / ModelOutput)."""
    import torch

    if isinstance(output, torch.Tensor):
        return float(output.numel())
    values = output.values() if hasattr(output, "values") else output
    return next((float(v.numel()) for v in values if isinstance(v, torch.Tensor)), 0.0)


_GEMMS = ("mm", "addmm")
_COUNTED = ("bmm", "baddbmm", "_scaled_dot_product", "convolution")  # FLOPs the counter has: not memory-bound
_FREE = (
    "empty",
    "zeros",
    "ones",
    "full",
    "scalar_tensor",
    "arange",
    "lift_fresh",
    "_local_scalar_dense",
    "_unsafe_view",
    "alias",
    "new_empty",
)
_FILLS = ("new_zeros", "new_ones", "new_full")  # x.new_zeros(shape): the output written, x not read


def _classify(func, args, out, seq: int, gemms: dict, moved: list) -> None:
    """Sort one operator of the counted forward (batch 1, ``seq`` tokens) into a linear layer's matmul (by
    its (K, N)), a counted FLOP (attention), a view (nothing moves), or a memory-bound operator (the
    elements of its tensor inputs and outputs)."""
    import torch

    name = func.__name__.split(".")[0]
    if name == "_grouped_mm" and args[0].dim() == 2 and args[1].dim() == 3:
        # the routed experts: (copies, K) x (groups, K, N), the copies sorted by expert; keyed with the groups
        a, b = args[0], args[1]
        key = (int(a.shape[1]), int(b.shape[2]), int(b.shape[0]))
        gemms[key] = gemms.get(key, 0.0) + 2.0 * a.shape[0] * a.shape[1] * b.shape[2] / seq
        return
    if name in _GEMMS:
        a, b = args[-2], args[-1]
        m, k = a.shape
        n = b.shape[1]
        if m == seq:
            gemms[(int(k), int(n))] = gemms.get((int(k), int(n)), 0.0) + 2.0 * k * n
        return
    if name.startswith(_COUNTED) or name.startswith(_FREE) or getattr(func, "is_view", False):
        return
    tensors = [t for t in (*args, *(out if isinstance(out, (tuple, list)) else (out,))) if isinstance(t, torch.Tensor)]
    if name.startswith(
        _FILLS
    ):  # a factory method of a tensor: writes its output, never reads the tensor it is called on
        tensors = [out]
    if name == "embedding":  # a lookup reads the rows its tokens pick (as many as it writes), not the whole table
        tensors = [out, out, *tensors[1:-1]]
    if seq > 1 and any(t.dim() >= 2 and t.shape[-1] == seq and t.shape[-2] == seq for t in tensors):
        return  # attention's scores (on the meta device SDPA runs as math): a fused kernel never writes them
    moved[0] += float(sum(t.numel() for t in tensors))
