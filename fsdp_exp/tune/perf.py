"""The step-time model: one rank's training step from the work it computes, the collectives its strategy
issues, the overlap its prefetch settings allow and what offloading moves. Two halves:

``step_costs(cfg, topology)`` counts, from the config alone (the model family's inventory and ``Work``,
the backend's ``PlannerRules`` and shard group, the mesh), what one optimizer step of one rank does:

- **compute**: ``tokens x (model FLOPs + recompute) / tp`` per rank, split into forward (a third of the
  model FLOPs) and backward (two thirds, plus the recompute); and the operators the host dispatches.
- **collectives**, each with its group (size, nodes it spans), how many per step and their bytes:
  - a backend that gathers units (FSDP): each unit's all-gather over the shard group in every
    micro-batch's forward, again in backward where units are resharded after forward (all but the last
    block, which stays gathered), in ``param_dtype``; one reduce-scatter per unit per micro-batch in
    ``reduce_dtype`` under ``trainer.grad_sync=every_micro_batch`` (FSDP's default), per step under
    ``last_micro_batch`` (earlier micro-batches only accumulate); across replicas of a shard (hybrid,
    no_shard) one all-reduce of the unit's shard as often;
  - a backend that replicates (DDP): the gradients all-reduced in 25 MiB buckets (DDP's default), once
    per step (per micro-batch under every_micro_batch);
  - tensor parallel: two all-reduces of the residual stream per block in forward and two in backward,
    every micro-batch, on the critical path (under sequence parallel each a reduce-scatter and an all-gather,
    the all-gathers in float8 under torchao's float8 styles);
  - context parallel (``parallel.cp``, fsdp_exp/parallel/context.py): each rank computes 1/cp of every
    sequence's tokens (the head-and-tail layout balances the causal work exactly). ``all_to_all``: four
    all-to-alls per attention layer in forward (q, k, v out, the output back) and four in backward, each
    moving (cp-1)/cp of the local tensor, on the critical path; ``ring``: cp-1 passes of the local keys and
    values per layer in forward, twice that in backward (the gradients travel too), overlapped with
    attention's own compute: only what attention does not cover is exposed;
  - a mixture of experts under expert parallel (``parallel.ep``): the dispatch and combine all-to-alls and the
    experts' own all-gathers and reduce-scatters over efsdp (``fsdp_exp.tune.experts_perf``);
  - two tiny all-reduces per step over the world (the loss statistics and the gradient norm).
- **the routed experts** (``expert_costs``, ``fsdp_exp.tune.experts_perf``): their grouped matmuls by tokens per
  expert and the most loaded EP rank's share of the copies; the all-to-alls' bytes and the permutation's memory
  traffic as the run's dispatcher moves them (``ExpertDispatch``: fsdp_exp's own by default, or a fused one such
  as DeepEP's, which the published MoE runs name).
- **float8** (``float8_costs``, ``fsdp_exp.tune.float8_perf``): the linears torchao converts, taken out of the
  high-precision matmuls, and their casts' bytes.
- **offload** (``offload=params`` where the backend offloads): each all-gather first copies the unit's
  fp32 shard from the host, the gradient shards go back once per step, and AdamW steps on the host.
  ``offload=optimizer`` (DeepSpeed's offload_optimizer): the parameters stay on the device; each reduction's
  gradient partition goes to the host during backward (hidden as a collective is), AdamW steps on the host,
  and the updated partition comes back in ``param_dtype`` before the next forward (exposed).
- **the optimizer step**: AdamW reads parameters, gradients and both moments and writes three of them
  back: 28 bytes per parameter of the rank's optimizer partition (its shard; ZeRO-1/2's and ZeRO-1 on DDP's
  share of the whole) through the device's memory (the host's, offloaded, shared by the node's ranks).

``timing(costs, perf)`` turns the counts into seconds with a ``DevicePerf``:

- compute on a GPU (``DevicePerf.kernels``), by kernel class (``kernel_seconds``): the linear layers'
  matmuls by shape at ``efficiency`` (less ``gemm_half_dim``'s penalty, never faster than their operands'
  bytes allow: ``fsdp_exp.tune.gemm``), attention as a causal fused kernel does it (half the counted square; 2.5 x in backward) at
  ``attention_efficiency``, the memory-bound operators and the loss's logits by their bytes at
  ``memory_efficiency`` of the memory's bandwidth, the experts' grouped matmuls
  (``grouped_seconds``, ``fsdp_exp.tune.experts_perf``; on a CPU too), backward twice the matmuls and bytes, and
  the share of the forward that activation checkpointing runs again. Under ``precision=float8`` the converted
  linears and their casts are timed by ``fsdp_exp.tune.float8_perf`` (``float8_seconds``; a GPU without an FP8
  peak refuses, unless emulated: ``float8_refusal``). On a CPU: FLOPs / (peak of
  ``param_dtype`` x efficiency x the probe's step-like scale of that dtype, ``DevicePerf.dtype_scale``). The operators cost ``dispatch_us`` each, hidden behind the device's work where dispatch is
  asynchronous (CUDA), added to it where it is not (eager CPU);
- each purpose's collectives on the node's link or the network's (``traffic_seconds``, the alpha-beta model of a
  ring; an all-to-all across nodes is no ring): ``fsdp_exp.tune.traffic``;
- the sharding backend's software: ``unit_us`` (by parameter layout) per gathered unit and collective;
- overlap: collectives that a prefetch or the backward's bucketing can run ahead of need are hidden
  behind the phase's compute, up to ``overlap`` of the smaller of the two; the first unit's all-gather
  and the last unit's reduction always wait. Forward prefetch off (``prefetch.forward=0``) exposes the
  forward's all-gathers, backward prefetch off (``prefetch.backward=0``) or issued after the unit's gradients
  (FSDP1's ``prefetch.backward_timing=post``) the backward's re-gathers. A
  deeper prefetch hides no more in steady state (it costs memory; the planner counts that);
- the step = forward + backward of every micro-batch + the optimizer step + ``step_overhead_ms`` + the
  tiny all-reduces.

A pipeline-parallel run (``parallel.pp > 1``) is timed by ``fsdp_exp.tune.pipeline_perf`` (its stages from this
module's counts, the schedule's bubble, the sends between stages, FSDP2 inside each stage); callers ask
``fsdp_exp.tune.step_time``, which dispatches to either.

Where the parts live: this module counts (``step_costs``) and times (``timing``) the step and its overlap;
``fsdp_exp.tune.traffic`` owns the collectives (``Traffic``, their seconds on a link), ``fsdp_exp.tune.gemm`` the
linear layers' matmuls by shape, ``fsdp_exp.tune.experts_perf`` a mixture of experts' terms and
``fsdp_exp.tune.float8_perf`` float8's. Each of them imports none of this module, so the imports point one way.

What it leaves out, knowingly: stragglers, congestion between jobs, NCCL's tree and NVLS algorithms,
compile (but for float8's casts, fused under it), rowwise float8's slower kernels; on a CPU kernels' efficiency by shape and the backend's per-collective software cost (both in
the probed and fitted figures). The GPU figures it fits on the published record: fsdp_exp/plan/devices.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.schema import EVERY_MICRO_BATCH
from fsdp_exp.plan.states import DTYPE_BYTES
from fsdp_exp.tune.experts_perf import (
    OWN_DISPATCH,
    ExpertCosts,
    ExpertDispatch,
    all_to_all_traffic,
    expert_costs,
    expert_layers,
    expert_traffic,
    grouped_extra_flops,
    grouped_seconds,
    memory_elements,
)
from fsdp_exp.tune.float8_perf import (
    Float8Costs,
    float8_all_gathered_numel,
    float8_costs,
    float8_on,
    float8_refusal,
    float8_seconds,
)
from fsdp_exp.tune.gemm import gemm_seconds
from fsdp_exp.tune.traffic import Traffic, collective_seconds, group_nodes, link_for, traffic_seconds

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.config.topology import Topology
    from fsdp_exp.plan.devices import DevicePerf

DDP_BUCKET_BYTES = 25 * 2**20
ADAMW_BYTES_PER_PARAM = 28  # reads p, g, m, v (16 bytes), writes p, m, v (12 bytes), all fp32


def adamw_bytes_per_param(storage_dtype: str) -> int:
    """AdamW's memory traffic a parameter: seven passes (reads p, g, m, v; writes p, m, v) over states stored in
    ``precision.storage_dtype`` (``ADAMW_BYTES_PER_PARAM`` in fp32, half in bf16)."""
    return ADAMW_BYTES_PER_PARAM * DTYPE_BYTES[storage_dtype] // 4


ADAMW_OPS_PER_TENSOR = 12  # a per-tensor AdamW step dispatches about this many operators
TINY_ALL_REDUCES = 2


@dataclass(frozen=True)
class StepCosts:
    """What one optimizer step of one rank does, in counts and bytes (see the module docstring)."""

    tokens_per_step: int  # global
    micro_batches: int
    units: int  # gathered units (FSDP) or gradient buckets (DDP): the first / last of them waits
    dtype: str  # the compute dtype
    forward_flops: float
    backward_flops: float
    forward_ops: float
    backward_ops: float
    optimizer_ops: float
    traffic: tuple[Traffic, ...]
    offload_forward_bytes: float  # host -> device copies before the forward's all-gathers
    offload_backward_bytes: float  # host -> device before backward's re-gathers, device -> host gradients
    offload_after_step_bytes: float  # host -> device after the host's optimizer step (offload=optimizer), exposed
    optimizer_bytes: float  # bytes the optimizer streams (through the host's memory when offloaded)
    optimizer_on_host: bool
    ranks_per_node: int
    world: int
    model_flops: float  # the step's model FLOPs on this rank (MFU's numerator)
    # By kernel class (the GPU timing, ``DevicePerf.kernels``), forward of the whole step on this rank:
    gemms: tuple[tuple[float, float, float, float], ...] = ()  # (M, K, N, FLOPs) of the linear layers' matmuls
    attention_flops: float = 0.0  # as a causal fused kernel computes them (half the counted square)
    memory_bytes: float = 0.0  # the memory-bound operators' reads and writes, the loss's included
    recompute_share: float = 0.0  # of the forward's kernels, the share activation checkpointing runs again
    param_layout: str = ""  # the backend's (PlannerRules.param_layout): which per-unit software cost applies
    # precision.float8_recipe (torchao): the converted linears' matmuls, taken out of ``gemms`` (same layout)
    float8: Optional[Float8Costs] = None
    # A mixture of experts: its routed experts' grouped matmuls (``expert_costs``); None for a dense model
    experts: Optional[ExpertCosts] = None


@dataclass
class StepPrediction:
    step_time_s: float
    tokens_per_s: float
    mfu: Optional[float]
    breakdown: dict  # seconds: compute, exposed_comm, offload, optimizer, overhead
    comm: dict  # seconds per collective purpose, before overlap
    dominant: str  # compute | exposed comm | offload | optimizer | overhead
    # precision=float8 on a device with FP8 tensor cores: MFU against the FP8 peak (``mfu`` is against the compute
    # dtype's), the two denominators a run reports (perf/mfu, perf/mfu_fp8)
    mfu_fp8: Optional[float] = None
    # seconds per kind of collective before overlap (all_gather, reduce_scatter, all_reduce, all_to_all, other: the
    # kinds a profiled run measures, comm/<kind>_s), so a report can split exposed_comm as a run's trace does
    comm_kinds: dict = field(default_factory=dict)

    def exposed_by_kind(self) -> dict:
        """``breakdown["exposed_comm"]`` split over the collective kinds in proportion to their seconds in flight
        (the model prices overlap per phase, not per kind)."""
        exposed, total = self.breakdown.get("exposed_comm", 0.0), sum(self.comm_kinds.values())
        if not total:
            return {"other": exposed} if exposed else {}
        return {kind: exposed * seconds / total for kind, seconds in self.comm_kinds.items() if seconds}

    def to_dict(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        """The step's time in shares, largest first, e.g. "compute 71% · exposed comm 22% · optimizer 7%"."""
        total = sum(self.breakdown.values()) or 1.0
        parts = sorted(((v / total, k.replace("_", " ")) for k, v in self.breakdown.items() if v > 0), reverse=True)
        text = " · ".join(f"{name} {share:.0%}" for share, name in parts if share >= 0.01)
        if self.breakdown.get("exposed_comm", 0) / total >= 0.05 and self.comm:
            top = max(self.comm, key=self.comm.get)
            text += f" (most comm: {top})"
        return text


