"""The run configuration's schema: one dataclass per config group, registered with Hydra's ConfigStore.

A leaf: it imports nothing of fsdp_exp, so every other module may import it. The config groups' YAML
files are merged onto these schemas, so a misspelt key or a value of the wrong type is refused
while Hydra composes. Checks that span groups live in ``fsdp_exp.preflight``, which calls
each owner's own checks (backends, models, data, checkpoints) before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

DTYPES = ("fp32", "bf16", "fp16")
# precision.storage_dtype: the dtype the sharded parameters (so their gradients and AdamW moments) are stored in
STORAGE_DTYPES = ("fp32", "bf16")
# trainer.grad_sync: auto resolves per backend (Backend.grad_sync); the other two say when gradients are reduced.
EVERY_MICRO_BATCH, LAST_MICRO_BATCH = "every_micro_batch", "last_micro_batch"
GRAD_SYNC = ("auto", EVERY_MICRO_BATCH, LAST_MICRO_BATCH)
# ac.ops: which op outputs a checkpointed block saves (``fsdp_exp.parallel.ac``)
AC_OPS = ("none", "every_other_matmul", "every_matmul")
# The allowed values of the other options with a closed set (each check and tune's search space read them here)
TRAINER_DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("full", "grad_op", "hybrid", "no_shard", "optimizer")
CP_METHODS = ("auto", "ring", "all_to_all")
LOSS_SCALERS = ("none", "dynamic")
WANDB_MODES = ("online", "offline", "disabled")
PREFETCH_TIMINGS = ("pre", "post")
WRAP_POLICIES = ("block", "none", "size", "experts")
AC_MODES = ("none", "full", "selective")
OPTIMIZERS = ("adamw",)
LR_SCHEDULES = ("cosine", "constant")


@dataclass
class ModelConfig:
    """A Llama-style decoder (the ``llama`` family). ``name`` selects the family in ``fsdp_exp.models.REGISTRY``;
    each family has its own schema (``MODEL_SCHEMAS``)."""

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
    head_dim: Optional[int] = None  # None = dim // n_heads (Qwen3's are wider: 128 at dim 2048, 32 heads)
    qk_norm: bool = False  # RMSNorm on each head's query and key before the rotation (Qwen3)
    n_experts: int = 0  # > 0: every block's feed-forward is a mixture of this many routed experts
    experts_top_k: int = 2  # experts each token is routed to
    # Mixture of experts (fsdp_exp/models/moe.py; the docs page models.md, "Mixture of experts"):
    moe_hidden_dim: Optional[int] = None  # one routed expert's SwiGLU width (None = the dense one's)
    n_shared_experts: int = 0  # always-on experts (one SwiGLU of n_shared_experts x moe_hidden_dim)
    router_score: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3, always renormalized)
    router_renormalize: bool = True  # softmax: the top-k weights rescaled to sum to 1
    aux_loss_coef: float = 0.0  # load-balancing loss coefficient (Mixtral 0.02, Qwen3-MoE 0.001)
    expert_bias_rate: float = 0.0  # DeepSeek-V3's loss-free balancing: bias update per step (0.001), 0 = off
    # causal: every earlier token of the sequence | block_causal: the earlier tokens of the same packed document
    attention_mask: str = "causal"
    capacity_factor: Optional[float] = None  # None = dropless; else copies per expert <= cf x tokens x k / E
    # the routed experts' SwiGLU product (and w2's input) recomputed in backward from w1's and w3's outputs:
    # per routed copy 2 x the experts' width kept instead of 4 (fsdp_exp.models.moe.grouped_swiglu)
    recompute_expert_activation: bool = False
    # DeepSeek-V3 / Kimi K2 (docs/models.md, "DeepSeek-V3 and Kimi K2"): dense first blocks, group-limited routing
    first_k_dense: int = 0  # the first k blocks keep a dense SwiGLU (DeepSeek's first_k_dense_replace)
    dense_hidden_dim: Optional[int] = None  # the dense SwiGLU's width (None = the Llama rule from dim)
    expert_groups: int = 1  # routed experts in this many groups (n_group); > 1: fsdp_exp/models/router.py
    expert_groups_top_k: int = 1  # groups a token's experts may come from (topk_group)
    routed_scaling: float = 1.0  # the routed experts' mixing weights times this (routed_scaling_factor)
    mtp_layers: int = 0  # multi-token prediction modules (num_nextn_predict_layers): not built, > 0 refused
    # Attention: gqa (grouped-query, the Llama papers') | mla (multi-head latent attention: fsdp_exp/models/mla.py)
    attention: str = "gqa"
    q_lora_rank: Optional[int] = None  # mla: the queries' low rank (None = one full query projection, V2-Lite)
    kv_lora_rank: int = 512  # mla: the keys' and values' shared latent
    qk_nope_head_dim: int = 128  # mla: each head's query / key part without position
    qk_rope_head_dim: int = 64  # mla: the rotary part, one key for every head
    v_head_dim: int = 128  # mla: each head's value width


@dataclass
class HfModelConfig:
    """Any Hugging Face causal LM, built from its transformers config (``fsdp_exp.models.hf``).

    The config is ``hf_config`` (a folder holding config.json, a config.json, or a hub name that the
    launcher resolves through the hub cache) or ``hf_fields`` (a config.json written out, with its
    ``model_type``: the shipped presets), never both. ``hf_overrides`` then sets any field of the
    architecture's config class (``+model.hf_overrides.num_hidden_layers=4``); its keys and types are
    checked against that class, not against this schema.
    """

    name: str = "hf"
    hf_config: Optional[str] = None
    hf_fields: dict[str, Any] = field(default_factory=dict)
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    revision: Optional[str] = None  # a hub name's branch, tag or commit (None = main)
    attn_implementation: str = "sdpa"  # sdpa | eager: transformers' attention kernels
    attention_mask: str = "causal"  # block_causal is refused for transformers models (fsdp_exp.models.hf)


# model.name -> the family's schema. The ``model`` group's presets name theirs in their defaults list
# (``schema/<name>@_here_``), so Hydra checks keys and types while composing; to_run_config types the
# node by its ``name``. A preset without one is checked there, by the same schema.
MODEL_SCHEMAS: dict[str, type] = {"llama": ModelConfig, "hf": HfModelConfig}


def model_schema(node: Any) -> type:
    """The schema of a model config node (a mapping or a dataclass): by its ``name``; Llama's when it has none."""
    name = node.get("name") if hasattr(node, "get") else getattr(node, "name", None)
    return MODEL_SCHEMAS.get(name, ModelConfig)


