"""The checks of the parallel package's config groups (sharding, parallel, prefetch, wrap, ac, precision,
offload), run by preflight before any rank starts, and the run's ``Layout`` they decide. Each parallelism's own
refusals stay with its owner (parallel.context, .expert, .pipeline, .float8, the backends' ``check``, the model
family's plans); this module orders them and builds the layout once (fsdp_exp/config/layout.py)."""

from __future__ import annotations

from fsdp_exp.config.layout import Layout, data_parallel_ranks, largest_divisor_at_most as _largest_divisor_at_most
from fsdp_exp.config.schema import (
    AC_MODES,
    AC_OPS,
    CP_METHODS,
    DTYPES,
    STORAGE_DTYPES,
    GRAD_SYNC,
    LOSS_SCALERS,
    PREFETCH_TIMINGS,
    STRATEGIES,
    WRAP_POLICIES,
    RunConfig,
)
from fsdp_exp.errors import fail
from fsdp_exp.parallel.backend import backend_for, check_backend_name


def layout_for(cfg: RunConfig, world: int, nproc: int, device_type: str) -> Layout:
    """The checks of the sharding and parallel groups, each parallelism's by its owner (tp: the model family's
    plan; cp: parallel.context; ep: parallel.expert; pp: parallel.pipeline), then the run's ``Layout``: the
    data-parallel dims from the strategy (named by the backend), [pp,] [cp,] [tp]."""
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
    _check_cp(cfg, world, device_type)
    if cfg.parallel.pp != 1:
        return _validate_pipeline(cfg, world, nproc)
    layout = Layout.from_config(cfg, world, nproc, backend_for(cfg).data_parallel_mesh)
    _check_ep(cfg, shard_ranks=layout.shard_cp)
    return layout


def _check_cp(cfg: RunConfig, world: int, device_type: str) -> int:
    """parallel.cp and parallel.cp_method; returns cp (it must divide the ranks left by pp and tp)."""
    p = cfg.parallel
    if p.cp_method not in CP_METHODS:
        fail(
            f"parallel.cp_method={p.cp_method!r} is not one of {', '.join(CP_METHODS)}.",
            "pass parallel.cp_method=auto",
        )
    rest = data_parallel_ranks(world, pp=p.pp, tp=p.tp)  # what cp divides
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