# ----------------------------------------------------------------------------------------------- counting
_LAYOUTS: dict[tuple, tuple[list[float], int, int]] = {}


def backward_prefetch_hides(cfg: "RunConfig") -> bool:
    """Whether the backward's re-gathers can run ahead of the units that need them. Not without backward prefetch
    (``prefetch.backward=0``), nor under FSDP1's ``BACKWARD_POST`` (``prefetch.backward_timing=post``): that
    prefetch is issued from the unit's post-backward hook, once its gradients are computed, so the previous unit's
    all-gather starts with no compute of its unit left to hide behind (``BACKWARD_PRE`` issues it before)."""
    return cfg.prefetch.backward != 0 and cfg.prefetch.backward_timing != "post"


def _units(cfg: "RunConfig", rules, shard: int, tp: int) -> tuple[list[float], int, int]:
    """(each unit's gathered elements, this rank's local elements, parameter tensors), cached per layout."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.models.spec import config_key
    from fsdp_exp.plan.states import param_infos, unit_names

    key = (config_key(cfg.model), config_key(cfg.wrap), rules.param_layout, rules.gathers_units, shard, tp)
    if key not in _LAYOUTS:
        spec = spec_for(cfg.model)
        inventory = spec.inventory(cfg.model)
        units = unit_names(spec, cfg) if rules.gathers_units else []
        infos = param_infos(inventory, units, rules, shard, tp)
        sizes: dict[str, float] = {}
        for info in infos:
            sizes[info.unit] = sizes.get(info.unit, 0.0) + (info.gathered_numel or info.local_numel)
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = (list(sizes.values()), int(sum(i.local_numel for i in infos)), len(infos))
    return _LAYOUTS[key]


def local_parameters(cfg: "RunConfig", rules, shard: int, tp: int) -> int:
    """This rank's share of the parameters (elements) under the backend's layout."""
    return _units(cfg, rules, shard, tp)[1]


def _tensor_parallel_traffic(cfg: "RunConfig", topology: "Topology", blocks: int, e_p: int, G: int, tp: int) -> list:
    """Tensor parallel's collectives on the critical path: per block and phase, two of the residual stream. An
    all-reduce each; under sequence parallel a reduce-scatter and an all-gather (the same bytes and rounds),
    whose all-gathers move float8 (1 byte an element) under torchao's float8 styles (parallel/tp.py: the
    input cast before the sequence is gathered, the output's gradient cast before backward gathers it)."""
    from fsdp_exp.parallel.float8 import tensor_parallel_styles
    from fsdp_exp.plan.activations import profile_for

    seq = cfg.trainer.seq_len // max(cfg.parallel.cp, 1)  # this rank's share of each sequence under CP
    stream = profile_for(cfg.model, topology.micro_batch_size, seq, 1, False).residual(1)
    count = G * 2 * blocks
    if not cfg.parallel.sequence_parallel:
        kinds = (("all-reduce", "all-reduce", e_p),)
    else:
        gather = 1 if tensor_parallel_styles(cfg) else e_p
        kinds = (("reduce-scatter", "reduce-scatter", e_p), ("all-gather", "all-gather", gather))
    return [
        Traffic(f"tensor-parallel {label} ({phase})", kind, tp, 1, count, count * stream * e, phase, False)
        for phase in ("forward", "backward")
        for label, kind, e in kinds
    ]


