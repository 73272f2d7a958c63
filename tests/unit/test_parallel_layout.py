"""The run's layout (fsdp_exp/config/layout.py): the one owner of the parallel degrees and every size derived from
them; preflight builds it once and the planner, the step-time model and tune read it. Then the 4-D layouts of a
405B model and a mixture of experts with stages, which preflight accepts and the planner and tune weigh (the
runtime runs each product: tests/integration/test_layouts.py)."""

from __future__ import annotations

import pytest

from fsdp_exp.config.layout import Layout, ep_values
from fsdp_exp.config.topology import Topology
from fsdp_exp.errors import ConfigError
from fsdp_exp.plan import plan
from fsdp_exp.preflight import validate

from conftest import run_config

H405 = [
    "model=llama3_405b",
    "trainer.nproc_per_node=8",
    "trainer.nnodes=64",
    "trainer.seq_len=131072",
    "trainer.global_batch_size=16",
    "precision=bf16",
    "ac=full",
    "parallel.tp=8",
    "parallel.sequence_parallel=true",
    "parallel.pp=8",
    "parallel.cp=4",
]


def test_the_degrees_multiply_to_the_world_and_the_data_parallel_ranks_are_what_pp_cp_tp_leave():
    layout = Layout.of(512, pp=8, cp=4, tp=8)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate) == (2, 2, 1)
    assert layout.mesh_shape == (8, 2, 4, 8) and layout.mesh_dim_names == ("pp", "dp", "cp", "tp")
    with pytest.raises(ValueError, match="is not the world"):
        Layout(world=16, pp=2, dp_shard=2, tp=2)


def test_fsdp_shards_a_dense_weight_over_shard_x_cp_and_the_experts_over_what_ep_leaves_of_them():
    layout = Layout.of(64, cp=2, tp=2, ep=4, replicate=2, dp_names=("replicate", "shard"))
    assert (layout.dp, layout.dp_replicate, layout.dp_shard) == (16, 2, 8)
    assert layout.shard_cp == 16 and layout.efsdp == 4 and layout.replicas == 2
    assert layout.mesh_dim_names == ("replicate", "shard", "cp", "tp") and layout.mesh_shape == (2, 8, 2, 2)


