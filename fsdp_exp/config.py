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


@dataclass
class ShardingConfig:
    """How parameters, gradients and optimizer state are spread over data-parallel ranks.

    ``strategy`` speaks the user's vocabulary; ``fsdp_exp.parallel`` translates it per backend
    (see docs/vocabulary.md). ``replicate_size`` x ``shard_size`` is the 2-D mesh of ``hybrid``.
    """

    backend: str = "fsdp2"
    strategy: str = "full"  # full | grad_op | hybrid | no_shard
    replicate_size: Optional[int] = None  # hybrid: None = world / shard_size
    shard_size: Optional[int] = None  # hybrid: None = trainer.nproc_per_node (shard within a node)


@dataclass
class PrecisionConfig:
    param_dtype: str = "fp32"  # dtype of the unsharded parameters used in forward/backward
    reduce_dtype: str = "fp32"  # dtype of gradient reduce-scatter / all-reduce
    output_dtype: Optional[str] = None  # dtype the root module's outputs are cast to (None = leave)
    loss_scaler: str = "none"  # none | dynamic (fp16 needs dynamic)


@dataclass
class OffloadConfig:
    params: bool = False  # keep sharded params, grads and optimizer state on the host
    pin_memory: Optional[bool] = None  # None = pin when CUDA is used (CPU-only torch cannot pin)


@dataclass
class PrefetchConfig:
    """Explicit FSDP2 prefetch depth, in wrapped blocks.

    ``forward=0`` prefetches nothing ahead in forward (FSDP2's own default). ``backward=None`` leaves
    FSDP2's implicit one-block backward prefetch; FSDP2 has no way to switch it off, so 0 is refused.
    """

    forward: int = 1
    backward: Optional[int] = 1


@dataclass
class WrapConfig:
    policy: str = "block"  # block: each transformer block is an FSDP unit, then the root | none: root only


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
    name: str = "synthetic"  # synthetic: seeded uniform random tokens


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
    """Fault injection, to test that a failing rank ends the job fast and is named."""

    fail_at_step: Optional[int] = None
    fail_rank: int = 0


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    """Register the primary schema; ``conf/config.yaml`` lists it first in its defaults."""
    ConfigStore.instance().store(name="schema", node=RunConfig)


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
    dp_size: int  # data-parallel ranks (all ranks until tensor parallel arrives)
    mesh_shape: tuple[int, ...]  # the data-parallel mesh: (shard,) or (replicate, shard)
    mesh_dim_names: tuple[str, ...]
    micro_batch_size: int
    grad_accum_steps: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Turn a composed (or plain, as handed to workers) config into typed dataclasses."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))


def _fail(problem: str, fix: str) -> None:
    raise ConfigError(f"{problem}\n  fix: {fix}")


def resolve_nproc(value: str, cuda_devices: int) -> int:
    if value == "auto":
        return cuda_devices if cuda_devices > 0 else 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        _fail(f"trainer.nproc_per_node={value!r} is neither 'auto' nor a positive whole number.",
              "pass trainer.nproc_per_node=auto or e.g. trainer.nproc_per_node=2")
    return n


