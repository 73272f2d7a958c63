"""Context parallel (CP): the sequence of every batch split over ``parallel.cp`` ranks that hold the same
weights (FSDP2 shards them over shard x cp, fsdp_exp.parallel.mesh) and read the same sequences.

Causal load balancing. The sequence is cut into 2 x cp equal chunks and CP rank r holds chunks r and
2cp-1-r (a head and a tail), so that under a causal mask every rank has the same number of query-key
pairs to compute: the first chunk sees few keys, the last many. Inputs, targets and the rotary tables
(the family's position buffers) are all indexed by the same positions, so each token keeps its own
angle and its own next-token target.

Attention, ``parallel.cp_method``:

- ``all_to_all`` (Ulysses, DeepSpeed's sequence parallel): before the kernel an all-to-all trades the
  sequence for heads, so each rank holds the whole sequence for heads/cp of its heads; the kernel runs
  unchanged (any kernel, the CPU's SDPA included) on the sequence restored to its natural order; a second
  all-to-all trades back. The backward of each is the other all-to-all, so four per attention layer in a
  step. It needs the local query heads (after tensor parallel) divisible by cp; key/value heads that cp
  does not divide (grouped-query attention) are repeated up to the query heads first.
- ``ring``: torch's own context parallel (torch.distributed.tensor.experimental): queries stay local,
  keys and values travel round the CP group and the partial results merge by their log-sum-exp. Its
  handlers exist for CUDA's flash, memory-efficient and cuDNN SDPA kernels only (``RING_REFUSAL`` says
  what happens on the CPU); ``auto`` picks ring on CUDA and all_to_all elsewhere.

The loss needs nothing more: every rank takes the mean over its own tokens, equally many on every CP
rank, and FSDP2's reduce-scatter over shard x cp averages the gradients over all of them, which is the
gradient of the mean over the whole sequence, each token counted once. More: docs/context_parallel.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_exp.config import RunConfig

# What torch 2.13 does when asked for ring attention on the CPU, found by running it (2 gloo ranks):
# context_parallel() turns q, k, v into sequence-sharded DTensors and dispatches SDPA's ATen op to a
# ring handler, and only CUDA's kernels have one. The CPU's SDPA lowers to
# aten._scaled_dot_product_flash_attention_for_cpu, which has neither a handler nor a DTensor sharding
# strategy ("does not have a sharding strategy registered"); forcing the math kernel fails on mixed
# Tensor/DTensor arithmetic. The FlexAttention route (its KV all-gather) cannot train either: eager
# FlexAttention on the CPU refuses backward.
RING_REFUSAL = (
    "torch's ring attention (torch.distributed.tensor.experimental.context_parallel) has handlers for CUDA's "
    "flash, memory-efficient and cuDNN SDPA kernels only; the CPU's SDPA kernel "
    "(aten._scaled_dot_product_flash_attention_for_cpu) has none and no DTensor sharding rule, and "
    "FlexAttention on the CPU has no backward"
)


def resolve_method(method: str, device_type: str) -> str:
    """``auto``: ring where torch's kernels support it (CUDA), all_to_all elsewhere."""
    if method == "auto":
        return "ring" if device_type == "cuda" else "all_to_all"
    return method


