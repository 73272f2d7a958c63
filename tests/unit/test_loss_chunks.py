"""trainer.loss_chunks=auto (issue #34 item 6): the planner decides whether the loss is taken in slices, the launcher
settles the choice before any rank starts, and the step-time model and HFU count the output projection a chunked
loss runs again in backward."""

from __future__ import annotations

import pytest

from fsdp_exp.launch import prepare, run_context
from fsdp_exp.plan import loss_chunks_for, plan
from fsdp_exp.plan.loss_chunks import CHUNKS, SIGNIFICANT, with_chunks
from fsdp_exp.preflight import validate
from fsdp_exp.tune.perf import step_costs
from tests.conftest import run_config

# benchmarks/overhead.py's model: a 4,096 vocabulary, width 256, 3 blocks, 2 ranks (4 sequences of 128 each)
SMALL = [
    "model.dim=256",
    "model.n_layers=3",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=4096",
    "model.multiple_of=64",
    "trainer.nproc_per_node=2",
    "trainer.global_batch_size=8",
    "trainer.seq_len=128",
]
# Llama-3 8B at sequence 8,192 on 8 GPUs: a 128,256 vocabulary's logits are gigabytes per rank
LARGE = ["model=llama3_8b", "trainer.nproc_per_node=8", "precision=bf16", "trainer.global_batch_size=16"]
LARGE += ["trainer.seq_len=8192"]


def _peaks(cfg, topology, kind=None) -> tuple[int, int]:
    return tuple(plan(with_chunks(cfg, n), topology, device_kind=kind).peak["total"] for n in (1, CHUNKS))


def test_auto_takes_one_chunk_where_slicing_the_logits_barely_lowers_the_peak():
    cfg = run_config(SMALL)
    assert cfg.trainer.loss_chunks == "auto"  # the default
    topology = validate(cfg, cuda_devices=0)
    one, chunked = _peaks(cfg, topology)
    assert 0 < (one - chunked) / one < SIGNIFICANT  # the logits are there, but a small part of the peak
    chosen = loss_chunks_for(cfg, topology)
    assert chosen.chunks == 1 and chosen.asked == "auto" and "under 10%" in chosen.why
    # The plan of auto is the plan of its choice, and says what was chosen
    result = plan(cfg, topology)
    assert result.peak["total"] == one
    assert any(note.startswith("trainer.loss_chunks=auto -> 1") for note in result.assumptions)


def test_auto_chunks_where_the_logits_are_a_large_part_of_the_peak():
    cfg = run_config(LARGE)
    topology = validate(cfg, cuda_devices=8)
    one, chunked = _peaks(cfg, topology, "cuda")
    assert (one - chunked) / one >= SIGNIFICANT
    chosen = loss_chunks_for(cfg, topology, "cuda")
    assert chosen.chunks == CHUNKS and "the logits matter" in chosen.why
    assert plan(cfg, topology, device_kind="cuda").peak["total"] == chunked


def test_a_number_is_taken_as_given_and_an_output_dtype_keeps_the_logits_whole():
    cfg = run_config([*SMALL, "trainer.loss_chunks=8"])
    assert loss_chunks_for(cfg, validate(cfg, cuda_devices=0)).chunks == 8
    cfg = run_config([*LARGE, "precision.output_dtype=bf16"])
    chosen = loss_chunks_for(cfg, validate(cfg, cuda_devices=8), "cuda")
    assert chosen.chunks == 1 and "output_dtype" in chosen.why


def test_the_launcher_settles_auto_for_the_ranks_and_records_what_it_chose(tmp_path):
    cfg = run_config(SMALL)
    context = run_context(cfg, prepare(cfg), tmp_path)
    assert context.config.trainer.loss_chunks == "1"  # what every rank reads: a number
    assert context.loss_chunks["trainer.loss_chunks"] == "auto" and context.loss_chunks["resolved"] == 1
    assert context.loss_chunks["why"].startswith("auto:")


def test_the_step_time_model_and_hfu_count_the_output_projection_once_more_under_a_chunked_loss():
    """The yardstick: torch's FlopCounterMode over the model's own chunked loss on the meta device (forward and
    backward, the slices checkpointed) against the plain loss, and the formula 2 x width x vocabulary."""
    from fsdp_exp.metrics.flops import recompute_flops_per_token
    from fsdp_exp.parallel.ac import apply as apply_checkpointing

    tiny = run_config(["trainer.loss_chunks=8"])  # the default model: the counter runs it quickly
    seq, head = tiny.trainer.seq_len, 2 * tiny.model.dim * tiny.model.vocab_size
    assert recompute_flops_per_token(tiny, seq, apply_checkpointing, 8) == pytest.approx(head)
    assert recompute_flops_per_token(tiny, seq, apply_checkpointing, 1) == 0

    head = 2 * 256 * 4096
    for ac in ("none", "full"):
        chunked, whole = (run_config([*SMALL, f"ac={ac}", f"trainer.loss_chunks={n}"]) for n in (8, 1))
        topology = validate(chunked, cuda_devices=0)
        tokens_rank = chunked.trainer.global_batch_size * chunked.trainer.seq_len / topology.dp_size
        more = step_costs(chunked, topology).backward_flops - step_costs(whole, topology).backward_flops
        assert more == pytest.approx(tokens_rank * head), ac
        if ac == "none":  # auto on this model takes one chunk: nothing recomputed
            auto = run_config(SMALL)
            assert step_costs(auto, topology).backward_flops == step_costs(whole, topology).backward_flops


LLAMA2_7B = ["model=llama7b", "trainer.nproc_per_node=8", "precision=bf16", "trainer.global_batch_size=16"]


@pytest.mark.parametrize(
    "overrides",
    [
        LARGE,
        [*LARGE, "trainer.seq_len=2048"],
        [*LARGE, "trainer.seq_len=4096", "trainer.micro_batch_size=1"],
        [*LARGE, "ac=full"],
        [*LARGE, "parallel.pp=2", "trainer.seq_len=4096"],
        [*LARGE, "parallel.pp=2", "ac=full"],
        [*LLAMA2_7B, "trainer.seq_len=4096"],
        [*LLAMA2_7B, "trainer.seq_len=4096", "parallel.pp=2"],
    ],
    ids=["8192", "2048", "4096-mb1", "ac-full", "pp2-4096", "pp2-ac-full", "7b-bound", "7b-pp2-bound"],
)
def test_the_logits_bound_decides_as_planning_both_ways_would(overrides):
    """loss_chunks_for skips planning the sliced step where the one-slice logits cannot reach the rule's share of
    the peak (tune's 70B search: 40.8 s of CPU planning both ways, 14.6 s with the bound); the choice is the one the
    two planned peaks give, on both sides of the rule's line and under stages."""
    from fsdp_exp.plan.loss_chunks import candidate, decide

    cfg = run_config(overrides)
    topology = validate(cfg, cuda_devices=8)
    one, chunked = (plan(with_chunks(cfg, n), topology, device_kind="cuda").peak["total"] for n in (1, candidate(cfg)))
    expected = decide("auto", candidate(cfg), one, chunked).chunks
    assert loss_chunks_for(cfg, topology, "cuda").chunks == expected