def step_costs(
    cfg: "RunConfig", topology: "Topology", expert_imbalance: float = 1.0, dispatch: ExpertDispatch = OWN_DISPATCH
) -> StepCosts:
    """``expert_imbalance``: a mixture of experts' max / mean routed copies per expert (the planner's
    ``plan.expert_imbalance``; 1.0 is a perfectly balanced router). ``dispatch``: how its routed copies travel and
    are permuted (``fsdp_exp.tune.experts_perf.ExpertDispatch``; fsdp_exp's own dispatcher by default)."""
    from fsdp_exp.parallel.backend import backend_for
    from fsdp_exp.tune.work import work

    backend = backend_for(cfg)
    rules = backend.planner_rules(cfg)
    tp, dp, nproc = topology.tp_size, topology.dp_size, topology.nproc_per_node
    shard = backend.shard_group(topology)  # shard x cp under context parallel
    replicas = topology.layout.replicas_of(shard)
    G = topology.grad_accum_steps
    # Gradient reductions per step (trainer.grad_sync as the backend resolves it): every micro-batch, or the last.
    R = G if backend.grad_sync(cfg) == EVERY_MICRO_BATCH else 1
    e_p, e_r = DTYPE_BYTES[cfg.precision.param_dtype], DTYPE_BYTES[cfg.precision.reduce_dtype]
    seq = cfg.trainer.seq_len
    cp = cfg.parallel.cp
    tokens = cfg.trainer.global_batch_size * seq
    tokens_rank = tokens / topology.layout.tokens_shards  # dp x cp: a CP rank computes its share of a sequence

    w = work(cfg)
    ep = max(1, topology.ep_size)
    moe_layers = expert_layers(cfg) if w.grouped_gemms else (0, 0)  # (MoE layers, routed experts' elements)
    model_flops = tokens_rank * w.flops_per_token / tp
    # trainer.loss_chunks > 1 (auto resolved by the planner's rule): each slice's output projection runs again in
    # backward (``fsdp_exp.models.loss``), counted with what activation checkpointing recomputes
    head_again = head_recompute_flops_per_token(w, cfg, topology)
    recompute = tokens_rank * (w.recompute_flops_per_token(cfg) + head_again) / tp
    ops_f, ops_b = w.ops_per_micro_batch(cfg)

    unit_numel, local_numel, tensors = _units(cfg, rules, shard, tp)
    full_numel = sum(unit_numel)
    shard_nodes = group_nodes(tp, shard, nproc)
    replica_nodes = group_nodes(tp * shard, replicas, nproc)
    dp_nodes = group_nodes(tp, dp, nproc)
    traffic: list[Traffic] = []
    offload = bool(cfg.offload.params and rules.offloads)
    # offload=optimizer (DeepSpeed's offload_optimizer): the parameters stay on the device, the optimizer's
    # partition lives and steps on the host, so its gradients go down and its updated parameters come back
    offload_optimizer = bool(cfg.offload.optimizer and rules.offloads and not offload)
    offload_f = offload_b = offload_after = 0.0
    units = len(unit_numel)
    regathered = 0
    if rules.gathers_units:
        regathered = units - 1 if rules.reshard_after_forward else 0  # the last block stays gathered
        # precision.float8_all_gather: the converted weights travel in float8, 1 byte an element
        gathered = e_p * full_numel - (e_p - 1) * float8_all_gathered_numel(cfg, tp)
        if ep > 1:  # the routed experts are their own units, over efsdp (expert_traffic), not over shard
            gathered -= e_p * moe_layers[1]
        if shard > 1:
            traffic.append(
                Traffic(
                    "forward all-gather",
                    "all-gather",
                    shard,
                    shard_nodes,
                    G * units,
                    G * gathered,
                    "forward",
                    cfg.prefetch.forward > 0,
                )
            )
            if regathered:
                share = regathered / units
                traffic.append(
                    Traffic(
                        "backward re-gather",
                        "all-gather",
                        shard,
                        shard_nodes,
                        G * regathered,
                        G * gathered * share,
                        "backward",
                        backward_prefetch_hides(cfg),
                    )
                )
            traffic.append(
                Traffic(
                    "gradient reduce-scatter",
                    "reduce-scatter",
                    shard,
                    shard_nodes,
                    R * units,
                    R * e_r * (full_numel - (moe_layers[1] if ep > 1 else 0)),
                    "backward",
                    True,
                )
            )
        if ep > 1:
            traffic += expert_traffic(moe_layers, ep, shard, tp, nproc, G, R, regathered > 0, cfg, e_p, e_r)
        if replicas > 1:
            traffic.append(
                Traffic(
                    "replica all-reduce",
                    "all-reduce",
                    replicas,
                    replica_nodes,
                    R * units,
                    R * e_r * full_numel / shard,
                    "backward",
                    True,
                )
            )
        if offload:
            offload_f = G * 4 * full_numel / shard
            offload_b = G * 4 * full_numel / shard * (regathered / units) + 4 * full_numel / shard
    elif dp > 1:  # replicas: gradients all-reduced in buckets during backward
        grad_bytes = e_r * full_numel
        units = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
        traffic.append(
            Traffic(
                "gradient all-reduce (buckets)", "all-reduce", dp, dp_nodes, R * units, R * grad_bytes, "backward", True
            )
        )
    # The optimizer's partition: ZeRO-1/2 keep whole parameters on every rank but split the optimizer over the
    # data-parallel ranks (as ZeRO-1 on DDP does); a gathering backend steps its shard.
    optimizer_numel = local_numel
    if not rules.gathers_units and (rules.zero_stage or rules.shards_optimizer):
        optimizer_numel = local_numel / max(dp, 1)
    if offload_optimizer:
        # the partition's gradients (reduce_dtype) go to the host at each reduction, as their buckets are reduced
        # during backward (they can overlap it); the updated partition (param_dtype) comes back after the host's
        # step, before the next forward can start (no delayed update): nothing to hide it behind
        offload_b = R * e_r * optimizer_numel
        offload_after = e_p * optimizer_numel
    if tp > 1:
        traffic += _tensor_parallel_traffic(cfg, topology, len(w.block_forward_flops), e_p, G, tp)
    if cp > 1:
        traffic += cp_traffic(cfg, topology, G, len(w.block_forward_flops), e_p)
    experts = None
    if w.grouped_gemms:
        micro_tokens = topology.micro_batch_size * seq // cp
        experts = expert_costs(w, tokens_rank / tp, micro_tokens, ep, expert_imbalance)
        if ep > 1:
            recomputed = len(w.checkpointed(cfg)) / max(len(w.block_forward_flops), 1)
            traffic += all_to_all_traffic(cfg, topology, moe_layers[0], ep, G, e_p, experts.load, recomputed, dispatch)
    memory = memory_elements(w, cfg, ep, dispatch)
    kernels = _kernel_classes(
        w, cfg, tokens_rank / tp, topology.micro_batch_size * seq // cp, tp, e_p, head_again, memory
    )
    float8 = None
    if float8_on(cfg):
        gathers = (G, G * regathered / units) if rules.gathers_units and units else (0.0, 0.0)
        kernels["gemms"], float8 = float8_costs(cfg, kernels["gemms"], tokens_rank / tp, e_p, shard, gathers, tp)
    return StepCosts(
        **kernels,
        param_layout=rules.param_layout if rules.gathers_units else "",
        float8=float8,
        experts=experts,
        tokens_per_step=tokens,
        micro_batches=G,
        units=max(units, 1),
        dtype=cfg.precision.param_dtype,
        forward_flops=model_flops / 3,
        backward_flops=2 * model_flops / 3 + recompute,
        forward_ops=G * ops_f,
        backward_ops=G * ops_b,
        optimizer_ops=ADAMW_OPS_PER_TENSOR * tensors,
        traffic=tuple(traffic),
        offload_forward_bytes=offload_f,
        offload_backward_bytes=offload_b,
        offload_after_step_bytes=offload_after,
        optimizer_bytes=adamw_bytes_per_param(cfg.precision.storage_dtype) * optimizer_numel,
        optimizer_on_host=offload or offload_optimizer,
        ranks_per_node=nproc,
        world=topology.world_size,
        model_flops=model_flops,
    )


