"""The step-time model and the tuner for a mixture of experts: the routed experts' grouped matmuls by tokens per
expert, expert parallel's all-to-alls by where its group sits, the experts' FSDP traffic over the ranks EP leaves,
the load imbalance, and ``ep`` in tune's space (fsdp_exp/tune/experts_perf.py, fsdp_exp/tune/space.py). No process group:
configs are validated for a GPU node (``cuda_devices=8``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from fsdp_exp.plan.devices import DEVICES
from fsdp_exp.preflight import validate
from fsdp_exp.tune.experts_perf import ExpertCosts, expert_layers, grouped_seconds, rank_load
from fsdp_exp.tune.perf import step_costs, timing
from fsdp_exp.tune.traffic import traffic_seconds
from fsdp_exp.tune.space import build_space, label
from fsdp_exp.tune.work import work

from conftest import run_config

H100 = DEVICES["h100_80gb"].perf
# moe_tiny with 8 experts, so that ep reaches 8 ranks; 2 sequences of 128 tokens per rank, one micro-batch each
MOE = ["model=moe_tiny", "model.n_experts=8", "trainer.seq_len=128", "trainer.global_batch_size=16"]


@functools.cache
def _composed(extra: tuple[str, ...] = ()):
    return run_config([*MOE, "trainer.nproc_per_node=8", *extra])


def _costs(extra: tuple[str, ...] = (), ep: int = 1, nodes: int = 1, imbalance: float = 1.0):
    """moe_tiny's step on 8 ranks (``nodes`` nodes of 8 / nodes) at ``ep``: one composition per ``extra``, the
    rest replaced in the config as Hydra would set it."""
    cfg = _composed(tuple(extra))
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, ep=ep),
        trainer=dataclasses.replace(cfg.trainer, nproc_per_node=str(8 // nodes), nnodes=nodes),
    )
    return step_costs(cfg, validate(cfg, cuda_devices=8 // nodes), imbalance)


def _purpose(costs, purpose: str):
    return next((t for t in costs.traffic if t.purpose == purpose), None)


def test_the_work_count_keeps_the_experts_grouped_matmuls_apart_from_attention():
    """moe_tiny: 2 layers, top-2 of 8 experts, width 64: three grouped matmuls a layer of 2 x 64 x 64 FLOPs per
    routed copy, two copies a token; attention over 128 tokens is 4 x 128 x 64 a layer, as a dense model's."""
    w = work(_composed())
    assert w.routed_copies_per_token == 2
    assert w.grouped_gemms == ((64, 64, 8, 2 * 3 * 2 * 64 * 64 * 2),)
    assert w.attention_flops_per_token == pytest.approx(2 * 4 * 128 * 64)


def test_more_tokens_per_expert_make_the_grouped_matmuls_faster_per_flop():
    flops = 1e12
    for perf in (H100, dataclasses.replace(H100, grouped_gemm_half_tokens=10.25, kernels=False)):
        seconds = [
            grouped_seconds(ExpertCosts(1, m, 1.0, ((m, 2048.0, 768.0, flops),), flops), perf, 700e12, 2)
            for m in (4, 32, 256, 2048)
        ]
        assert seconds == sorted(seconds, reverse=True) and len(set(seconds)) == 4
    # the fall has its stated shape where the roofline does not bind (a slow rate): m / (m + 64) of the large-shape rate
    big = grouped_seconds(ExpertCosts(1, 1e6, 1.0, ((1e6, 8192.0, 8192.0, flops),), flops), H100, 50e12, 2)
    at_64 = grouped_seconds(ExpertCosts(1, 64, 1.0, ((64.0, 8192.0, 8192.0, flops),), flops), H100, 50e12, 2)
    assert at_64 / big == pytest.approx(2.0, rel=0.01)


def test_each_expert_gets_tokens_times_k_over_experts_and_ep_times_that_under_expert_parallel():
    """2 sequences of 128 tokens a micro-batch x top-2 / 8 experts = 64 copies an expert at ep=1; each EP rank
    runs its 8 / ep experts on the copies of the ep ranks of its group."""
    for ep in (1, 2, 4, 8):
        costs = _costs(ep=ep)
        assert costs.experts.tokens_per_expert == pytest.approx(ep * 2 * 128 * 2 / 8)
    # more tokens per expert: the same FLOPs take less time at ep=8 than at ep=1
    one, eight = (_costs(ep=ep) for ep in (1, 8))
    assert grouped_seconds(eight.experts, H100, 700e12, 2) < grouped_seconds(one.experts, H100, 700e12, 2)


def test_expert_parallel_dispatches_and_combines_by_all_to_all_and_recomputes_them_under_checkpointing():
    layers = 2
    plain = _costs(ep=4)
    forward, backward = _purpose(plain, "expert all-to-all (forward)"), _purpose(plain, "expert all-to-all (backward)")
    assert (forward.ranks, forward.nodes, forward.count, backward.count) == (4, 1, 2 * layers, 2 * layers)
    assert not forward.overlappable
    # each all-to-all moves this rank's routed copies: 2 sequences x 128 tokens x top-2 x width 64, fp32
    assert forward.bytes == pytest.approx(2 * layers * 2 * 128 * 2 * 64 * 4)
    recomputed = _costs(("ac=full",), ep=4)
    assert _purpose(recomputed, "expert all-to-all (backward)").count == 4 * layers
    assert _purpose(_costs(), "expert all-to-all (forward)") is None


