"""Preflight: every check that spans config groups, run once before any rank (or sweep job) starts.

``validate`` resolves the topology and calls each owner's own checks. Every refusal goes through
``fsdp_exp.errors.fail`` and names the override that fixes it. No network I/O happens here.
"""

from __future__ import annotations

import math
from typing import Optional

from fsdp_exp.config.schema import AC_OPS, DTYPES, GRAD_SYNC, ModelConfig, OptimConfig, RunConfig
from fsdp_exp.config.schema import LOSS_CHUNKS_AUTO as AUTO_CHUNKS, fixed_loss_chunks as fixed_chunks
from fsdp_exp.config.topology import Topology, largest_divisor_at_most as _largest_divisor_at_most, resolve_nproc
from fsdp_exp.checkpoint.checks import check_checkpoint
from fsdp_exp.context import sampled_steps
from fsdp_exp.errors import fail
from fsdp_exp.parallel.backend import backend_for, check_backend_name
from fsdp_exp.parallel.mesh import layout as mesh_layout


def validate(cfg: RunConfig, *, cuda_devices: int, world_size: Optional[int] = None) -> Topology:
    """Check everything that spans groups; return the resolved topology.

    ``world_size`` is given when ranks come from outside (torchrun, SLURM); otherwise it follows
    from ``trainer.nproc_per_node`` x ``trainer.nnodes``.
    """
    t, p = cfg.trainer, cfg.precision

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
        fail(
            f"trainer.nproc_per_node={nproc} asks for more ranks than the {cuda_devices} GPUs here.",
            f"pass trainer.nproc_per_node={cuda_devices} (or auto)",
        )

    for name, value in (
        ("trainer.steps", t.steps),
        ("trainer.seq_len", t.seq_len),
        ("trainer.global_batch_size", t.global_batch_size),
        ("trainer.log_every", t.log_every),
    ):
        if value < 1:
            fail(f"{name}={value} must be at least 1.", f"pass a positive {name}")
    if t.repeat < 0:
        fail(
            f"trainer.repeat={t.repeat} is negative; it numbers the repetitions of a configuration from 0.",
            "pass trainer.repeat=0 (or trainer.repeat=0,1,2 in a multirun to measure each configuration 3 times)",
        )
    if not 0 <= t.warmup_steps < t.steps:
        fail(
            f"trainer.warmup_steps={t.warmup_steps} leaves no step for the summary of {t.steps} steps.",
            f"pass trainer.warmup_steps={max(0, t.steps // 5)} or raise trainer.steps",
        )
    _validate_model(cfg.model)  # first: what follows reads the model's length and vocabulary through its family
    max_seq_len = _model_spec(cfg).max_seq_len(cfg.model)
    if t.seq_len > max_seq_len:
        fail(
            f"trainer.seq_len={t.seq_len} exceeds the model's maximum sequence length {max_seq_len}.",
            f"pass trainer.seq_len={max_seq_len}, or a model with a longer one (model.max_seq_len="
            f"{t.seq_len} for Llama)",
        )
    if t.track_memory and t.track_memory_step is not None and not 0 <= t.track_memory_step < t.warmup_steps:
        fail(
            f"trainer.track_memory_step={t.track_memory_step} is not a warm-up step (0 to "
            f"{t.warmup_steps - 1}); the tracked step is slow and must stay out of the summary.",
            f"pass trainer.warmup_steps={t.track_memory_step + 1} or more, or trainer.track_memory_step=null",
        )
    sampled = sampled_steps(t, backend_for(cfg).tracks_memory, device_type).memory_sampled  # the trainer's rule
    for step in t.profile_steps:
        if not 0 <= step < t.steps:
            fail(
                f"trainer.profile_steps has {step}, not a step of this run (0 to {t.steps - 1}).",
                f"pass trainer.profile_steps=[{min(t.warmup_steps, t.steps - 1)}]",
            )
        if step == sampled:
            fail(
                f"trainer.profile_steps has {step}, the memory-sampled step: the memory tracker's per-op "
                "instrumentation (or the allocator's history) would be in the trace and in its times.",
                f"pass trainer.profile_steps=[{t.warmup_steps if t.warmup_steps < t.steps else step}] "
                "or trainer.track_memory_step=<another warm-up step>",
            )
    if t.memory_snapshot and device_type != "cuda":
        fail(
            "trainer.memory_snapshot=true records the CUDA allocator's history; this run is on the CPU.",
            "pass trainer.memory_snapshot=false (the CPU breakdown is mem/tracked_*)",
        )
    if t.memory_snapshot and t.warmup_steps == 0:
        fail(
            "trainer.memory_snapshot=true samples a warm-up step; trainer.warmup_steps=0 has none.",
            "pass trainer.warmup_steps=2",
        )
    if t.grad_clip < 0:
        fail(f"trainer.grad_clip={t.grad_clip} is negative.", "pass trainer.grad_clip=1.0 (0 disables clipping)")
    if not t.collective_timeout_s > 0:
        fail(
            f"trainer.collective_timeout_s={t.collective_timeout_s} must be positive.",
            "pass trainer.collective_timeout_s=600 (seconds a collective waits for a peer)",
        )
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        fail(f"trainer.peak_tflops={t.peak_tflops} must be positive.", "pass trainer.peak_tflops=null to look it up")
    from fsdp_exp.metrics.flops import CONVENTIONS

    if t.flops_convention not in CONVENTIONS:
        fail(
            f"trainer.flops_convention={t.flops_convention!r} is not a FLOPs convention MFU knows.",
            f"pass one of {', '.join(CONVENTIONS)} (docs/metrics.md defines each)",
        )
    chunks = fixed_chunks(t.loss_chunks)
    if chunks is None and str(t.loss_chunks).strip() != AUTO_CHUNKS:
        fail(
            f"trainer.loss_chunks={t.loss_chunks!r} is neither auto nor a number.",
            "pass trainer.loss_chunks=auto (the planner decides), or a number of slices such as 8 (1 takes the loss "
            "on all the logits at once)",
        )
    if chunks is not None and chunks < 1:
        fail(
            f"trainer.loss_chunks={t.loss_chunks} must be at least 1.",
            "pass trainer.loss_chunks=8 (1 takes the loss on all the logits at once), or auto",
        )
    if chunks is not None and chunks > 1 and p.output_dtype not in (None, "fp32"):
        # The chunked loss is taken inside the model's forward: the root's output is the loss itself.
        # (auto takes one chunk then: fsdp_exp.plan.predict.loss_chunks_for.)
        fail(
            f"precision.output_dtype={p.output_dtype} would round the loss: with trainer.loss_chunks="
            f"{t.loss_chunks} the model's output is the loss, not the logits.",
            "pass precision.output_dtype=null (or fp32), or trainer.loss_chunks=1 (or auto)",
        )

    _validate_optim(cfg.optim, t.steps)

    mesh_shape, mesh_names, dp = _validate_parallel(cfg, world, nproc, device_type)
    _validate_backend_knobs(cfg, device_type)

    # Batch over data-parallel ranks.
    if t.global_batch_size % dp:
        fail(
            f"trainer.global_batch_size={t.global_batch_size} does not divide over {dp} data-parallel ranks.",
            f"pass trainer.global_batch_size={dp * max(1, math.ceil(t.global_batch_size / dp))} "
            f"(a multiple of {dp}) or change trainer.nproc_per_node",
        )
    per_rank = t.global_batch_size // dp
    micro = t.micro_batch_size if t.micro_batch_size is not None else per_rank
    if micro < 1 or per_rank % micro:
        fail(
            f"trainer.micro_batch_size={micro} does not divide the {per_rank} sequences each of {dp} ranks "
            f"gets from trainer.global_batch_size={t.global_batch_size}.",
            f"pass trainer.micro_batch_size={_largest_divisor_at_most(per_rank, max(micro, 1))} "
            "(a divisor of the per-rank batch) or null",
        )
    _validate_loss_chunks(cfg)

    # Precision.
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(p, name) not in DTYPES:
            fail(
                f"precision.{name}={getattr(p, name)!r} is not one of {', '.join(DTYPES)}.",
                f"pass precision.{name}=bf16 (or a precision=fp32|bf16|bf16_pure|fp16 preset)",
            )
    for name in ("output_dtype", "buffer_dtype"):
        if getattr(p, name) is not None and getattr(p, name) not in DTYPES:
            fail(
                f"precision.{name}={getattr(p, name)!r} is not one of {', '.join(DTYPES)}.",
                f"pass precision.{name}=null or fp32",
            )
    if p.loss_scaler not in ("none", "dynamic"):
        fail(
            f"precision.loss_scaler={p.loss_scaler!r} is not one of none, dynamic.",
            "pass precision.loss_scaler=dynamic",
        )
    if "fp16" in (p.param_dtype, p.reduce_dtype) and p.loss_scaler != "dynamic":
        fail(
            "fp16 gradients underflow without loss scaling, and precision.loss_scaler=none.",
            "pass precision.loss_scaler=dynamic (or use precision=fp16, which sets it)",
        )
    from fsdp_exp.parallel import float8

    float8.check(cfg, device_type)

    # Offload.
    if cfg.offload.pin_memory and device_type == "cpu":
        fail(
            "offload.pin_memory=true needs a CUDA device; CPU-only torch cannot pin host memory.",
            "pass offload.pin_memory=null (auto) or false",
        )
    if cfg.offload.pin_memory is not None and not (cfg.offload.params or cfg.offload.optimizer):
        fail(
            "offload.pin_memory is set but offload.params=false and offload.optimizer=false, so nothing is offloaded.",
            "pass offload=params (or offload=optimizer), or drop offload.pin_memory",
        )

    if cfg.logger.wandb.mode not in ("online", "offline", "disabled"):
        fail(
            f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of online, offline, disabled.",
            "pass logger.wandb.mode=offline",
        )
    _validate_data(cfg)
    if (
        cfg.debug.fail_at_step is not None or cfg.debug.nan_at_step is not None
    ) and not 0 <= cfg.debug.fail_rank < world:
        fail(
            f"debug.fail_rank={cfg.debug.fail_rank} is not a rank of a world of {world}.",
            f"pass debug.fail_rank between 0 and {world - 1}",
        )
    if cfg.debug.step_sleep_s < 0:
        fail(f"debug.step_sleep_s={cfg.debug.step_sleep_s} is negative.", "pass debug.step_sleep_s=0 (no sleep)")
    experts = getattr(cfg.model, "n_experts", 0) or 0
    if cfg.debug.favour_expert is not None and not 0 <= cfg.debug.favour_expert < experts:
        fail(
            f"debug.favour_expert={cfg.debug.favour_expert} names no expert of this model ({experts} experts): it "
            "routes every token's first pick to one expert of a mixture of experts.",
            "pass debug.favour_expert=null, or an expert between 0 and model.n_experts - 1 (e.g. model=moe_tiny)",
        )
    check_checkpoint(cfg)

    return Topology(
        device_type=device_type,
        nproc_per_node=nproc,
        nnodes=t.nnodes,
        world_size=world,
        dp_size=dp,
        tp_size=cfg.parallel.tp,
        mesh_shape=mesh_shape,
        mesh_dim_names=mesh_names,
        cp_size=cfg.parallel.cp,
        ep_size=cfg.parallel.ep,
        # Under pipeline parallel the trainer feeds each dp rank's whole batch to the schedule,
        # which cuts it into parallel.pp_microbatches (trainer.micro_batch_size is that cut).
        micro_batch_size=micro if cfg.parallel.pp == 1 else per_rank,
        grad_accum_steps=per_rank // micro if cfg.parallel.pp == 1 else 1,
    )


