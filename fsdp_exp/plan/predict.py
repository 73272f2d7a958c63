"""One rank's memory for a configuration: the model states at rest and the peak of the step, from
the model family's spec (``fsdp_exp.models.spec``) and the backend's planner rules
(``fsdp_exp.parallel.backend.PlannerRules``) alone.

Planning many candidates of one model is cheap: the meta model, its inventory and its sharding
units are built once per model config and reused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from fsdp_exp.metrics.schema import PHASES as STAGES  # the tracker's phases are the planner's stages
from fsdp_exp.models import spec_for
from fsdp_exp.parallel import float8
from fsdp_exp.parallel.backend import backend_for
from fsdp_exp.plan.activations import profile_for
from fsdp_exp.plan.devices import allocator_margin
from fsdp_exp.plan.loss_chunks import (
    LOSS_BYTES_BOUND,
    SIGNIFICANT,
    LossChunks,
    candidate,
    decide,
    fixed,
    given,
    small_logits,
    with_chunks,
)
from fsdp_exp.plan.states import expert_units, gathered, model_states, param_infos, unit_names, zero_model_states
from fsdp_exp.plan.step import StepSetting, StepWalk
from fsdp_exp.units import GIB

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.config.topology import Topology


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


def plan(
    cfg: "RunConfig",
    topology: "Topology",
    *,
    device_kind: Optional[str] = None,
    margin: Optional[float] = None,
    expert_imbalance: float = 1.0,
) -> Plan:
    """Predict one rank's memory (rank 0, the largest) for ``cfg`` on ``topology``; ``expert_imbalance``
    (``plan.expert_imbalance``): a mixture of experts' max / mean routed copies per expert, which sizes what the
    busiest rank's experts receive under expert parallel."""
    kind = device_kind or topology.device_type
    asked, cfg = cfg, settled(cfg, topology, kind)
    walk, infos, states = _walk(cfg, topology, kind, expert_imbalance)
    phases = walk.phases()
    peak = max(phases, key=lambda ph: ph.total)
    stage_peaks = {
        stage: max((ph for ph in phases if ph.stage == stage), key=lambda ph: ph.total).by_piece() for stage in STAGES
    }
    margin_bytes, margin_rule = allocator_margin(kind, peak.total, margin)
    on_device = states.on_device
    per_rank = {
        "params": on_device["params"],
        "grads": on_device["grads"],
        "optimizer": on_device["optimizer"],
        "activations": peak.activations + peak.temporaries + peak.inputs,
        "buffers": peak.unsharded + peak.comm + peak.module_buffers,
        "total": peak.total + margin_bytes,
    }
    result = Plan(
        num_params=sum(i.numel for i in infos),
        world_size=topology.world_size,
        device_kind=kind,
        model_states={
            "device": dict(on_device),  # copies: the states are shared by the plans of one layout (``_states``)
            "host": dict(states.host),
            "total": states.at_rest["total"],
            "described": states.described,
        },
        per_rank_bytes=per_rank,
        peak=peak.by_piece(),
        stage_peaks=stage_peaks,
        margin_bytes=margin_bytes,
        margin_rule=margin_rule,
        phases=[{"name": ph.name, "stage": ph.stage, "total": ph.total} for ph in phases],
        assumptions=assumptions(cfg, walk.rules.notes, walk.x.notes(kind, walk.e), expert_imbalance),
    )
    if cfg is not asked:  # trainer.loss_chunks=auto: what the rule chose, in the table's notes
        chosen = loss_chunks_for(asked, topology, kind)
        result.assumptions.append(f"trainer.loss_chunks=auto -> {chosen.chunks} ({chosen.why.removeprefix('auto: ')})")
    if cfg.parallel.pp > 1:  # the worst pipeline rank's figures (``fsdp_exp.plan.pipeline``)
        from fsdp_exp.plan.pipeline import with_worst_stage

        result = with_worst_stage(result, cfg, topology, margin)
    return result


