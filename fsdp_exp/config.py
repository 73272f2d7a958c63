"""Typed run configuration: one dataclass per config group, registered with Hydra's ConfigStore.

The YAML files under ``fsdp_exp/conf/`` are merged onto these schemas, so a misspelt key or a value
of the wrong type is refused while Hydra composes, before anything runs. Checks that span groups
(batch vs. ranks, mesh vs. world size, fp16 vs. loss scaler, ...) live in :func:`validate`, which the
launcher calls before any worker process exists. Every message names the override that fixes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    """A Llama-style decoder. ``name`` selects the architecture in ``fsdp_exp.models.REGISTRY``."""

    name: str = "llama"
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None  # None = n_heads (no grouped-query attention)
    vocab_size: int = MISSING
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    n_experts: int = 0  # > 0: every block's feed-forward is a mixture of this many experts
    experts_top_k: int = 2  # experts each token is routed to


@dataclass
class ShardingConfig:
    """How parameters, gradients and optimizer state are spread over data-parallel ranks.

    ``strategy`` speaks the user's vocabulary; each backend in ``fsdp_exp.parallel`` translates it
    (docs/vocabulary.md). ``replicate_size`` x ``shard_size`` is the 2-D mesh of ``hybrid``.
    """

    backend: str = "fsdp2"  # fsdp2 | fsdp1 | ddp
    strategy: str = "full"  # full | grad_op | hybrid | no_shard
    replicate_size: Optional[int] = None  # hybrid: None = world / shard_size
    shard_size: Optional[int] = None  # hybrid: None = trainer.nproc_per_node (shard within a node)
    # FSDP2: "auto" (from the strategy) | true | false | N (reshard to groups of N ranks after forward).
    reshard_after_forward: str = "auto"
    # FSDP2: reshard the last block after forward too? None = no (backward needs it at once).
    reshard_last_block: Optional[bool] = None
    # FSDP1 only (None = fsdp_exp's FSDP1 default: use_orig_params=True, for per-parameter weight decay;
    # sync_module_states=False, since every rank initializes identically by seed):
    use_orig_params: Optional[bool] = None
    sync_module_states: Optional[bool] = None


@dataclass
class PrecisionConfig:
    param_dtype: str = "fp32"  # dtype of the unsharded parameters used in forward/backward
    reduce_dtype: str = "fp32"  # dtype of gradient reduce-scatter / all-reduce
    output_dtype: Optional[str] = None  # FSDP2: dtype the root module's outputs are cast to (None = leave)
    buffer_dtype: Optional[str] = None  # FSDP1: dtype of buffers (None = param_dtype)
    cast_forward_inputs: bool = True  # cast floating-point forward inputs to param_dtype
    loss_scaler: str = "none"  # none | dynamic (fp16 needs dynamic)


@dataclass
class OffloadConfig:
    params: bool = False  # keep sharded params, grads and optimizer state on the host
    pin_memory: Optional[bool] = None  # None = pin when CUDA is used (CPU-only torch cannot pin)


@dataclass
class PrefetchConfig:
    """All-gather prefetch, in wrapped units.

    FSDP2: ``forward`` / ``backward`` are explicit prefetch depths. ``forward=0`` prefetches nothing
    ahead (FSDP2's own default); ``backward=None`` leaves FSDP2's implicit one-unit backward prefetch,
    which FSDP2 cannot switch off, so ``backward=0`` is refused there.
    FSDP1: ``forward`` 0/1 = ``forward_prefetch``; ``backward`` 0 = no ``backward_prefetch``, 1 or None =
    ``BackwardPrefetch.BACKWARD_PRE`` or ``BACKWARD_POST`` by ``backward_timing``; ``limit_all_gathers``.
    """

    forward: int = 1
    backward: Optional[int] = 1
    backward_timing: str = "pre"  # pre | post (FSDP1's BACKWARD_POST; FSDP2 prefetches pre only)
    limit_all_gathers: Optional[bool] = None  # FSDP1 rate limiter; None = FSDP1's default (true)


@dataclass
class WrapConfig:
    # block: each transformer block is a unit, then the root | none: the root alone |
    # size: every module holding >= min_num_params not yet wrapped (FSDP1 size_based_auto_wrap_policy) |
    # experts: each expert of an MoE layer, then each block, then the root (a custom policy)
    policy: str = "block"
    min_num_params: int = 100_000_000


@dataclass
class ParallelConfig:
    """Model parallelism beside data parallelism."""

    tp: int = 1  # tensor-parallel degree (FSDP2 only): a 2-D mesh (dp, tp)
    sequence_parallel: bool = False  # shard norms and activations between TP regions over the sequence


@dataclass
class ActivationCheckpointConfig:
    mode: str = "none"  # none | full | selective
    every: int = 1  # selective: checkpoint every k-th block (layer-level selective AC)
    ops: str = "none"  # selective: none | matmul_save (op-level: save matmul outputs, recompute the rest)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    lr_warmup_steps: int = 2  # linear warm-up of the learning rate
    schedule: str = "cosine"  # cosine | constant (after warm-up)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step


@dataclass
class DataConfig:
    """Where tokens come from (fsdp_exp/data/). Real data is tokenized and packed once, before any rank starts."""

    name: str = "synthetic"  # synthetic (seeded random tokens) | text | json | parquet (data.files) | hf (data.dataset)
    files: list[str] = field(default_factory=list)  # local files or glob patterns; pkg://fsdp_exp/... = shipped
    val_files: list[str] = field(default_factory=list)  # validation text for trainer.eval_every (local kinds)
    dataset: Optional[str] = None  # hf: a hub dataset name or a local dataset folder
    dataset_config: Optional[str] = None  # hf: the dataset's configuration (subset) name
    split: str = "train"  # hf: the training split
    val_split: Optional[str] = None  # hf: the validation split
    revision: Optional[str] = None  # hf: a branch, tag or commit of the dataset
    streaming: bool = False  # read through datasets' streaming mode (never holds the corpus in memory)
    text_field: str = "text"  # json / parquet / hf: the column that holds the text
    sample_by: str = "paragraph"  # text: one document per line | paragraph (blank-line separated) | document (file)
    tokenizer: str = "byte"  # byte (UTF-8 bytes, id 0 ends a document) | tokenizer.json path or folder | hub name
    eos_token: Optional[str] = None  # HF tokenizers: the end-of-document token; None = the first usual one found
    max_blocks: Optional[int] = None  # pack at most this many training blocks (a prefix of a huge corpus)
    cache_dir: str = "~/.cache/fsdp_exp/data"  # packed blocks (and datasets' copies of local files)
    shuffle: bool = True  # a new permutation of the blocks every epoch, by (seed, epoch)
    seed: Optional[int] = None  # None = trainer.seed
    num_workers: int = 0  # DataLoader worker processes per rank; 0 = load in the training loop
    prefetch_factor: int = 2  # micro-batches each worker keeps ready
    val_batches: int = 4  # global batches of validation data per evaluation


@dataclass
class TrainerConfig:
    steps: int = 10
    warmup_steps: int = 2  # first steps left out of the summary's medians (compile, caches, allocator)
    nproc_per_node: str = "auto"  # "auto" = number of CUDA GPUs, or 2 CPU ranks without CUDA
    nnodes: int = 1
    seed: int = 0
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: Optional[int] = None  # sequences per rank per forward; None = no accumulation
    seq_len: int = 128
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    log_every: int = 1
    device: str = "auto"  # auto | cpu | cuda
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None = look the device up
    threads_per_rank: Optional[int] = None  # CPU threads per rank; None = cores / local ranks
    eval_every: int = 0  # steps between evaluations on the validation data (val/loss); 0 = never
    # Memory breakdown of one step by torch's memory tracker (slow: sampled inside the warm-up).
    # Not for sharding.backend=fsdp1: torch's MemTracker cannot hook FSDP1's flat-parameter views.
    track_memory: bool = True
    track_memory_step: Optional[int] = None  # 0-based; None = the last warm-up step
    # Steps (0-based) to run under torch.profiler: a chrome trace per rank in <run dir>/traces and the
    # step's communication times (comm/*). Profiling slows the step: profiled steps stay out of the summary.
    profile_steps: list[int] = field(default_factory=list)
    # CUDA: record the allocator's history during the memory-sampled step (track_memory_step, else the last
    # warm-up step) and dump a snapshot per rank to <run dir>/memory/ (open it in pytorch.org/memory_viz).
    memory_snapshot: bool = False
    digest_shards: bool = True  # hash every rank's parameter shards at the end (replicas must agree)


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "fsdp_exp"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None  # None = built from the command-line overrides
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # progress bar on rank 0
    summary_table: bool = True


@dataclass
class DebugConfig:
    """Fault injection, to test that a failing rank ends the job fast and is named; and diagnostics."""

    fail_at_step: Optional[int] = None
    fail_rank: int = 0
    # How rank fail_rank fails: None = raise InjectedFailure; a signal name (SIGKILL, SIGTERM, ...) = the
    # rank sends itself that signal.
    fail_signal: Optional[str] = None
    # step = at the start of step fail_at_step (0-based) | save = inside the save of checkpoint step_<fail_at_step>,
    # after its shard files are written and before the checkpoint is complete.
    fail_during: str = "step"
    nan_at_step: Optional[int] = None  # rank fail_rank's parameters become NaN at the start of this step (0-based)
    # At start, hash every rank's initial parameter shards: replicas must agree and each shard must be the
    # slice of the seeded full tensor; a mismatch names the ranks and tensors.
    check_identical_init: bool = False


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (fsdp_exp/checkpoint.py): when to save, where, how many to keep, how to resume.

    A checkpoint is ``<dir>/step_<N>/`` (torch.distributed.checkpoint shards, each rank's RNG state,
    the trainer state and ``fsdp_exp_checkpoint.json``), written as ``step_<N>.tmp`` and renamed when
    every rank has finished: a folder named ``step_<N>`` is always complete.
    """

    dir: Optional[str] = None  # None = <run dir>/checkpoints
    every: int = 0  # save every N steps and after the last step; 0 = no periodic checkpoints
    keep: int = 2  # the newest K complete checkpoints are kept, older ones deleted; 0 = keep all
    # auto = continue from the newest complete checkpoint in dir, if there is one | none = start at step 0 |
    # a path to a step_<N> folder (or a checkpoint dir: its newest)
    resume: str = "auto"
    async_save: bool = False  # write in a background thread while training continues
    # On one of these signals every rank saves a checkpoint at the same step and exits cleanly (status
    # "interrupted"), so a requeued job resumes; the local launcher forwards them to its ranks.
    on_signal: bool = True
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    nan_check: bool = True  # stop with an error on a NaN/inf loss; the last good checkpoint stays
    export: str = "none"  # none | safetensors | hf: the final model, consolidated on rank 0
    export_dir: Optional[str] = None  # None = <run dir>/export


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ac: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: bool = False  # torch.compile each transformer block (before sharding)


def run_stamp() -> str:
    """The name of a run's default folder (``${run_stamp:}`` in conf/config.yaml): the time, or, when an
    outside launcher started this process as one rank, an id every rank of the job shares. Each rank
    composes its own config, at its own second: time stamps would give one folder per rank (and per
    node), with the record in rank 0's and another rank's error file elsewhere."""
    import datetime
    import os

    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") and "RANK" in env:  # torchrun: its --rdzv-id (standalone: one uuid)
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if env.get("SLURM_JOB_ID") and (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")) \
            and int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1) > 1:
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID') or env.get('SLURM_STEPID')}"
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def register_configs() -> None:
    """Register the primary schema (``conf/config.yaml`` lists it first in its defaults) and the
    ``run_stamp`` resolver its run folder uses."""
    ConfigStore.instance().store(name="schema", node=RunConfig)
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)  # one value per process


register_configs()


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the override that fixes it."""


@dataclass(frozen=True)
class Topology:
    """What the run looks like once ``auto`` values are resolved against the hardware."""

    device_type: str  # "cpu" | "cuda"
    nproc_per_node: int
    nnodes: int
    world_size: int
    dp_size: int  # data-parallel ranks: world / tp_size
    tp_size: int  # tensor-parallel ranks per data-parallel rank
    mesh_shape: tuple[int, ...]  # (shard,) or (replicate, shard), with a trailing tp dim when tp > 1
    mesh_dim_names: tuple[str, ...]
    micro_batch_size: int
    grad_accum_steps: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Turn a composed (or plain, as handed to workers) config into typed dataclasses."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))


def fail(problem: str, fix: str) -> None:
    """Refuse a configuration: what is wrong, then the override that fixes it (every validator uses this)."""
    raise ConfigError(f"{problem}\n  fix: {fix}")


def resolve_nproc(value: str, cuda_devices: int) -> int:
    if value == "auto":
        return cuda_devices if cuda_devices > 0 else 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        fail(f"trainer.nproc_per_node={value!r} is neither 'auto' nor a positive whole number.",
              "pass trainer.nproc_per_node=auto or e.g. trainer.nproc_per_node=2")
    return n


def validate(cfg: RunConfig, *, cuda_devices: int, world_size: Optional[int] = None) -> Topology:
    """Check everything that spans groups; return the resolved topology.

    ``world_size`` is given when ranks come from outside (torchrun, SLURM); otherwise it follows
    from ``trainer.nproc_per_node`` x ``trainer.nnodes``.
    """
    t, s, p = cfg.trainer, cfg.sharding, cfg.precision

    if t.device not in ("auto", "cpu", "cuda"):
        fail(f"trainer.device={t.device!r} is not one of auto, cpu, cuda.", "pass trainer.device=auto")
    device_type = "cuda" if (t.device == "cuda" or (t.device == "auto" and cuda_devices > 0)) else "cpu"
    if device_type == "cuda" and cuda_devices == 0:
        fail("trainer.device=cuda but this machine has no CUDA device.", "pass trainer.device=cpu (or auto)")

    nproc = resolve_nproc(t.nproc_per_node, cuda_devices if device_type == "cuda" else 0)
    if t.nnodes < 1:
        fail(f"trainer.nnodes={t.nnodes} must be at least 1.", "pass trainer.nnodes=1")
    world = world_size if world_size is not None else nproc * t.nnodes
    if device_type == "cuda" and nproc > cuda_devices:
        fail(f"trainer.nproc_per_node={nproc} asks for more ranks than the {cuda_devices} GPUs here.",
              f"pass trainer.nproc_per_node={cuda_devices} (or auto)")

    for name, value in (("trainer.steps", t.steps), ("trainer.seq_len", t.seq_len),
                        ("trainer.global_batch_size", t.global_batch_size), ("trainer.log_every", t.log_every)):
        if value < 1:
            fail(f"{name}={value} must be at least 1.", f"pass a positive {name}")
    if not 0 <= t.warmup_steps < t.steps:
        fail(f"trainer.warmup_steps={t.warmup_steps} leaves no step for the summary of {t.steps} steps.",
              f"pass trainer.warmup_steps={max(0, t.steps // 5)} or raise trainer.steps")
    if t.seq_len > cfg.model.max_seq_len:
        fail(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.",
              f"pass trainer.seq_len={cfg.model.max_seq_len} or model.max_seq_len={t.seq_len}")
    if t.track_memory and t.track_memory_step is not None and not 0 <= t.track_memory_step < t.warmup_steps:
        fail(f"trainer.track_memory_step={t.track_memory_step} is not a warm-up step (0 to "
              f"{t.warmup_steps - 1}); the tracked step is slow and must stay out of the summary.",
              f"pass trainer.warmup_steps={t.track_memory_step + 1} or more, or trainer.track_memory_step=null")
    # The memory-sampled step (the trainer's): the tracked one, else the CUDA snapshot's (last warm-up step).
    sampled = (t.track_memory_step if t.track_memory_step is not None else t.warmup_steps - 1) \
        if t.track_memory and t.warmup_steps > 0 and s.backend != "fsdp1" else \
        (t.warmup_steps - 1 if t.memory_snapshot else None)
    for step in t.profile_steps:
        if not 0 <= step < t.steps:
            fail(f"trainer.profile_steps has {step}, not a step of this run (0 to {t.steps - 1}).",
                  f"pass trainer.profile_steps=[{min(t.warmup_steps, t.steps - 1)}]")
        if step == sampled:
            fail(f"trainer.profile_steps has {step}, the memory-sampled step: the memory tracker's per-op "
                  "instrumentation (or the allocator's history) would be in the trace and in its times.",
                  f"pass trainer.profile_steps=[{t.warmup_steps if t.warmup_steps < t.steps else step}] "
                  "or trainer.track_memory_step=<another warm-up step>")
    if t.memory_snapshot and device_type != "cuda":
        fail("trainer.memory_snapshot=true records the CUDA allocator's history; this run is on the CPU.",
              "pass trainer.memory_snapshot=false (the CPU breakdown is mem/tracked_*)")
    if t.memory_snapshot and t.warmup_steps == 0:
        fail("trainer.memory_snapshot=true samples a warm-up step; trainer.warmup_steps=0 has none.",
              "pass trainer.warmup_steps=2")
    if t.grad_clip < 0:
        fail(f"trainer.grad_clip={t.grad_clip} is negative.", "pass trainer.grad_clip=1.0 (0 disables clipping)")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        fail(f"trainer.peak_tflops={t.peak_tflops} must be positive.", "pass trainer.peak_tflops=null to look it up")

    _validate_model(cfg.model)
    _validate_optim(cfg.optim, t.steps)

    mesh_shape, mesh_names, dp = _validate_parallel(cfg, world, nproc, device_type)
    _validate_backend_knobs(cfg, device_type)

    # Batch over data-parallel ranks.
    if t.global_batch_size % dp:
        fail(f"trainer.global_batch_size={t.global_batch_size} does not divide over {dp} data-parallel ranks.",
              f"pass trainer.global_batch_size={dp * max(1, math.ceil(t.global_batch_size / dp))} "
              f"(a multiple of {dp}) or change trainer.nproc_per_node")
    per_rank = t.global_batch_size // dp
    micro = t.micro_batch_size if t.micro_batch_size is not None else per_rank
    if micro < 1 or per_rank % micro:
        fail(f"trainer.micro_batch_size={micro} does not divide the {per_rank} sequences each of {dp} ranks "
              f"gets from trainer.global_batch_size={t.global_batch_size}.",
              f"pass trainer.micro_batch_size={_largest_divisor_at_most(per_rank, max(micro, 1))} "
              "(a divisor of the per-rank batch) or null")

    # Precision.
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(p, name) not in DTYPES:
            fail(f"precision.{name}={getattr(p, name)!r} is not one of {', '.join(DTYPES)}.",
                  f"pass precision.{name}=bf16 (or a precision=fp32|bf16|bf16_pure|fp16 preset)")
    for name in ("output_dtype", "buffer_dtype"):
        if getattr(p, name) is not None and getattr(p, name) not in DTYPES:
            fail(f"precision.{name}={getattr(p, name)!r} is not one of {', '.join(DTYPES)}.",
                  f"pass precision.{name}=null or fp32")
    if p.loss_scaler not in ("none", "dynamic"):
        fail(f"precision.loss_scaler={p.loss_scaler!r} is not one of none, dynamic.",
              "pass precision.loss_scaler=dynamic")
    if "fp16" in (p.param_dtype, p.reduce_dtype) and p.loss_scaler != "dynamic":
        fail("fp16 gradients underflow without loss scaling, and precision.loss_scaler=none.",
              "pass precision.loss_scaler=dynamic (or use precision=fp16, which sets it)")

    # Offload.
    if cfg.offload.pin_memory and device_type == "cpu":
        fail("offload.pin_memory=true needs a CUDA device; CPU-only torch cannot pin host memory.",
              "pass offload.pin_memory=null (auto) or false")
    if cfg.offload.pin_memory is not None and not cfg.offload.params:
        fail("offload.pin_memory is set but offload.params=false, so nothing is offloaded.",
              "pass offload=params, or drop offload.pin_memory")

    if cfg.logger.wandb.mode not in ("online", "offline", "disabled"):
        fail(f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of online, offline, disabled.",
              "pass logger.wandb.mode=offline")
    _validate_data(cfg)
    if (cfg.debug.fail_at_step is not None or cfg.debug.nan_at_step is not None) \
            and not 0 <= cfg.debug.fail_rank < world:
        fail(f"debug.fail_rank={cfg.debug.fail_rank} is not a rank of a world of {world}.",
              f"pass debug.fail_rank between 0 and {world - 1}")
    _validate_checkpoint(cfg)

    return Topology(device_type=device_type, nproc_per_node=nproc, nnodes=t.nnodes, world_size=world,
                    dp_size=dp, tp_size=cfg.parallel.tp, mesh_shape=mesh_shape, mesh_dim_names=mesh_names,
                    micro_batch_size=micro, grad_accum_steps=per_rank // micro)


BACKENDS = ("fsdp2", "fsdp1", "ddp")
STRATEGIES = ("full", "grad_op", "hybrid", "no_shard")


def _validate_parallel(cfg: RunConfig, world: int, nproc: int, device_type: str):
    """The device mesh: data-parallel dims from the strategy, then a tp dim. Returns (shape, names, dp)."""
    s, tp = cfg.sharding, cfg.parallel.tp
    if s.backend not in BACKENDS:
        fail(f"sharding.backend={s.backend!r} is not one of {', '.join(BACKENDS)}.",
              "pass sharding.backend=fsdp2 (or a preset: sharding=full|grad_op|hybrid|no_shard|ddp)")
    if s.strategy not in STRATEGIES:
        fail(f"sharding.strategy={s.strategy!r} is not one of {', '.join(STRATEGIES)}.",
              "pick one with sharding=full|grad_op|hybrid|no_shard")
    if s.backend == "ddp" and s.strategy != "no_shard":
        fail(f"DDP replicates the model; it cannot do sharding.strategy={s.strategy}.",
              "pass sharding=ddp alone, or sharding.backend=fsdp2 for a sharded strategy")
    if tp < 1 or world % tp:
        fail(f"parallel.tp={tp} does not divide the world size {world}.",
              f"pass parallel.tp={_largest_divisor_at_most(world, max(tp, 1))} (a divisor of {world})")
    if tp > 1:
        _validate_tp(cfg, tp)
    dp = world // tp
    if s.strategy == "hybrid":
        local_dp = max(1, min(nproc // tp, dp)) if nproc >= tp else 1
        shard = s.shard_size if s.shard_size is not None else (
            dp // s.replicate_size if s.replicate_size else local_dp)
        replicate = s.replicate_size if s.replicate_size is not None else max(1, dp // max(shard, 1))
        if shard < 1 or replicate < 1 or replicate * shard != dp:
            good = _largest_divisor_at_most(dp, local_dp)
            fail(f"sharding=hybrid needs replicate_size x shard_size = {dp} data-parallel ranks, "
                  f"got {replicate} x {shard}.",
                  f"pass sharding.shard_size and sharding.replicate_size whose product is {dp}, "
                  f"e.g. sharding.replicate_size={dp // good} sharding.shard_size={good}")
        shape, names = (replicate, shard), ("replicate", "shard")
    elif s.strategy == "no_shard":
        shape, names = ((dp,), ("replicate",)) if s.backend == "ddp" else ((dp, 1), ("replicate", "shard"))
    else:
        if s.replicate_size is not None or s.shard_size is not None:
            fail(f"sharding.replicate_size/shard_size only apply to sharding=hybrid, not {s.strategy}.",
                  "drop them, or pass sharding=hybrid")
        shape, names = (dp,), ("shard",)
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    return shape, names, dp


def _validate_tp(cfg: RunConfig, tp: int) -> None:
    from fsdp_exp.models.llama import ffn_hidden_dim

    m = cfg.model
    if cfg.sharding.backend != "fsdp2":
        fail(f"parallel.tp={tp} composes with FSDP2 only, not sharding.backend={cfg.sharding.backend}.",
              "pass sharding.backend=fsdp2 (or parallel.tp=1)")
    for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads or m.n_heads),
                        ("the SwiGLU width", ffn_hidden_dim(m))):
        if value % tp:
            fail(f"parallel.tp={tp} does not divide {name} ({value}).", "pick parallel.tp that divides it")
    if cfg.parallel.sequence_parallel and cfg.trainer.seq_len % tp:
        fail(f"parallel.sequence_parallel shards the sequence, but trainer.seq_len={cfg.trainer.seq_len} "
              f"does not divide by parallel.tp={tp}.", f"pass a trainer.seq_len that is a multiple of {tp}")


def _validate_backend_knobs(cfg: RunConfig, device_type: str) -> None:
    """Every knob either reaches the chosen backend's API or is refused here, naming the equivalent."""
    s, p, pf, w = cfg.sharding, cfg.precision, cfg.prefetch, cfg.wrap
    b = s.backend
    if pf.forward < 0:
        fail(f"prefetch.forward={pf.forward} is negative.", "pass prefetch.forward=0 (none) or more")
    if pf.backward is not None and pf.backward < 0:
        fail(f"prefetch.backward={pf.backward} is negative.", "pass prefetch.backward=0 or more, or null")
    if pf.backward_timing not in ("pre", "post"):
        fail(f"prefetch.backward_timing={pf.backward_timing!r} is not one of pre, post.",
              "pass prefetch.backward_timing=pre")
    if w.policy not in ("block", "none", "size", "experts"):
        fail(f"wrap.policy={w.policy!r} is not one of block, none, size, experts.", "pass wrap=block")
    if w.policy == "experts" and cfg.model.n_experts < 1:
        fail("wrap=experts wraps the experts of an MoE model, but this model has none.",
              "pass model=moe_tiny, or wrap=block")
    if w.min_num_params < 1:
        fail(f"wrap.min_num_params={w.min_num_params} must be positive.", "pass wrap.min_num_params=100000")
    ac = cfg.ac
    if ac.mode not in ("none", "full", "selective") or ac.every < 1 or ac.ops not in ("none", "matmul_save"):
        fail(f"ac.mode={ac.mode!r} ac.every={ac.every} ac.ops={ac.ops!r} is not a valid activation checkpointing "
              "setting.", "pick a preset: ac=none|full|selective|selective_op")
    if ac.ops != "none" and ac.mode != "selective":
        fail(f"ac.ops={ac.ops} is op-level selective checkpointing and needs ac.mode=selective.",
              "pass ac=selective_op")
    rs = s.reshard_after_forward.lower()
    if rs not in ("auto", "true", "false") and not (rs.isdigit() and int(rs) >= 1):
        fail(f"sharding.reshard_after_forward={s.reshard_after_forward!r} is not auto, true, false or a "
              "positive whole number.", "pass sharding.reshard_after_forward=auto")

    def refuse(knob: str, why: str, fix: str) -> None:
        fail(f"{knob} cannot be honoured by sharding.backend={b}: {why}", fix)

    if b == "fsdp2":
        if pf.backward == 0:
            refuse("prefetch.backward=0", "FSDP2 always prefetches at least one unit in backward (an empty "
                   "prefetch list means its implicit one).",
                   "pass prefetch.backward=null (FSDP2's implicit one unit) or a depth of 1 or more")
        if pf.backward_timing != "pre":
            refuse("prefetch.backward_timing=post", "FSDP2 issues backward prefetch before a unit's gradient "
                   "computation only (FSDP1's BACKWARD_PRE).", "drop it, or pass sharding.backend=fsdp1")
        if pf.limit_all_gathers is not None:
            refuse("prefetch.limit_all_gathers", "FSDP2 always bounds in-flight all-gathers by its own stream "
                   "synchronization; there is no switch.", "drop it; tune prefetch.forward / prefetch.backward")
        for knob in ("use_orig_params", "sync_module_states"):
            if getattr(s, knob) is not None:
                refuse(f"sharding.{knob}", "FSDP2 always keeps the original parameters (as DTensors) and fsdp_exp "
                       "initializes every shard identically by seed.", f"drop sharding.{knob}")
        if p.buffer_dtype is not None:
            refuse("precision.buffer_dtype", "FSDP2's MixedPrecisionPolicy has no buffer dtype (buffers keep "
                   "their dtype).", "drop precision.buffer_dtype")
        if rs.isdigit() and cfg.sharding.strategy in ("no_shard",):
            refuse("an integer sharding.reshard_after_forward", "no_shard has nothing to reshard.",
                   "pass sharding.reshard_after_forward=auto")
    else:
        if rs != "auto":
            refuse(f"sharding.reshard_after_forward={s.reshard_after_forward}",
                   "FSDP1 and DDP take resharding from the strategy (FULL_SHARD reshards, SHARD_GRAD_OP keeps).",
                   "pass sharding=full or sharding=grad_op, or sharding.backend=fsdp2")
        if s.reshard_last_block is not None:
            refuse("sharding.reshard_last_block", "only FSDP2 sets resharding per unit.",
                   "drop it, or pass sharding.backend=fsdp2")
        if p.output_dtype is not None:
            refuse("precision.output_dtype", "only FSDP2's MixedPrecisionPolicy casts the outputs.",
                   "drop precision.output_dtype")
    if b == "fsdp1":
        if pf.forward > 1 or (pf.backward or 0) > 1:
            refuse(f"prefetch depth forward={pf.forward} backward={pf.backward}",
                   "FSDP1 prefetches exactly one unit (forward_prefetch, backward_prefetch).",
                   "pass prefetch.forward and prefetch.backward of 0 or 1, or sharding.backend=fsdp2")
        if device_type == "cpu" and s.sync_module_states:
            refuse("sharding.sync_module_states=true on CPU", "torch's FSDP1 refuses to broadcast CPU "
                   "parameters.", "drop it (fsdp_exp initializes every rank identically) or run on CUDA")
        if device_type == "cpu" and cfg.offload.params:
            refuse("offload=params on CPU-only torch", "FSDP1's CPUOffload pins host memory, which needs CUDA.",
                   "pass offload=none, or sharding.backend=fsdp2 (its CPUOffloadPolicy runs unpinned)")
        if s.use_orig_params is False and cfg.optim.weight_decay > 0:
            refuse("sharding.use_orig_params=false with weight decay", "flat parameters mix matrices and norm "
                   "weights, so weight decay could not skip the norms.",
                   "pass optim.weight_decay=0, or drop sharding.use_orig_params=false")
        if cfg.compile and s.use_orig_params is False:
            refuse("compile=true with sharding.use_orig_params=false", "torch.compile needs the original "
                   "parameters.", "drop sharding.use_orig_params=false")
    if b == "ddp":
        if pf != PrefetchConfig():
            refuse("a prefetch setting", "DDP has no all-gathers to prefetch.",
                   "leave the prefetch group at its default (drop prefetch=...)")
        if w != WrapConfig():
            refuse(f"wrap={w.policy}", "DDP has no wrapped units (it buckets gradients).",
                   "leave the wrap group at its default (drop wrap=...)")
        if cfg.offload.params:
            refuse("offload=params", "DDP keeps full replicas on the device.",
                   "pass sharding=no_shard (FSDP2 replication with offload) or offload=none")
        if p.reduce_dtype == "bf16" and device_type == "cpu":
            refuse("precision.reduce_dtype=bf16 on CPU", "torch's bf16 gradient-compression hook for DDP needs "
                   "NCCL (CUDA) or XCCL.", "pass precision.reduce_dtype=fp32 (e.g. precision=bf16)")
        if p.param_dtype != p.reduce_dtype and p.reduce_dtype != "fp32":
            refuse(f"precision.reduce_dtype={p.reduce_dtype} with param_dtype={p.param_dtype}",
                   "DDP compresses gradients to the reduce dtype with a communication hook; only fp32 or "
                   "the compute dtype are offered.", "pass precision.reduce_dtype=fp32")
        if p.buffer_dtype is not None or not p.cast_forward_inputs:
            refuse("precision.buffer_dtype / cast_forward_inputs", "DDP runs mixed precision by autocast.",
                   "drop them")


def _validate_checkpoint(cfg: RunConfig) -> None:
    """The checkpoint group and the fault-injection knobs that exercise it."""
    import signal

    c, d = cfg.checkpoint, cfg.debug
    if c.every < 0:
        fail(f"checkpoint.every={c.every} is negative.", "pass checkpoint.every=0 (no periodic saves) or a step interval")
    if c.keep < 0:
        fail(f"checkpoint.keep={c.keep} is negative.", "pass checkpoint.keep=2 (or 0 to keep every checkpoint)")
    if not c.resume:
        fail("checkpoint.resume is empty.", "pass checkpoint.resume=auto, none, or a path to a step_<N> folder")
    if c.export not in ("none", "safetensors", "hf"):
        fail(f"checkpoint.export={c.export!r} is not one of none, safetensors, hf.", "pass checkpoint.export=safetensors")
    if c.export == "hf" and cfg.model.n_experts > 0:
        fail("checkpoint.export=hf writes a LlamaForCausalLM, and this model is a mixture of experts.",
              "pass checkpoint.export=safetensors (fsdp_exp's own parameter names)")
    if c.export == "hf" and cfg.model.name != "llama":
        fail(f"checkpoint.export=hf knows the Llama layout only, not model.name={cfg.model.name}.",
              "pass checkpoint.export=safetensors")
    for name in c.signals:
        if not name.startswith("SIG") or not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
            fail(f"checkpoint.signals holds {name!r}, which is not a signal a process can catch.",
                  "pass checkpoint.signals=[SIGTERM,SIGUSR1]")
    if d.fail_signal is not None and (not d.fail_signal.startswith("SIG") or not hasattr(signal, d.fail_signal)):
        fail(f"debug.fail_signal={d.fail_signal!r} is not a signal name.", "pass debug.fail_signal=SIGKILL (or null)")
    if d.fail_during not in ("step", "save"):
        fail(f"debug.fail_during={d.fail_during!r} is not one of step, save.", "pass debug.fail_during=step")
    if d.fail_during == "save":
        if d.fail_at_step is None or c.every < 1 or d.fail_at_step % c.every or d.fail_at_step < 1:
            fail(f"debug.fail_during=save fails inside the save of checkpoint step_<debug.fail_at_step>, but "
                  f"checkpoint.every={c.every} never saves step {d.fail_at_step}.",
                  "pass checkpoint.every=N and debug.fail_at_step=<a positive multiple of N>")


def _validate_model(m: ModelConfig) -> None:
    from fsdp_exp.models import REGISTRY

    if m.name not in REGISTRY:
        fail(f"model.name={m.name!r} is not a known architecture ({', '.join(sorted(REGISTRY))}).",
              "pick a preset with model=llama_tiny|llama7b|... or pass model.name=llama")
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
        if getattr(m, name) < 1:
            fail(f"model.{name}={getattr(m, name)} must be positive.", f"pass a positive model.{name}")
    if m.dim % m.n_heads:
        fail(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}.",
              "pick model.n_heads that divides model.dim")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        fail(f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads} (grouped-query attention).",
              "pick model.n_kv_heads that divides model.n_heads, or null")
    if (m.dim // m.n_heads) % 2:
        fail(f"head dimension model.dim/model.n_heads={m.dim // m.n_heads} is odd; rotary embeddings need it even.",
              "change model.dim or model.n_heads")


def _validate_data(cfg: RunConfig) -> None:
    """Source, files (missing, empty), tokenizer vs. model.vocab_size: see fsdp_exp.data.check_config."""
    from fsdp_exp.data import check_config

    check_config(cfg)


def _validate_optim(o: OptimConfig, steps: int) -> None:
    if o.name != "adamw":
        fail(f"optim.name={o.name!r} is not available.", "pass optim=adamw")
    if not o.lr > 0:
        fail(f"optim.lr={o.lr} must be positive.", "pass a positive learning rate, e.g. optim.lr=3e-4")
    if o.weight_decay < 0:
        fail(f"optim.weight_decay={o.weight_decay} is negative.", "pass optim.weight_decay=0.1 (or 0)")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail(f"optim.betas={list(o.betas)} must be two numbers in [0, 1).", "pass optim.betas=[0.9,0.95]")
    if o.lr_warmup_steps < 0:
        fail(f"optim.lr_warmup_steps={o.lr_warmup_steps} is negative.", "pass optim.lr_warmup_steps=0 or more")
    if o.schedule not in ("cosine", "constant"):
        fail(f"optim.schedule={o.schedule!r} is not one of cosine, constant.", "pass optim.schedule=cosine")
    if not 0 <= o.min_lr_ratio <= 1:
        fail(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].", "pass optim.min_lr_ratio=0.1")


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)


def plain(cfg: Any) -> dict:
    """A JSON-ready dict of a RunConfig (what workers, run.json and W&B receive)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