@dataclass
class ShardingConfig:
    """How parameters, gradients and optimizer state are spread over data-parallel ranks.

    ``strategy`` speaks the user's vocabulary; each backend under ``fsdp_exp.parallel`` translates it
    (the docs page vocabulary.md). ``replicate_size`` x ``shard_size`` is the 2-D mesh of ``hybrid``.
    """

    backend: str = "fsdp2"  # fsdp2 | fsdp1 | ddp | deepspeed (optional: pip install fsdp_exp[deepspeed])
    # full | grad_op | hybrid | no_shard | optimizer (ZeRO-1: optimizer state sharded only; DDP with torch's
    # ZeroRedundancyOptimizer, or DeepSpeed stage 1)
    strategy: str = "full"
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
    # dtype the parameters are stored in (STORAGE_DTYPES): fp32 master parameters, or bf16 (the model cast before
    # sharding, so its gradients and AdamW moments are bf16 too: half the states; needs param_dtype=bf16; FSDP2)
    storage_dtype: str = "fp32"
    reduce_dtype: str = "fp32"  # dtype of gradient reduce-scatter / all-reduce
    output_dtype: Optional[str] = None  # FSDP2: dtype the root module's outputs are cast to (None = leave)
    buffer_dtype: Optional[str] = None  # FSDP1: dtype of buffers (None = param_dtype)
    cast_forward_inputs: bool = True  # cast floating-point forward inputs to param_dtype
    loss_scaler: str = "none"  # none | dynamic (fp16 needs dynamic)
    # Float8 matmuls (torchao, ``fsdp_exp.parallel.float8``, the docs page float8.md): null = off | tensorwise | rowwise |
    # rowwise_with_gw_hp (mxfp8 is refused by name). The parameters keep param_dtype; only the matmuls run in float8.
    float8_recipe: Optional[str] = None
    float8_all_gather: bool = False  # FSDP2, tensorwise: all-gather the weights in float8 (1 byte a parameter)
    float8_emulate: bool = False  # torchao's emulated float8 matmul instead of torch._scaled_mm
    # Modules kept high precision: a name or a run of dotted name parts (feed_forward, layers.0; null = the model's
    # output projection); besides these, every
    # linear whose dims are not multiples of 16 stays high precision.
    float8_filter_fqns: Optional[list[str]] = None