def cp_traffic(cfg: "RunConfig", topology: "Topology", G: int, layers: int, e: int) -> list[Traffic]:
    """Context parallel's collectives in one step of one rank (see the module docstring). The CP group is cp
    ranks tp apart (the mesh's cp dim sits just outside tp)."""
    from fsdp_exp.parallel.context import resolve_method
    from fsdp_exp.plan.activations import profile_for

    cp, tp = cfg.parallel.cp, topology.tp_size
    x = profile_for(cfg.model, topology.micro_batch_size, cfg.trainer.seq_len, tp, False, cp=cp)
    nodes = group_nodes(tp, cp, topology.nproc_per_node)
    kv = x.dq if getattr(x, "cp_repeats_kv", False) else x.dkv  # all-to-all repeats what cp does not divide
    if resolve_method(cfg.parallel.cp_method, topology.device_type) == "all_to_all":
        moved = e * x.tokens * (2 * x.dq + 2 * kv)  # q, k, v there, the output back: this rank's tensors
        return [
            Traffic(
                f"context-parallel all-to-all ({phase})",
                "all-to-all",
                cp,
                nodes,
                G * 4 * layers,
                G * layers * moved,
                phase,
                False,
            )
            for phase in ("forward", "backward")
        ]
    kv_bytes = e * x.tokens * 2 * x.dkv  # this rank's keys and values, one pass round the ring
    return [
        Traffic(
            f"ring attention key/value passes ({phase})",
            "ring pass",
            cp,
            nodes,
            G * layers * passes,  # one ring of cp - 1 steps per layer and pass
            G * layers * passes * kv_bytes * cp,  # each step moves kv_bytes: (cp-1)/cp of this, as a collective
            phase,
            True,
            behind_attention=True,
        )
        for phase, passes in (("forward", 1), ("backward", 2))
    ]


