"""Pipeline parallel: the model cut into stages by blocks, FSDP2 inside each stage, a schedule of
torch.distributed.pipelining driving the micro-batches (issue #26; ``parallelize`` calls
``parallelize_pipeline`` when parallel.pp > 1, see docs/pipeline.md).

The mesh is (pp, dp[, cp][, tp]), pp outermost and tp innermost as torchtitan orders its dims: rank =
((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index, so the ranks of one stage are neighbours (one
node) and the stage-to-stage sends cross the nodes. Every stage runs the recipe of an unpipelined model
(``fsdp_exp.parallel.apply_recipe``: float8, TP, EP, CP, AC, compile, the backend's data-parallel wrap) on its
pp slice of the mesh (``stage_mesh``); this module cuts the stages and drives their schedule.

A stage is the family's own model built on the meta device with what the stage does not run taken out:
its blocks not in the stage are deleted, the input modules (the spec's ``input_modules``: embeddings)
become ``nn.Identity`` on every stage but the first, and the root modules after the blocks (final norm,
output projection) become ``nn.Identity`` on every stage but the last. The stage therefore runs the
family's own forward, and its parameters keep their names in the full model, so the seeded
initialization (``models.init_weights``: a function of the seed and the name) gives every stage exactly
the values the unsplit model has.

    import torch.distributed as dist; dist.init_process_group("gloo")        # 2 ranks
    mesh = pipeline_mesh("cpu", pp=2, dp=1)
    engine = build_pipeline(cfg, PipelineSettings(pp=2, schedule="1f1b", microbatches=4), mesh, device)
    loss = engine.step(inputs, targets)        # this dp rank's batch, on every rank of the stage group
    grad_norm = engine.optimizer_step(cfg.trainer.grad_clip)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from fsdp_exp.config.layout import Layout, dp_split
from fsdp_exp.config.schema import settled_loss_chunks
from fsdp_exp.errors import fail
from fsdp_exp.parallel import Parallelized, apply_recipe

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_exp.config import ModelConfig, RunConfig
    from fsdp_exp.metrics.pipeline import StageObserver
    from fsdp_exp.parallel.context import ContextShards

# parallel.pp_schedule -> (torch.distributed.pipelining class, stage placement). "loop": stage s on pp rank
# s % pp; "v": rank r holds stages r and 2 pp - 1 - r (the V-shaped schedules need 2 stages per rank).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop"),
    "1f1b": ("Schedule1F1B", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}
SINGLE_STAGE = ("gpipe", "1f1b")  # PipelineScheduleSingle: one stage per rank


@dataclass(frozen=True)
class PipelineSettings:
    """The ``parallel.pp*`` keys, as plain values (``settings_from`` reads them from a run's config)."""

    pp: int  # parallel.pp: pipeline ranks (the mesh's pp dim)
    schedule: str = "1f1b"  # parallel.pp_schedule: a key of SCHEDULES
    microbatches: int = 0  # parallel.pp_microbatches: 0 = pp (the fewest 1F1B accepts)
    stages_per_rank: int = 1  # parallel.pp_stages_per_rank (interleaved, looped, V schedules)
    split: Optional[tuple[int, ...]] = None  # parallel.pp_split: first block of every stage but the first

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp


def settings_from(cfg: "RunConfig", local_batch: int) -> PipelineSettings:
    """The run's ``parallel.pp*`` keys; ``local_batch``: the sequences each dp rank trains on per step.
    ``parallel.pp_microbatches=0`` follows ``trainer.micro_batch_size`` (the pipeline's micro-batch), else pp."""
    p, micro = cfg.parallel, cfg.trainer.micro_batch_size
    microbatches = p.pp_microbatches or (local_batch // micro if micro else 0)
    return PipelineSettings(
        pp=p.pp,
        schedule=p.pp_schedule,
        microbatches=microbatches,
        stages_per_rank=p.pp_stages_per_rank,
        split=tuple(p.pp_split) if p.pp_split is not None else None,
    )


# ------------------------------------------------------------------------------------------ checks
def check(settings: PipelineSettings, model_cfg: "ModelConfig", local_batch: int) -> None:
    """Refuse (``fail``, naming the override) what the pipeline cannot run, before any rank starts."""
    from fsdp_exp.models import spec_for

    s = settings
    if s.schedule not in SCHEDULES:
        fail(
            f"parallel.pp_schedule={s.schedule!r} is not a schedule fsdp_exp knows.",
            f"pass parallel.pp_schedule={'|'.join(SCHEDULES)}",
        )
    if s.schedule in SINGLE_STAGE and s.stages_per_rank != 1:
        fail(
            f"parallel.pp_schedule={s.schedule} runs one stage per rank, not {s.stages_per_rank}.",
            "pass parallel.pp_stages_per_rank=1, or parallel.pp_schedule=interleaved_1f1b|looped_bfs",
        )
    if SCHEDULES[s.schedule][1] == "v" and s.stages_per_rank != 2:
        fail(
            f"parallel.pp_schedule={s.schedule} places two stages on every rank (a V).",
            "pass parallel.pp_stages_per_rank=2",
        )
    spec = spec_for(model_cfg)
    spec.check_pipeline(model_cfg)  # the family's refusals: what its stages cannot run (models/hf.py)
    n_blocks = len(spec.inventory(model_cfg).blocks)
    if s.num_stages > n_blocks:
        fail(
            f"{s.num_stages} pipeline stages (parallel.pp={s.pp} x parallel.pp_stages_per_rank={s.stages_per_rank}) "
            f"need at least as many blocks; the model has {n_blocks}.",
            f"pass a smaller parallel.pp or parallel.pp_stages_per_rank, or model.n_layers>={s.num_stages}",
        )
    if s.split is not None:
        _check_split(s.split, s.num_stages, n_blocks)
    if local_batch % s.n_microbatches:
        fail(
            f"parallel.pp_microbatches={s.n_microbatches} does not divide the {local_batch} sequences each "
            "data-parallel rank trains on per step (unequal micro-batches would weigh tokens unequally).",
            "pass a parallel.pp_microbatches that divides trainer.global_batch_size / dp",
        )
    if s.schedule == "1f1b" and s.n_microbatches < s.num_stages:
        fail(
            f"1F1B needs at least as many micro-batches as stages ({s.num_stages}), not {s.n_microbatches}.",
            f"pass parallel.pp_microbatches>={s.num_stages}",
        )
    if getattr(model_cfg, "tie_embeddings", False):
        fail(
            "model.tie_embeddings=true ties the first stage's embeddings to the last stage's output "
            "projection; stages on different ranks cannot share a tensor.",
            "pass model.tie_embeddings=false",
        )


def check_sharding(cfg: "RunConfig") -> None:
    """Each stage runs the recipe of an unpipelined model (``apply_recipe``), whose data-parallel wrap is the
    backend's: FSDP2 fully sharded, FSDP2 hybrid (HSDP: replicate x shard of dp) or DDP (replicated, as torch's
    ``replicate``), the backend's ``stage_strategies``; refuse, naming the override, the rest (FSDP1,
    DeepSpeed: their ``check`` refuses them too; FSDP2 grad_op and no_shard). Tune asks it which shardings
    stages run."""
    from fsdp_exp.parallel.backend import backend_for

    s, p = cfg.sharding, cfg.parallel
    if s.strategy not in backend_for(cfg).stage_strategies:
        fail(
            f"parallel.pp={p.pp} runs FSDP2 (sharding=full or hybrid) or DDP (sharding=ddp) inside each stage; "
            f"sharding.backend={s.backend} sharding.strategy={s.strategy} is not composed with pipeline stages.",
            "pass sharding=full (FSDP2), sharding=hybrid or sharding=ddp, or parallel.pp=1",
        )


def check_stage_settings(cfg: "RunConfig") -> None:
    """Refuse, naming the override, what the stages would otherwise ignore (preflight): they keep every unit
    unsharded from the first forward to the last backward of a step (``fsdp2.reshard_after_forward``: no resharding, so no
    all-gather to prefetch) and reduce the gradients once, after the last micro-batch (torch's schedule)."""
    from fsdp_exp.config.schema import EVERY_MICRO_BATCH, PrefetchConfig

    p, s, t = cfg.parallel, cfg.sharding, cfg.trainer
    if s.reshard_after_forward.lower() not in ("auto", "false"):
        fail(
            f"sharding.reshard_after_forward={s.reshard_after_forward} with parallel.pp={p.pp}: the stages keep "
            "their parameters unsharded between the micro-batches of a step (resharding would all-gather every "
            "unit again for each of them).",
            "pass sharding.reshard_after_forward=auto (or false), or parallel.pp=1",
        )
    if cfg.prefetch != PrefetchConfig():
        fail(
            f"a prefetch setting with parallel.pp={p.pp}: the stages gather each unit once a step and keep it, so "
            "there is no all-gather to prefetch.",
            "leave the prefetch group at its default (drop prefetch=...), or parallel.pp=1",
        )
    if t.grad_sync == EVERY_MICRO_BATCH:
        fail(
            f"trainer.grad_sync={t.grad_sync} with parallel.pp={p.pp}: torch's pipeline schedule reduces the "
            "stages' gradients once, after the last micro-batch.",
            "pass trainer.grad_sync=auto (or last_micro_batch), or parallel.pp=1",
        )


def stage_dp_layout(cfg: "RunConfig", dp: int) -> tuple[int, int]:
    """(replicate, shard) of a stage's dp ranks: the layout's split (``fsdp_exp.config.layout.dp_split``)."""
    return dp_split(cfg, dp)


def stage_planner_rules(cfg: "RunConfig"):
    """The planner's rules for a stage's parameters: FSDP2's under every stage strategy (torch's replicate is
    FSDP2's machinery on a replicate-only mesh), whichever backend the config names."""
    from fsdp_exp.parallel.fsdp2 import BACKEND as FSDP2_BACKEND

    return FSDP2_BACKEND.planner_rules(cfg)


def _check_split(split: tuple[int, ...], num_stages: int, n_blocks: int) -> None:
    cuts = list(split)
    if len(cuts) != num_stages - 1 or cuts != sorted(set(cuts)) or not all(0 < c < n_blocks for c in cuts):
        fail(
            f"parallel.pp_split={cuts} must be {num_stages - 1} increasing block indices between 1 and "
            f"{n_blocks - 1} (the first block of every stage after the first).",
            "pass parallel.pp_split=null (balanced by parameters) or fix the list",
        )


# ------------------------------------------------------------------------------------------ the cut
def balanced_split(weights: list[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """The first block of every stage but the first (see ``_balanced_split``); remembered per model shape, as
    tune asks it for every pipeline candidate of one model."""
    return list(_balanced_split(tuple(weights), num_stages, first_extra, last_extra))


@functools.lru_cache(maxsize=256)
def _balanced_split(weights: tuple[int, ...], num_stages: int, first_extra: int, last_extra: int) -> tuple[int, ...]:
    """The first block of every stage but the first, cutting ``weights`` (parameters per block) into
    ``num_stages`` contiguous runs of at least one block so that the heaviest stage is as light as it can
    be; ``first_extra`` / ``last_extra`` are the parameters the first / last stage hold beside blocks.
    Exact (dynamic programming over the cut points; ties go to the earliest cut)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(start: int, end: int, stage: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[k][j]: the lightest heaviest stage placing blocks [0, j) on stages 0..k-1; cut[k][j]: where k-1 began
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j, k - 1))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    cuts, j = [], n
    for k in range(num_stages, 1, -1):
        j = cut[k][j]
        cuts.append(j)
    return tuple(sorted(cuts))


def stage_blocks(settings: PipelineSettings, model_cfg: "ModelConfig") -> list[list[int]]:
    """The block indices of every stage, in stage order (``parallel.pp_split``, or balanced by parameters)."""
    from fsdp_exp.models import spec_for

    inventory = spec_for(model_cfg).inventory(model_cfg)
    n_blocks = len(inventory.blocks)
    if settings.split is not None:
        cuts = list(settings.split)
    else:
        per_block = [0] * n_blocks
        first = last = 0
        for p in inventory.params:
            if p.block is not None:
                per_block[p.block] += p.numel
            elif p.name in inventory.input_params:
                first += p.numel
            else:  # the root's parameters after the blocks: final norm, output projection
                last += p.numel
        cuts = balanced_split(per_block, settings.num_stages, first, last)
    bounds = [0, *cuts, n_blocks]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(settings.num_stages)]


def stages_of_rank(settings: PipelineSettings, pp_rank: int) -> list[int]:
    """The stage indices pp rank ``pp_rank`` holds, in the order the schedule expects them."""
    pp, per_rank = settings.pp, settings.stages_per_rank
    if SCHEDULES[settings.schedule][1] == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


# ------------------------------------------------------------------------------------------ building
def pipeline_mesh(device_type: str, pp: int, dp: int, tp: int = 1) -> "DeviceMesh":
    """The (pp, dp) mesh, (pp, dp, tp) when tp > 1 (fsdp_exp/parallel/mesh.py orders the dims)."""
    from fsdp_exp.parallel.mesh import build

    return build(device_type, *mesh_layout(pp, dp, tp))


def mesh_layout(pp: int, dp: int, tp: int = 1, cp: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of a pipeline run's mesh: a stage's data-parallel ranks are one ``dp`` dim."""
    layout = Layout.of(pp * dp * cp * tp, pp=pp, cp=cp, tp=tp)
    return layout.mesh_shape, layout.mesh_dim_names


def stage_mesh(cfg: "RunConfig", mesh: "DeviceMesh") -> "DeviceMesh":
    """The mesh the stages' recipe reads: the run's (pp, dp[, cp][, tp]) mesh with its dp dim laid out as a
    stage's data parallelism is (``stage_dp_layout``): (replicate, shard) under sharding=hybrid, replicate
    under DDP, one shard dim else. Each parallelism takes its own dims of it, this rank's pp slice."""
    replicas, shards = stage_dp_layout(cfg, mesh["dp"].size())
    if cfg.sharding.strategy == "hybrid":
        return mesh._unflatten("dp", (replicas, shards), ("replicate", "shard"))
    if cfg.sharding.strategy == "no_shard":
        return mesh._unflatten("dp", (replicas,), ("replicate",))
    return mesh


def build_stage_module(model_cfg: "ModelConfig", blocks: list[int], first: bool, last: bool) -> "nn.Module":
    """The family's model on the meta device with only what this stage runs (see the module docstring): the
    other stages' blocks deleted here, the ends cut by the family (``ModelSpec.cut_stage``)."""
    from fsdp_exp.models import build_meta, spec_for

    spec = spec_for(model_cfg)
    inventory = spec.inventory(model_cfg)
    model = build_meta(model_cfg)
    keep = {inventory.blocks[i] for i in blocks}
    for name in inventory.blocks:
        if name not in keep:
            parent, _, child = name.rpartition(".")
            delattr(model.get_submodule(parent), child)
    return spec.cut_stage(model, model_cfg, first, last)  # the ends, and a forward on activations


def stage_loss(logits: "torch.Tensor", targets: "torch.Tensor", chunks: int = 1) -> "torch.Tensor":
    """The schedule's loss_fn on the last stage: the project's mean cross-entropy per token of the logits the
    stage made, in ``trainer.loss_chunks`` slices of the sequence (each slice's fp32 log-softmax alone at a
    time; the logits themselves are the stage's output, made whole)."""
    from fsdp_exp.models.loss import logits_cross_entropy

    return logits_cross_entropy(logits, targets, chunks)


@dataclass
class PipelineEngine:
    """This rank's stages, their schedule and optimizers: the training step of a pipeline-parallel run.

    ``step`` runs forward and backward over the micro-batches of this dp rank's batch and returns the
    step's mean loss on every rank; ``optimizer_step`` clips by the norm over all stages, steps and zeroes.
    Gradients come out as the whole batch's mean: the schedule divides them by the micro-batch count
    (``scale_grads=True``) and FSDP2 averages them over dp.
    """

    settings: PipelineSettings
    stage_indices: list[int]
    stages: list["nn.Module"]
    schedule: object
    mesh: "DeviceMesh"
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)
    applied: dict = field(default_factory=dict)
    # Times the schedule's steps, their chunks' compute and P2P waits (fsdp_exp/metrics/pipeline.py; installed
    # on the schedule and its PipelineStages by build_pipeline): the measured bubble and comm/p2p_wait_s.
    observer: Optional["StageObserver"] = None
    # Around the schedule's step (its forwards, losses and backwards): tensor parallel's loss parallel when
    # the last stage's logits stay sharded over the vocabulary (parallel/tp.py's loss_context), else a no-op.
    loss_context: Callable = contextlib.nullcontext
    precompute_float8_scales: bool = False  # precision.float8_all_gather: after every optimizer step
    # parallel.cp > 1: this rank's positions of every sequence (parallel/context.py), cut before the schedule
    # splits the batch into micro-batches, so that each stage's micro-batch is a CP-sharded sequence
    context: Optional["ContextShards"] = None

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.settings.num_stages - 1 in self.stage_indices

    def step(self, inputs: "torch.Tensor", targets: "torch.Tensor", **packed) -> float:
        """Forward and backward over ``settings.n_microbatches`` micro-batches of (inputs, targets): this dp
        rank's sequences (every rank passes them; the schedule reads inputs on the first stage, targets on
        the last). ``packed`` (documents, positions: attention_mask.packed_inputs) reaches every stage's
        forward, cut into the same micro-batches. Returns the step's mean loss over the global batch, on every rank."""
        import torch
        import torch.distributed as dist

        if self.context is not None:
            inputs, targets = self.context(inputs, targets)
        losses: list = []
        with self.loss_context():
            self.schedule.step(
                *((inputs,) if self.has_first else ()),
                target=targets if self.has_last else None,
                losses=losses if self.has_last else None,
                return_outputs=False,
                **packed,
            )
        # The last stage's mean over its micro-batches, summed over the pp group (the other stages add 0),
        # then averaged over dp and cp (each cp rank's mean is over equally many tokens of the same sequences):
        # the mean over the global batch, on every rank of this mesh.
        local = torch.stack([x.detach().float() for x in losses]).mean() if self.has_last else torch.zeros(())
        local = local.to(inputs.device)
        dist.all_reduce(local, group=self.mesh["pp"].get_group())
        for dim in ("dp", "cp"):
            if dim in self.mesh.mesh_dim_names and self.mesh[dim].size() > 1:  # a sum, then divided: gloo has no AVG
                dist.all_reduce(local, group=self.mesh[dim].get_group())
                local /= self.mesh[dim].size()
        return local.item()

    def clip_grad_norm(self, max_norm: float) -> "torch.Tensor":
        """The L2 norm of every gradient of every stage (over dp by DTensor, over pp by an all-reduce of the
        squares), and the clipping by it, the rule of torch.nn.utils.clip_grad_norm_ (0: no clipping)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        grads = [p.grad for stage in self.stages for p in stage.parameters() if p.grad is not None]
        # Under tensor parallel the gradients live on two meshes (matrices on (dp, tp), norms on dp) and
        # DTensor combines no norms across meshes: each mesh's squared norm, then their sum.
        by_mesh: dict = {}
        for grad in grads:
            by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
        square = torch.zeros((), device=grads[0].device if grads else None)
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
            square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
        dist.all_reduce(square, group=self.mesh["pp"].get_group())
        total = square.sqrt()
        coef = max_norm / (total.item() + 1e-6)
        if max_norm > 0 and coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return total

    def optimizer_step(self, max_norm: float) -> float:
        norm = self.clip_grad_norm(max_norm)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.precompute_float8_scales:  # the next all-gathers' float8 scales, from the updated weights
            from fsdp_exp.parallel import float8

            for stage in self.stages:
                float8.precompute_scales(stage)
        for scheduler in self.schedulers:  # none when the trainer steps its own (PipelineParallelized)
            scheduler.step()
        return norm.item()


def build_pipeline(
    cfg: "RunConfig", settings: PipelineSettings, mesh: "DeviceMesh", device: "torch.device", optimizers: bool = True
) -> PipelineEngine:
    """This rank's stages (built on meta, FSDP2 over dp, materialized), their PipelineStages on the pp
    group, the schedule, and one AdamW + LR schedule per stage (the project's, decay on matrices; with
    ``optimizers=False`` none: the trainer hands the engine its own, see ``PipelineParallelized``)."""
    import torch.distributed.pipelining as pipelining

    from fsdp_exp.metrics.pipeline import StageObserver
    from fsdp_exp.models import matrix_parameter_names
    from fsdp_exp.optim import build_optimizer, build_scheduler
    from fsdp_exp.parallel import tp

    local_batch = cfg.trainer.global_batch_size // mesh["dp"].size()
    check(settings, cfg.model, local_batch)
    # The stages' recipe reads a pipeline run's config (parallel.pp: FSDP2 keeps the stages unsharded, DDP
    # replicates them with torch's replicate), whichever config a caller building stages by hand passed.
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=settings.pp))
    blocks = stage_blocks(settings, cfg.model)
    indices = stages_of_rank(settings, mesh["pp"].get_local_rank())
    last = settings.num_stages - 1
    stages, pipeline_stages, applied = [], [], {"stage_blocks": blocks, "stages": {}}
    replicas, shards = stage_dp_layout(cfg, mesh["dp"].size())
    recipe_mesh = stage_mesh(cfg, mesh)
    context = None
    for index in indices:
        stage = build_stage_module(cfg.model, blocks[index], first=index == 0, last=index == last)
        # the recipe of an unpipelined model (parallel/__init__.py), on this pp rank's slice of the mesh
        stage, applied["stages"][index], context = apply_recipe(
            stage, cfg, recipe_mesh, device, first_block=blocks[index][0]
        )
        applied["stages"][index]["dp_layout"] = {"replicate": replicas, "shard": shards}
        stages.append(stage)
        pipeline_stages.append(
            pipelining.PipelineStage(stage, index, settings.num_stages, device, group=mesh["pp"].get_group())
        )
    schedule_class = getattr(pipelining, SCHEDULES[settings.schedule][0])
    chunks = settled_loss_chunks(cfg.trainer.loss_chunks)
    loss_fn = functools.partial(stage_loss, chunks=chunks)
    if settings.schedule in SINGLE_STAGE:
        schedule = schedule_class(pipeline_stages[0], settings.n_microbatches, loss_fn=loss_fn)
    else:
        schedule = schedule_class(pipeline_stages, settings.n_microbatches, loss_fn=loss_fn)
    observer = StageObserver(
        pp_rank=mesh["pp"].get_local_rank(),
        stages_of={r: stages_of_rank(settings, r) for r in range(settings.pp)},
        predicted_bubble=bubble_fraction(
            settings.schedule, settings.pp, settings.n_microbatches, settings.stages_per_rank
        ),
    ).observe(schedule, pipeline_stages)
    applied.update(
        schedule=type(schedule).__name__,
        n_microbatches=settings.n_microbatches,
        local_stages=indices,
        mesh={"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names)},
        loss="mean cross-entropy of each micro-batch's logits on the last stage, in trainer.loss_chunks slices "
        "of the sequence",
        loss_chunks=chunks,
    )
    stage_optimizers = (
        [build_optimizer(stage, cfg.optim, matrix_parameter_names(stage)) for stage in stages] if optimizers else []
    )
    schedulers = [build_scheduler(o, cfg.optim, cfg.trainer.steps) for o in stage_optimizers]
    return PipelineEngine(
        settings=settings,
        stage_indices=indices,
        stages=stages,
        schedule=schedule,
        mesh=mesh,
        optimizers=stage_optimizers,
        schedulers=schedulers,
        applied=applied,
        observer=observer,
        loss_context=functools.partial(tp.loss_context, cfg),
        precompute_float8_scales=cfg.precision.float8_all_gather,
        context=context,
    )


# ------------------------------------------------------------------------------------------ the trainer's view
@dataclass
class PipelineParallelized(Parallelized):
    """What ``parallelize`` returns when parallel.pp > 1: this rank's stages as the trainer's model (an
    ``nn.ModuleList``; every parameter keeps its full-model name below the stage's index), one optimizer over
    them, and the engine whose ``step`` / ``optimizer_step`` replace the trainer's micro-batch loop
    (``owns_step``). The learning-rate schedule stays the trainer's, stepped after the engine's optimizer step."""

    engine: Optional[PipelineEngine] = None
    owns_step = True

    def build_optimizer(self, decay_names: set[str]):
        """One AdamW over every local stage (per-parameter, so the same updates as one per stage), made by
        the project's ``build_optimizer`` per stage (decay on the stage's matrices), handed to the engine."""
        import torch

        from fsdp_exp.models import matrix_parameter_names
        from fsdp_exp.optim import build_optimizer

        groups = [
            group
            for stage in self.engine.stages
            for group in build_optimizer(stage, self.cfg.optim, matrix_parameter_names(stage)).param_groups
        ]
        optimizer = torch.optim.AdamW(groups)
        self.engine.optimizers, self.engine.schedulers = [optimizer], []
        return optimizer


class StagesBackend:
    """The stages' own backend (FSDP2), asked through this rank's list of stages. Its memory tracker counts the
    rank's stages (torch's FSDP tracker follows one FSDP root, and the generic ``MemTracker``'s module
    statistics refuse a stage called once per micro-batch: fsdp_exp/metrics/pipeline.py's ``StageMemTracker``
    does without them); ``stage_observer`` times the engine's steps."""

    tracks_memory = True

    def __init__(self, inner, stage_observer: Optional["StageObserver"] = None, mesh: Optional["DeviceMesh"] = None):
        self._inner, self.stage_observer, self.mesh = inner, stage_observer, mesh

    def memory_tracker(self, model: "nn.Module", optimizer):
        from fsdp_exp.metrics.pipeline import stage_memory_tracker

        buffers = self.stage_observer.receive_buffers() if self.stage_observer else []
        return stage_memory_tracker(model, optimizer, buffers)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def state_dict_options(self) -> dict:
        """Checkpoints: each pp rank's optimizer holds other parameters, so its param groups are saved per
        parameter name (flattened, as torchtitan saves under PP) instead of as one list that DCP would keep
        from a single rank."""
        return {**self._inner.state_dict_options(), "flatten_optimizer_state_dict": True}

    def full_state_dict(self, model: "nn.Module"):
        """The export's consolidation: this pp rank's stages gathered over the stage's other dims (dp, tp), one
        parameter at a time, onto the stage's first rank, under the full model's names: one ``ExportPart`` per
        pp rank (export.py writes a file per part and rank 0 the index), no rank holding more than its stages."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from fsdp_exp.export import ExportPart, full_model_names, gathered

        writer = all(c == 0 for c in self.mesh.get_coordinate()[1:])  # the stage's first dp (and tp) rank
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        part = gathered(full_model_names(state), keep=writer)
        return ExportPart(part, index=self.mesh["pp"].get_local_rank(), count=self.mesh["pp"].size())


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The fraction of a step each stage idles waiting on its neighbours (equal stages, no comm time): the
    figure the run records and the planner reports."""
    v = 1 if schedule in SINGLE_STAGE else stages_per_rank
    return (pp - 1) / (v * microbatches + pp - 1)


def parallelize_pipeline(cfg: "RunConfig", mesh: "DeviceMesh", device: "torch.device") -> PipelineParallelized:
    """``parallelize`` under parallel.pp > 1: the stages of this pp rank, FSDP2 inside each over the dp dim of
    the run's (pp, dp) mesh, and their schedule. ``applied["pipeline"]`` records the schedule, the micro-batch
    count and every stage's blocks (the cut), ``applied["pipeline"]["stages"]`` the FSDP2 settings per stage."""
    from torch import nn

    from fsdp_exp.config.schema import LAST_MICRO_BATCH
    from fsdp_exp.parallel.fsdp2 import BACKEND as FSDP2_BACKEND

    settings = settings_from(cfg, cfg.trainer.global_batch_size // mesh["dp"].size())
    engine = build_pipeline(cfg, settings, mesh, device, optimizers=False)
    applied = {
        "pipeline": {
            "parallel.pp": settings.pp,
            "parallel.pp_schedule": settings.schedule,
            "parallel.pp_stages_per_rank": settings.stages_per_rank,
            "parallel.pp_split": list(settings.split) if settings.split else None,
            "bubble": bubble_fraction(
                settings.schedule, settings.pp, settings.n_microbatches, settings.stages_per_rank
            ),
            **engine.applied,
        },
        # torch's schedule reduces the gradients after the last micro-batch (check_stage_settings refuses the rest)
        "grad_sync": {"trainer.grad_sync": cfg.trainer.grad_sync, "resolved": LAST_MICRO_BATCH},
    }
    return PipelineParallelized(
        model=nn.ModuleList(engine.stages),
        applied=applied,
        # the stages are FSDP2 modules under every stage strategy (torch's replicate is FSDP2's machinery too)
        backend=StagesBackend(FSDP2_BACKEND, engine.observer, mesh=mesh),
        cfg=cfg,
        device=device,
        grad_sync=LAST_MICRO_BATCH,
        engine=engine,
    )