@dataclass
class OffloadConfig:
    params: bool = False  # keep sharded params, grads and optimizer state on the host
    optimizer: bool = False  # keep the optimizer state (and its step) on the host only (DeepSpeed's offload_optimizer)
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
    # Keep the logits sharded over the vocabulary on the TP group and take the loss there (torch's
    # loss_parallel); false: gather them to every TP rank first.
    loss_parallel: bool = True
    # Pipeline parallel (``fsdp_exp.parallel.pipeline``, the docs page pipeline.md): the mesh becomes (pp, dp), pp outermost
    pp: int = 1  # pipeline ranks; the model is cut by blocks into pp x pp_stages_per_rank stages
    pp_schedule: str = (
        "1f1b"  # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble | dualpipev
    )
    pp_microbatches: int = (
        0  # micro-batches per step of each dp rank's batch; 0 = from trainer.micro_batch_size, else pp
    )
    pp_stages_per_rank: int = 1  # stages each pp rank holds (interleaved_1f1b, looped_bfs: any; the V schedules: 2)
    pp_split: Optional[list[int]] = None  # first block of every stage but the first; null = balanced by parameters
    # Context parallel: each sequence split over cp ranks taken from the data-parallel ranks (a "cp" mesh dim
    # between the data-parallel dims and tp; FSDP shards dense weights over shard x cp). fsdp_exp/parallel/mesh.py
    cp: int = 1
    cp_method: str = "auto"  # auto | ring (torch's context_parallel) | all_to_all (heads exchanged for sequence)
    # Expert parallel: the experts of each MoE layer split over ep ranks borrowed from shard x cp; expert weights
    # FSDP-sharded over the shard x cp ranks left (fsdp_exp/parallel/mesh.py: expert_meshes)
    ep: int = 1


@dataclass
class ActivationCheckpointConfig:
    mode: str = "none"  # none | full | selective
    every: int = 1  # selective: checkpoint every k-th block (layer-level selective AC)
    # selective, op level: none | every_other_matmul (torchtitan's per-op SAC: every other matmul's output and
    # the attention kernel's) | every_matmul (every matmul's and attention's); the rest is recomputed
    ops: str = "none"


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
    """Where tokens come from (``fsdp_exp.data``). Real data is tokenized and packed once, before any rank starts."""

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
    # byte (UTF-8 bytes, id 0 ends a document) | tokenizer.json path or folder | hub name |
    # model (the model's own where it is on this machine, e.g. beside model.hf_config's config.json; else byte)
    tokenizer: str = "byte"
    eos_token: Optional[str] = None  # HF tokenizers: the end-of-document token; None = the first usual one found
    max_blocks: Optional[int] = None  # pack at most this many training blocks (a prefix of a huge corpus)
    cache_dir: str = "~/.cache/fsdp_exp/data"  # packed blocks (and datasets' copies of local files)
    shuffle: bool = True  # a new permutation of the blocks every epoch, by (seed, epoch)
    seed: Optional[int] = None  # None = trainer.seed
    num_workers: int = 0  # DataLoader worker processes per rank; 0 = load in the training loop
    prefetch_factor: int = 2  # micro-batches each worker keeps ready
    val_batches: int = 4  # global batches of validation data per evaluation
    # rotary positions: block (0.. over the packed block) | document (restart at each document's first token)
    positions: str = "block"
    # synthetic: mean document length in tokens (lengths drawn uniformly in [1, 2 x mean - 1]); 0 = one per block
    synthetic_doc_len: Optional[int] = None  # None = trainer.seq_len // 4
    # The step-time model's document lengths (model.attention_mask=block_causal prices each document's own
    # attention): None = what the data says (fsdp_exp.data.attention_span); else their mean and spread in tokens.
    doc_len_mean: Optional[float] = None
    doc_len_std: float = 0.0


