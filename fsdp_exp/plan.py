"""The memory planner: each rank's memory for a configuration, by arithmetic, before anything runs.

    python -m fsdp_exp.plan model=llama7b precision=bf16 trainer.nproc_per_node=8 plan.device=h100_80gb
    python -m fsdp_exp.plan sharding=grad_op ac=full plan.format=json

It takes the same overrides as a run (``python -m fsdp_exp ...``), composes the same config, resolves
the same ``Topology`` (``fsdp_exp.config.validate``) and builds the model on the meta device only
(parameter shapes, no memory, no process group). Three options belong to the planner and never
reach the run config: ``plan.format=table|json``, ``plan.device=<name>`` (a row of ``DEVICES``;
default: this machine) and ``plan.margin=<fraction>`` (the allocator margin; default 0 on a CPU,
10% on CUDA, plus 1 GiB for the CUDA context and library workspaces).

What it predicts, per rank (the largest rank: rank 0 holds the ``ceil`` chunk of every uneven shard):

- **Model states at rest** (after the optimizer step): parameters, gradients and AdamW's two moments,
  all fp32 and sharded as the strategy says (FSDP2 pads dim 0 to a multiple of the shard group, as
  ``torch.chunk`` does; FSDP1 pads each flat unit; DDP and ``no_shard`` replicate; tensor parallel
  splits the matrices first). With ``offload=params`` they live on the host (reported apart).
- **The peak** of one training step: the step is walked phase by phase (each block's forward at its
  feed-forward, the output projection, the loss's forward and backward, each block's backward at its
  feed-forward, each unit's gradient reduction, the root's, the optimizer step) and each phase's
  live bytes are added up from the pieces below; the peak is the largest phase. The phases are
  grouped into the stages the run's tracker reports (``STAGES``: forward, backward, optimizer), and
  each stage's largest phase is its prediction (``stage_peaks``). Pieces: model states (gradients
  only of the units whose backward has run), unsharded parameters in ``param_dtype`` (the root and
  the unit in flight; every unit under ``grad_op`` / ``no_shard``; DDP's autocast copies of the
  weights), all-gather prefetch and reduce-scatter buffers, activations saved for backward
  (derived tensor by tensor from ``fsdp_exp.models.llama``: see ``block_saved_bytes``), the
  recomputed block under activation checkpointing, the logits and the loss's gradients, the
  gradients flowing through a block's backward, module buffers, the input batch.

Measured against torch's memory tracker (``mem/tracked_total_gib_max`` for the step,
``mem/tracked_<stage>_total_gib_max`` for each stage) on CPU runs of tiny models, see docs/design.md
for the errors by configuration.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from fsdp_exp.config import ConfigError, RunConfig, Topology

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EXIT_BAD_INPUT = 2

# Allocator margin on CUDA: the caching allocator reserves more than it hands out (fragmentation,
# rounding to blocks), and the CUDA context, NCCL and cuBLAS workspaces sit outside the allocator.
CUDA_MARGIN_FRACTION = 0.10
CUDA_FIXED_OVERHEAD = 1 * GIB


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # cuda | cpu
    bytes: int
    description: str


def _gib(x: float) -> int:
    return int(x * GIB)


# Roughly what torch.cuda.get_device_properties(...).total_memory reports for each (a little under the
# marketing size); torch.cuda.mem_get_info() tells the exact figure of a given machine.
DEVICES: dict[str, Device] = {
    "l4_24gb": Device("l4_24gb", "cuda", _gib(22.0), "NVIDIA L4 (24 GB)"),
    "a10g_24gb": Device("a10g_24gb", "cuda", _gib(22.0), "NVIDIA A10G (24 GB)"),
    "a100_40gb": Device("a100_40gb", "cuda", _gib(39.4), "NVIDIA A100 40GB"),
    "a100_80gb": Device("a100_80gb", "cuda", _gib(79.1), "NVIDIA A100 80GB"),
    "h100_80gb": Device("h100_80gb", "cuda", _gib(79.1), "NVIDIA H100 80GB"),
    "h200_141gb": Device("h200_141gb", "cuda", _gib(139.8), "NVIDIA H200 141GB"),
    "b200_192gb": Device("b200_192gb", "cuda", _gib(178.4), "NVIDIA B200 192GB"),
    "cpu_host": Device("cpu_host", "cpu", 0, "this machine's RAM (psutil), shared by its ranks"),
}


def device_table() -> dict[str, Device]:
    """``DEVICES`` with ``cpu_host`` filled in from this machine."""
    import psutil

    table = dict(DEVICES)
    table["cpu_host"] = Device("cpu_host", "cpu", psutil.virtual_memory().total, DEVICES["cpu_host"].description)
    return table


# ------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class Dims:
    """Per-rank activation dimensions of one micro-batch (tensor parallel divides the heads and the
    SwiGLU width; sequence parallel divides the residual stream's sequence)."""

    b: int  # micro-batch
    s: int  # sequence length
    d: int  # model width (the residual stream)
    dq: int  # query width on this rank: n_heads * head_dim / tp
    dkv: int  # key / value width on this rank
    heads: int  # query heads on this rank
    ffn: int  # SwiGLU hidden width on this rank (per expert)
    vocab: int
    layers: int
    experts: int
    sp: int  # divisor of the residual stream (tp with sequence parallel, else 1)


def dims_of(cfg: RunConfig, topology: Topology) -> Dims:
    from fsdp_exp.models.llama import ffn_hidden_dim

    m, tp = cfg.model, topology.tp_size
    head_dim = m.dim // m.n_heads
    return Dims(b=topology.micro_batch_size, s=cfg.trainer.seq_len, d=m.dim,
                dq=m.n_heads * head_dim // tp, dkv=(m.n_kv_heads or m.n_heads) * head_dim // tp,
                heads=m.n_heads // tp, ffn=ffn_hidden_dim(m) // tp, vocab=m.vocab_size, layers=m.n_layers,
                experts=m.n_experts, sp=tp if cfg.parallel.sequence_parallel else 1)


def block_saved_bytes(x: Dims, e: int, autocast: bool = False, math_attention: bool = False) -> dict[str, int]:
    """Bytes one transformer block keeps for backward, tensor by tensor (fsdp_exp/models/llama.py).

    ``e`` is the compute dtype's size. FSDP computes everything in ``param_dtype`` (its parameters
    are cast): RMSNorm saves two fp32 copies of its input when that is not fp32 (``x.float()`` twice)
    or the input itself in fp32, its rsqrt, the normalized tensor and the weighted one (the input of
    the next linear); attention saves the rotated q and k, v, the softmax log-sum-exp (fp32) and the
    output; SwiGLU saves w1's and w3's outputs, silu's output and the product. Under DDP's autocast
    (``autocast=True``) the residual stream and norms stay fp32 and every linear saves its own
    low-precision copy of its input. The block's input is counted here (the previous block's output).
    ``math_attention``: SDPA's math fallback (CUDA, fp32 with grouped-query attention, which the
    flash and memory-efficient kernels do not take in fp32) also saves the attention probabilities and
    the key / value heads repeated to the query heads.
    """
    bs = x.b * x.s
    resid = bs * x.d // x.sp  # one residual-stream tensor, in elements
    if autocast:
        norms = 2 * (4 * bs // x.sp + 4 * resid)  # rsqrt and the fp32 normalized tensor, twice
        residual = 2 * 4 * resid  # the block input and h, fp32
        casts = e * bs * x.d * (3 + 2)  # the inputs of wq, wk, wv and w1, w3, each cast
    else:
        copies = 0 if e == 4 else 2 * 4 * resid  # x.float() twice when x is not fp32
        norms = 2 * (copies + 4 * bs // x.sp + e * resid + e * bs * x.d)
        residual = 2 * 4 * resid if e == 4 else 0  # fp32: the norms save the residual tensors themselves
        casts = 0
    attention = e * bs * x.dq * 2 + 2 * e * bs * x.dkv + 4 * x.b * x.heads * x.s
    if math_attention:
        attention += e * x.b * x.heads * x.s * x.s + 2 * e * bs * (x.dq - x.dkv)
    if x.experts:
        # Dense MoE: every expert's SwiGLU, the stacked expert outputs and the router's probabilities.
        ffn = x.experts * (4 * e * bs * x.ffn) + e * bs * x.d * x.experts + 3 * 4 * bs * x.experts
    else:
        ffn = 4 * e * bs * x.ffn
    return {"residual": residual, "norms": norms, "casts": casts, "attention": attention, "ffn": ffn,
            "total": residual + norms + casts + attention + ffn}


# ------------------------------------------------------------------------------------------ params
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


@dataclass
class ParamInfo:
    name: str
    numel: int  # global
    local_numel: int  # this rank's shard at rest (rank 0: the ceil chunk)
    gathered_numel: int  # the unsharded copy FSDP all-gathers (padded), 0 for DDP
    unit: str  # owning sharding unit ("" = the root)
    block: Optional[int]  # transformer block index, or None
    is_matrix: bool


def _tp_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if tp == 1 or len(shape) != 2:
        return shape
    module = name.rsplit(".", 1)[0]
    if module.endswith(COLWISE) or module == "output":
        return (math.ceil(shape[0] / tp), shape[1])
    if module.endswith(ROWWISE) or module == "tok_embeddings":
        return (shape[0], math.ceil(shape[1] / tp))
    return shape


def param_infos(cfg: RunConfig, topology: Topology) -> list[ParamInfo]:
    """Every parameter of the meta model with its per-rank sizes under the configured sharding."""
    from fsdp_exp.models import build_meta
    from fsdp_exp.parallel.wrap import unit_names

    model = build_meta(cfg.model)
    backend = cfg.sharding.backend
    units = unit_names(model, cfg) if backend != "ddp" else []
    shard = _shard_group(topology, cfg)
    infos = []
    for name, p in model.named_parameters():
        shape = _tp_shape(name, tuple(p.shape), topology.tp_size)
        numel = math.prod(shape)
        owner = max((u for u in units if name.startswith(u + ".")), key=len, default="")
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        if backend == "fsdp2":
            rows = math.ceil(shape[0] / shard)
            local = rows * numel // shape[0]
            gathered = local * shard
        else:  # fsdp1: flat units, padded below; ddp: replicas
            local, gathered = numel, (numel if backend == "fsdp1" else 0)
        infos.append(ParamInfo(name, math.prod(p.shape), local, gathered, owner, block, p.ndim >= 2))
    if backend == "fsdp1":  # one flat parameter per unit, padded to a multiple of the shard group
        for unit in {i.unit for i in infos}:
            members = [i for i in infos if i.unit == unit]
            total = sum(i.numel for i in members)
            per_rank = math.ceil(total / shard)
            for i in members:  # spread the flat shard over its members in proportion
                i.local_numel = per_rank * i.numel / total
                i.gathered_numel = per_rank * shard * i.numel / total
    return infos


def _shard_group(topology: Topology, cfg: RunConfig) -> int:
    if cfg.sharding.backend == "ddp":
        return 1
    names = list(topology.mesh_dim_names)
    return topology.mesh_shape[names.index("shard")] if "shard" in names else 1


# -------------------------------------------------------------------------------------------- plan
# The step's phases as the run's memory tracker splits them (fsdp_exp.metrics.tracker.PHASES); each
# planner phase below belongs to one.
STAGES = ("forward", "backward", "optimizer")


@dataclass
class Phase:
    name: str
    stage: str  # forward | backward | optimizer
    params: int = 0  # sharded parameters (fp32) on the device
    grads: int = 0  # gradients on the device (sharded, or unsharded while they are reduced)
    optimizer: int = 0
    unsharded: int = 0  # all-gathered parameters in param_dtype (DDP: autocast's weight copies)
    comm: int = 0  # all-gather prefetch, reduce-scatter buffers, DDP's gradient buckets
    module_buffers: int = 0
    activations: int = 0  # saved for backward (and a recomputed block)
    temporaries: int = 0  # gradients of activations, the loss's, optimizer temporaries
    inputs: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.unsharded + self.comm + self.module_buffers
                + self.activations + self.temporaries + self.inputs)


@dataclass
class Plan:
    num_params: int
    world_size: int
    device_kind: str  # what the prediction assumes: cuda | cpu
    model_states: dict  # at rest, per rank: params, grads, optimizer, total; device and host
    per_rank_bytes: dict  # params, grads, optimizer, activations, buffers, total (with the margin)
    peak: dict  # the peak phase, by piece, before the margin
    stage_peaks: dict  # {forward, backward, optimizer: the largest phase of that stage, by piece}
    margin_bytes: int
    margin_rule: str
    phases: list[dict]
    assumptions: list[str] = field(default_factory=list)
    device: Optional[dict] = None  # the named device and whether the plan fits it

    def to_dict(self) -> dict:
        return asdict(self)


def plan(cfg: RunConfig, topology: Topology, *, device_kind: Optional[str] = None,
         margin: Optional[float] = None) -> Plan:
    """Predict one rank's memory (rank 0, the largest) for ``cfg`` on ``topology``."""
    kind = device_kind or topology.device_type
    backend = cfg.sharding.backend
    e_p = DTYPE_BYTES[cfg.precision.param_dtype]
    e_r = DTYPE_BYTES[cfg.precision.reduce_dtype]
    ddp = backend == "ddp"
    autocast = ddp and e_p != 4
    infos = param_infos(cfg, topology)
    x = dims_of(cfg, topology)
    L = cfg.model.n_layers
    bs = x.b * x.s
    accum = topology.grad_accum_steps
    assumptions: list[str] = []

    # ---- model states at rest (all fp32: FSDP keeps fp32 sharded master parameters)
    local = sum(i.local_numel for i in infos)
    at_rest = {"params": int(4 * local), "grads": int(4 * local), "optimizer": int(2 * 4 * local)}
    offload = cfg.offload.params and not ddp
    host = dict(at_rest) if offload else {"params": 0, "grads": 0, "optimizer": 0}
    on_device = {k: 0 for k in at_rest} if offload and kind == "cuda" else dict(at_rest)
    for states in (at_rest, host, on_device):
        states["total"] = states["params"] + states["grads"] + states["optimizer"]
    # A CPU run has one memory: offloaded states still count towards its peak.
    resident = at_rest if kind == "cpu" else on_device
    grads_here = int(resident["grads"] > 0)

    # ---- parameters by where they are gathered
    def total(pred, attr: str, e: float) -> int:
        return int(e * sum(getattr(i, attr) for i in infos if pred(i)))

    def block_unit(i: ParamInfo) -> bool:  # owned by a unit inside its block (the block or a part of it)
        return i.block is not None and (i.unit == f"layers.{i.block}" or i.unit.startswith(f"layers.{i.block}."))

    def root_level(i: ParamInfo) -> bool:  # the root, or units that span blocks: gathered throughout
        return not block_unit(i)

    # Per block: its own unit, and the units nested in it (MoE experts, wrap=size parts), which FSDP2
    # gathers one at a time (plus one implicitly prefetched).
    own = [total(lambda i, j=j: block_unit(i) and i.block == j and i.unit == f"layers.{j}", "gathered_numel", 1)
           for j in range(L)]
    nested = [sorted({i.unit for i in infos if i.block == j and i.unit.startswith(f"layers.{j}.")}) for j in range(L)]
    nested_numel = [[total(lambda i, u=u: i.unit == u, "gathered_numel", 1) for u in units] for units in nested]
    block_numel = [own[j] + sum(nested_numel[j]) for j in range(L)]  # gathered elements of block j
    largest_nested = [max(n, default=0) for n in nested_numel]
    block_local = [total(lambda i, j=j: block_unit(i) and i.block == j, "local_numel", 4) for j in range(L)]
    root_numel = total(root_level, "gathered_numel", 1)
    # Root gradients computed before the blocks' backward: final norm and output (the embedding's last).
    root_early_numel = total(lambda i: root_level(i) and not i.name.startswith("tok_embeddings."), "gathered_numel", 1)

    reshard = _reshard(cfg)
    keep_last = reshard is not False and not cfg.sharding.reshard_last_block and cfg.wrap.policy != "none"
    back_depth = cfg.prefetch.backward if cfg.prefetch.backward is not None else 1

    def gathered_in_backward(i: int) -> int:
        """Unsharded parameter bytes while block i runs its backward."""
        if reshard is False:
            return e_p * (root_numel + sum(block_numel[: i + 1]))
        return e_p * (root_numel + own[i] + largest_nested[i])

    def prefetched(i: int) -> int:
        """All-gather buffers of units gathered ahead of block i's backward."""
        if reshard is False:
            return 0
        ahead = sum(own[max(0, i - back_depth):i])
        return e_p * (ahead + (largest_nested[i] if len(nested[i]) > 1 else 0))

    # ---- activations
    every = {"none": 0, "full": 1, "selective": cfg.ac.every}[cfg.ac.mode]
    checkpointed = [every > 0 and j % every == 0 for j in range(L)]
    e_act = 4 if (ddp and not autocast) else e_p
    math_attention = kind == "cuda" and e_act == 4 and x.dkv != x.dq
    full_block = block_saved_bytes(x, e_act, autocast, math_attention)["total"]
    block_input = (4 if (ddp or e_act == 4) else e_act) * bs * x.d // x.sp
    if cfg.ac.ops == "matmul_save":
        # Op-level selective AC: the block input and the outputs of matmuls and attention are kept.
        kept = block_input + e_act * bs * (3 * x.dq + 2 * x.dkv + 2 * x.d + 2 * x.ffn * max(1, x.experts)) \
            + 4 * x.b * x.heads * x.s
        act_block = [kept if c else full_block for c in checkpointed]
    else:
        act_block = [block_input if c else full_block for c in checkpointed]
    if autocast:
        final_norm = 4 * bs * x.d + 4 * bs + 4 * bs * x.d + e_p * bs * x.d
    else:
        final_norm = (4 if e_act == 4 else 2 * 4) * bs * x.d + 4 * bs + 2 * e_act * bs * x.d
    # The logits, held by the step until it returns: param_dtype, or FSDP2's root output_dtype.
    out_dtype = cfg.precision.output_dtype if backend == "fsdp2" else None
    logits = (4 if (ddp and not autocast) else DTYPE_BYTES[out_dtype] if out_dtype else e_p) * bs * x.vocab
    log_softmax = 4 * bs * x.vocab
    inputs = 2 * 8 * bs  # token ids and targets (int64)
    module_buffers = 2 * 4 * cfg.model.max_seq_len * (cfg.model.dim // cfg.model.n_heads // 2)
    e_grad_w = 4 if ddp else e_p
    resid_grad = e_act * bs * x.d // x.sp
    # A block's backward at its SwiGLU: the gradient arriving from above, w2's weight gradient (one
    # expert's), the gradients of silu's output and w3's output next to the product's (the product is
    # freed by then); MoE adds the gradient of the stacked expert outputs.
    ffn_backward = resid_grad + e_grad_w * x.d * x.ffn + 2 * e_act * bs * x.ffn + \
        (e_act * bs * x.d * x.experts if x.experts else 0)

    # ---- DDP: full replicas, gradient buckets, autocast's weight copies
    bucket = 4 * sum(i.numel for i in infos) if ddp else 0
    if ddp:
        block_grads_full = [4 * sum(i.numel for i in infos if i.block == j) for j in range(L)]
        root_early_grads_full = 4 * sum(i.numel for i in infos if i.block is None and not i.name.startswith("tok_"))
        casts = [e_p * sum(i.numel for i in infos if i.block == j and i.is_matrix) if autocast else 0
                 for j in range(L)]
        output_cast = e_p * sum(i.numel for i in infos if i.name.startswith("output.")) if autocast else 0

    # Gradient accumulation: FSDP2 keeps each unit's unsharded gradient (in reduce_dtype) from the
    # first micro-batch until the last one's backward reduces it; DDP accumulates into .grad.
    def accumulated(upto: Optional[int]) -> int:
        if accum == 1 or ddp:
            return 0
        blocks = block_numel if upto is None else block_numel[: upto + 1]
        return e_r * (root_numel + sum(blocks))

    ddp_accumulated = accum > 1 and ddp
    # gloo's reduce-scatter over more than one rank holds a second copy of its input (measured with
    # torch's tracker on CPU); NCCL reduces in place.
    gloo_copy = kind == "cpu" and not ddp and _shard_group(topology, cfg) > 1

    def phase(name, **kw) -> Phase:
        stage = "optimizer" if name.startswith("optimizer") else "forward" if name.startswith(
            ("forward", "loss forward")) else "backward"
        return Phase(name, stage, params=resident["params"], optimizer=resident["optimizer"],
                     module_buffers=module_buffers, inputs=inputs, **kw)

    phases: list[Phase] = []
    all_acts = sum(act_block)
    ddp_all_grads = 4 * sum(i.numel for i in infos) if ddp_accumulated else 0
    # 1) Each block's forward at its SwiGLU product, its largest moment: the activations of the blocks
    # before it and its own saved so far (a checkpointed block saves only its input, but then holds h,
    # the norm's output, silu's and w3's outputs and their product; under op-level AC its kept matmul
    # outputs and silu's and the product); the root and the block gathered (every block so far under
    # grad_op / no_shard), its all-gather output (FSDP2 frees it at the next unit's wait) and those
    # prefetched ahead (prefetch.forward).
    fwd_depth = max(0, cfg.prefetch.forward)
    # A shard group of one rank (one rank, or no_shard's (world, 1) mesh) all-gathers nothing: FSDP2
    # makes the unsharded parameters from the sharded ones directly, with no all-gather output.
    all_gathers = not ddp and _shard_group(topology, cfg) > 1

    def last_gathered(i: int) -> int:
        """The all-gather output still held while block i runs forward: the latest unit's up to block i
        (the root's when no block is a unit, e.g. wrap=none)."""
        return next((own[j] for j in range(i, -1, -1) if own[j]), root_numel)
    h_alive = 0 if autocast or e_act == 4 else e_act * bs * x.d // x.sp  # fp32 and autocast: saved already
    for i in range(L):
        if not checkpointed[i]:
            in_block = full_block + h_alive
        elif cfg.ac.ops == "matmul_save":
            in_block = act_block[i] + 2 * e_act * bs * x.ffn + h_alive
        else:
            in_block = block_input + 2 * e_act * bs * x.d // x.sp + 3 * e_act * bs * x.ffn \
                + (e_act * bs * x.d * x.experts if x.experts else 0)
        if ddp:
            unsh, comm = sum(casts[: i + 1]), bucket
        else:
            unsh = e_p * (root_numel + (sum(block_numel[: i + 1]) if reshard is False else own[i] + largest_nested[i]))
            comm = e_p * (last_gathered(i) + sum(own[i + 1: i + 1 + fwd_depth])) if all_gathers else 0
        phases.append(phase(f"forward block {i}", grads=accumulated(None) + ddp_all_grads, unsharded=unsh,
                            comm=comm, activations=sum(act_block[:i]) + in_block))
    # 2) Forward, at the output projection: the root and the last block gathered (every unit under
    # grad_op / no_shard), the last block's all-gather buffer not yet released, the logits made.
    if ddp:
        unsh, comm = sum(casts) + output_cast, bucket
    else:
        unsh = e_p * (root_numel + (sum(block_numel) if reshard is False else (own[L - 1] if keep_last else 0)))
        comm = e_p * last_gathered(L - 1) if all_gathers else 0
    # Tensor parallel: the column-parallel output is gathered to a replicated one (parallel/tp.py), so
    # the local shard of the logits and the all-gather's output are alive next to the result.
    tp_gather = logits // topology.tp_size + logits if topology.tp_size > 1 else 0
    phases.append(phase("forward (output projection)", grads=accumulated(None) + ddp_all_grads, unsharded=unsh,
                        comm=comm, activations=all_acts + final_norm + logits, temporaries=tp_gather))
    # 3) The loss's backward: every activation, the loss gradients (fp32); a resharded root is
    # gathered again only after this.
    if ddp:
        unsh, comm = sum(casts) + output_cast, bucket
    elif reshard is False:
        unsh, comm = e_p * (root_numel + sum(block_numel)), 0
    else:
        unsh, comm = (e_p * own[L - 1] if keep_last else 0), 0
    # The loss's forward (the end of the forward stage): the same state, while log_softmax's output
    # (fp32) is made; a logits tensor that is not fp32 has its fp32 copy (``.float()``) alive then.
    float_copy = 4 * bs * x.vocab if logits != 4 * bs * x.vocab else 0
    phases.append(phase("loss forward", grads=accumulated(None) + ddp_all_grads, unsharded=unsh, comm=comm,
                        activations=all_acts + final_norm + logits + log_softmax, temporaries=float_copy))
    phases.append(phase("loss backward", grads=accumulated(None) + ddp_all_grads, unsharded=unsh, comm=comm,
                        activations=all_acts + final_norm + logits + log_softmax,
                        temporaries=2 * 4 * bs * x.vocab))

    # 4) Each block's backward, last to first, at its SwiGLU; 5) its gradient reduction.
    for i in reversed(range(L)):
        recompute = full_block if checkpointed[i] else 0
        acts = sum(act_block[:i]) + (0 if checkpointed[i] else full_block) + logits
        if ddp:
            grads = ddp_all_grads or (root_early_grads_full + sum(block_grads_full[i + 1:])
                                      + 4 * x.d * x.ffn * max(1, x.experts))  # w2's, just computed
            phases.append(phase(f"block {i} backward", grads=grads, unsharded=sum(casts[: i + 1]), comm=bucket,
                                activations=acts, temporaries=ffn_backward - e_grad_w * x.d * x.ffn + recompute))
            continue
        # sharded gradients of the blocks already reduced (offloaded to the host on CUDA)
        done = sum(block_local[i + 1:]) * grads_here
        previous_rs = e_r * block_numel[i + 1] if i + 1 < L else 0  # released at the next reduce-scatter
        new_grads = e_p * root_early_numel + e_grad_w * x.d * x.ffn
        if accum > 1 and e_r == e_p:  # later micro-batches accumulate into the kept gradients in place
            new_grads = 0
        phases.append(phase(f"block {i} backward", grads=done + accumulated(i), unsharded=gathered_in_backward(i),
                            comm=prefetched(i) + previous_rs, activations=acts,
                            temporaries=new_grads + ffn_backward - e_grad_w * x.d * x.ffn + recompute))
        # Post-backward: the block is resharded, its gradients copied into the reduce-scatter input
        # (reduce_dtype), the unsharded ones freed.
        unsh = e_p * (root_numel + (sum(block_numel[:i]) if reshard is False else 0))
        rest = dict(unsharded=unsh, activations=sum(act_block[:i]) + logits,
                    temporaries=e_p * root_early_numel + resid_grad)
        phases.append(phase(f"block {i} reduce-scatter", grads=done + accumulated(i - 1) + e_p * block_numel[i],
                            comm=prefetched(i) + e_r * block_numel[i], **rest))
        if gloo_copy:  # w2's unsharded gradient is still referenced; the output shard exists
            phases.append(phase(f"block {i} reduce-scatter (gloo copy)",
                                grads=done + accumulated(i - 1) + block_local[i] * grads_here + e_p * x.d * x.ffn,
                                comm=prefetched(i) + 2 * e_r * block_numel[i], **rest))

    # 6) The root's gradient reduction, after the embedding's backward.
    if not ddp:
        phases.append(phase("root reduce-scatter", grads=sum(block_local) * grads_here, unsharded=e_p * root_numel,
                            comm=e_r * root_numel * (2 if gloo_copy else 1), activations=logits,
                            temporaries=e_p * root_numel))
    # 7) The optimizer step: CUDA's foreach AdamW makes a temporary the size of all shards. The
    # per-tensor loop (CPU) makes two per tensor (the second moment's sqrt, then its quotient by the
    # bias correction, ``denom``) while the previous tensor's ``denom`` is still alive: the largest
    # previous + 2 x this tensor, within each parameter group (matrices, then norms: fsdp_exp.optim).
    def loop_temporaries(sizes: list[int]) -> int:
        return max((prev + 2 * cur for prev, cur in zip([0, *sizes[:-1]], sizes)), default=0)

    groups = ([int(4 * i.local_numel) for i in infos if i.is_matrix],
              [int(4 * i.local_numel) for i in infos if not i.is_matrix])
    opt_temp = int(resident["params"]) if kind == "cuda" else max(loop_temporaries(g) for g in groups)
    phases.append(phase("optimizer step", grads=resident["grads"], comm=bucket, activations=logits,
                        temporaries=opt_temp))

    peak = max(phases, key=lambda ph: ph.total)
    pieces = ("params", "grads", "optimizer", "unsharded", "comm", "module_buffers", "activations", "temporaries",
              "inputs")

    def by_piece(ph: Phase) -> dict:
        return {"phase": ph.name, **{k: getattr(ph, k) for k in pieces}, "total": ph.total}

    stage_peaks = {stage: by_piece(max((ph for ph in phases if ph.stage == stage), key=lambda ph: ph.total))
                   for stage in STAGES}
    if margin is None:
        margin_bytes = 0 if kind == "cpu" else int(CUDA_MARGIN_FRACTION * peak.total) + CUDA_FIXED_OVERHEAD
        margin_rule = ("0 on a CPU (no caching allocator)" if kind == "cpu" else
                       f"{CUDA_MARGIN_FRACTION:.0%} of the peak + {CUDA_FIXED_OVERHEAD / GIB:.0f} GiB "
                       "(caching allocator, CUDA context, NCCL and cuBLAS workspaces)")
    else:
        margin_bytes = int(margin * peak.total)
        margin_rule = f"plan.margin={margin:g} of the peak"
    per_rank = {"params": on_device["params"], "grads": on_device["grads"], "optimizer": on_device["optimizer"],
                "activations": peak.activations + peak.temporaries + peak.inputs,
                "buffers": peak.unsharded + peak.comm + peak.module_buffers,
                "total": peak.total + margin_bytes}

    if backend == "fsdp1":
        assumptions.append("FSDP1's peak follows FSDP2's schedule (torch's tracker cannot measure FSDP1)")
    if cfg.compile:
        assumptions.append("compile=true can fuse away saved tensors: the eager estimate is an upper bound")
    if cfg.ac.ops == "matmul_save":
        assumptions.append("op-level selective AC (ac=selective_op): saved matmul outputs estimated")
    if cfg.wrap.policy == "size":
        assumptions.append("wrap=size: units inside blocks are treated like MoE experts (estimated)")
    if kind == "cuda":
        assumptions.append("CUDA: calibrated on CPU runs; SDPA assumed to save q, k, v, out and the log-sum-exp "
                           "(flash / memory-efficient)" + (", math fallback here (fp32 with GQA)" if math_attention
                                                          else ""))
    return Plan(
        num_params=sum(i.numel for i in infos), world_size=topology.world_size, device_kind=kind,
        model_states={"device": on_device, "host": host, "total": at_rest["total"]},
        per_rank_bytes=per_rank,
        peak=by_piece(peak), stage_peaks=stage_peaks,
        margin_bytes=margin_bytes, margin_rule=margin_rule,
        phases=[{"name": ph.name, "stage": ph.stage, "total": ph.total} for ph in phases], assumptions=assumptions)


def _reshard(cfg: RunConfig):
    if cfg.sharding.backend == "ddp":
        return False
    if cfg.sharding.backend == "fsdp1":
        return cfg.sharding.strategy in ("full", "hybrid")
    from fsdp_exp.parallel.fsdp2 import reshard_after_forward

    value = reshard_after_forward(cfg)
    return value if value is False else True  # an integer group still frees the unsharded copy


def fits(result: Plan, device: Device) -> dict:
    need = result.per_rank_bytes["total"]
    ranks = result.world_size if device.kind == "cpu" else 1  # a host's RAM is shared by its ranks
    return {"name": device.name, "description": device.description, "bytes": device.bytes,
            "ranks_sharing": ranks, "needed_bytes": need * ranks, "fits": need * ranks <= device.bytes,
            "headroom_bytes": device.bytes - need * ranks}


PREDICTED_METRICS = ("mem/predicted_model_states_gib", "mem/predicted_peak_gib")
PREDICTED_STAGE_METRICS = tuple(f"mem/predicted_{stage}_peak_gib" for stage in STAGES)


def plan_for_run(cfg: RunConfig, topology: Topology) -> tuple[dict, dict, dict]:
    """What a run records: the whole plan (run.json["plan"]), the two predictions it logs in every
    row beside the measurements, and the per-phase peaks it logs beside the sampled step's breakdown.
    Never raises: a configuration the planner cannot model must not stop a run; the record then says
    why there is no plan."""
    try:
        result = plan(cfg, topology)
    except Exception as exc:  # noqa: BLE001 - the prediction is an aside to the run
        return ({"error": f"{type(exc).__name__}: {exc}"}, dict.fromkeys(PREDICTED_METRICS),
                dict.fromkeys(PREDICTED_STAGE_METRICS))
    return (result.to_dict(),
            {"mem/predicted_model_states_gib": result.model_states["total"] / GIB,
             "mem/predicted_peak_gib": result.peak["total"] / GIB},
            {f"mem/predicted_{stage}_peak_gib": result.stage_peaks[stage]["total"] / GIB for stage in STAGES})


# --------------------------------------------------------------------------------------------- CLI
PLAN_OPTIONS = ("plan.format", "plan.device", "plan.margin")


class PlanOptionError(ValueError):
    """A bad ``plan.*`` option (the planner's own, not the run's)."""


def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Take the planner's own ``plan.*`` options off the command line; the rest are run overrides."""
    options, overrides = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key.startswith("plan."):
            if key not in PLAN_OPTIONS or not sep:
                known = ", ".join(o + "=..." for o in PLAN_OPTIONS)
                raise PlanOptionError(f"{arg!r} is not a planner option ({known}).\n"
                                      "  fix: pass plan.format=table|json, plan.device=<name>, plan.margin=<fraction>")
            options[key.removeprefix("plan.")] = value
        else:
            overrides.append(arg)
    return options, overrides


def compose(overrides: list[str]) -> RunConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from fsdp_exp.config import to_run_config

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        return to_run_config(hydra_compose(config_name="config", overrides=overrides))


def plan_from_argv(argv: list[str]) -> tuple[Plan, dict[str, str]]:
    from fsdp_exp.config.preflight import validate

    options, overrides = split_argv(argv)
    fmt = options.get("format", "table")
    if fmt not in ("table", "json"):
        raise PlanOptionError(f"plan.format={fmt!r} is not one of table, json.\n  fix: pass plan.format=json")
    table = device_table()
    device = None
    if "device" in options:
        device = table.get(options["device"])
        if device is None:
            raise PlanOptionError(f"plan.device={options['device']!r} is not a known device.\n"
                              f"  fix: pass one of {', '.join(table)}")
    margin = None
    if "margin" in options:
        try:
            margin = float(options["margin"])
        except ValueError:
            margin = -1.0
        if not 0 <= margin < 10:
            raise PlanOptionError(f"plan.margin={options['margin']!r} is not a fraction.\n"
                                  "  fix: pass e.g. plan.margin=0.1")
    cfg = compose(overrides)
    if device is not None and device.kind == "cuda":
        # Plan for that GPU: as many GPUs per node as the run asks for (auto = 8).
        n = cfg.trainer.nproc_per_node
        gpus = int(n) if n.isdigit() else 8
        topology = validate(cfg, cuda_devices=gpus)
    else:
        from fsdp_exp.env import cuda_device_count

        topology = validate(cfg, cuda_devices=cuda_device_count())
    result = plan(cfg, topology, device_kind=device.kind if device else None, margin=margin)
    if device is None:
        device = table["cpu_host"] if result.device_kind == "cpu" else _local_cuda_device()
    if device is not None:
        result.device = fits(result, device)
    return result, {"format": fmt}


def _local_cuda_device() -> Optional[Device]:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Device("cuda:0", "cuda", props.total_memory, props.name)


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def render_table(result: Plan, overrides: list[str]):
    from rich.table import Table

    ms, per, pk = result.model_states, result.per_rank_bytes, result.peak
    unit, scale = ("GiB", GIB) if per["total"] >= GIB else ("MiB", 2**20)

    def fmt(n: float) -> str:
        return f"{n / scale:.3f}" if n < 10 * scale else f"{n / scale:.1f}"

    title = (f"Memory plan per rank: {_count(result.num_params)} parameters, {result.world_size} ranks, "
             f"{result.device_kind}")
    table = Table(title=title, caption=" ".join(overrides) or "(the default config)")
    table.add_column("what")
    table.add_column(unit, justify="right")
    table.add_column("notes")
    table.add_row("parameters", fmt(ms["device"]["params"]), "fp32 shards")
    table.add_row("gradients", fmt(ms["device"]["grads"]), "fp32 shards, after backward")
    table.add_row("optimizer state", fmt(ms["device"]["optimizer"]), "AdamW: two fp32 moments")
    table.add_row("model states", fmt(ms["device"]["total"]), "at rest, on the device",
                  end_section=not ms["host"]["total"])
    if ms["host"]["total"]:
        table.add_row("model states on host", fmt(ms["host"]["total"]), "offload=params", end_section=True)
    table.add_row("activations", fmt(per["activations"]), "at the peak, with their gradients")
    table.add_row("buffers", fmt(per["buffers"]), f"at the peak: unsharded params {fmt(pk['unsharded'])}, "
                  f"comm {fmt(pk['comm'])}, module {fmt(pk['module_buffers'])}")
    table.add_row("peak", fmt(pk["total"]), f"{pk['phase']}; gradients alive then {fmt(pk['grads'])}")
    table.add_row("allocator margin", fmt(result.margin_bytes), result.margin_rule)
    table.add_row("total", fmt(per["total"]), "peak + margin", end_section=True)
    if result.device:
        dv = result.device
        shared = f" ({dv['ranks_sharing']} ranks share it)" if dv["ranks_sharing"] > 1 else ""
        verdict = "fits" if dv["fits"] else "does NOT fit"
        table.add_row(dv["name"], fmt(dv["bytes"]),
                      f"{verdict}{shared}: needs {fmt(dv['needed_bytes'])}, headroom {fmt(dv['headroom_bytes'])}")
    for note in result.assumptions:
        table.add_row("note", "", note)
    return table


def verdict_line(result: Plan) -> Optional[str]:
    dv = result.device
    if not dv:
        return None
    word = "fits" if dv["fits"] else "does not fit"
    unit, scale = ("GiB", GIB) if dv["needed_bytes"] >= GIB else ("MiB", 2**20)
    return (f"{word} on {dv['name']} ({dv['description']}): needs {dv['needed_bytes'] / scale:.2f} {unit} of "
            f"{dv['bytes'] / GIB:.2f} GiB")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("devices: " + ", ".join(f"{d.name} ({d.bytes / GIB:.1f} GiB)" for d in device_table().values()))
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        result, opts = plan_from_argv(argv)
    except PlanOptionError as err:
        print(f"fsdp_exp.plan: invalid planner option: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ConfigError as err:
        print(f"fsdp_exp.plan: invalid configuration: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (HydraException, OmegaConfBaseException) as err:
        print(f"fsdp_exp.plan: invalid configuration: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if opts["format"] == "json":
        print(json.dumps(result.to_dict(), indent=1))
    else:
        from rich.console import Console

        console = Console()
        console.print(render_table(result, split_argv(argv)[1]))
        line = verdict_line(result)
        if line:
            console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