def test_a_rank_reads_the_batch_share_of_its_data_parallel_index_cp_and_tp_ranks_share_one():
    layout = Layout.of(16, cp=2, tp=2)  # rank = (dp_i x cp + cp_i) x tp + tp_i
    assert [layout.dp_rank(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert layout.coordinates(13) == {"shard": 3, "cp": 0, "tp": 1}
    piped = Layout.of(16, pp=2, tp=2)  # the pp index is outermost: rank 8 is stage 1's first dp rank
    assert piped.dp_rank(8) == 0 and piped.dp_rank(10) == 1


def test_the_expert_parallel_degrees_to_try_are_the_divisors_of_the_shard_x_cp_ranks_up_to_64():
    assert ep_values(12) == [1, 2, 3, 4, 6, 12]
    assert ep_values(256)[-1] == 64
    assert ep_values() == [1, 2, 4, 8, 16, 32, 64]


def test_preflight_builds_the_layout_once_and_the_topology_reads_its_sizes_from_it():
    topology = validate(
        run_config(["trainer.nproc_per_node=8", "sharding=hybrid", "sharding.shard_size=4"]), cuda_devices=0
    )
    layout = topology.layout
    assert (layout.dp_replicate, layout.dp_shard) == (2, 4) and topology.dp_size == layout.dp == 8
    assert topology.mesh_dim_names == ("replicate", "shard") and topology.mesh_shape == (2, 4)
    record = topology.as_dict()
    assert Topology.from_dict(record) == topology
    # a record written before the layout was: its mesh describes it
    older = {k: v for k, v in record.items() if k != "layout"}
    assert Topology.from_dict(older).layout == layout


def test_a_stage_split_under_hybrid_is_the_layouts_and_needs_a_size_named():
    cfg = run_config(["trainer.nproc_per_node=8", "parallel.pp=2", "sharding=hybrid", "sharding.replicate_size=2"])
    layout = Layout.for_stages(cfg, 4)
    assert (layout.dp_replicate, layout.dp_shard, layout.mesh_dim_names) == (2, 2, ("pp", "dp"))
    with pytest.raises(ConfigError, match="needs the split of each stage"):
        Layout.for_stages(run_config(["trainer.nproc_per_node=8", "parallel.pp=2", "sharding=hybrid"]), 4)


def test_a_run_of_pp_x_cp_x_tp_with_sequence_parallel_is_accepted_with_its_4d_mesh():
    topology = validate(run_config(H405), cuda_devices=8)
    assert topology.mesh_shape == (8, 2, 4, 8)
    assert topology.mesh_dim_names == ("pp", "dp", "cp", "tp")


def test_llama3_405b_on_512_h100_with_fsdp_tp8_sp_pp8_cp4_at_128k_tokens_fits_per_stage():
    cfg = run_config(H405)
    topology = validate(cfg, cuda_devices=8)
    result = plan(cfg, topology, device_kind="cuda")
    # Each stage holds 1/8 of the blocks; TP 8 and FSDP over shard x cp = 8 shard them 64 ways: fp32 parameters,
    # gradients and two AdamW moments of 405.9e9 / 8 / 64 each, about 11.8 GiB in all
    states = result.model_states["device"]["total"]
    assert 10 * 2**30 < states < 14 * 2**30
    # Without CP in the stages' plan a 128K-token micro-batch would not fit any GPU: with it, an H100 does
    assert result.per_rank_bytes["total"] < 80e9


def test_a_mixture_of_experts_with_stages_and_expert_parallel_is_planned_its_experts_split_over_ep():
    base = ["model=qwen3_moe_30b_a3b", "trainer.nproc_per_node=8", "trainer.nnodes=4", "parallel.pp=4"]
    base += ["precision=bf16", "trainer.global_batch_size=64", "trainer.seq_len=4096", "ac=full"]
    needs = {}
    for ep in (1, 8):
        cfg = run_config([*base, f"parallel.ep={ep}"])
        topology = validate(cfg, cuda_devices=8)
        assert topology.layout.efsdp == 8 // ep
        needs[ep] = plan(cfg, topology, device_kind="cuda").per_rank_bytes["total"]
    assert needs[8] < needs[1]  # each rank gathers its experts/ep only


def test_tune_ranks_stages_with_expert_parallel_and_can_choose_them_for_measurement():
    from fsdp_exp.tune import measure
    from fsdp_exp.tune.options import split_argv
    from fsdp_exp.tune.search import weigh

    run = [
        "model=moe_tiny",
        "trainer.device=cuda",
        "trainer.nproc_per_node=4",
        "trainer.global_batch_size=16",
        "sharding=full",
    ]
    run += ["offload=none", "prefetch=default", "ac=none", "precision=fp32"]
    opts, overrides = split_argv(
        run + ["plan.device=h100_80gb", "tune.space.pp=[1,2]", "tune.space.ep=[1,2]", "tune.space.micro_batch_size=[2]"]
    )
    tuning = weigh(overrides, opts)
    staged = [w for w in tuning.ranked if w.candidate.cfg.parallel.pp == 2 and w.candidate.cfg.parallel.ep == 2]
    assert staged and all(w.refused is None for w in staged)
    assert all(w.topology.layout.efsdp == 1 for w in staged)  # ep 2 of a stage's 2 dp ranks
    chosen = measure.choose(tuning, opts)
    assert chosen


def test_the_stage_step_time_counts_each_stages_cp_traffic_and_its_experts_over_efsdp():
    from fsdp_exp.tune.pipeline_perf import pipeline_costs

    def purposes(overrides):
        cfg = run_config(["trainer.device=cuda", "trainer.nproc_per_node=8", "parallel.pp=2", *overrides])
        costs = pipeline_costs(cfg, validate(cfg, cuda_devices=8))
        rank = costs.ranks[0]
        return {t.purpose: t.ranks for c in rank.compute for t in c.traffic} | {
            t.purpose: t.ranks for t in rank.traffic
        }

    cp = purposes(["trainer.seq_len=256", "parallel.cp=2", "parallel.cp_method=all_to_all"])
    assert any(p.startswith("context-parallel all-to-all") for p in cp)
    assert cp["stage all-gather"] == 4  # a stage's 2 dp ranks x cp 2
    moe = purposes(["model=moe_tiny", "parallel.ep=2", "trainer.global_batch_size=8"])
    assert moe["stage experts' all-gather (efsdp)"] == 2  # a stage's 4 dp ranks over ep 2
    assert any(p.startswith("expert all-to-all") for p in moe)
