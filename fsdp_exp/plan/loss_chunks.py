"""``trainer.loss_chunks=auto``: how many slices of the sequence the loss is taken in, decided by the planner.

The chunked loss (``fsdp_exp.models.loss``) holds one slice's fp32 logits at a time instead of all of them, and pays
for it with the output projection run again in backward (under ``torch.utils.checkpoint``): on a small model with a
large vocabulary that is about a tenth of the step (a 4,096 vocabulary, width 256, 3 blocks on 2 CPU ranks: 0.89x
against 1.07x with one chunk, issue #34). Whether the memory is worth that time is a question the planner answers.

The rule: plan the step both ways, with all the logits at once and in ``CHUNKS`` slices; chunk where chunking
lowers the planned peak (before the allocator's margin) by at least ``SIGNIFICANT`` of the one-chunk peak, take
one chunk where it does not. The peak counts every copy the loss makes (the logits in the compute dtype, their
fp32 copy, the log-softmax and its gradient: about 4 x batch x sequence x vocabulary bytes each in fp32), so a
vocabulary that is a large part of the step chunks and one that is not does not: a Llama-3 8B at sequence 8,192 on
8 GPUs (vocabulary 128,256) chunks (its peak falls 13%), a Llama-2 7B at 4,096 (vocabulary 32,000) does not (under
1%), nor the 4,096-vocabulary benchmark model (4%).

A number (``trainer.loss_chunks=8``) is taken as given. The launcher settles ``auto`` once, before any rank starts
(``fsdp_exp.launch.run_context``), into the config the ranks get, and records what was asked, chosen and why in
run.json's applied settings (``applied.loss_chunks``); the planner and tune resolve each candidate the same way
(``fsdp_exp.plan.predict.loss_chunks_for``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_exp.config.schema import LOSS_CHUNKS_AUTO as AUTO, fixed_loss_chunks as fixed  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig

CHUNKS = 8  # the slices auto takes where chunking pays: 1/8 of the logits alive at once
SIGNIFICANT = 0.10  # chunk where that lowers the planned peak by at least this share of the one-chunk peak


@dataclass(frozen=True)
class LossChunks:
    """What ``trainer.loss_chunks`` became: the number asked for or chosen, and why."""

    asked: str  # trainer.loss_chunks as given: auto or a number
    chunks: int
    why: str

    def record(self) -> dict:
        """run.json's ``applied.loss_chunks``."""
        return {"trainer.loss_chunks": self.asked, "resolved": self.chunks, "why": self.why}


def with_chunks(cfg: "RunConfig", chunks: int) -> "RunConfig":
    """A copy of ``cfg`` whose loss is taken in ``chunks`` slices (the other sections shared, not copied)."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, loss_chunks=str(chunks)))


def candidate(cfg: "RunConfig") -> int:
    """The slices auto weighs against one: ``CHUNKS``, at most the sequence's tokens (under sequence parallel the
    slices are of the micro-batch, which the loss caps itself: ``fsdp_exp.models.loss``)."""
    over_batch = cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel
    return CHUNKS if over_batch else max(1, min(CHUNKS, cfg.trainer.seq_len))


def decide(asked: str, chunks: int, peak_one: int, peak_chunked: int) -> LossChunks:
    """The rule (the module's docstring), from the planned peaks (bytes, before the margin) with one chunk and with
    ``chunks`` (``candidate``)."""
    saved = (peak_one - peak_chunked) / peak_one if peak_one > 0 else 0.0
    figures = f"{chunks} chunks plan a peak {saved:.1%} below one chunk's ({peak_one / 2**20:,.1f} MiB)"
    if chunks > 1 and saved >= SIGNIFICANT:
        return LossChunks(asked, chunks, f"auto: {figures}, at least {SIGNIFICANT:.0%}: the logits matter")
    return LossChunks(
        asked, 1, f"auto: {figures}, under {SIGNIFICANT:.0%}: one chunk, no recompute of the output projection"
    )


# What slicing can save at most, per logit this rank makes with one slice: the logits (at most fp32), their fp32
# copy, log_softmax's output and the loss parallel's extra fp32 tensor (fsdp_exp.plan.step.StepWalk.loss).
LOSS_BYTES_BOUND = 16


def small_logits(asked: str, chunks: int, peak_one: int, bound: int) -> LossChunks:
    """The rule's answer where the one-slice loss's logits cannot reach ``SIGNIFICANT`` of the peak (``bound``:
    ``LOSS_BYTES_BOUND`` a logit): slicing cannot lower the peak that much, one chunk without planning it."""
    return LossChunks(
        asked,
        1,
        f"auto: {chunks} chunks could save at most {bound / 2**20:,.1f} MiB (the one-slice logits), under "
        f"{SIGNIFICANT:.0%} of one chunk's peak ({peak_one / 2**20:,.1f} MiB): one chunk, no recompute of the output "
        "projection",
    )


def given(asked: str, chunks: int) -> LossChunks:
    return LossChunks(asked, chunks, "as given")
