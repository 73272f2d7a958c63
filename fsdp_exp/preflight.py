"""Preflight: every check of a configuration, run once before any rank (or sweep job) starts.

``validate`` orders the owners' checks (each config group's are beside the code that owns it) and then runs the
table of checks that span groups; the parallel groups decide the run's ``Layout`` (fsdp_exp.parallel.checks).
Every refusal goes through ``fsdp_exp.errors.fail`` and names the override that fixes it. No network I/O here.
"""

from __future__ import annotations

import math
from typing import Optional

from fsdp_exp.checkpoint.checks import check_checkpoint
from fsdp_exp.config.layout import Layout, largest_divisor_at_most as _largest_divisor_at_most
from fsdp_exp.config.schema import STRATEGIES, RunConfig, fixed_loss_chunks as fixed_chunks  # noqa: F401
from fsdp_exp.config.topology import Topology, resolve_where
from fsdp_exp.context import check_trainer
from fsdp_exp.errors import fail
from fsdp_exp.models import attention_mask
from fsdp_exp.parallel.backend import backend_for
from fsdp_exp.parallel.checks import check_knobs, check_offload, check_precision, layout_for


def validate(cfg: RunConfig, *, cuda_devices: int, world_size: Optional[int] = None) -> Topology:
    """Check everything; return the resolved topology.

    ``world_size`` is given when ranks come from outside (torchrun, SLURM); otherwise it follows
    from ``trainer.nproc_per_node`` x ``trainer.nnodes``.
    """
    from fsdp_exp import debug, optim
    from fsdp_exp.data import check_config as check_data
    from fsdp_exp.metrics.flops import check_convention
    from fsdp_exp.models import get_spec
    from fsdp_exp.record.wandb_sink import check_logger

    t = cfg.trainer
    device_type, nproc, world = resolve_where(t, cuda_devices, world_size)
    # Each group by its owner, in the order a refusal reads best: where the run is, what it trains and how
    # long, the model (what follows reads its length and vocabulary), the optimizer, then the layout.
    check_trainer(t, device_type, backend_for(cfg).tracks_memory)
    check_convention(t.flops_convention)
    get_spec(cfg.model.name).check(cfg.model)  # the family must be registered (with a "did you mean")
    attention_mask.check(cfg, device_type)  # model.attention_mask, data.positions: packed documents kept apart
    optim.check(cfg.optim, t.steps)
    layout = layout_for(cfg, world, nproc, device_type)
    check_knobs(cfg, device_type)
    check_precision(cfg, device_type)
    check_offload(cfg, device_type)
    check_logger(cfg)
    debug.check(cfg, world)
    # What spans groups: the table below, then the data and the checkpoint (each reads several groups).
    for check in CROSS_GROUP:
        check(cfg, layout)
    check_data(cfg)
    check_checkpoint(cfg)
    per_rank = layout.local_batch(t.global_batch_size)
    micro = t.micro_batch_size if t.micro_batch_size is not None else per_rank
    return Topology(
        device_type=device_type,
        nproc_per_node=nproc,
        nnodes=t.nnodes,
        layout=layout,
        # Under pipeline parallel the trainer feeds each dp rank's whole batch to the schedule,
        # which cuts it into parallel.pp_microbatches (trainer.micro_batch_size is that cut).
        micro_batch_size=micro if layout.pp == 1 else per_rank,
        grad_accum_steps=per_rank // micro if layout.pp == 1 else 1,
    )


# ------------------------------------------------------------------------------------------ across groups
def _check_seq_len(cfg: RunConfig, layout: Layout) -> None:
    """trainer x model: the sequence fits the model's positions."""
    from fsdp_exp.models import spec_for

    t = cfg.trainer
    max_seq_len = spec_for(cfg.model).max_seq_len(cfg.model)
    if t.seq_len > max_seq_len:
        fail(
            f"trainer.seq_len={t.seq_len} exceeds the model's maximum sequence length {max_seq_len}.",
            f"pass trainer.seq_len={max_seq_len}, or a model with a longer one (model.max_seq_len="
            f"{t.seq_len} for Llama)",
        )


def _check_output_dtype(cfg: RunConfig, layout: Layout) -> None:
    """precision x trainer: the chunked loss is the model's output."""
    t, p = cfg.trainer, cfg.precision
    chunks = fixed_chunks(t.loss_chunks)
    if chunks is not None and chunks > 1 and p.output_dtype not in (None, "fp32"):
        # The chunked loss is taken inside the model's forward: the root's output is the loss itself.
        # (auto takes one chunk then: fsdp_exp.plan.predict.loss_chunks_for.)
        fail(
            f"precision.output_dtype={p.output_dtype} would round the loss: with trainer.loss_chunks="
            f"{t.loss_chunks} the model's output is the loss, not the logits.",
            "pass precision.output_dtype=null (or fp32), or trainer.loss_chunks=1 (or auto)",
        )


def _check_batch(cfg: RunConfig, layout: Layout) -> None:
    """trainer x layout: the batch divides over the data-parallel ranks, the micro-batch over a rank's share."""
    t = cfg.trainer
    dp = layout.dp
    if t.global_batch_size % dp:
        fail(
            f"trainer.global_batch_size={t.global_batch_size} does not divide over {dp} data-parallel ranks.",
            f"pass trainer.global_batch_size={dp * max(1, math.ceil(t.global_batch_size / dp))} "
            f"(a multiple of {dp}) or change trainer.nproc_per_node",
        )
    per_rank = layout.local_batch(t.global_batch_size)
    micro = t.micro_batch_size if t.micro_batch_size is not None else per_rank
    if micro < 1 or per_rank % micro:
        fail(
            f"trainer.micro_batch_size={micro} does not divide the {per_rank} sequences each of {dp} ranks "
            f"gets from trainer.global_batch_size={t.global_batch_size}.",
            f"pass trainer.micro_batch_size={_largest_divisor_at_most(per_rank, max(micro, 1))} "
            "(a divisor of the per-rank batch) or null",
        )


def _check_loss_chunks(cfg: RunConfig, layout: Layout) -> None:
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


# The checks that span config groups, in order (each owner's checks have run before them).
def _check_capacity_with_cp(cfg: RunConfig, layout: Layout) -> None:
    """model x parallel: a MoE's capacity factor under context parallel."""
    capacity = getattr(cfg.model, "capacity_factor", None)
    if layout.cp > 1 and capacity is not None:
        # An expert's capacity counts the tokens of one rank's micro-batch, and which copies pass it depends on
        # their order there: cp gives each rank a part of every sequence, so the same run would drop other
        # copies (and train to other losses) at each cp.
        fail(
            f"model.capacity_factor={capacity} with parallel.cp={layout.cp}: an expert's capacity is counted over "
            "one rank's tokens, and context parallel splits each sequence over ranks, so which copies are dropped "
            "would change with parallel.cp.",
            "pass model.capacity_factor=null (dropless), or parallel.cp=1",
        )


CROSS_GROUP = (_check_seq_len, _check_output_dtype, _check_batch, _check_loss_chunks, _check_capacity_with_cp)
