"""The pipeline planner (fsdp_exp/plan/pipeline.py) and the stage cut (fsdp_exp/parallel/pipeline.py),
against figures worked out by hand.

The model: TINY_MODEL with 4 blocks (width 64, 4 query heads of 16, 2 key/value heads, SwiGLU width 192,
vocabulary 256). Parameters by hand:
    a block: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 = 12288, SwiGLU 3*64*192 = 36864, two norms 128: 49280
    embeddings 256*64 = 16384; final norm 64 + output projection 256*64 = 16448
pp=2, balanced: stage 0 = blocks 0-1 + embeddings = 114944, stage 1 = blocks 2-3 + norm + output = 115008.
Activations of one micro-batch of 2 sequences of 32 tokens (64 tokens), fp32, per block (see
plan/activations/llama.py for which tensors): residual 2*4*64*64 = 32768, norms 2*(4*64 + 4*4096 + 4*4096)
= 66048, attention 4*64*64*2 + 2*4*64*32 + 4*2*4*32 = 50176, SwiGLU 4*4*64*192 = 196608: 345600.
The last stage adds the final norm (4*4096 + 4*64 + 2*4*4096 = 49408) and one slice of the loss's fp32
log-softmax (4*64*256 / 8 = 8192: trainer.loss_chunks=8 slices of the sequence, one alive at a time): 57600,
and its forward cache keeps the logits (4*64*256 = 65536). A stage's input or
output (the residual stream of one micro-batch) is 4*64*64 = 16384: every stage but the first receives its
input into one of torch's receive buffers (m of them) instead of the first block's saved input, every stage
but the last keeps its output for backward and receives its gradient (m buffers). A block's backward makes
temporaries: the residual's gradient 16384, SwiGLU's two gradients 2*4*64*192 = 98304 and w2's weight
gradient 4*64*192 = 49152: 163840. Each stage holds the rotary table (16384 bytes).
"""

from __future__ import annotations

import pytest

from conftest import TINY_BATCH, TINY_MODEL, run_config
from fsdp_exp.errors import ConfigError
from fsdp_exp.parallel.pipeline import PipelineSettings, balanced_split, check, stage_blocks, stages_of_rank
from fsdp_exp.plan.pipeline import bubble_fraction, in_flight, pipeline_plan

BLOCK, HEAD, LOGITS, RESID, TEMP, ROPE = 345600, 57600, 65536, 16384, 163840, 16384
PARAMS_0, PARAMS_1 = 4 * 114944, 4 * 115008  # fp32
STATES_0, STATES_1 = 4 * PARAMS_0, 4 * PARAMS_1  # fp32 parameters, gradients and two AdamW moments
FIRST, LAST = 2 * BLOCK + RESID, 2 * BLOCK - RESID + HEAD + LOGITS  # a micro-batch of either stage at pp=2


@pytest.fixture(scope="module")
def cfg():
    # trainer.loss_chunks=8 as the figures above were worked out (auto would take one chunk for this model)
    return run_config([*TINY_MODEL, "model.n_layers=4", *TINY_BATCH, "trainer.loss_chunks=8"])


def test_one_f_one_b_holds_pp_minus_i_micro_batches_on_stage_i_and_gpipe_all_of_them():
    assert [in_flight("1f1b", 4, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, i, 2) for i in range(4)] == [2, 2, 2, 1]  # never more than there are
    assert [in_flight("gpipe", 4, i, 8) for i in range(4)] == [8, 8, 8, 8]
    assert in_flight("looped_bfs", 2, 0, 4, 2) == 8


def test_interleaved_one_f_one_b_holds_torch_warm_up_plus_one():
    # pp=2, m=4, v=2: 2 rounds of 2; rank 0 warms up (2-1)*2 + 2*(2-1-0) = 4 forwards, rank 1 2
    assert [in_flight("interleaved_1f1b", 2, i, 4, 2) for i in range(2)] == [5, 3]
    # pp=4, m=4, v=2: one round of 4; rank 0: 4 + 6 = 10, capped at m*v = 8
    assert in_flight("interleaved_1f1b", 4, 0, 4, 2) == 8


def test_bubble_is_pp_minus_one_over_m_plus_pp_minus_one_and_interleaving_divides_it():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


def test_the_balanced_cut_gives_the_embeddings_stage_fewer_blocks():
    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([1, 1, 1, 1], 2, first_extra=3) == [1]  # stage 0: 1 + 3, stage 1: 3
    assert balanced_split([5, 1, 1, 1, 1, 5], 3) == [1, 5]


def test_stages_split_balanced_by_parameters_or_at_the_given_blocks(cfg):
    assert stage_blocks(PipelineSettings(pp=2), cfg.model) == [[0, 1], [2, 3]]
    assert stage_blocks(PipelineSettings(pp=2, split=(1,)), cfg.model) == [[0], [1, 2, 3]]
    assert stage_blocks(PipelineSettings(pp=2, schedule="interleaved_1f1b", stages_per_rank=2), cfg.model) == [
        [0],
        [1],
        [2],
        [3],
    ]
    assert stages_of_rank(PipelineSettings(pp=2, schedule="interleaved_1f1b", stages_per_rank=2), 1) == [1, 3]
    assert stages_of_rank(PipelineSettings(pp=2, schedule="zbv_zero_bubble", stages_per_rank=2), 0) == [0, 3]