@dataclass
class TrainerConfig:
    steps: int = 10
    warmup_steps: int = 2  # first steps left out of the summary's medians (compile, caches, allocator)
    nproc_per_node: str = "auto"  # "auto" = number of CUDA GPUs, or 2 CPU ranks without CUDA
    nnodes: int = 1
    seed: int = 0
    # Which repetition of a configuration this run is: changes nothing in the run (not the seed, not the
    # data), only its identity, so that trainer.repeat=0,1,2 measures each configuration of a sweep three
    # times and the report groups them (``fsdp_exp.report.repeats``).
    repeat: int = 0
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: Optional[int] = None  # sequences per rank per forward; None = no accumulation
    # When accumulated micro-batches reduce their gradients: every_micro_batch (each backward reduces into
    # the sharded gradient: no unsharded gradient between micro-batches) | last_micro_batch (only the last:
    # fewer collectives, a whole unsharded gradient held) | auto (the backend's natural rule: FSDP every,
    # DDP last, DeepSpeed its engine's). The resolved value is in run.json["applied"]["grad_sync"].
    grad_sync: str = "auto"
    seq_len: int = 128
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    # The output projection and cross-entropy in this many slices of the sequence, each slice's fp32 logits
    # alive only while its loss and gradient are made (``fsdp_exp.models.loss``; the head runs again in
    # backward); 1 = all logits at once. auto: the planner's rule (``fsdp_exp.plan.loss_chunks``: 8 where that
    # lowers the planned peak by 10% or more, else 1), settled by the launcher before any rank starts; the
    # choice is in run.json["applied"]["loss_chunks"]. A string: auto or a number.
    loss_chunks: str = "auto"
    log_every: int = 1
    device: str = "auto"  # auto | cpu | cuda
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None = look the device up
    # MFU's FLOPs per token, by a named convention (``fsdp_exp.metrics.flops.CONVENTIONS``, metrics.md):
    # fsdp_exp | llmfoundry | torchtitan_2024_04 | torchtitan | megatron. Recorded beside every MFU (run.json env).
    flops_convention: str = "fsdp_exp"
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
    # Before any rank starts, refuse a run the memory planner says cannot fit this node (a GPU's free
    # memory, or a CPU host's RAM under its memory cgroup's limit): ``fsdp_exp.fit_check``. false = run anyway.
    check_fit: bool = True
    # How long a collective may wait for a peer before the rank gives up with an error (the process group's
    # timeout). A rank that dies usually ends its peers at once (its connections close); a node that
    # vanishes from the network does not, and then this bounds how long the job waits for it.
    collective_timeout_s: float = 600.0


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
    # Every rank sleeps this long at the start of each step: a slow job that stays cheap, for tests of
    # time limits, preemption and lost nodes (the sleep is inside the timed step).
    step_sleep_s: float = 0.0
    # At start, hash every rank's initial parameter shards: replicas must agree and each shard must be the
    # slice of the seeded full tensor; a mismatch names the ranks and tensors.
    check_identical_init: bool = False
    # A mixture of experts routes every token's first pick to this expert (its router bias set far above the
    # scores' range at each step's start): a run whose expert load is as imbalanced as a router can make it,
    # to see the moe/* metrics, the summary and the report show it. None: routing as trained.
    favour_expert: Optional[int] = None


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (``fsdp_exp.checkpoint``): when to save, where, how many to keep, how to resume.

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
    # The family's own schema (ModelConfig, HfModelConfig, ...: MODEL_SCHEMAS by model.name).
    model: Any = field(default_factory=dict, metadata={"schemas": MODEL_SCHEMAS, "select": model_schema})
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


LOSS_CHUNKS_AUTO = "auto"  # trainer.loss_chunks: the planner's rule (fsdp_exp.plan.loss_chunks)


def fixed_loss_chunks(value) -> Optional[int]:
    """``trainer.loss_chunks`` as a number, or None for auto (and for anything else: preflight refuses it)."""
    text = str(value).strip()
    return int(text) if text.lstrip("-").isdigit() else None


def settled_loss_chunks(value) -> int:
    """``trainer.loss_chunks`` as the ranks use it: a number, ``auto`` having been settled by the launcher
    (``fsdp_exp.launch.run_context``) before they started."""
    number = fixed_loss_chunks(value)
    if number is None:
        raise ValueError(
            f"trainer.loss_chunks={value} reached a rank unsettled: the launcher settles auto "
            "(fsdp_exp.launch.run_context; fsdp_exp.plan.loss_chunks_for for a config outside a run)"
        )
    return number