def method_refusal(cfg: "RunConfig", method: str, device_type: str) -> tuple[str, str] | None:
    """(problem, fix) where attention ``method`` (resolved: ring or all_to_all) cannot run this config on
    ``device_type``, by that method's own rules only; None where it can. Ring needs CUDA's SDPA kernels;
    all_to_all needs whole heads on each CP rank, which the family says (``check_context_parallel``)."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.models import spec_for

    if method == "ring" and device_type != "cuda":
        return f"parallel.cp_method=ring cannot run on the CPU: {RING_REFUSAL}.", "pass parallel.cp=1"
    try:
        spec_for(cfg.model).check_context_parallel(cfg.model, cfg.parallel.cp, cfg.parallel.tp, method)
    except ConfigError as refused:
        problem, _, fix = str(refused).partition("\n  fix: ")
        return problem, fix
    return None


def check(cfg: "RunConfig", device_type: str) -> None:
    """preflight's context-parallel checks (before any rank starts; preflight has checked that cp divides the
    ranks and names a method): the sequence and the chosen method's own rules (on this device, with the family's
    heads). A method refused here names the other one where that one would run. Pipeline stages take the
    CP-sharded sequence as their micro-batches (parallel/pipeline.py)."""
    from fsdp_exp.errors import fail

    p, seq = cfg.parallel, cfg.trainer.seq_len
    if p.cp == 1:
        return
    if seq % (2 * p.cp):
        fail(
            f"trainer.seq_len={seq} does not cut into 2 x parallel.cp = {2 * p.cp} equal chunks (each CP rank holds "
            "a head and a tail chunk of every sequence, for causal load balance).",
            f"pass trainer.seq_len={max(2 * p.cp, seq // (2 * p.cp) * 2 * p.cp)} (a multiple of {2 * p.cp})",
        )
    method = resolve_method(p.cp_method, device_type)
    refusal = method_refusal(cfg, method, device_type)
    if refusal is not None:
        problem, fix = refusal
        other = next(m for m in ("all_to_all", "ring") if m != method)
        if method_refusal(cfg, other, device_type) is None:
            fix = f"pass parallel.cp_method={other}, which runs here; or " + fix.removeprefix("pass ")
        fail(problem, fix)


# ------------------------------------------------------------------------------- load balancing
def balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions CP rank ``rank`` holds, in the order it holds them: chunk ``rank`` then chunk
    ``2cp-1-rank`` of the ``2cp`` equal chunks of the sequence."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x cp = {2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat((head, tail))


def gathered_order(seq_len: int, cp: int) -> torch.Tensor:
    """The natural position at each place of the sequence gathered from the CP ranks in rank order."""
    return torch.cat([balanced_positions(seq_len, cp, r) for r in range(cp)])


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Query-key pairs under the causal mask that rank ``rank``'s queries compute: the load balance
    (equal on every rank for the head-and-tail layout)."""
    return int((balanced_positions(seq_len, cp, rank) + 1).sum())


def shard(tensor: torch.Tensor, positions: torch.Tensor, dim: int) -> torch.Tensor:
    return tensor.index_select(dim, positions.to(tensor.device))


# ------------------------------------------------------------------------------- all-to-all attention
def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """dim 0 of ``x`` (cp equal parts) scattered to the CP ranks, part j to rank j; the result's dim 0
    is the part each rank sent here. Differentiable: its backward is the same exchange of the gradient."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def heads_for_sequence(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(batch, heads, local seq, d) -> (batch, heads/cp, cp x local seq, d): this rank's group of heads
    over the sequence of every CP rank, in rank order."""
    b, h, s, d = x.shape
    parts = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # (cp, b, h/cp, s, d): part j goes to rank j
    received = _all_to_all(parts, group)  # (cp, b, h/cp, s, d): the sequence shard of each rank
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def sequence_for_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of ``heads_for_sequence``."""
    b, hc, full, d = x.shape
    s = full // cp
    parts = x.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4)  # (cp, b, h/cp, s, d): rank j's sequence shard
    received = _all_to_all(parts, group)  # (cp, b, h/cp, s, d): each rank's group of heads
    return received.transpose(0, 1).reshape(b, cp * hc, s, d)


class AllToAllAttention(nn.Module):
    """Wraps a family's attention kernel (q, k, v of shape (batch, heads, seq, head_dim) -> the same) so that
    it sees the whole sequence for a share of the heads (Ulysses)."""

    def __init__(self, kernel: nn.Module, cp: int, group, seq_len: int):
        super().__init__()
        self.kernel, self.cp, self.group = kernel, cp, group
        order = gathered_order(seq_len, cp)
        # Not buffers: derived from the config, never saved, and they must not be cast by mixed precision.
        self.to_natural = torch.argsort(order)
        self.to_gathered = order

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        cp, group = self.cp, self.group
        if k.shape[1] % cp:  # grouped-query heads that cp does not divide: one key/value head per query head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        natural = self.to_natural.to(q.device)
        q, k, v = (heads_for_sequence(t, cp, group).index_select(2, natural) for t in (q, k, v))
        out = self.kernel(q, k, v, mask)  # whole sequences in natural order: the mask applies as built
        return sequence_for_heads(out.index_select(2, self.to_gathered.to(out.device)), cp, group)


class RingAttention(nn.Module):
    """Wraps a family's attention kernel in torch's ring attention (CUDA only): the kernel's q, k, v enter as
    DTensors sharded over the sequence on the CP mesh, and SDPA's CUDA kernels dispatch to torch's ring
    handlers, which pass keys and values round the group and merge the partial outputs. Its head-and-tail load
    balancing is this module's layout (``balanced_positions``). Grouped-query heads are repeated first: the
    ring handlers take the flash / memory-efficient / cuDNN ops, which have no grouped-query argument."""

    def __init__(self, kernel: nn.Module, cp_mesh: "DeviceMesh"):
        from torch.distributed.tensor.experimental._context_parallel import _ContextParallel

        super().__init__()
        style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
        self.kernel = style._apply(kernel, cp_mesh)  # forward hooks: local tensors in, DTensors to SDPA, local out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return self.kernel(q, k, v)


def _enable_ring() -> None:
    """torch's switches for ring attention: the SDPA ops' ring handlers on DTensors, and the causal mask read
    as the head-and-tail layout (the ranks' chunks r and 2cp-1-r)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _cp_options,
        _enable_context_parallel_dispatcher,
    )

    _cp_options.enable_load_balance = True
    _enable_context_parallel_dispatcher()