STRATEGIES = ("full", "grad_op", "hybrid", "no_shard", "optimizer")
CP_METHODS = ("auto", "ring", "all_to_all")


def _validate_parallel(cfg: RunConfig, world: int, nproc: int, device_type: str):
    """The device mesh: data-parallel dims from the strategy (laid out by the backend), then a tp dim.
    Returns (shape, names, dp)."""
    s, tp = cfg.sharding, cfg.parallel.tp
    check_backend_name(s.backend)
    if s.strategy not in STRATEGIES:
        fail(
            f"sharding.strategy={s.strategy!r} is not one of {', '.join(STRATEGIES)}.",
            "pick one with sharding=full|grad_op|hybrid|no_shard|optimizer",
        )
    if tp < 1 or world % tp:
        fail(
            f"parallel.tp={tp} does not divide the world size {world}.",
            f"pass parallel.tp={_largest_divisor_at_most(world, max(tp, 1))} (a divisor of {world})",
        )
    if tp > 1:
        _validate_tp(cfg, tp)
    cp = _check_cp(cfg, world, device_type)
    if cfg.parallel.pp != 1:
        return _validate_pipeline(cfg, world)
    dp = world // (tp * cp)
    replicate, shard = 1, dp
    if s.strategy == "hybrid":
        local_dp = max(1, min(nproc // tp, dp)) if nproc >= tp else 1
        shard = s.shard_size if s.shard_size is not None else (dp // s.replicate_size if s.replicate_size else local_dp)
        replicate = s.replicate_size if s.replicate_size is not None else max(1, dp // max(shard, 1))
        if shard < 1 or replicate < 1 or replicate * shard != dp:
            good = _largest_divisor_at_most(dp, local_dp)
            fail(
                f"sharding=hybrid needs replicate_size x shard_size = {dp} data-parallel ranks, "
                f"got {replicate} x {shard}.",
                f"pass sharding.shard_size and sharding.replicate_size whose product is {dp}, "
                f"e.g. sharding.replicate_size={dp // good} sharding.shard_size={good}",
            )
    elif s.strategy != "no_shard" and (s.replicate_size is not None or s.shard_size is not None):
        fail(
            f"sharding.replicate_size/shard_size only apply to sharding=hybrid, not {s.strategy}.",
            "drop them, or pass sharding=hybrid",
        )
    shape, names = backend_for(cfg).data_parallel_mesh(s.strategy, dp, replicate, shard)
    _check_ep(cfg, shard_ranks=shape[names.index("shard")] * cp if "shard" in names else cp)
    return (*mesh_layout(shape, names, cp=cp, tp=tp), dp)


def _check_cp(cfg: RunConfig, world: int, device_type: str) -> int:
    """parallel.cp and parallel.cp_method; returns cp (it must divide the ranks left by pp and tp)."""
    p = cfg.parallel
    if p.cp_method not in CP_METHODS:
        fail(
            f"parallel.cp_method={p.cp_method!r} is not one of {', '.join(CP_METHODS)}.",
            "pass parallel.cp_method=auto",
        )
    rest = world // max(p.pp, 1) // max(p.tp, 1)
    if p.cp < 1 or rest % p.cp:
        fail(
            f"parallel.cp={p.cp} does not divide the {rest} ranks left by parallel.pp={p.pp} x parallel.tp={p.tp}.",
            f"pass parallel.cp={_largest_divisor_at_most(rest, max(p.cp, 1))} (a divisor of {rest})",
        )
    from fsdp_exp.parallel import context

    context.check(cfg, device_type)  # the sequence, the heads, the method on this device, what cp refuses
    return p.cp


def _check_ep(cfg: RunConfig, shard_ranks: int) -> None:
    """parallel.ep: expert parallel borrows its ranks from the shard x cp ranks, so it must divide them; what
    it composes with is expert parallel's own check (fsdp_exp.parallel.expert.check)."""
    from fsdp_exp.parallel import expert

    ep = cfg.parallel.ep
    if ep < 1 or shard_ranks % ep:
        fail(
            f"parallel.ep={ep} does not divide the {shard_ranks} shard x cp ranks the experts are spread over.",
            f"pass parallel.ep={_largest_divisor_at_most(shard_ranks, max(ep, 1))} (a divisor of {shard_ranks})",
        )
    expert.check(cfg, ep)


def _validate_pipeline(cfg: RunConfig, world: int):
    """parallel.pp > 1: the (pp, dp) mesh, (pp, dp, tp) under tensor parallel, FSDP2 or DDP inside each stage;
    what the pipeline does not compose with yet is refused by name. Returns (shape, names, dp)."""
    from fsdp_exp.parallel import pipeline

    pp, tp = cfg.parallel.pp, cfg.parallel.tp  # checkpoint and export work per stage (fsdp_exp.checkpoint, .export)
    if pp < 1 or world % pp:
        fail(
            f"parallel.pp={pp} does not divide the world size {world}.",
            f"pass parallel.pp={_largest_divisor_at_most(world, max(pp, 1))} (a divisor of {world})",
        )
    if (world // pp) % tp:
        fail(
            f"parallel.pp={pp} x parallel.tp={tp} does not divide the world size {world}.",
            f"pass parallel.tp={_largest_divisor_at_most(world // pp, tp)} (a divisor of {world // pp})",
        )
    pipeline.check_sharding(cfg)
    pipeline.check_stage_settings(cfg)  # what the stages would otherwise ignore
    refused = [
        ("debug.check_identical_init", cfg.debug.check_identical_init, "debug.check_identical_init=false"),
        ("trainer.eval_every", cfg.trainer.eval_every > 0, "trainer.eval_every=0"),
        ("precision.loss_scaler", cfg.precision.loss_scaler != "none", "precision=fp32|bf16"),
    ]
    for key, bad, fix in refused:
        if bad:
            fail(
                f"{key}={_value(cfg, key)} is not "
                f"supported with parallel.pp={pp} yet (evaluation and loss scaling under stages are "
                "not built; docs/pipeline.md).",
                f"pass {fix}, or parallel.pp=1",
            )
    dp = world // (pp * tp * cfg.parallel.cp)
    _check_ep(cfg, shard_ranks=dp * cfg.parallel.cp)
    pipeline.stage_dp_layout(cfg, dp)  # sharding=hybrid: the split of a stage's dp ranks
    t = cfg.trainer
    local_batch = t.global_batch_size // dp
    settings = pipeline.settings_from(cfg, local_batch)
    if (
        t.micro_batch_size is not None
        and cfg.parallel.pp_microbatches
        and t.micro_batch_size * cfg.parallel.pp_microbatches != local_batch
    ):
        fail(
            f"trainer.micro_batch_size={t.micro_batch_size} x parallel.pp_microbatches="
            f"{cfg.parallel.pp_microbatches} is not the {local_batch} sequences each data-parallel rank trains "
            "on per step (under pipeline parallel the micro-batch is the pipeline's).",
            "pass one of them only (the other follows), or trainer.micro_batch_size=null",
        )
    if t.global_batch_size % dp == 0:  # otherwise the batch check after this one names the fix
        pipeline.check(settings, cfg.model, local_batch)
    return (*pipeline.mesh_layout(pp, dp, tp, cfg.parallel.cp), dp)


def _value(cfg: RunConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _validate_tp(cfg: RunConfig, tp: int) -> None:
    from fsdp_exp.models import spec_for

    # Which backends compose with tensor parallel is theirs to say (their check); what tp must divide
    # is the model family's (its tensor-parallel plan).
    spec = spec_for(cfg.model)
    spec.check_tensor_parallel(cfg.model, tp)
    if cfg.parallel.sequence_parallel and not spec.tensor_parallel_plan(cfg.model).sequence_parallel_block:
        fail(
            "parallel.sequence_parallel shards the norms over the sequence, and this model's tensor-parallel plan "
            "names none.",
            "pass parallel.sequence_parallel=false",
        )
    if cfg.parallel.sequence_parallel and cfg.trainer.seq_len % tp:
        fail(
            f"parallel.sequence_parallel shards the sequence, but trainer.seq_len={cfg.trainer.seq_len} "
            f"does not divide by parallel.tp={tp}.",
            f"pass a trainer.seq_len that is a multiple of {tp}",
        )


def _validate_backend_knobs(cfg: RunConfig, device_type: str) -> None:
    """Every knob either reaches the chosen backend's API or is refused here, naming the equivalent: the
    values no backend could take first, then the backend's own refusals (``Backend.check``)."""
    s, pf, w = cfg.sharding, cfg.prefetch, cfg.wrap
    if pf.forward < 0:
        fail(f"prefetch.forward={pf.forward} is negative.", "pass prefetch.forward=0 (none) or more")
    if pf.backward is not None and pf.backward < 0:
        fail(f"prefetch.backward={pf.backward} is negative.", "pass prefetch.backward=0 or more, or null")
    if pf.backward_timing not in ("pre", "post"):
        fail(
            f"prefetch.backward_timing={pf.backward_timing!r} is not one of pre, post.",
            "pass prefetch.backward_timing=pre",
        )
    if w.policy not in ("block", "none", "size", "experts"):
        fail(f"wrap.policy={w.policy!r} is not one of block, none, size, experts.", "pass wrap=block")
    if w.policy == "experts" and getattr(cfg.model, "n_experts", 0) < 1:
        fail(
            "wrap=experts wraps the experts of an MoE model, but this model has none.",
            "pass model=moe_tiny, or wrap=block",
        )
    if w.min_num_params < 1:
        fail(f"wrap.min_num_params={w.min_num_params} must be positive.", "pass wrap.min_num_params=100000")
    ac = cfg.ac
    if ac.ops == "matmul_save":  # the name of every_matmul before torchtitan's policy became selective_op's
        fail(
            "ac.ops=matmul_save is now called ac.ops=every_matmul (ac=selective_op saves every other matmul).",
            "pass ac.ops=every_matmul, or ac=selective_op for torchtitan's per-op policy",
        )
    if ac.mode not in ("none", "full", "selective") or ac.every < 1 or ac.ops not in AC_OPS:
        fail(
            f"ac.mode={ac.mode!r} ac.every={ac.every} ac.ops={ac.ops!r} is not a valid activation checkpointing "
            "setting.",
            f"pick a preset: ac=none|full|selective|selective_op (ac.ops={'|'.join(AC_OPS)})",
        )
    if ac.ops != "none" and ac.mode != "selective":
        fail(
            f"ac.ops={ac.ops} is op-level selective checkpointing and needs ac.mode=selective.", "pass ac=selective_op"
        )
    if cfg.trainer.grad_sync not in GRAD_SYNC:
        fail(
            f"trainer.grad_sync={cfg.trainer.grad_sync!r} is not one of {', '.join(GRAD_SYNC)}.",
            "pass trainer.grad_sync=auto (the backend's rule), every_micro_batch or last_micro_batch",
        )
    rs = s.reshard_after_forward.lower()
    if rs not in ("auto", "true", "false") and not (rs.isdigit() and int(rs) >= 1):
        fail(
            f"sharding.reshard_after_forward={s.reshard_after_forward!r} is not auto, true, false or a "
            "positive whole number.",
            "pass sharding.reshard_after_forward=auto",
        )
    backend_for(cfg).check(cfg, device_type)


def _validate_model(m: ModelConfig) -> None:
    """The family must be registered (with a "did you mean"); then its own checks."""
    from fsdp_exp.models import get_spec

    get_spec(m.name).check(m)


def _model_spec(cfg: RunConfig):
    from fsdp_exp.models import spec_for

    return spec_for(cfg.model)


def _validate_data(cfg: RunConfig) -> None:
    """Source, files (missing, empty), tokenizer vs. model.vocab_size: see fsdp_exp.data.check_config."""
    from fsdp_exp.data import check_config

    check_config(cfg)


def _validate_loss_chunks(cfg: RunConfig) -> None:
    """The loss is taken in trainer.loss_chunks slices of the sequence (``fsdp_exp.models.loss``); more
    chunks than tokens would be quietly cut down to one token each. Under sequence parallel the slices
    are of the micro-batch instead (the hidden states arrive sharded over the sequence), as many as it
    has sequences: the default of 8 with micro-batches of 1 or 2 is the common case there, not a mistake."""
    t = cfg.trainer
    chunks = fixed_chunks(t.loss_chunks)  # auto: at most the sequence's tokens (fsdp_exp.plan.loss_chunks)
    if chunks is not None and chunks > t.seq_len and not (cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel):
        fail(
            f"trainer.loss_chunks={t.loss_chunks} exceeds trainer.seq_len={t.seq_len}: the loss is taken in "
            "slices of the sequence, one token each at the most.",
            f"pass trainer.loss_chunks={t.seq_len} or less",
        )


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