def loss_chunks_for(cfg: "RunConfig", topology: "Topology", kind: Optional[str] = None) -> LossChunks:
    """``trainer.loss_chunks`` resolved: a number as given; ``auto`` by the rule of ``fsdp_exp.plan.loss_chunks``
    on this plan's peaks with one chunk and with ``loss_chunks.candidate`` slices (cached per config and layout: a search asks for each
    candidate from its plan and from its step-time model)."""
    asked = str(cfg.trainer.loss_chunks)
    number = fixed(asked)
    if number is not None:
        return given(asked, number)
    if cfg.precision.output_dtype not in (None, "fp32"):  # the logits must be the model's output
        return LossChunks(asked, 1, f"auto: precision.output_dtype={cfg.precision.output_dtype} needs the logits out")
    kind = kind or topology.device_type
    key = (repr(cfg), topology, kind)  # a dataclass's repr holds every field: cheaper than config_key
    if key not in _CHUNKS:
        if len(_CHUNKS) >= 1024:
            _CHUNKS.clear()
            _ONE_CHUNK_WALKS.clear()
        k = candidate(cfg)
        if cfg.parallel.pp > 1:  # the worst stage's peaks (``plan`` under stages), from the shared stage plans
            one = _pipeline_peak(with_chunks(cfg, 1), topology, kind)
            logits = _stage_logits(cfg, topology)
            bound = LOSS_BYTES_BOUND * logits if logits is not None else None
            if bound is not None and bound < SIGNIFICANT * one:  # as below, with the last stage's micro-batch
                _CHUNKS[key] = small_logits(asked, k, one, bound)
            else:
                _CHUNKS[key] = decide(asked, k, one, _pipeline_peak(with_chunks(cfg, k), topology, kind))
        else:
            walked = _walk(with_chunks(cfg, 1), topology, kind)
            one = max(ph.total for ph in walked[0].phases())
            # Slicing the loss changes its own phases only, and there it saves at most the one-slice loss's logits
            # and their fp32 copies (``StepWalk.loss``: under 16 bytes a logit): under the rule's share of the
            # one-slice peak that bound decides without walking the sliced step (most candidates of a search).
            if LOSS_BYTES_BOUND * walked[0].logit_elements < SIGNIFICANT * one:
                _CHUNKS[key] = small_logits(asked, k, one, LOSS_BYTES_BOUND * walked[0].logit_elements)
                # ``_walk`` of the settled config (this one-slice one) takes it again
                _ONE_CHUNK_WALKS[(repr(with_chunks(cfg, 1)), topology, kind)] = walked
            else:
                chunked = max(ph.total for ph in _walk(with_chunks(cfg, k), topology, kind)[0].phases())
                _CHUNKS[key] = decide(asked, k, one, chunked)
    return _CHUNKS[key]