def test_one_f_one_b_peaks_on_the_first_stage_with_two_micro_batches_in_flight(cfg):
    plan = pipeline_plan(cfg, PipelineSettings(pp=2, schedule="1f1b", microbatches=4), dp=1)
    first, last = plan.ranks
    assert (first.params, last.params) == (114944, 115008)
    assert (first.model_states, last.model_states) == (STATES_0, STATES_1)
    assert (first.per_microbatch, last.per_microbatch) == (FIRST, LAST)
    assert (first.activations, last.activations) == (2 * FIRST, LAST)
    # a forward follows the first backward: the peak holds the unsharded gradients beside the parameters
    assert (first.unsharded, first.p2p_buffers, first.module_buffers) == (2 * PARAMS_0, 4 * RESID, ROPE)
    # the sharded parameters and the moments, the unsharded parameters and gradients, two micro-batches
    assert plan.peak_rank.rank == 0 and plan.peak == 5 * PARAMS_0 + 2 * FIRST + 4 * RESID + ROPE + TEMP == 3959808
    assert plan.bubble == pytest.approx(1 / 5)


def test_gpipe_peaks_on_the_last_stage_holding_every_micro_batch_and_the_logits(cfg):
    plan = pipeline_plan(cfg, PipelineSettings(pp=2, schedule="gpipe", microbatches=4), dp=1)
    assert plan.peak_rank.rank == 1  # at the first backward: every micro-batch, no gradients yet
    assert plan.peak == 4 * PARAMS_1 + 4 * LAST + 4 * RESID + ROPE + TEMP == 5277696


def test_interleaving_holds_more_but_smaller_micro_batches(cfg):
    plan = pipeline_plan(
        cfg, PipelineSettings(pp=2, schedule="interleaved_1f1b", microbatches=4, stages_per_rank=2), dp=1
    )
    first, last = plan.ranks
    assert (first.stages, last.stages) == ((0, 2), (1, 3))
    # rounds of 2 micro-batches a local stage: rank 0 forwards stage 0 twice, stage 2 twice, stage 0 again
    assert (first.activations, last.activations) == (3 * (BLOCK + RESID) + 2 * BLOCK, 3 * BLOCK - RESID + HEAD + LOGITS)
    assert plan.peak_rank.rank == 0 and plan.bubble == pytest.approx(1 / 9)


def test_fsdp2_over_dp_halves_the_states_and_keeps_the_stage_unsharded_through_the_step(cfg):
    plan = pipeline_plan(cfg, PipelineSettings(pp=2, schedule="1f1b", microbatches=2), dp=2)
    first = plan.ranks[0]
    assert first.model_states == STATES_0 // 2
    # the parameters, whole; the gradients come later (no forward follows the first backward at m = 2)
    assert first.unsharded == PARAMS_0
    assert first.per_microbatch == FIRST  # still 2 sequences a micro-batch: 8 / dp 2 / 2 micro-batches


@pytest.mark.parametrize(
    "settings, fix",
    [
        (PipelineSettings(pp=2, schedule="1f1b", stages_per_rank=2), "parallel.pp_stages_per_rank=1"),
        (PipelineSettings(pp=2, schedule="zbv_zero_bubble"), "parallel.pp_stages_per_rank=2"),
        (PipelineSettings(pp=2, microbatches=3), "parallel.pp_microbatches that divides"),
        (PipelineSettings(pp=2, microbatches=1), "parallel.pp_microbatches>=2"),
        (PipelineSettings(pp=8), "model.n_layers>=8"),
        (PipelineSettings(pp=2, split=(4,)), "parallel.pp_split=null"),
        (PipelineSettings(pp=2, schedule="chimera"), "parallel.pp_schedule=gpipe|1f1b"),
    ],
)
def test_a_pipeline_it_cannot_run_is_refused_naming_the_fix(cfg, settings, fix):
    with pytest.raises(ConfigError, match="fix: .*" + fix.replace("|", r"\|")):
        check(settings, cfg.model, local_batch=8)


def _held_at_peak(actions) -> int:
    """The most micro-batches a rank's action list has forwarded and not yet backwarded (the input-gradient
    half of a split backward frees them too)."""
    held = peak = 0
    for action in actions:
        kind = None if action is None else action.computation_type.value
        held += 1 if kind == "F" else -1 if kind in ("B", "I") else 0
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [2, 4])
def test_the_in_flight_rules_are_what_torch_schedules_do(pp):
    """torch builds every rank's action list when a schedule is made: read them (on torch's in-process fake
    process group: no ranks, no traffic) and count what each rank holds at its peak."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from fsdp_exp.parallel.pipeline import SCHEDULES, SINGLE_STAGE

    dist.init_process_group("fake", rank=0, world_size=pp, store=dist.HashStore())
    try:
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2)):
            for m in (pp, 2 * pp):
                stages = [
                    pipelining.PipelineStage(torch.nn.Linear(2, 2), k * pp, pp * v, torch.device("cpu"))
                    for k in range(v)
                ]
                cls = getattr(pipelining, SCHEDULES[schedule][0])
                made = cls(stages[0] if schedule in SINGLE_STAGE else stages, m, loss_fn=lambda out, target: out.sum())
                torch_held = [_held_at_peak(made.pipeline_order[rank]) for rank in range(pp)]
                assert torch_held == [in_flight(schedule, pp, rank, m, v) for rank in range(pp)], (schedule, m)
    finally:
        dist.destroy_process_group()