def validate(cfg: RunConfig, *, cuda_devices: int, world_size: Optional[int] = None) -> Topology:
    """Check everything that spans groups; return the resolved topology.

    ``world_size`` is given when ranks come from outside (torchrun, SLURM); otherwise it follows
    from ``trainer.nproc_per_node`` x ``trainer.nnodes``.
    """
    t, s, p = cfg.trainer, cfg.sharding, cfg.precision

    if t.device not in ("auto", "cpu", "cuda"):
        _fail(f"trainer.device={t.device!r} is not one of auto, cpu, cuda.", "pass trainer.device=auto")
    device_type = "cuda" if (t.device == "cuda" or (t.device == "auto" and cuda_devices > 0)) else "cpu"
    if device_type == "cuda" and cuda_devices == 0:
        _fail("trainer.device=cuda but this machine has no CUDA device.", "pass trainer.device=cpu (or auto)")

    nproc = resolve_nproc(t.nproc_per_node, cuda_devices if device_type == "cuda" else 0)
    if t.nnodes < 1:
        _fail(f"trainer.nnodes={t.nnodes} must be at least 1.", "pass trainer.nnodes=1")
    world = world_size if world_size is not None else nproc * t.nnodes
    if device_type == "cuda" and nproc > cuda_devices:
        _fail(f"trainer.nproc_per_node={nproc} asks for more ranks than the {cuda_devices} GPUs here.",
              f"pass trainer.nproc_per_node={cuda_devices} (or auto)")

    for name, value in (("trainer.steps", t.steps), ("trainer.seq_len", t.seq_len),
                        ("trainer.global_batch_size", t.global_batch_size), ("trainer.log_every", t.log_every)):
        if value < 1:
            _fail(f"{name}={value} must be at least 1.", f"pass a positive {name}")
    if not 0 <= t.warmup_steps < t.steps:
        _fail(f"trainer.warmup_steps={t.warmup_steps} leaves no step for the summary of {t.steps} steps.",
              f"pass trainer.warmup_steps={max(0, t.steps // 5)} or raise trainer.steps")
    if t.seq_len > cfg.model.max_seq_len:
        _fail(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.",
              f"pass trainer.seq_len={cfg.model.max_seq_len} or model.max_seq_len={t.seq_len}")
    if t.grad_clip < 0:
        _fail(f"trainer.grad_clip={t.grad_clip} is negative.", "pass trainer.grad_clip=1.0 (0 disables clipping)")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        _fail(f"trainer.peak_tflops={t.peak_tflops} must be positive.", "pass trainer.peak_tflops=null to look it up")

    _validate_model(cfg.model)
    _validate_optim(cfg.optim, t.steps)

    # Sharding and its mesh.
    if s.backend != "fsdp2":
        _fail(f"sharding.backend={s.backend!r} is not available; this version implements fsdp2.",
              "pass sharding.backend=fsdp2")
    if s.strategy not in ("full", "grad_op", "hybrid", "no_shard"):
        _fail(f"sharding.strategy={s.strategy!r} is not one of full, grad_op, hybrid, no_shard.",
              "pick one with sharding=full|grad_op|hybrid|no_shard")
    if s.strategy == "hybrid":
        shard = s.shard_size if s.shard_size is not None else (
            world // s.replicate_size if s.replicate_size else min(nproc, world))
        replicate = s.replicate_size if s.replicate_size is not None else max(1, world // max(shard, 1))
        if shard < 1 or replicate < 1 or replicate * shard != world:
            _fail(f"sharding=hybrid needs replicate_size x shard_size = world size {world}, "
                  f"got {replicate} x {shard}.",
                  f"pass sharding.shard_size and sharding.replicate_size whose product is {world}, "
                  f"e.g. sharding.replicate_size={world // _largest_divisor_at_most(world, nproc)} "
                  f"sharding.shard_size={_largest_divisor_at_most(world, nproc)}")
        mesh_shape, mesh_names = (replicate, shard), ("replicate", "shard")
    elif s.strategy == "no_shard":
        mesh_shape, mesh_names = (world, 1), ("replicate", "shard")
    else:
        if s.replicate_size is not None or s.shard_size is not None:
            _fail(f"sharding.replicate_size/shard_size only apply to sharding=hybrid, not {s.strategy}.",
                  "drop them, or pass sharding=hybrid")
        mesh_shape, mesh_names = (world,), ("shard",)

    # Batch over ranks.
    dp = world
    if t.global_batch_size % dp:
        _fail(f"trainer.global_batch_size={t.global_batch_size} does not divide over {dp} data-parallel ranks.",
              f"pass trainer.global_batch_size={dp * max(1, math.ceil(t.global_batch_size / dp))} "
              f"(a multiple of {dp}) or change trainer.nproc_per_node")
    per_rank = t.global_batch_size // dp
    micro = t.micro_batch_size if t.micro_batch_size is not None else per_rank
    if micro < 1 or per_rank % micro:
        _fail(f"trainer.micro_batch_size={micro} does not divide the {per_rank} sequences each of {dp} ranks "
              f"gets from trainer.global_batch_size={t.global_batch_size}.",
              f"pass trainer.micro_batch_size={_largest_divisor_at_most(per_rank, max(micro, 1))} "
              "(a divisor of the per-rank batch) or null")

    # Precision.
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(p, name) not in DTYPES:
            _fail(f"precision.{name}={getattr(p, name)!r} is not one of {', '.join(DTYPES)}.",
                  f"pass precision.{name}=bf16 (or a precision=fp32|bf16|bf16_pure|fp16 preset)")
    if p.output_dtype is not None and p.output_dtype not in DTYPES:
        _fail(f"precision.output_dtype={p.output_dtype!r} is not one of {', '.join(DTYPES)}.",
              "pass precision.output_dtype=null or fp32")
    if p.loss_scaler not in ("none", "dynamic"):
        _fail(f"precision.loss_scaler={p.loss_scaler!r} is not one of none, dynamic.",
              "pass precision.loss_scaler=dynamic")
    if "fp16" in (p.param_dtype, p.reduce_dtype) and p.loss_scaler != "dynamic":
        _fail("fp16 gradients underflow without loss scaling, and precision.loss_scaler=none.",
              "pass precision.loss_scaler=dynamic (or use precision=fp16, which sets it)")

    # Offload.
    if cfg.offload.pin_memory and device_type == "cpu":
        _fail("offload.pin_memory=true needs a CUDA device; CPU-only torch cannot pin host memory.",
              "pass offload.pin_memory=null (auto) or false")
    if cfg.offload.pin_memory is not None and not cfg.offload.params:
        _fail("offload.pin_memory is set but offload.params=false, so nothing is offloaded.",
              "pass offload=params, or drop offload.pin_memory")

    # Prefetch and wrap.
    if cfg.prefetch.forward < 0:
        _fail(f"prefetch.forward={cfg.prefetch.forward} is negative.", "pass prefetch.forward=0 (none) or more")
    if cfg.prefetch.backward is not None and cfg.prefetch.backward < 1:
        _fail(f"prefetch.backward={cfg.prefetch.backward}: FSDP2 always prefetches at least one block in "
              "backward (an empty prefetch list means its implicit one).",
              "pass prefetch.backward=null (FSDP2's implicit one block) or a depth of 1 or more")
    if cfg.wrap.policy not in ("block", "none"):
        _fail(f"wrap.policy={cfg.wrap.policy!r} is not one of block, none.", "pass wrap=block or wrap=none")

    if cfg.logger.wandb.mode not in ("online", "offline", "disabled"):
        _fail(f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of online, offline, disabled.",
              "pass logger.wandb.mode=offline")
    if cfg.data.name != "synthetic":
        _fail(f"data={cfg.data.name!r} is not available; this version implements synthetic tokens.",
              "pass data=synthetic")
    if cfg.debug.fail_at_step is not None and not 0 <= cfg.debug.fail_rank < world:
        _fail(f"debug.fail_rank={cfg.debug.fail_rank} is not a rank of a world of {world}.",
              f"pass debug.fail_rank between 0 and {world - 1}")

    return Topology(device_type=device_type, nproc_per_node=nproc, nnodes=t.nnodes, world_size=world,
                    dp_size=dp, mesh_shape=mesh_shape, mesh_dim_names=mesh_names,
                    micro_batch_size=micro, grad_accum_steps=per_rank // micro)


def _validate_model(m: ModelConfig) -> None:
    from fsdp_exp.models import REGISTRY

    if m.name not in REGISTRY:
        _fail(f"model.name={m.name!r} is not a known architecture ({', '.join(sorted(REGISTRY))}).",
              "pick a preset with model=llama_tiny|llama7b|... or pass model.name=llama")
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
        if getattr(m, name) < 1:
            _fail(f"model.{name}={getattr(m, name)} must be positive.", f"pass a positive model.{name}")
    if m.dim % m.n_heads:
        _fail(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}.",
              "pick model.n_heads that divides model.dim")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        _fail(f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads} (grouped-query attention).",
              "pick model.n_kv_heads that divides model.n_heads, or null")
    if (m.dim // m.n_heads) % 2:
        _fail(f"head dimension model.dim/model.n_heads={m.dim // m.n_heads} is odd; rotary embeddings need it even.",
              "change model.dim or model.n_heads")


def _validate_optim(o: OptimConfig, steps: int) -> None:
    if o.name != "adamw":
        _fail(f"optim.name={o.name!r} is not available.", "pass optim=adamw")
    if not o.lr > 0:
        _fail(f"optim.lr={o.lr} must be positive.", "pass a positive learning rate, e.g. optim.lr=3e-4")
    if o.weight_decay < 0:
        _fail(f"optim.weight_decay={o.weight_decay} is negative.", "pass optim.weight_decay=0.1 (or 0)")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        _fail(f"optim.betas={list(o.betas)} must be two numbers in [0, 1).", "pass optim.betas=[0.9,0.95]")
    if o.lr_warmup_steps < 0:
        _fail(f"optim.lr_warmup_steps={o.lr_warmup_steps} is negative.", "pass optim.lr_warmup_steps=0 or more")
    if o.schedule not in ("cosine", "constant"):
        _fail(f"optim.schedule={o.schedule!r} is not one of cosine, constant.", "pass optim.schedule=cosine")
    if not 0 <= o.min_lr_ratio <= 1:
        _fail(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].", "pass optim.min_lr_ratio=0.1")


def _largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)


def plain(cfg: Any) -> dict:
    """A JSON-ready dict of a RunConfig (what workers, run.json and W&B receive)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