def _pipeline_peak(cfg: "RunConfig", topology: "Topology", kind: str) -> int:
    """``plan(cfg, topology).peak["total"]`` under stages: the worst pp rank's, from the stage plan a search's
    candidates share (``pipeline.shared_pipeline_plan``), or the whole plan where the stages have no model."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.parallel.pipeline import settings_from
    from fsdp_exp.plan.pipeline import shared_pipeline_plan

    try:
        settings = settings_from(cfg, topology.layout.local_batch(cfg.trainer.global_batch_size))
        return shared_pipeline_plan(cfg, settings, topology.dp_size, kind).peak_rank.peak
    except ConfigError:
        return plan(cfg, topology, device_kind=kind).peak["total"]


def _stage_logits(cfg: "RunConfig", topology: "Topology") -> Optional[int]:
    """At most the logits the last stage makes at once with one slice: a pipeline micro-batch's (the data-parallel
    rank's batch over the schedule's micro-batches, rounded up), the whole vocabulary (an upper bound under TP)."""
    from fsdp_exp.parallel.pipeline import settings_from
    from fsdp_exp.plan.activations import profile_for

    from fsdp_exp.errors import ConfigError

    local = topology.layout.local_batch(cfg.trainer.global_batch_size)
    try:
        sequences = -(-local // settings_from(cfg, local).n_microbatches)
        return sequences * profile_for(cfg.model, 1, cfg.trainer.seq_len, 1, False).logits
    except ConfigError:  # no stage model here: ``_pipeline_peak`` plans the whole step, both ways
        return None


_CHUNKS: dict[tuple, LossChunks] = {}
OUTPUT_PROJECTION = "forward (output projection)"  # StepWalk.forward's phase that holds the logits
_ONE_CHUNK_WALKS: dict[tuple, tuple] = {}  # the one-slice walks ``loss_chunks_for`` made and chose


def settled(cfg: "RunConfig", topology: "Topology", kind: Optional[str] = None) -> "RunConfig":
    """``cfg`` with ``trainer.loss_chunks`` a number (itself where it is one already)."""
    if fixed(cfg.trainer.loss_chunks) is not None:
        return cfg
    return with_chunks(cfg, loss_chunks_for(cfg, topology, kind).chunks)


def _walk(cfg: "RunConfig", topology: "Topology", kind: str, expert_imbalance: float = 1.0):
    """(the step's walk, every parameter's sizes, the model states): all ``plan`` reads of the config
    (``trainer.loss_chunks=auto`` settled first: ``settled``)."""
    cfg = settled(cfg, topology, kind)
    reuse = _ONE_CHUNK_WALKS.get((repr(cfg), topology, kind)) if expert_imbalance == 1.0 else None
    if reuse is not None:
        return reuse
    backend = backend_for(cfg)
    rules = backend.planner_rules(cfg)
    shard = backend.shard_group(topology)
    inventory = spec_for(cfg.model).inventory(cfg.model)
    infos, states = _states(cfg, topology, kind)
    profile = profile_for(
        cfg.model,
        topology.micro_batch_size,
        cfg.trainer.seq_len,
        topology.tp_size,
        cfg.parallel.sequence_parallel,
        cp=cfg.parallel.cp,
        ep=cfg.parallel.ep,
        imbalance=expert_imbalance,
    )
    setting = StepSetting(
        kind=kind,
        param_dtype=cfg.precision.param_dtype,
        reduce_dtype=cfg.precision.reduce_dtype,
        grad_accum_steps=topology.grad_accum_steps,
        tp=topology.tp_size,
        shard=shard,
        ac_mode=cfg.ac.mode,
        ac_every=cfg.ac.every,
        ac_ops=cfg.ac.ops,
        prefetch_forward=cfg.prefetch.forward,
        prefetch_backward=cfg.prefetch.backward,
        reshard_last_block=cfg.sharding.reshard_last_block,
        wrap_policy=cfg.wrap.policy,
        grad_sync=backend.grad_sync(cfg),
        loss_chunks=fixed(cfg.trainer.loss_chunks),
        loss_parallel=cfg.parallel.loss_parallel,
        sequence_parallel=cfg.parallel.sequence_parallel,
        float8_matmuls=float8.planned_matmuls(cfg, inventory.blocks, topology.tp_size),
        float8_all_gather=cfg.precision.float8_all_gather,
        ep=cfg.parallel.ep,
    )
    return StepWalk(setting, rules, profile, gathered(infos, inventory), states, inventory.buffer_bytes), infos, states


def _states(cfg: "RunConfig", topology: "Topology", kind: str):
    """(every parameter's per-rank sizes, the model states at rest) under the backend's layout: the first part of
    ``plan``, cheap after the first call (the inventory and the layouts are cached)."""
    backend = backend_for(cfg)
    rules = backend.planner_rules(cfg)
    shard = backend.shard_group(topology)
    spec = spec_for(cfg.model)
    inventory = spec.inventory(cfg.model)
    units = unit_names(spec, cfg) if rules.gathers_units else []
    infos = param_infos(inventory, units, rules, shard, topology.tp_size, expert_units(spec, cfg), cfg.parallel.ep)
    args = (
        (
            cfg.offload.params and rules.offloads,
            kind,
            topology.dp_size if rules.shards_optimizer else 1,
            cfg.precision.storage_dtype,
        )
        if rules.zero_stage is None
        else (rules.zero_stage, shard, cfg.precision.param_dtype, cfg.offload.params, cfg.offload.optimizer, kind)
    )
    key = (id(infos), args)  # param_infos' lists are cached and never changed: one per layout
    if key not in _STATES:
        if len(_STATES) >= 1024:
            _STATES.clear()
        # DeepSpeed's own layout, or the FSDP / DDP one
        states = model_states(infos, *args) if rules.zero_stage is None else zero_model_states(infos, *args)
        _STATES[key] = (infos, states)  # holding the list keeps its id from being reused
    return _STATES[key]


_STATES: dict[tuple, tuple] = {}


def peak_and_need(
    cfg: "RunConfig",
    topology: "Topology",
    *,
    device_kind: Optional[str] = None,
    margin: Optional[float] = None,
    over: Optional[Callable[[int], bool]] = None,
    expert_imbalance: float = 1.0,
) -> tuple[int, int, bool]:
    """What a search reads of ``plan``: (``peak["total"]``, ``per_rank_bytes["total"]``, True), the same figures by
    the cheapest way. Under a pipeline they are the worst pp rank's (``pipeline.with_worst_stage``), so the
    whole-model walk (whose phases the plan keeps only as an aside) is skipped and the pipeline's plan is shared by
    candidates that agree on what it reads; where the pipeline has no activation model the whole plan is made, as
    ``plan`` does.

    ``over``: a test of a need (peak + margin). Without stages the forward's phases are walked first; where their
    need alone passes it, the rest of the step is not walked and the figures are that lower bound (False)."""
    from fsdp_exp.errors import ConfigError

    kind = device_kind or topology.device_type
    if over is not None and cfg.parallel.pp == 1 and fixed(cfg.trainer.loss_chunks) is None:
        # Before settling trainer.loss_chunks=auto (which walks the whole step): the blocks' forward phases, the
        # same whichever the rule takes (the slices change only the output projection's phase and the loss's), a
        # lower bound of the step's peak either way.
        blocks = _walk(with_chunks(cfg, 1), topology, kind, expert_imbalance)[0].forward()
        ahead = max(ph.total for ph in blocks if ph.name != OUTPUT_PROJECTION)
        need = ahead + allocator_margin(kind, ahead, margin)[0]
        if over(need):
            return ahead, need, False
    cfg = settled(cfg, topology, kind)
    if cfg.parallel.pp > 1:
        from fsdp_exp.parallel.pipeline import settings_from
        from fsdp_exp.plan.pipeline import shared_pipeline_plan

        settings = settings_from(cfg, topology.layout.local_batch(cfg.trainer.global_batch_size))
        try:
            worst = shared_pipeline_plan(cfg, settings, topology.dp_size, kind).peak_rank
        except ConfigError:
            pass
        else:
            return worst.peak, worst.peak + allocator_margin(kind, worst.peak, margin)[0], True
    elif over is not None:  # the forward's phases are some of the step's: their largest is at most its peak
        ahead = max(ph.total for ph in _walk(cfg, topology, kind, expert_imbalance)[0].forward())
        need = ahead + allocator_margin(kind, ahead, margin)[0]
        if over(need):
            return ahead, need, False
    result = plan(cfg, topology, device_kind=kind, margin=margin, expert_imbalance=expert_imbalance)
    return result.peak["total"], result.per_rank_bytes["total"], True


def peak_floor(cfg: "RunConfig", topology: "Topology", *, device_kind: Optional[str] = None) -> int:
    """A lower bound of ``plan(cfg, topology).peak["total"]`` (before the margin) from the model states alone, without
    walking the step: a search skips the walk where even this is over the device.

    Every phase of the walk holds the resident parameters and optimizer state (``StepWalk.phase``), so the peak is
    at least their sum. Under a pipeline the worst pp rank's peak (``pipeline.RankPlan.peak``) holds its stages'
    parameters and moments, at least the average rank's: the whole model's, sharded over the data-parallel ranks,
    over pp (or the whole model's own plan where the pipeline has no activation model, larger still)."""
    kind = device_kind or topology.device_type
    _, states = _states(cfg, topology, kind)
    floor = states.resident["params"] + states.resident["optimizer"]
    if cfg.parallel.pp > 1:
        from fsdp_exp.plan.pipeline import stage_states_floor

        # each rank's pieces are whole bytes (rounded down): the ranks' sum may fall short of the whole's by 2 a rank
        floor = min(
            floor, max(0, stage_states_floor(cfg, topology.dp_size, kind) - 2 * cfg.parallel.pp) // cfg.parallel.pp
        )
    return floor


def assumptions(
    cfg: "RunConfig", backend_notes: tuple[str, ...], model_notes: list[str], expert_imbalance: float = 1.0
) -> list[str]:
    """What the prediction takes for granted here, in words (the table's notes)."""
    notes = list(backend_notes)
    if cfg.compile:
        notes.append("compile=true can fuse away saved tensors: the eager estimate is an upper bound")
    if cfg.ac.ops != "none" and cfg.parallel.tp > 1:
        notes.append(f"ac.ops={cfg.ac.ops} under tensor parallel: the collectives' saved outputs estimated")
    if cfg.wrap.policy == "size":
        notes.append("wrap=size: units inside blocks are treated like MoE experts (estimated)")
    if cfg.parallel.ep > 1:
        balance = "balanced" if expert_imbalance == 1 else f"the busiest expert {expert_imbalance:g}x the mean"
        notes.append(
            f"parallel.ep={cfg.parallel.ep}: routed copies {balance} (plan.expert_imbalance); "
            "the experts' unit gathers experts/ep"
        )
    return notes + model_notes


PREDICTED_METRICS = ("mem/predicted_model_states_gib", "mem/predicted_peak_gib")
PREDICTED_STAGE_METRICS = tuple(f"mem/predicted_{stage}_peak_gib" for stage in STAGES)


def plan_for_run(cfg: "RunConfig", topology: "Topology") -> tuple[dict, dict, dict]:
    """What a run records: the whole plan (run.json["plan"]), the two predictions it logs in every
    row beside the measurements, and the per-phase peaks it logs beside the sampled step's breakdown.
    Never raises: a configuration the planner cannot model must not stop a run; the record then says
    why there is no plan."""
    try:
        result = plan(cfg, topology)
    except Exception as exc:  # noqa: BLE001 - the prediction is an aside to the run
        return (
            {"error": f"{type(exc).__name__}: {exc}"},
            dict.fromkeys(PREDICTED_METRICS),
            dict.fromkeys(PREDICTED_STAGE_METRICS),
        )
    return (
        result.to_dict(),
        {
            "mem/predicted_model_states_gib": result.model_states["total"] / GIB,
            "mem/predicted_peak_gib": result.peak["total"] / GIB,
        },
        {f"mem/predicted_{stage}_peak_gib": result.stage_peaks[stage]["total"] / GIB for stage in STAGES},
    )