LOSS_BYTES_PER_LOGIT = 24  # cross-entropy in fp32: cast, log-softmax, its gradient and the cast back (read + write)
FLASH_BACKWARD_PER_FORWARD = 2.5  # a fused attention backward recomputes the scores: 5 matmuls to forward's 2
BACKWARD_BYTES_PER_FORWARD = 2.0  # an elementwise backward reads the output's gradient and the saved input


def head_recompute_flops_per_token(w, cfg: "RunConfig", topology: "Topology") -> float:
    """Forward FLOPs per token of the output projection (the linear whose outputs are the logits), where the loss
    is taken in more than one slice (``trainer.loss_chunks``, as ``fsdp_exp.plan.loss_chunks_for`` resolves it):
    the chunked loss checkpoints each slice's projection and runs it again in backward. 0 for one slice."""
    from fsdp_exp.plan import loss_chunks_for

    if loss_chunks_for(cfg, topology).chunks <= 1:
        return 0.0
    return sum(f for _, n, f in w.gemms if n == w.logits_per_token)


def _kernel_classes(
    w, cfg: "RunConfig", tokens: float, m: int, tp: int, e_p: int, head_again: float = 0.0, memory=None
) -> dict:
    """The forward's work on this rank by kernel class (``Work``'s counts scaled to the step's tokens): each
    linear layer's matmul with its shape (M: a micro-batch's tokens; N split over tensor-parallel ranks),
    attention at the FLOPs a causal fused kernel does, the memory-bound operators' bytes in the compute dtype
    (``memory``: their elements per token, ``Work``'s unless a fused expert dispatcher moves fewer)."""
    gemms = tuple((float(m), float(k), float(n) / tp, tokens * f) for k, n, f in w.gemms)
    counted = w.forward_flops_per_token or 1.0
    memory = w.memory_elements_per_token if memory is None else memory
    return {
        "gemms": gemms,
        "attention_flops": tokens * w.attention_flops_per_token / 2,
        "memory_bytes": tokens * (memory * e_p + LOSS_BYTES_PER_LOGIT * w.logits_per_token),
        "recompute_share": (w.recompute_flops_per_token(cfg) + head_again) / counted,
    }


