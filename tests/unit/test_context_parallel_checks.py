"""Context parallel without a process group: the causal load balance of the sequence shards and the
re-ordering that all-to-all attention relies on (the exchange itself runs in tests/integration)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_QWEN2

from fsdp_exp.parallel.context import (
    RING_REFUSAL,
    balanced_positions,
    causal_pairs,
    gathered_order,
    resolve_method,
)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_the_cp_ranks_hold_every_position_once(cp):
    seq = 64
    held = torch.cat([balanced_positions(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))


def test_each_rank_holds_a_head_chunk_and_its_mirror_tail_chunk():
    # 16 tokens over cp 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_equal_on_every_rank_and_a_plain_split_is_not(cp):
    seq = 256
    balanced = {causal_pairs(seq, cp, r) for r in range(cp)}
    assert len(balanced) == 1
    assert balanced.pop() * cp == seq * (seq + 1) // 2  # every query-key pair of the mask, counted once
    chunk = seq // cp  # the plain split: the last rank's queries see every key
    plain = [sum(range(r * chunk + 1, (r + 1) * chunk + 1)) for r in range(cp)]
    assert plain[-1] > 1.5 * plain[0]


def test_the_gathered_sequence_returns_to_its_natural_order():
    order = gathered_order(24, 3)
    natural = torch.arange(24).index_select(0, order).index_select(0, torch.argsort(order))
    assert natural.tolist() == list(range(24))


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="2 x cp = 8"):
        balanced_positions(20, 4, 0)


def test_auto_picks_ring_on_cuda_and_all_to_all_on_the_cpu():
    assert resolve_method("auto", "cuda") == "ring"
    assert resolve_method("auto", "cpu") == "all_to_all"
    assert resolve_method("ring", "cpu") == "ring"  # preflight refuses it there, naming RING_REFUSAL
    assert "_scaled_dot_product_flash_attention_for_cpu" in RING_REFUSAL


def test_a_published_context_parallel_row_is_expressed_as_parallel_cp_with_its_method():
    from fsdp_exp.tune.published import sharding_overrides

    row = {"sharding": "FSDP2 fully_shard", "framework": "torchtitan", "cp": "4", "ep": "", "tp": "2", "pp": "1"}
    assert sharding_overrides({**row, "notes": ""}) == [
        "sharding=full",
        "parallel.tp=2",
        "parallel.cp=4",
        "parallel.cp_method=ring",  # torchtitan's context parallel passes keys and values round the group
    ]
    ulysses = sharding_overrides({**row, "notes": "DeepSpeed-Ulysses sequence parallel"})
    assert ulysses[-1] == "parallel.cp_method=all_to_all"
    assert "parallel.ep=8" in sharding_overrides({**row, "ep": "8", "notes": ""})  # a published EP row is expressed


TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256"]


@pytest.mark.parametrize(
    "overrides,problem,fix",
    [
        (["parallel.cp=2", "parallel.cp_method=ring"], "cannot run on the CPU", "parallel.cp_method=all_to_all"),
        (
            ["parallel.cp=4", "trainer.seq_len=36", "trainer.nproc_per_node=4"],
            "2 x parallel.cp = 8",
            "trainer.seq_len=32",
        ),
        (["parallel.cp=4", "parallel.tp=2", "trainer.nproc_per_node=8"], "2 query heads", "parallel.cp=2"),
        (["parallel.cp=2", "sharding.backend=fsdp1"], "FSDP2 only", "sharding.backend=fsdp2"),
        (["parallel.cp=2", "sharding=ddp"], "FSDP2 only", "sharding.backend=fsdp2"),
        (["parallel.cp=3", "trainer.nproc_per_node=4"], "does not divide the 4 ranks", "parallel.cp=2"),
        ([*TINY_QWEN2, "parallel.cp=2"], "Qwen2ForCausalLM", "parallel.cp=1"),
    ],
    ids=["ring_on_cpu", "seq_len", "heads_after_tp", "fsdp1", "ddp", "divides_ranks", "transformers"],
)
def test_what_context_parallel_cannot_run_is_refused_by_name_before_any_rank_starts(overrides, problem, fix):
    from fsdp_exp.config import ConfigError
    from fsdp_exp.preflight import validate

    from conftest import run_config

    model = [] if "model=hf_qwen2_7b" in overrides else TINY
    cfg = run_config([*model, "trainer.seq_len=32", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(cfg, cuda_devices=0)
    assert problem in str(info.value) and fix in str(info.value), str(info.value)


def test_a_cp_run_lays_out_its_mesh_and_batch_as_torchtitan_orders_them():
    from fsdp_exp.preflight import validate

    from conftest import run_config

    t = validate(run_config([*TINY, "parallel.cp=2", "parallel.tp=2", "trainer.nproc_per_node=8"]), cuda_devices=0)
    assert (t.mesh_dim_names, t.mesh_shape) == (("shard", "cp", "tp"), (2, 2, 2))
    assert (t.dp_size, t.cp_size) == (2, 2)  # 2 batch shards, each sequence over 2 CP ranks


def test_ring_attention_has_no_rule_on_the_heads_and_all_to_all_names_ring_where_ring_would_run():
    from fsdp_exp.config import ConfigError
    from fsdp_exp.preflight import validate

    from conftest import run_config

    eight = [*TINY, "trainer.seq_len=32", "parallel.cp=8", "trainer.nproc_per_node=8"]  # 4 heads over cp 8
    validate(run_config([*eight, "parallel.cp_method=ring"]), cuda_devices=8)  # ring splits the sequence only
    with pytest.raises(ConfigError) as on_cuda:
        validate(run_config([*eight, "parallel.cp_method=all_to_all"]), cuda_devices=8)
    assert "4 query heads" in str(on_cuda.value) and "parallel.cp_method=ring, which runs here" in str(on_cuda.value)
    with pytest.raises(ConfigError) as on_cpu:  # ring cannot run on the CPU: not offered there
        validate(run_config([*eight, "parallel.cp_method=all_to_all"]), cuda_devices=0)
    assert "4 query heads" in str(on_cpu.value) and "cp_method=ring" not in str(on_cpu.value)


def test_a_ring_plan_with_more_cp_ranks_than_heads_plans():
    # Llama-3 8B (32 heads) at 262,144 tokens, each sequence over 64 ranks of 8 nodes: the long-context plan
    # that all-to-all's rule on the heads used to refuse.
    from fsdp_exp.plan.predict import plan
    from fsdp_exp.preflight import validate

    from conftest import run_config

    cfg = run_config(
        ["model=llama3_8b", "model.max_seq_len=262144", "trainer.nnodes=8", "trainer.nproc_per_node=8"]
        + ["trainer.seq_len=262144", "trainer.global_batch_size=1", "trainer.micro_batch_size=1"]
        + ["parallel.cp=64", "parallel.cp_method=ring", "ac=full", "precision=bf16"]
    )
    result = plan(cfg, validate(cfg, cuda_devices=8), device_kind="cuda")
    assert 0 < result.per_rank_bytes["total"] < 80 * 2**30