def test_an_ep_group_over_the_network_costs_more_than_one_inside_a_node():
    """8 ranks either way: one node of 8 (the EP group on NVLink) or two of 4 (ep=8 spans both)."""
    inside = _costs(ep=8)
    across = _costs(ep=8, nodes=2)
    a, b = _purpose(inside, "expert all-to-all (forward)"), _purpose(across, "expert all-to-all (forward)")
    assert (a.nodes, b.nodes) == (1, 2) and a.bytes == b.bytes
    assert traffic_seconds(b, H100, 4) > traffic_seconds(a, H100, 8)
    assert (
        timing(across, H100).comm["expert all-to-all (forward)"]
        > timing(inside, H100).comm["expert all-to-all (forward)"]
    )
    # no ring: half of each rank's copies cross the network at once with the node's other 3 ranks' halves
    network = H100.inter.gbps / 4 * 1e9
    expected = b.count * (3 * H100.intra.latency_us + 4 * H100.inter.latency_us) * 1e-6 + 4 / 8 * b.bytes / network
    assert traffic_seconds(b, H100, 4) == pytest.approx(expected)
    # ep=4 on the two-node cluster stays inside a node (the group's ranks are consecutive)
    assert (
        _purpose(
            _costs(ep=4, nodes=2),
            "expert all-to-all (forward)",
        ).nodes
        == 1
    )


def test_expert_parallel_cuts_the_experts_fsdp_traffic_to_the_ranks_it_leaves():
    _, expert_numel = expert_layers(_composed())
    assert expert_numel == 2 * 8 * 3 * 64 * 64  # 2 layers of 8 experts, three 64 x 64 weights each
    one = _costs(("precision=bf16",))
    two = _costs(("precision=bf16",), ep=2)
    gathered = _purpose(one, "forward all-gather")
    dense, experts = _purpose(two, "forward all-gather"), _purpose(two, "experts' all-gather (efsdp)")
    assert dense.bytes == pytest.approx(gathered.bytes - 2 * expert_numel)  # bf16: the experts left the units
    assert (experts.ranks, experts.bytes) == (4, 2 * expert_numel / 2)  # efsdp = 8 / 2, each rank's half
    assert _purpose(two, "experts' reduce-scatter (efsdp)").bytes == 4 * expert_numel / 2  # fp32 reduce
    wire = dataclasses.replace(H100, intra=dataclasses.replace(H100.intra, latency_us=0.0))  # bytes, not latency
    ep1_seconds = traffic_seconds(gathered, wire, 8)
    assert traffic_seconds(dense, wire, 8) + traffic_seconds(experts, wire, 8) < ep1_seconds
    # ep = the shard ranks: every rank holds its experts whole, nothing of them to gather
    eight = _costs(ep=8)
    assert not [t for t in eight.traffic if t.purpose.startswith("experts'")]


def test_the_most_loaded_rank_sets_the_pace_under_expert_parallel_only():
    assert rank_load(2.0, 8, 1) == 1.0 and rank_load(1.0, 8, 8) == 1.0
    assert rank_load(2.0, 8, 8) == pytest.approx(2.0)  # one expert a rank: its own imbalance
    loads = [rank_load(2.0, 128, ep) for ep in (2, 8, 32, 128)]
    assert loads == sorted(loads) and 1.0 < loads[0] < loads[-1] == pytest.approx(2.0)
    for ep, slower in ((1, False), (8, True)):
        even = timing(_costs(ep=ep), H100).step_time_s
        skewed = timing(_costs(ep=ep, imbalance=3.0), H100).step_time_s
        assert (skewed > even) if slower else skewed == even


def test_mfu_counts_the_active_parameters_whatever_the_ep():
    one, four = (timing(_costs(ep=ep), H100) for ep in (1, 4))
    flops = _costs().model_flops
    assert one.mfu == pytest.approx(flops / one.step_time_s / (H100.peak_tflops["fp32"] * 1e12))
    assert four.mfu * four.step_time_s == pytest.approx(one.mfu * one.step_time_s)


# ------------------------------------------------------------------------------------------------ the space
GROUPS = {"ac": ["none"], "precision": ["fp32"], "offload": ["none"], "prefetch": ["default"]}


def _space(overrides: list[str], world: int = 8):
    return build_space(run_config(overrides), overrides, {}, GROUPS, world)


def test_ep_is_searched_for_a_mixture_of_experts_only_and_a_fixed_ep_is_the_users():
    assert "ep" not in _space(["model=llama_tiny"]).values  # a dense model's space does not grow
    assert _space(["model=moe_tiny", "model.n_experts=8"]).values["ep"] == ["1", "2", "4", "8"]
    assert _space(["model=moe_tiny"]).values["ep"] == ["1", "2", "4"]  # 4 experts: ep=8 has none to split
    fixed = _space(["model=moe_tiny", "parallel.ep=2"])
    assert "ep" not in fixed.values and fixed.fixed["ep"] == "parallel.ep=2"
    assert label(["sharding.strategy=full", "ac=full", "parallel.ep=4"]) == "full · ac=full · ep=4"