# ----------------------------------------------------------------------------------------------- timing
def _phase(compute: float, overlappable: float, waiting: float, overlap: float, units: int) -> tuple[float, float]:
    """(exposed communication of a phase, its part hidden) given its compute and its communication that
    can run ahead (``overlappable``) or must wait (``waiting``). The first (last) unit's share waits."""
    first = overlappable / max(units, 1)
    rest = overlappable - first
    hidden = overlap * min(compute, rest)
    return waiting + first + rest - hidden, hidden


def kernel_seconds(costs: StepCosts, perf: "DevicePerf", peak: float) -> tuple[float, float]:
    """(forward, backward) device seconds by kernel class (``DevicePerf.kernels``): matmuls by shape (float8 ones
    at the FP8 peak, with their casts), attention as a causal fused kernel, the memory-bound operators by their
    bytes; backward twice the matmuls and the bytes, 2.5 x attention (a fused backward recomputes the scores), and
    what checkpointing recomputes."""
    rate = peak * 1e12 * perf.efficiency
    e = DTYPE_BYTES[costs.dtype]
    gemm = gemm_seconds(costs.gemms, perf, rate, e, e)
    if costs.experts:
        gemm += grouped_seconds(costs.experts, perf, rate, e)
    f8_f, f8_b = float8_seconds(costs.float8, perf, rate, e) if costs.float8 else (0.0, 0.0)
    attention = costs.attention_flops / (peak * 1e12 * perf.attention_efficiency)
    memory = costs.memory_bytes / (perf.memory_gbps * 1e9 * perf.memory_efficiency)
    forward = gemm + f8_f + attention + memory
    backward = 2 * gemm + f8_b + FLASH_BACKWARD_PER_FORWARD * attention + BACKWARD_BYTES_PER_FORWARD * memory
    return forward, backward + costs.recompute_share * forward


