"""The memory planner under expert parallel (fsdp_exp/plan, parallel.ep > 1), by arithmetic on the meta model: what
each rank holds at rest and gathers, what the routed copies cost under imbalance, and plan.expert_imbalance's
refusals. Against torch's tracker on 4 gloo ranks: tests/integration/test_expert_parallel.py."""

from __future__ import annotations

import pytest

from conftest import TINY_BATCH, run_config

BASE = ["model=moe_tiny", "model.n_experts=8", *TINY_BATCH, "trainer.nproc_per_node=4"]
EXPERT_ELEMENTS = 8 * 3 * 64 * 64  # one layer's stacked w1, w3, w2


def _plan(*overrides: str, imbalance: float = 1.0):
    from fsdp_exp.plan import plan
    from fsdp_exp.preflight import validate

    cfg = run_config([*BASE, *overrides])
    return plan(cfg, validate(cfg, cuda_devices=0), expert_imbalance=imbalance)


def _expert_infos(ep: int, *overrides: str):
    from fsdp_exp.plan.predict import _states
    from fsdp_exp.preflight import validate

    cfg = run_config([*BASE, f"parallel.ep={ep}", *overrides])
    infos, _ = _states(cfg, validate(cfg, cuda_devices=0), "cpu")
    return [i for i in infos if i.unit.endswith(".experts")] or [i for i in infos if ".experts." in i.name]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_rank_holds_a_quarter_of_the_experts_at_rest_whatever_ep_but_gathers_experts_over_ep(ep):
    infos = _expert_infos(ep)
    per_layer = [i for i in infos if i.block == 0]
    assert sum(i.local_numel for i in per_layer) == EXPERT_ELEMENTS // 4
    if ep == 1:  # inside the block's unit, gathered whole with it
        assert sum(i.gathered_numel for i in per_layer) == EXPERT_ELEMENTS
        return
    assert {i.unit for i in per_layer} == {"layers.0.feed_forward.experts"}
    assert sum(i.gathered_numel for i in per_layer) == EXPERT_ELEMENTS // ep
    assert {i.group for i in per_layer} == {4 // ep}


def test_under_hybrid_sharding_the_experts_shard_over_the_shard_ranks_ep_leaves():
    infos = [i for i in _expert_infos(2, "sharding=hybrid", "sharding.shard_size=2") if i.block == 0]
    assert {i.group for i in infos} == {1}  # 2 shard ranks, both in the EP group: nothing left to shard over
    assert sum(i.local_numel for i in infos) == sum(i.gathered_numel for i in infos) == EXPERT_ELEMENTS // 2


def test_ep_shrinks_the_gathered_buffers_and_ep_equal_to_the_shard_ranks_gathers_no_experts():
    from fsdp_exp.plan.predict import _walk
    from fsdp_exp.preflight import validate

    gathered = {}
    for ep in (1, 2, 4):
        cfg = run_config([*BASE, f"parallel.ep={ep}"])
        g = _walk(cfg, validate(cfg, cuda_devices=0), "cpu")[0].g
        gathered[ep] = (g.block_numel[0], g.nested_all_gather[0])
    dense = gathered[1][0] - EXPERT_ELEMENTS
    assert gathered[2] == (dense + EXPERT_ELEMENTS // 2, EXPERT_ELEMENTS // 2)
    assert gathered[4] == (dense + EXPERT_ELEMENTS // 4, 0)


def test_an_imbalanced_router_costs_the_busiest_rank_received_copies_under_ep_only():
    from fsdp_exp.plan.activations import profile_for

    cfg = run_config(BASE).model
    # 64 tokens x top-2 = 128 copies a rank. ep=2: 4 experts a rank; the busiest at 4x the mean (every token's
    # first pick), the other 7 sharing the rest: (4 + 3 x 4/7) / 4 x 128 = 182.9. Every copy to one expert: the
    # whole EP group's copies (2 x 128, 4 x 128) go to its rank.
    cases = ((1, 2.0, 128), (2, 1.0, 128), (2, 4.0, 183), (2, 8.0, 256), (4, 8.0, 512), (2, 20.0, 256))
    for ep, imbalance, received in cases:
        assert profile_for(cfg, 2, 32, 1, False, ep=ep, imbalance=imbalance).received == received
    assert _plan("parallel.ep=1", imbalance=2.0).peak == _plan("parallel.ep=1").peak
    balanced, skewed = _plan("parallel.ep=2").peak["total"], _plan("parallel.ep=2", imbalance=1.5).peak["total"]
    assert skewed > balanced


@pytest.mark.parametrize("value", ["0.5", "nan", "many"])
def test_plan_expert_imbalance_below_one_or_not_a_number_is_refused_naming_the_fix(value, capsys):
    from fsdp_exp.plan import main

    assert main([*BASE, "parallel.ep=2", f"plan.expert_imbalance={value}"]) == 2
    err = capsys.readouterr().err
    assert f"plan.expert_imbalance={value!r}" in err and "fix: pass plan.expert_imbalance=1" in err


def test_tune_takes_plan_expert_imbalance_and_refuses_a_ratio_below_one():
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.tune.options import split_argv

    opts, overrides = split_argv(["model=moe_tiny", "plan.expert_imbalance=1.3"])
    assert opts.expert_imbalance == 1.3 and overrides == ["model=moe_tiny"]
    with pytest.raises(ConfigError, match="plan.expert_imbalance=1"):
        split_argv(["plan.expert_imbalance=0.9"])


def test_the_plan_of_a_mixture_of_experts_lists_the_need_at_every_ep_the_run_can_take(capsys):
    from fsdp_exp.plan import main

    assert main([*BASE, "parallel.ep=2"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("expert parallel by parallel.ep") :].splitlines()[1:4]
    assert [line.split()[0] for line in lines] == ["ep=1", "ep=2", "ep=4"]  # ep=8 divides no 4 ranks: left out
    assert lines[1].endswith("(this plan)") and "ep=8" not in out
    needs = {line.split()[0]: float(line.split()[2]) for line in lines}
    assert needs["ep=1"] > needs["ep=2"] > needs["ep=4"]  # the tiny model's gathered experts shrink with ep


def test_the_fit_search_tries_expert_parallel_for_a_mixture_of_experts_only():
    from fsdp_exp.plan.fit import _dimensions

    def tried(overrides):
        dims = _dimensions(run_config(overrides), lambda group, option: None, 4)
        return [value[0] for dim in dims for value in dim if value[0].startswith("parallel.ep=")]

    assert tried(BASE) == ["parallel.ep=2", "parallel.ep=4"]  # the divisors of 4 data-parallel ranks
    assert tried([*BASE, "parallel.ep=2"]) == []  # the run's own choice stands
    assert tried(["model=llama_tiny", *TINY_BATCH]) == []


@pytest.mark.parametrize(
    "shape,group,dim,per_rank",
    [
        ((8, 4, 6), 16, 0, 4 * 6),  # 4 doesn't divide by 16 nor 6: 8 experts padded to 16, one a rank
        ((8, 16, 6), 16, 1, 8 * 6),  # 8 experts over 16 ranks: the out dim, unpadded (was 1 x 16 x 6, twice)
        ((3, 6, 8), 4, 2, 3 * 6 * 2),  # dim 1 does not divide either: the next that does
        ((3, 6, 6), 4, 0, 6 * 6),  # none divides: dim 0 and its padding stay (rank 0 holds 1 expert of 3/4)
        ((8, 4, 6), 4, 0, 2 * 4 * 6),  # experts divide the group: dim 0 as always
        ((3, 64), 4, 0, 64),  # a 2-D weight keeps dim 0 (its padding is at most a row a rank)
        ((3, 4, 6), 1, 0, 3 * 4 * 6),  # one rank: nothing to pad
    ],
)
def test_a_stacked_weight_is_sharded_on_the_first_dim_its_group_divides_when_its_experts_do_not(
    shape, group, dim, per_rank
):
    from fsdp_exp.parallel.placement import shard_dim, shard_numel

    assert shard_dim(shape, group) == dim
    assert shard_numel(shape, group) == per_rank


@pytest.mark.parametrize("n_experts,ep", [(3, 1), (2, 1), (6, 2)])
def test_experts_that_do_not_divide_the_shard_ranks_are_planned_unpadded(n_experts, ep):
    """moe_tiny on 4 ranks: 3 (or 2) experts over 4 ranks, 6 over ep=2 (3 a rank over 2 efsdp ranks) are
    sharded on their out dim, so every rank holds exactly its share of each layer's experts and the experts'
    unit gathers them unpadded; the model states' bytes are 16 (fp32 weight, gradient, two moments) a held
    element: the dense weights' and the two layers' experts' shares."""
    from fsdp_exp.plan.predict import _states
    from fsdp_exp.preflight import validate

    cfg = run_config([*BASE, f"model.n_experts={n_experts}", f"parallel.ep={ep}"])
    infos, states = _states(cfg, validate(cfg, cuda_devices=0), "cpu")
    experts = [i for i in infos if i.block == 0 and ".experts." in i.name]
    whole = n_experts * 3 * 64 * 64
    assert sum(i.local_numel for i in experts) == whole // 4
    assert sum(i.gathered_numel for i in experts) == whole // ep
    dense = sum(i.local_numel for i in infos if ".experts." not in i.name)
    assert states.at_rest["total"] == 16 * (dense + 2 * whole // 4)  # both layers' experts, unpadded


# NeMo AutoModel's two rows of ../shared/published/moe_ep.csv as fsdp_exp plans them (tune/published.py's
# mapping): one DGX-H100, FSDP2 without resharding after forward (sharding=grad_op) + EP 8, full AC, bf16 compute
# with fp32 reduction on parameters stored in bf16 (AutoModel's models cast them). GPT-OSS 20B as the nearest
# Llama-family MoE (its q/k/v/o and expert biases and attention sinks dropped, the sliding-window layers as full
# attention: the row's notes; 0.03% of its parameters).
AUTOMODEL = [
    "trainer.nproc_per_node=8",
    "precision=bf16",
    "precision.storage_dtype=bf16",
    "sharding=grad_op",
    "parallel.ep=8",
    "ac=full",
    "trainer.seq_len=4096",
]
QWEN3_30B = ["model=qwen3_moe_30b_a3b", "trainer.micro_batch_size=4", "trainer.global_batch_size=512"]
GPT_OSS_20B = [
    "model=qwen3_moe_30b_a3b",
    "model.dim=2880",
    "model.n_layers=24",
    "model.n_heads=64",
    "model.n_kv_heads=8",
    "model.head_dim=64",
    "model.qk_norm=false",
    "model.vocab_size=201088",
    "model.moe_hidden_dim=2880",
    "model.n_experts=32",
    "model.experts_top_k=4",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=256",
]
GIB = 2**30


def _device_plan(*overrides: str):
    from fsdp_exp.plan import plan
    from fsdp_exp.preflight import validate

    cfg = run_config(list(overrides))
    return plan(cfg, validate(cfg, cuda_devices=0), device_kind="cuda")  # python -m fsdp_exp.plan's on a GPU


def test_ep_8_needs_less_than_ep_1_for_qwen3_30b_a3b_without_ac():
    """Before, the layer kept two more copies of its routed rows for backward (index_add_'s source at every ep,
    index_copy's under EP), and the need rose with ep: 256.5 GiB at ep=1, 281.7 at ep=8. Now 206.0 and 204.9."""
    layout = [*QWEN3_30B, "trainer.nproc_per_node=8", "precision=bf16", "trainer.seq_len=4096"]
    ep1, ep8 = (_device_plan(*layout, f"parallel.ep={ep}").per_rank_bytes["total"] / GIB for ep in (1, 8))
    assert ep8 < ep1 < 230, (ep1, ep8)


def test_automodels_rows_are_planned_at_what_their_states_need():
    """Both rows fit their 79.1 GiB. Qwen3-30B-A3B peaked at its optimizer step with fp32 master parameters,
    gradients and moments (56.9 GiB) and foreach AdamW's temporary (14.2): 79.2 GiB planned, where AutoModel trains
    parameters cast to bf16 (its model's initialize_weights). Stored in bf16 (precision.storage_dtype=bf16) the
    states are half (28.4 GiB) and the need 44.3. Before that, grad_op kept every layer's experts gathered in bf16
    from forward to backward (6.75 GiB at ep = 8 = the shard ranks, where the experts' unit gathers nothing and now
    reshards), and planned 83.0 GiB."""
    gpt = _device_plan(*AUTOMODEL, *GPT_OSS_20B)
    need = gpt.per_rank_bytes["total"] / GIB
    assert need < 79.1, need
    qwen = _device_plan(*AUTOMODEL, *QWEN3_30B)
    states = qwen.model_states["device"]["total"]
    assert all(qwen.stage_peaks[stage]["total"] < 75 * GIB for stage in ("forward", "backward"))
    need = qwen.per_rank_bytes["total"] / GIB
    assert 28 < states / GIB < 29 and need < 79.1, (states / GIB, need)


def test_bf16_storage_holds_half_the_states_of_fp32():
    """precision.storage_dtype=bf16: parameters, gradients and AdamW's moments all in bf16, half of fp32's for the
    same layout (the planner counted fp32 states whatever the run stored before the option)."""
    layout = [*QWEN3_30B, "trainer.nproc_per_node=8", "precision=bf16", "parallel.ep=8", "trainer.seq_len=4096"]
    fp32 = _device_plan(*layout).model_states["device"]
    bf16 = _device_plan(*layout, "precision.storage_dtype=bf16").model_states["device"]
    for part in ("params", "grads", "optimizer", "total"):
        assert bf16[part] * 2 == pytest.approx(fp32[part], abs=4), part