def _validate_pipeline(cfg: RunConfig, world: int, nproc: int):
    """parallel.pp > 1: the (pp, dp) mesh, (pp, dp, tp) under tensor parallel, FSDP2 or DDP inside each stage;
    what the pipeline does not compose with yet is refused by name. Returns the run's ``Layout``."""
    from fsdp_exp.parallel import pipeline

    pp, tp = cfg.parallel.pp, cfg.parallel.tp  # checkpoint and export work per stage (fsdp_exp.checkpoint, .export)
    if pp < 1 or world % pp:
        fail(
            f"parallel.pp={pp} does not divide the world size {world}.",
            f"pass parallel.pp={_largest_divisor_at_most(world, max(pp, 1))} (a divisor of {world})",
        )
    per_stage = data_parallel_ranks(world, pp=pp)
    if per_stage % tp:
        fail(
            f"parallel.pp={pp} x parallel.tp={tp} does not divide the world size {world}.",
            f"pass parallel.tp={_largest_divisor_at_most(per_stage, tp)} (a divisor of {per_stage})",
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
    layout = Layout.from_config(cfg, world, nproc, backend_for(cfg).data_parallel_mesh)
    _check_ep(cfg, shard_ranks=layout.shard_cp)
    t = cfg.trainer
    local_batch = layout.local_batch(t.global_batch_size)
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
    if t.global_batch_size % layout.dp == 0:  # otherwise the batch check after this one names the fix
        pipeline.check(settings, cfg.model, local_batch)
    return layout


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


def check_knobs(cfg: RunConfig, device_type: str) -> None:
    """Every knob either reaches the chosen backend's API or is refused here, naming the equivalent: the
    values no backend could take first, then the backend's own refusals (``Backend.check``)."""
    s, pf, w = cfg.sharding, cfg.prefetch, cfg.wrap
    if pf.forward < 0:
        fail(f"prefetch.forward={pf.forward} is negative.", "pass prefetch.forward=0 (none) or more")
    if pf.backward is not None and pf.backward < 0:
        fail(f"prefetch.backward={pf.backward} is negative.", "pass prefetch.backward=0 or more, or null")
    if pf.backward_timing not in PREFETCH_TIMINGS:
        fail(
            f"prefetch.backward_timing={pf.backward_timing!r} is not one of {', '.join(PREFETCH_TIMINGS)}.",
            "pass prefetch.backward_timing=pre",
        )
    if w.policy not in WRAP_POLICIES:
        fail(f"wrap.policy={w.policy!r} is not one of {', '.join(WRAP_POLICIES)}.", "pass wrap=block")
    if w.policy == "experts" and getattr(cfg.model, "n_experts", 0) < 1:
        fail(
            "wrap=experts wraps the experts of an MoE model, but this model has none.",
            "pass model=moe_tiny, or wrap=block",
        )
    if w.min_num_params < 1:
        fail(f"wrap.min_num_params={w.min_num_params} must be positive.", "pass wrap.min_num_params=100000")
    if cfg.compile and cfg.parallel.tp > 1 and w.policy in ("none", "size"):
        # Found by the every-pair test (tests/integration/test_compose.py): with the blocks inside the root's
        # unit, the compiled blocks' backward fails in torch's DTensor redistribution ('_local_tensor'), with or
        # without AC; a unit per block runs. wrap=size is refused too: whether it gives a block a unit of its own
        # depends on the model's size.
        fail(
            f"compile=true with parallel.tp={cfg.parallel.tp} needs a FSDP unit per block, and wrap={w.policy} can "
            "leave the blocks inside one larger unit: the compiled blocks' backward then fails in torch's DTensor "
            "redistribution.",
            "pass wrap=block (or compile=false)",
        )
    ac = cfg.ac
    if ac.ops == "matmul_save":  # the name of every_matmul before torchtitan's policy became selective_op's
        fail(
            "ac.ops=matmul_save is now called ac.ops=every_matmul (ac=selective_op saves every other matmul).",
            "pass ac.ops=every_matmul, or ac=selective_op for torchtitan's per-op policy",
        )
    if ac.mode not in AC_MODES or ac.every < 1 or ac.ops not in AC_OPS:
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


def check_precision(cfg: RunConfig, device_type: str) -> None:
    """The precision group: the dtypes, loss scaling, then float8's own checks (parallel.float8)."""
    p = cfg.precision
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
    if p.storage_dtype not in STORAGE_DTYPES:
        fail(
            f"precision.storage_dtype={p.storage_dtype!r} is not one of {', '.join(STORAGE_DTYPES)}.",
            "pass precision.storage_dtype=fp32 (fp32 master parameters) or bf16",
        )
    if p.storage_dtype != "fp32":  # which backends store bf16: their ``check`` (parallel.common.refuse_bf16_storage)
        if p.param_dtype != p.storage_dtype:
            fail(
                f"precision.storage_dtype={p.storage_dtype} with param_dtype={p.param_dtype}: compute would run in "
                f"{p.param_dtype} on parameters stored in {p.storage_dtype}, no more precise than they are.",
                f"pass precision.param_dtype={p.storage_dtype} (precision=bf16), or precision.storage_dtype=fp32",
            )
    if p.loss_scaler not in LOSS_SCALERS:
        fail(
            f"precision.loss_scaler={p.loss_scaler!r} is not one of {', '.join(LOSS_SCALERS)}.",
            "pass precision.loss_scaler=dynamic",
        )
    if "fp16" in (p.param_dtype, p.reduce_dtype) and p.loss_scaler != "dynamic":
        fail(
            "fp16 gradients underflow without loss scaling, and precision.loss_scaler=none.",
            "pass precision.loss_scaler=dynamic (or use precision=fp16, which sets it)",
        )
    from fsdp_exp.parallel import float8  # torch (beside its check): imported where the check runs

    float8.check(cfg, device_type)


def check_offload(cfg: RunConfig, device_type: str) -> None:
    """The offload group: pinned host memory needs CUDA and something to offload."""
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