def tiny_all_reduce_seconds(perf: "DevicePerf", world: int, ranks_per_node: int) -> float:
    """The step's ``TINY_ALL_REDUCES`` over the world (the loss statistics, the gradient norm): latency-bound, on the
    network's link once the world spans nodes."""
    link = link_for(perf, 2 if world > ranks_per_node else 1)
    return collective_seconds("all-reduce", world, 8.0 * TINY_ALL_REDUCES, TINY_ALL_REDUCES, link.latency_us, link.gbps)


def unit_seconds(costs: StepCosts, perf: "DevicePerf") -> float:
    """The sharding backend's own software per gathered unit and collective (``DevicePerf.unit_us`` of its
    parameter layout): host work that waits on the device (FSDP1's rate limiter, FSDP2's copy-in / copy-out
    launches), so it adds to the step."""
    us = perf.unit_us.get(costs.param_layout, 0.0) if costs.param_layout else 0.0
    calls = sum(t.count for t in costs.traffic if t.kind in ("all-gather", "reduce-scatter"))
    return us * 1e-6 * calls


def compute_seconds(costs: StepCosts, perf: "DevicePerf") -> tuple[float, float]:
    """(forward, backward) seconds of the step's compute on this rank: by kernel class on a GPU, else FLOPs at the
    peak x efficiency; the host's dispatch hidden behind the device's work where it is asynchronous."""
    peak = perf.peak_tflops[costs.dtype]
    rate = peak * 1e12 * perf.efficiency * perf.dtype_scale.get(costs.dtype, 1.0)
    dispatch = perf.dispatch_us * 1e-6

    def compute(flops: float, ops: float) -> float:
        work, host = flops / rate, ops * dispatch
        return max(work, host) if perf.async_dispatch else work + host

    if perf.kernels and costs.gemms:
        k_f, k_b = kernel_seconds(costs, perf, peak)
        return max(k_f, costs.forward_ops * dispatch), max(k_b, costs.backward_ops * dispatch)
    extra = grouped_extra_flops(costs.experts, perf) if costs.experts else 0.0
    return compute(costs.forward_flops + extra, costs.forward_ops), compute(
        costs.backward_flops + 2 * extra, costs.backward_ops
    )


def _attention_seconds(costs: StepCosts, c_f: float, c_b: float) -> dict[str, float]:
    """Attention's share of each phase's compute, by its FLOPs (a fused kernel's backward does 2.5 x its forward)."""
    forward = min(1.0, costs.attention_flops / costs.forward_flops) if costs.forward_flops else 0.0
    backward = (
        min(1.0, FLASH_BACKWARD_PER_FORWARD * costs.attention_flops / costs.backward_flops)
        if costs.backward_flops
        else 0.0
    )
    return {"forward": forward * c_f, "backward": backward * c_b}


