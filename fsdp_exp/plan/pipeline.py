"""The planner's view of a pipeline-parallel run (fsdp_exp/parallel/pipeline.py): per pp rank, the model
states of its stages (their blocks' parameters, plus the embeddings on the first stage and the final norm
and output projection on the last, sharded over dp x cp; under tensor parallel their tp shares, under expert
parallel the routed experts split over ep), the activations (of seq_len / cp tokens, the residual stream
sharded over tp under sequence parallel) the schedule keeps alive, the peak over ranks and which rank holds it, and the schedule's bubble.

Activations held at a rank's peak, in micro-batches of one stage each ("in flight": forwarded, not yet
backwarded):

    GPipe             all m micro-batches on every stage (every forward runs before the first backward)
    1F1B              min(m, pp - i) on stage i (its warm-up forwards, then one forward per backward)
    interleaved 1F1B  min(w_i + 1, m v) local stage micro-batches on rank i, w_i = (v - 1) m_r + 2 (pp - 1 - i)
                      the warm-up of torch's ScheduleInterleaved1F1B (torch/distributed/pipelining/schedules.py,
                      ``_get_warmup_ops``: m_r = m / max(1, m // pp) micro-batches a round, as Megatron-LM's
                      interleaved schedule, Narayanan et al. 2021), plus the first steady-state forward
    looped BFS        m v: every local stage forwards every micro-batch before any backward

Bubble (the fraction of the step a stage waits): (pp - 1) / (m + pp - 1) for GPipe and 1F1B; interleaving
(and looped BFS) makes each of the pp - 1 fill/drain slots one v-th as long: (pp - 1) / (v m + pp - 1).

Under pipeline parallel FSDP2 keeps each stage unsharded for the whole step (reshard_after_forward=False)
and torch's stages defer the gradient reduce-scatter to the last micro-batch, so a rank holds its stages'
unsharded parameters (param dtype) through the step, at dp = 1 too (FSDP2 all-gathers into its own buffer
on a one-rank mesh), and from the first backward on their unsharded gradients (accumulated in reduce_dtype,
as FSDP2 does when the reduction waits for the last micro-batch), while the sharded
gradients appear only at the step's end (when the activations are gone).

A rank's peak (checked against fsdp_exp/metrics/pipeline.py's tracker on every stage, within 5%: see
docs/pipeline.md) is at a backward, the larger of two moments: the first backward, with ``in_flight``
micro-batches' activations and no gradients yet, or a later one, with the unsharded gradients and the
micro-batches held once a forward followed a backward (``in_flight``, or one fewer where no forward
follows the first backward: GPipe, looped BFS). Beside them: the sharded parameters and AdamW moments,
the module buffers of every local stage (each is a copy of the model's root), torch's receive buffers (a
stage allocates one per micro-batch for its input and, but on the last stage, one for its output's
gradient, kept from step to step) and the block backward's temporaries. A micro-batch of a stage holds
its blocks' saved tensors less the first block's input (in the receive buffer, but on the first stage),
plus what the stage's forward cache keeps for its backward: its output (the last block's, or on the last
stage the logits; the final norm and the loss's fp32 log-softmax besides). Under activation checkpointing
(``ac``, applied in each stage to the full model's every ``ac.every``-th block, parallel/pipeline.py) a
checkpointed block keeps its input alone (with ``ac.ops``, the outputs its op-level policy saves), as
plan/step.py counts it at pp=1, and its backward recomputes its saved tensors: at the stage's first block
backward (its last block's) that block's full saved tensors replace what it kept, counted with the
temporaries (on the last stage, less the head's saved tensors, which its backward freed before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp_exp.config.layout import Layout
from fsdp_exp.errors import fail
from fsdp_exp.parallel.pipeline import (
    PipelineSettings,
    bubble_fraction,
    stage_blocks,
    stages_of_rank,
)
from fsdp_exp.plan.loss_chunks import candidate, decide, fixed, with_chunks
from fsdp_exp.plan.states import DTYPE_BYTES

if TYPE_CHECKING:
    from fsdp_exp.config import RunConfig

PLANNED = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Micro-batches (of one local stage each) whose activations pp rank ``rank`` holds at its peak."""
    m, v = microbatches, stages_per_rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    if schedule == "interleaved_1f1b":
        per_round = m // max(1, m // pp)
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        return min(warmup + 1, m * v)
    if schedule == "looped_bfs":
        return m * v
    fail(
        f"the planner has no activation model of parallel.pp_schedule={schedule} yet.",
        f"plan with parallel.pp_schedule={'|'.join(PLANNED)}",
    )