# ------------------------------------------------------------------------------- applying it
class ContextShards:
    """One rank's share of every sequence: what the trainer applies to a batch's inputs and targets."""

    def __init__(self, seq_len: int, cp: int, rank: int):
        self.seq_len, self.cp, self.rank = seq_len, cp, rank
        self.positions = balanced_positions(seq_len, cp, rank)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.shape[1] != self.seq_len:
            # The rotary tables were cut for trainer.seq_len: a shorter batch would take the wrong angles.
            raise ValueError(
                f"context parallel was set up for sequences of {self.seq_len} tokens; this batch has {inputs.shape[1]}"
            )
        return shard(inputs, self.positions, 1), shard(targets, self.positions, 1)

    def shard_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a (batch, seq) tensor that goes with the tokens (their rotary positions)."""
        return shard(tensor, self.positions, 1)


def wrap_attention(model: nn.Module, cp_mesh: "DeviceMesh", method: str, seq_len: int) -> dict:
    """On the meta model, after tensor parallel and before checkpointing, compile and sharding (which then
    wrap the exchange with the rest of the block): each attention kernel the family names is wrapped in the
    method's runner (``AllToAllAttention`` or ``RingAttention``)."""
    from fsdp_exp.models import spec_of

    cp, group = cp_mesh.size(), cp_mesh.get_group()
    kernels = spec_of(model).attention_kernels(model)
    if method == "ring":
        _enable_ring()
    for name in kernels:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        kernel = getattr(owner, attr)
        wrapped = RingAttention(kernel, cp_mesh) if method == "ring" else AllToAllAttention(kernel, cp, group, seq_len)
        setattr(owner, attr, wrapped)
    api = (
        "torch.distributed.tensor.experimental context parallel (_ContextParallel, SDPA ring handlers)"
        if method == "ring"
        else "funcol.all_to_all_single_autograd"
    )
    return {"cp": cp, "method": method, "attention_kernels": len(kernels), "api": api}


def shard_positions(model: nn.Module, cp_mesh: "DeviceMesh", seq_len: int) -> ContextShards:
    """After the backend materialized ``model`` (and the family filled its position buffers): this rank keeps
    its own rows of them. Returns the batch sharder."""
    from fsdp_exp.models import spec_of

    shards = ContextShards(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
    for name, dim in spec_of(model).position_buffers(model).items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        full = getattr(owner, attr)
        # The first seq_len rows are the ones the model slices; this rank keeps its own positions of them.
        setattr(owner, attr, shard(full.narrow(dim, 0, seq_len), shards.positions, dim))
    return shards
