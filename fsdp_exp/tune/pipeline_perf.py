"""The step-time model of a pipeline-parallel run (``parallel.pp > 1``; the engine: fsdp_exp/parallel/pipeline.py).

``pipeline_costs(cfg, topology)`` counts what one optimizer step does on each pp rank:

- **compute per stage**: the whole model's work for this dp rank's batch, cut into micro-batches of
  ``global / dp / m`` sequences (``perf.step_costs``), shared out by the cut of ``stage_blocks``: each stage
  its blocks' share of the blocks' forward FLOPs (matmuls, attention, memory-bound operators, operators,
  tensor-parallel all-reduces); the output projection's matmul and the loss's bytes on the last stage (the
  embeddings' lookup is memory-bound and goes with the blocks' bytes). A pp rank computes its local stages.
- **the bubble**: ``parallel.pipeline.bubble_fraction`` (the one formula the run records and the planner
  reports: ``(pp-1)/(m+pp-1)`` for GPipe and 1F1B, ``(pp-1)/(v m+pp-1)`` with v stages per rank). The
  pipeline runs at the pace of its busiest rank: compute + bubble = busiest / (1 - bubble).
- **P2P sends**: each stage boundary sends one micro-batch's activations forward and their gradient back
  (``micro-batch x seq x dim`` in ``param_dtype``), over the node's link (``intra``) when the two pp ranks
  share a node in the (pp, dp) mesh (rank = pp_index * dp + dp_index) and the network's (``inter``, a node's
  cards shared by its ranks, all sending at once) otherwise. The fill and the drain cross every boundary
  once each way, exposed; in steady state a rank receives one activation and one gradient per micro-batch of
  each local stage, hidden behind its compute up to ``DevicePerf.overlap``.
- **FSDP2 inside each stage**, over the dp ranks of the stage: ``reshard_after_forward=False`` and the
  reduce-scatter deferred to the last micro-batch (``fsdp2.reshard_after_forward`` under pp, torch's ``PipelineStage``): one
  all-gather of each unit (each block, and the stage's root) per step, in the first micro-batch's forward,
  and one reduce-scatter per unit in the last micro-batch's backward; each hidden behind that one
  micro-batch's compute as ``perf.timing`` hides a phase's collectives (the first / last unit waits).
- **the optimizer** of the rank's parameters (this dp rank's shards), the fixed step overhead, the tiny
  all-reduces (the loss over pp, the gradient norm over dp and pp).

The step is the rank whose pipeline time + exposed collectives + optimizer is largest (all ranks leave the
step together: the optimizer waits for the gradient norm over every stage).

Zero-bubble schedules (interleaved_zero_bubble, zbv_zero_bubble, dualpipev) split each backward into its
input and weight gradients to fill the bubble; this model does not count that split and refuses to time them
(``pipeline_refusal``, naming the fix), as the planner has no activation model of them either; nor does it time
``offload=params`` inside stages (the host copies), refused the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.layout import Layout
from fsdp_exp.parallel.pipeline import (
    bubble_fraction,
    settings_from,
    stage_blocks,
    stage_planner_rules,
    stages_of_rank,
)
from fsdp_exp.plan.states import DTYPE_BYTES, expert_units
from fsdp_exp.tune.experts_perf import OWN_DISPATCH, ExpertDispatch
from fsdp_exp.tune.perf import (
    adamw_bytes_per_param,
    ADAMW_OPS_PER_TENSOR,
    LOSS_BYTES_PER_LOGIT,
    StepCosts,
    StepPrediction,
    _phase,
    compute_seconds,
    step_costs,
    tiny_all_reduce_seconds,
)
from fsdp_exp.tune.traffic import Traffic, group_nodes, link_for, traffic_seconds

# The whole model's traffic that stays inside a stage (its purposes' first words, fsdp_exp.tune.perf / experts_perf)
IN_STAGE = ("tensor", "context-parallel", "ring attention", "expert all-to-all")

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.config.topology import Topology
    from fsdp_exp.parallel.pipeline import PipelineSettings
    from fsdp_exp.plan.devices import DevicePerf

TIMED = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")


@dataclass(frozen=True)
class Boundary:
    """One stage-to-stage send: stage ``stage`` to ``stage + 1``, both ways per micro-batch."""

    stage: int
    nodes: int  # 1: the two pp ranks share a node; 2: the send crosses the network
    bytes: float  # one micro-batch's activations (and, backward, their gradient), one way


@dataclass(frozen=True)
class RankCosts:
    """One pp rank's step: its stages' compute (each a ``StepCosts`` with no traffic, over the step's micro-batches)
    and the FSDP2 collectives inside its stages."""

    rank: int
    stages: tuple[int, ...]
    compute: tuple[StepCosts, ...]  # per local stage
    traffic: tuple[Traffic, ...]  # FSDP2 over dp: all-gathers (forward), reduce-scatters (backward)
    units: int
    local_params: float  # this dp rank's shard of the rank's parameters (elements)
    tensors: int  # parameter tensors (the optimizer's dispatched operators)


@dataclass(frozen=True)
class PipelineCosts:
    settings: "PipelineSettings"
    microbatches: int
    stage_blocks: tuple[tuple[int, ...], ...]
    ranks: tuple[RankCosts, ...]
    boundaries: tuple[Boundary, ...]
    bubble: float
    tokens_per_step: int
    model_flops: float  # of the whole model for this dp rank's tokens (every pp rank's together)
    param_layout: str
    ranks_per_node: int
    world: int
    dtype: str
    offloaded: bool = False  # offload=params inside the stages (not timed)
    storage_dtype: str = "fp32"  # precision.storage_dtype: the optimizer's states' dtype


def pipeline_refusal(schedule: str, offloaded: bool = False) -> Optional[str]:
    """Why a pipeline step cannot be timed (None: it can)."""
    if schedule not in TIMED:
        return (
            f"parallel.pp_schedule={schedule}: the step-time model does not count the zero-bubble schedules' split "
            f"of backward into input and weight gradients; pass parallel.pp_schedule={'|'.join(TIMED)}"
        )
    if offloaded:
        return (
            "offload=params with parallel.pp>1: the step-time model does not count the host copies inside stages; "
            "pass offload=none"
        )
    return None


def _nodes(a: int, b: int, ranks_per_node: int) -> int:
    return 1 if a // ranks_per_node == b // ranks_per_node else 2


def boundary_nodes(stage: int, settings: "PipelineSettings", dp: int, tp: int, ranks_per_node: int) -> int:
    """Nodes a send from ``stage`` to the next spans, the worst over the dp ranks (rank = (pp_index * dp +
    dp_index) * tp + tp_index: pp outermost)."""
    src = stages_owner(stage, settings)
    dst = stages_owner(stage + 1, settings)
    return max(_nodes((src * dp + d) * tp, (dst * dp + d) * tp, ranks_per_node) for d in range(dp))


def stages_owner(stage: int, settings: "PipelineSettings") -> int:
    """The pp rank holding ``stage``."""
    return next(r for r in range(settings.pp) if stage in stages_of_rank(settings, r))


_CUTS: dict[tuple, tuple[tuple[int, ...], ...]] = {}


def _cut(settings: "PipelineSettings", model_cfg) -> tuple[tuple[int, ...], ...]:
    """``stage_blocks``, cached per model and settings: its balanced cut is an exact search (tens of ms for a 70B's
    80 blocks), and tune weighs thousands of candidates with a few cuts between them."""
    from fsdp_exp.models.spec import config_key

    key = (config_key(model_cfg), settings)
    if key not in _CUTS:
        if len(_CUTS) >= 256:
            _CUTS.clear()
        _CUTS[key] = tuple(tuple(b) for b in stage_blocks(settings, model_cfg))
    return _CUTS[key]


def _stage_costs(
    whole: StepCosts, share: float, flop_share: float, ops_share: float, last: bool, head_gemm, loss_bytes: float
) -> StepCosts:
    """A stage's part of the whole model's compute: ``share`` of the blocks' work, and on the last stage the output
    projection's matmul and the loss's bytes (``flop_share``, ``ops_share``: of the whole forward's FLOPs and
    operators, the head's included)."""
    gemms = tuple((m, k, n, f * share) for (m, k, n, f) in whole.gemms if (m, k, n, f) != head_gemm)
    float8 = whole.float8
    if float8 is not None:
        float8 = dataclasses.replace(
            float8,
            gemms=tuple((m, k, n, f * share) for (m, k, n, f) in float8.gemms),
            cast_bytes_forward=float8.cast_bytes_forward * share,
            cast_bytes_backward=float8.cast_bytes_backward * share,
            optimizer_bytes=float8.optimizer_bytes * share,
        )
    return dataclasses.replace(
        whole,
        gemms=gemms + ((head_gemm,) if last and head_gemm else ()),
        attention_flops=whole.attention_flops * share,
        memory_bytes=(whole.memory_bytes - loss_bytes) * share + (loss_bytes if last else 0.0),
        forward_flops=whole.forward_flops * flop_share,
        backward_flops=whole.backward_flops * flop_share,
        forward_ops=whole.forward_ops * ops_share,
        backward_ops=whole.backward_ops * ops_share,
        traffic=tuple(
            dataclasses.replace(t, count=max(1, round(t.count * share)), bytes=t.bytes * share) for t in whole.traffic
        ),
        float8=float8,
        optimizer_bytes=0.0,
        optimizer_ops=0.0,
    )


def pipeline_costs(
    cfg: "RunConfig", topology: "Topology", expert_imbalance: float = 1.0, dispatch: ExpertDispatch = OWN_DISPATCH
) -> PipelineCosts:
    """``expert_imbalance`` and ``dispatch`` as ``perf.step_costs`` takes them: a stage's MoE layers run at the
    busiest expert's pace and their all-to-all inside the stage."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.plan.activations import profile_for
    from fsdp_exp.tune.work import work

    tp, dp = topology.tp_size, topology.dp_size
    local_batch = topology.layout.local_batch(cfg.trainer.global_batch_size)
    s = settings_from(cfg, local_batch)
    m = s.n_microbatches
    micro = local_batch // m
    # The whole model's compute on one rank for this dp rank's batch, in m micro-batches of the pipeline's size.
    whole_topology = dataclasses.replace(
        topology, layout=topology.layout.without_pipeline(), micro_batch_size=micro, grad_accum_steps=m
    )
    whole = step_costs(cfg, whole_topology, expert_imbalance, dispatch)
    # What a stage's blocks exchange inside it (TP, CP, the experts' all-to-all), in proportion to its blocks;
    # its data-parallel collectives are counted below, per stage
    whole = dataclasses.replace(whole, traffic=tuple(t for t in whole.traffic if t.purpose.startswith(IN_STAGE)))
    w = work(cfg)
    vocab = w.logits_per_token
    head = next((g for g in whole.gemms if round(g[2] * tp) == round(vocab)), None)
    loss_bytes = whole.tokens_per_step / dp / tp * LOSS_BYTES_PER_LOGIT * vocab
    blocks = _cut(s, cfg.model)
    block_flops = sum(w.block_forward_flops) or 1.0
    head_flops = max(0.0, w.forward_flops_per_token - block_flops)  # the output projection (embeddings: none)
    other_ops = max(0, w.forward_ops - sum(w.block_forward_ops))
    last = s.num_stages - 1

    def stage_compute(stage: int) -> StepCosts:
        mine = sum(w.block_forward_flops[b] for b in blocks[stage])
        head_here = head_flops if stage == last else 0.0
        ops = sum(w.block_forward_ops[b] for b in blocks[stage]) + (other_ops if stage == last else 0)
        return _stage_costs(
            whole,
            share=mine / block_flops,
            flop_share=(mine + head_here) / (block_flops + head_flops),
            ops_share=ops / max(w.forward_ops, 1),
            last=stage == last,
            head_gemm=head,
            loss_bytes=loss_bytes,
        )

    # FSDP2 inside each stage: this rank's units (each block, then the stage's root) and their elements.
    spec = spec_for(cfg.model)
    inventory = spec.inventory(cfg.model)
    rules = stage_planner_rules(cfg)
    e_p, e_r = DTYPE_BYTES[cfg.precision.param_dtype], DTYPE_BYTES[cfg.precision.reduce_dtype]
    stage_of_block = {b: st for st, bs in enumerate(blocks) for b in bs}
    # The stage's dp ranks as (replicate, shard): dp_index = replica * shards + shard_index; FSDP shards a stage's
    # weights over shard x cp (a CP rank holds the same weights), tp ranks apart; under expert parallel a layer's
    # routed experts are a unit of their own, this rank's experts/ep gathered over efsdp (ep x tp ranks apart)
    layout = Layout.for_stages(cfg, dp)
    replicas, shards, ep, efsdp = layout.dp_replicate, layout.shard_cp, layout.ep, layout.efsdp
    experts = tuple(f"{unit}." for unit in expert_units(spec, cfg))
    numel = [0.0] * s.num_stages
    expert_numel = [0.0] * s.num_stages
    expert_layers: list[set] = [set() for _ in range(s.num_stages)]
    tensors = [0] * s.num_stages
    for p in inventory.params:
        st = stage_of_block[p.block] if p.block is not None else (0 if p.name in inventory.input_params else last)
        owner = next((u for u in experts if p.name.startswith(u)), None)
        if owner is None:
            numel[st] += p.numel / tp
        else:
            expert_numel[st] += p.numel / tp / ep
            expert_layers[st].add(owner)
        tensors[st] += 1
    nproc = topology.nproc_per_node
    shard_nodes = len({(i * tp) // nproc for i in range(shards)})
    replica_nodes = len({(i * shards * tp) // nproc for i in range(replicas)})
    efsdp_nodes = group_nodes(tp * ep, efsdp, nproc)
    ranks = []
    for r in range(s.pp):
        mine = stages_of_rank(s, r)
        units = sum(len(blocks[st]) + 1 for st in mine)
        gathered = sum(numel[st] for st in mine)
        expert_gathered = sum(expert_numel[st] for st in mine)
        expert_units_here = sum(len(expert_layers[st]) for st in mine)
        traffic: tuple = ()
        if efsdp > 1 and expert_units_here:
            traffic = tuple(
                Traffic(
                    f"stage experts' {kind} (efsdp)",
                    kind,
                    efsdp,
                    efsdp_nodes,
                    expert_units_here,
                    e * expert_gathered,
                    phase,
                    True,
                )
                for kind, e, phase in (("all-gather", e_p, "forward"), ("reduce-scatter", e_r, "backward"))
            )
        if shards > 1:
            traffic += (
                Traffic("stage all-gather", "all-gather", shards, shard_nodes, units, e_p * gathered, "forward", True),
                Traffic(
                    "stage reduce-scatter",
                    "reduce-scatter",
                    shards,
                    shard_nodes,
                    units,
                    e_r * gathered,
                    "backward",
                    True,
                ),
            )
        if replicas > 1:  # HSDP's all-reduce of each shard across the replicas; DDP's of the whole stage
            traffic += (
                Traffic(
                    "stage replica all-reduce",
                    "all-reduce",
                    replicas,
                    replica_nodes,
                    units,
                    e_r * (gathered / shards + expert_gathered / max(efsdp, 1)),
                    "backward",
                    True,
                ),
            )
        ranks.append(
            RankCosts(
                rank=r,
                stages=tuple(mine),
                compute=tuple(stage_compute(st) for st in mine),
                traffic=traffic,
                units=units,
                local_params=gathered / shards + expert_gathered / max(efsdp, 1),
                tensors=sum(tensors[st] for st in mine),
            )
        )
    residual = profile_for(cfg.model, micro, cfg.trainer.seq_len, tp=tp, sequence_parallel=False).residual(e_p)
    boundaries = tuple(
        Boundary(st, boundary_nodes(st, s, dp, tp, nproc), float(residual)) for st in range(s.num_stages - 1)
    )
    return PipelineCosts(
        settings=s,
        microbatches=m,
        stage_blocks=blocks,
        ranks=tuple(ranks),
        boundaries=boundaries,
        bubble=bubble_fraction(s.schedule, s.pp, m, s.stages_per_rank),
        tokens_per_step=whole.tokens_per_step,
        model_flops=whole.model_flops,
        param_layout=rules.param_layout if rules.gathers_units else "",
        ranks_per_node=nproc,
        world=topology.world_size,
        dtype=whole.dtype,
        offloaded=bool(cfg.offload.params and rules.offloads),
        storage_dtype=cfg.precision.storage_dtype,
    )


# ----------------------------------------------------------------------------------------------- timing
def send_seconds(b: Boundary, perf: "DevicePerf", ranks_per_node: int) -> float:
    """One way of one micro-batch over a boundary: a point-to-point copy (one latency, the bytes at the link's
    rate; a network given per node is shared by the node's ranks, which all send at once)."""
    link = link_for(perf, b.nodes)
    gbps = link.gbps / ranks_per_node if link.per_node else link.gbps
    return link.latency_us * 1e-6 + b.bytes / (gbps * 1e9)


def pipeline_timing(costs: PipelineCosts, perf: "DevicePerf") -> StepPrediction:
    peak = perf.peak_tflops.get(costs.dtype)
    if not peak:
        raise ValueError(f"no peak FLOPS for {costs.dtype} on this device")
    refusal = pipeline_refusal(costs.settings.schedule, costs.offloaded)
    if refusal:
        raise ValueError(refusal)
    m, s = costs.microbatches, costs.settings
    busy = []  # per rank: (forward, backward) seconds of every micro-batch of its local stages
    for rank in costs.ranks:
        parts = [compute_seconds(c, perf) for c in rank.compute]
        tp = sum(
            traffic_seconds(t, perf, costs.ranks_per_node) for c in rank.compute for t in c.traffic
        )  # tensor parallel inside the stage: on the critical path
        busy.append((sum(f for f, _ in parts), sum(b for _, b in parts), tp))
    pace = max(f + b + tp for f, b, tp in busy)
    pipeline = pace / (1 - costs.bubble)
    hops = [2 * send_seconds(b, perf, costs.ranks_per_node) for b in costs.boundaries]
    fill = sum(hops)  # the fill's forwards and the drain's backwards cross every boundary once
    steady = m * s.stages_per_rank * max(hops, default=0.0)
    p2p_exposed = fill + steady - perf.overlap * min(pace, steady)
    comm = {"pipeline sends": fill + steady}

    tiny = tiny_all_reduce_seconds(perf, costs.world, costs.ranks_per_node)
    unit_us = perf.unit_us.get(costs.param_layout, 0.0) if costs.param_layout else 0.0
    dispatch = perf.dispatch_us * 1e-6
    worst = None
    for rank, (f, b, tp) in zip(costs.ranks, busy):
        exposed = 0.0
        for t in rank.traffic:
            seconds = traffic_seconds(t, perf, costs.ranks_per_node)
            comm[t.purpose] = max(comm.get(t.purpose, 0.0), seconds)
            one = f / m if t.phase == "forward" else b / m  # the first / last micro-batch's compute hides it
            exposed += _phase(one, seconds, 0.0, perf.overlap, rank.units)[0]
        optimizer = adamw_bytes_per_param(costs.storage_dtype) * rank.local_params / (perf.memory_gbps * 1e9)
        if not perf.async_dispatch:
            optimizer += ADAMW_OPS_PER_TENSOR * rank.tensors * dispatch
        software = unit_us * 1e-6 * sum(t.count for t in rank.traffic)
        total = pipeline + p2p_exposed + exposed + optimizer + software
        if worst is None or total > worst[0]:
            worst = (total, rank, exposed, optimizer, software)
    _, rank, exposed, optimizer, software = worst
    breakdown = {
        "compute": pace,
        "bubble": pipeline - pace,
        "exposed_comm": p2p_exposed + exposed,
        "offload": 0.0,
        "optimizer": optimizer,
        "overhead": perf.step_overhead_ms * 1e-3 + software + tiny,
    }
    step = sum(breakdown.values())
    dominant = max(breakdown, key=breakdown.get).replace("_", " ")
    per_gpu = costs.model_flops / s.pp  # the dp rank's model FLOPs, shared by its pp ranks
    fp8_peak = perf.peak_tflops.get("fp8") if any(c.float8 for r in costs.ranks for c in r.compute) else None
    return StepPrediction(
        step_time_s=step,
        tokens_per_s=costs.tokens_per_step / step,
        mfu=per_gpu / step / (peak * 1e12),
        breakdown=breakdown,
        comm=comm,
        dominant=dominant,
        mfu_fp8=per_gpu / step / (fp8_peak * 1e12) if fp8_peak else None,
    )


def predict_pipeline(cfg: "RunConfig", topology: "Topology", perf: "DevicePerf") -> StepPrediction:
    return pipeline_timing(pipeline_costs(cfg, topology), perf)


__all__ = ["Boundary", "PipelineCosts", "RankCosts", "pipeline_costs", "pipeline_timing", "predict_pipeline"]