def timing(costs: StepCosts, perf: "DevicePerf") -> StepPrediction:
    peak = perf.peak_tflops.get(costs.dtype)
    if not peak:
        raise ValueError(f"no peak FLOPS for {costs.dtype} on this device")
    refusal = float8_refusal(costs.float8, perf)
    if refusal:
        raise ValueError(refusal)
    dispatch = perf.dispatch_us * 1e-6
    c_f, c_b = compute_seconds(costs, perf)
    comm: dict[str, float] = {}
    kinds: dict[str, float] = {}
    parts = {"forward": [0.0, 0.0], "backward": [0.0, 0.0]}  # [overlappable, waiting] seconds
    attention = _attention_seconds(costs, c_f, c_b)
    for t in costs.traffic:
        seconds = traffic_seconds(t, perf, costs.ranks_per_node)
        comm[t.purpose] = comm.get(t.purpose, 0.0) + seconds
        kind = COMM_KIND.get(t.kind, "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        if t.behind_attention:  # ring attention: each pass hides behind the attention of the block it serves
            parts[t.phase][1] += max(0.0, seconds - attention[t.phase])
            continue
        parts[t.phase][0 if t.overlappable else 1] += seconds
    copy = perf.host
    off_f = costs.offload_forward_bytes / (copy.gbps * 1e9)
    off_b = costs.offload_backward_bytes / (copy.gbps * 1e9)
    exposed_f, _ = _phase(c_f, parts["forward"][0] + off_f, parts["forward"][1], perf.overlap, costs.units)
    exposed_b, _ = _phase(c_b, parts["backward"][0] + off_b, parts["backward"][1], perf.overlap, costs.units)
    # Split each phase's exposed time between communication and offload copies in proportion.
    offload_share_f = off_f / (off_f + sum(parts["forward"])) if off_f else 0.0
    offload_share_b = off_b / (off_b + sum(parts["backward"])) if off_b else 0.0
    exposed_offload = exposed_f * offload_share_f + exposed_b * offload_share_b
    exposed_comm = exposed_f + exposed_b - exposed_offload

    if costs.optimizer_on_host:
        optimizer = 0.0
        offload_opt = costs.optimizer_bytes / (perf.host_memory_gbps / costs.ranks_per_node * 1e9)
        offload_opt += costs.offload_after_step_bytes / (copy.gbps * 1e9)
    else:
        optimizer, offload_opt = costs.optimizer_bytes / (perf.memory_gbps * 1e9), 0.0
    if costs.float8 and perf.kernels:  # float8 all-gather: the next all-gathers' scales, from the updated weights
        optimizer += costs.float8.optimizer_bytes / (perf.memory_gbps * 1e9 * perf.memory_efficiency)
    if not perf.async_dispatch:
        optimizer += costs.optimizer_ops * dispatch
    overhead = (
        perf.step_overhead_ms * 1e-3
        + unit_seconds(costs, perf)
        + tiny_all_reduce_seconds(perf, costs.world, costs.ranks_per_node)
    )
    breakdown = {
        "compute": c_f + c_b,
        "exposed_comm": exposed_comm,
        "offload": exposed_offload + offload_opt,
        "optimizer": optimizer,
        "overhead": overhead,
    }
    step = sum(breakdown.values())
    named = {
        "compute": "compute",
        "exposed_comm": "exposed comm",
        "offload": "offload",
        "optimizer": "optimizer",
        "overhead": "overhead",
    }
    dominant = named[max(breakdown, key=breakdown.get)]
    mfu = costs.model_flops / step / (peak * 1e12)
    fp8_peak = perf.peak_tflops.get("fp8") if costs.float8 else None
    return StepPrediction(
        step_time_s=step,
        tokens_per_s=costs.tokens_per_step / step,
        mfu=mfu,
        breakdown=breakdown,
        comm=comm,
        dominant=dominant,
        mfu_fp8=costs.model_flops / step / (fp8_peak * 1e12) if fp8_peak else None,
        comm_kinds=kinds,
    )


# A Traffic's kind as a profiled run names it (fsdp_exp.metrics.comm.COMM_KINDS); ring passes are sends/receives
COMM_KIND = {
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-reduce": "all_reduce",
    "all-to-all": "all_to_all",
}


def counts(costs: StepCosts) -> dict[str, int]:
    """Collectives per step by purpose (what the tests compare with each strategy's schedule)."""
    out: dict[str, int] = {}
    for t in costs.traffic:
        out[t.purpose] = out.get(t.purpose, 0) + t.count
    return out


__all__ = ["StepCosts", "StepPrediction", "counts", "step_costs", "timing"]