def forwarded(stages: list[int], count: int, per_microbatch, per_round: int) -> int:
    """The activations of a rank's first ``count`` forwards, of its local ``stages`` in the order torch's
    schedules run them: ``per_round`` micro-batches on each local stage in turn (interleaved 1F1B: m / max(1,
    m // pp); looped BFS: all m)."""
    return sum(per_microbatch(stages[(j // per_round) % len(stages)]) for j in range(count))


@dataclass(frozen=True)
class RankPlan:
    """One pp rank's memory, per data-parallel rank, in bytes."""

    rank: int
    stages: tuple[int, ...]
    blocks: tuple[int, ...]
    params: int  # elements of its stages, unsharded
    model_states: int  # parameters, gradients, AdamW moments (fp32), this dp rank's shards
    unsharded: int  # the stages' unsharded parameters and gradients held through the step (dp > 1)
    per_microbatch: int  # activations one micro-batch leaves on its heaviest local stage
    in_flight: int  # micro-batches of one local stage each
    activations: int  # at the peak: its micro-batches (in_flight, or one fewer) times per_microbatch
    state_pieces: dict = field(default_factory=dict)  # model_states by piece: params, grads, optimizer, total
    p2p_buffers: int = 0  # torch's receive buffers of the local stages (activations in, gradients back)
    module_buffers: int = 0  # the rotary tables, one per local stage
    temporaries: int = 0  # a block's backward: the residual's gradient, SwiGLU's, the new weight gradient

    @property
    def peak(self) -> int:
        """At the peak only the sharded parameters and the AdamW moments of the model states are alive (the
        sharded gradients come at the step's end); ``unsharded`` holds the parameters and, at a later
        backward's peak, the gradients."""
        resident = self.state_pieces["params"] + self.state_pieces["optimizer"]
        return resident + self.unsharded + self.activations + self.p2p_buffers + self.module_buffers + self.temporaries


@dataclass(frozen=True)
class PipelinePlan:
    ranks: tuple[RankPlan, ...]
    bubble: float

    @property
    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak)  # the first of equal peaks

    @property
    def peak(self) -> int:
        return self.peak_rank.peak


def pipeline_plan(cfg: "RunConfig", settings: PipelineSettings, dp: int, device_kind: str = "cpu") -> PipelinePlan:
    """The plan of ``cfg`` cut as ``settings`` say, FSDP2 (or HSDP, or replicas) over ``dp`` ranks in each stage.
    ``trainer.loss_chunks=auto``: the plan of the choice ``fsdp_exp.plan.loss_chunks``'s rule makes on the worst
    rank's peaks (what ``predict.loss_chunks_for`` decides for a pipeline run)."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.parallel.pipeline import stage_planner_rules
    from fsdp_exp.plan.activations import profile_for
    from fsdp_exp.plan.states import expert_units, model_states, param_infos, unit_names

    if fixed(cfg.trainer.loss_chunks) is None:
        k = candidate(cfg)
        one, more = (pipeline_plan(with_chunks(cfg, n), settings, dp, device_kind) for n in (1, k))
        chosen = decide(str(cfg.trainer.loss_chunks), k, one.peak_rank.peak, more.peak_rank.peak)
        return more if chosen.chunks > 1 else one
    s = settings
    spec = spec_for(cfg.model)
    inventory = spec.inventory(cfg.model)
    blocks = stage_blocks(s, cfg.model)
    last = s.num_stages - 1
    stage_of_block = {b: stage for stage, bs in enumerate(blocks) for b in bs}

    def stage_of(info) -> int:
        if info.block is not None:
            return stage_of_block[info.block]
        return 0 if info.name in inventory.input_params else last

    # Each stage runs the pp=1 recipe (parallel.apply_recipe) on its slice of the mesh: tensor parallel (with
    # sequence parallel), context parallel (this rank's seq_len / cp tokens; FSDP shards over shard x cp) and
    # expert parallel (the routed experts split over ep ranks, FSDP-sharded over the efsdp ranks left).
    layout = Layout.for_stages(cfg, dp)
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    experts = expert_units(spec, cfg)
    infos = param_infos(
        inventory, unit_names(spec, cfg), stage_planner_rules(cfg), shard=layout.shard_cp, tp=tp, experts=experts, ep=ep
    )
    e = DTYPE_BYTES[cfg.precision.param_dtype]
    e_reduce = DTYPE_BYTES[cfg.precision.reduce_dtype] if cfg.precision.reduce_dtype else e
    micro_batch = layout.local_batch(cfg.trainer.global_batch_size) // s.n_microbatches
    sp = cfg.parallel.sequence_parallel and tp > 1
    profile = profile_for(cfg.model, micro_batch, cfg.trainer.seq_len, tp=tp, sequence_parallel=sp, cp=cp, ep=ep)
    full_block = profile.block_saved(e, False, profile.math_attention(device_kind, e))["total"]
    resid = profile.residual(e)  # a stage's input or output, one micro-batch
    saved = _block_saved(cfg, profile, e, full_block, resid)
    # The last stage: the final norm's saved tensors, the loss's fp32 log-softmax and the logits themselves.
    logits = profile.logits // (tp if cfg.parallel.loss_parallel else 1)  # loss parallel: sharded over the vocabulary
    # trainer.loss_chunks: the stage's loss takes the logits in slices of the sequence, one slice's fp32
    # log-softmax at a time (parallel/pipeline.py's stage_loss); the logits themselves are the stage's output
    chunks = max(1, min(fixed(cfg.trainer.loss_chunks), cfg.trainer.seq_len))  # settled above
    head_bytes = profile.head_saved(e, False) + 4 * -(-logits // chunks) + e * logits
    temporaries = resid + profile.backward_peak(e) + e * profile.peak_weight_grad
    # model.attention_mask=block_causal: every stage builds the micro-batch's mask, held until its backward ends
    mask = profile.batch_inputs(device_kind, e) if hasattr(profile, "batch_inputs") else 0

    def stage_microbatch(stage: int) -> int:
        first_input = resid if stage != 0 else 0  # in a receive buffer instead
        output = head_bytes if stage == last else resid
        return sum(saved(b) for b in blocks[stage]) - first_input + output + mask

    # Each stage's once: the ranks' walks below ask for it once per micro-batch in flight (a search plans thousands).
    per_microbatch = [stage_microbatch(stage) for stage in range(s.num_stages)].__getitem__
    # The parameters' indices by stage, once, so that each rank picks its own in the inventory's order.
    indices: dict[int, list[int]] = {}
    for k, info in enumerate(infos):
        indices.setdefault(stage_of(info), []).append(k)

    def recompute(stage: int) -> int:
        """A checkpointed block's backward recomputes its forward: at a stage's first block backward (its last
        block's, every block of the micro-batch still held) the block's saved tensors replace what it kept. On
        the last stage the head's backward came first and freed its saved tensors (the logits among them)."""
        extra = full_block - saved(blocks[stage][-1])
        return max(0, extra - head_bytes) if stage == last else extra

    m = s.n_microbatches
    per_round = m // max(1, m // s.pp) if s.schedule == "interleaved_1f1b" else m

    def receive_buffers(stage: int) -> int:
        return s.n_microbatches * resid * ((stage != 0) + (stage != last))

    ranks = []
    for rank in range(s.pp):
        stages = stages_of_rank(s, rank)
        mine = [infos[k] for k in sorted(k for stage in stages for k in indices.get(stage, ()))]
        pieces = model_states(mine, offload=False, kind=device_kind, storage_dtype=cfg.precision.storage_dtype).resident
        states = pieces["total"]
        gathered = int(sum(i.gathered_numel for i in mine))
        unsharded_params = e * gathered
        # FSDP2 accumulates the deferred unsharded gradients in reduce_dtype (fp32 under bf16 parameters)
        unsharded_grads = e_reduce * gathered
        held = in_flight(s.schedule, s.pp, rank, s.n_microbatches, s.stages_per_rank)
        heaviest = max(per_microbatch(stage) for stage in stages)
        # The first backward (no gradients yet), or a later one (the unsharded gradients, and as many
        # micro-batches again if a forward follows the first backward, else one fewer).
        held_later = held if s.n_microbatches * len(stages) > held else held - 1
        first = forwarded(stages, held, per_microbatch, per_round)
        later = forwarded(stages, held_later, per_microbatch, per_round) + unsharded_grads
        activations = max(first, later) - (unsharded_grads if later > first else 0)
        ranks.append(
            RankPlan(
                rank=rank,
                stages=tuple(stages),
                blocks=tuple(b for st in stages for b in blocks[st]),
                params=sum(i.numel for i in mine),
                model_states=states,
                unsharded=unsharded_params + (unsharded_grads if later > first else 0),
                per_microbatch=heaviest,
                in_flight=held,
                activations=activations,
                state_pieces=dict(pieces),
                p2p_buffers=sum(receive_buffers(stage) for stage in stages),
                module_buffers=len(stages) * inventory.buffer_bytes,
                temporaries=temporaries + max(recompute(stage) for stage in stages),
            )
        )
    return PipelinePlan(
        ranks=tuple(ranks), bubble=bubble_fraction(s.schedule, s.pp, s.n_microbatches, s.stages_per_rank)
    )


_SHARED: dict[tuple, PipelinePlan] = {}


def shared_pipeline_plan(cfg: "RunConfig", settings: PipelineSettings, dp: int, device_kind: str) -> PipelinePlan:
    """``pipeline_plan``, shared by the configs that agree on everything it reads (a search's candidates that differ
    only in what the stages do not plan today: prefetch and offload). The key holds every config section it reads
    whole, so that a key read there later splits it rather than being lost; a section it starts to read must join
    the key (tests/integration/test_tune_pruning.py compares with the plan of each candidate's own)."""
    from fsdp_exp.models.spec import config_key
    from fsdp_exp.parallel.backend import backend_for

    key = (
        config_key(cfg.model),
        config_key(cfg.wrap),
        backend_for(cfg).planner_rules(cfg),
        cfg.precision.param_dtype,  # of precision, only the dtypes: the stages plan no float8 yet
        cfg.precision.reduce_dtype,
        repr(cfg.trainer),
        repr(cfg.parallel),
        repr(cfg.ac),
        settings,
        dp,
        device_kind,
    )
    if key not in _SHARED:
        if len(_SHARED) >= 4096:
            _SHARED.clear()
        _SHARED[key] = pipeline_plan(cfg, settings, dp, device_kind)
    return _SHARED[key]


def stage_states_floor(cfg: "RunConfig", dp: int, device_kind: str) -> int:
    """The resident parameters and AdamW moments of every stage together, each sharded over ``dp`` as
    ``pipeline_plan`` holds them: the pp ranks' share of it (``plan.predict.peak_floor``)."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.parallel.backend import backend_for
    from fsdp_exp.plan.states import expert_units, model_states, param_infos, unit_names

    spec = spec_for(cfg.model)
    inventory = spec.inventory(cfg.model)
    layout = Layout.for_stages(cfg, dp)
    infos = param_infos(
        inventory,
        unit_names(spec, cfg),
        backend_for(cfg).planner_rules(cfg),
        shard=layout.shard_cp,
        tp=layout.tp,
        experts=expert_units(spec, cfg),
        ep=layout.ep,
    )
    pieces = model_states(infos, offload=False, kind=device_kind, storage_dtype=cfg.precision.storage_dtype).resident
    return pieces["params"] + pieces["optimizer"]


def _block_saved(cfg: "RunConfig", profile, e: int, full_block: int, resid: int):
    """block index (in the full model) -> the bytes one micro-batch of it saves for backward: all of a block's,
    or, for a block the stage checkpoints (parallel/ac.py's choice: every ``ac.every``-th block of the full
    model), its input alone, and with ``ac.ops`` the outputs the op-level policy keeps (plan/step.py's rule)."""
    every = {"none": 0, "full": 1, "selective": cfg.ac.every}[cfg.ac.mode]
    kept = resid + (profile.op_level_saved(e, cfg.ac.ops) if cfg.ac.ops != "none" else 0)

    def saved(block: int) -> int:
        return kept if every and block % every == 0 else full_block

    return saved


def with_worst_stage(result, cfg: "RunConfig", topology, margin=None):
    """``plan``'s result for a pipeline run (parallel.pp > 1), its per-rank figures (what the fit check and tune
    read: ``per_rank_bytes``, ``peak["total"]``, the model states) replaced by the worst pp rank's of
    ``pipeline_plan``. The phase walk (``phases``, ``stage_peaks``, the peak's phase) stays the whole model's on
    one rank, which the notes say."""
    import dataclasses

    from fsdp_exp.parallel.pipeline import settings_from
    from fsdp_exp.plan.devices import allocator_margin

    from fsdp_exp.errors import ConfigError

    settings = settings_from(cfg, topology.layout.local_batch(cfg.trainer.global_batch_size))
    try:
        pipeline = pipeline_plan(cfg, settings, topology.dp_size, result.device_kind)
    except ConfigError as exc:  # a schedule without an activation model: the whole model, an upper bound
        return dataclasses.replace(
            result,
            assumptions=[
                *result.assumptions,
                f"parallel.pp={settings.pp}: approximate, the whole model on one rank (an upper bound): {exc}",
            ],
        )
    worst = pipeline.peak_rank
    margin_bytes, margin_rule = allocator_margin(result.device_kind, worst.peak, margin)
    pieces = {k: worst.state_pieces[k] for k in ("params", "grads", "optimizer", "total")}
    no_host = {k: 0 for k in pieces}
    per_rank = {
        **{k: pieces[k] for k in ("params", "grads", "optimizer")},
        "activations": worst.activations + worst.temporaries,
        "buffers": worst.unsharded + worst.p2p_buffers + worst.module_buffers,
        "total": worst.peak + margin_bytes,
    }
    peak = {
        **result.peak,
        "total": worst.peak,
        "activations": worst.activations,
        "unsharded": worst.unsharded,  # with the unsharded gradients where the peak holds them
        "comm": worst.p2p_buffers,
        "module_buffers": worst.module_buffers,
        "temporaries": worst.temporaries,
        "grads": 0,  # the sharded gradients come at the step's end, after the peak
    }
    note = (
        f"parallel.pp={settings.pp}: the per-rank figures are pp rank {worst.rank}'s, the worst of {settings.pp} "
        f"(stages {list(worst.stages)}, blocks {list(worst.blocks)}; {worst.in_flight} micro-batches of "
        f"activations in flight under {settings.schedule}, bubble {pipeline.bubble:.0%}; "
        "fsdp_exp.plan.pipeline); the phases and per-phase peaks are still the whole model's on one rank"
    )
    return dataclasses.replace(
        result,
        model_states={**result.model_states, "device": pieces, "host": no_host, "total": pieces["total"]},
        per_rank_bytes=per_rank,
        peak=peak,
        margin_bytes=margin_bytes,
        margin_rule=margin_rule,
        assumptions=[*result.assumptions, note],
    )
