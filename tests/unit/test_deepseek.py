"""DeepSeek-V3's architecture in the llama family on one process: the presets' parameter counts against the
published figures (on meta), multi-head latent attention (fsdp_exp/models/mla.py) and the group-limited router
(fsdp_exp/models/router.py) against references computed here, the Hugging Face export against transformers'
DeepseekV3, the planner against torch's tracker, the FLOP count against torch's counter, and the refusals."""

from __future__ import annotations

import pytest
import torch

from fsdp_exp.models import count_params, init_weights, spec_for
from fsdp_exp.models.llama import Llama, TransformerBlock, rope_tables
from fsdp_exp.models.moe import dense_reference, moe_layers
from fsdp_exp.models.router import GroupLimitedRouter

from conftest import run_config


def tiny(*overrides: str):
    return run_config(["model=deepseek_v3_tiny", *overrides]).model


def built(cfg, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, seed, torch.device("cpu"))
    return model


# Total (with the routers' score-correction biases, as the released checkpoints hold them), active parameters as
# counted here (the top k of the routed experts, everything else whole), and active as the model cards round them.
PUBLISHED = {
    "deepseek_v3": (671_026_419_200, 37_552_282_624, 37.6),
    "kimi_k2": (1_026_408_232_448, 32_861_477_888, 32.9),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_deepseek_v3_and_kimi_k2_count_the_published_parameters(preset):
    """The score-correction bias is a buffer here (the loss-free update moves it, no gradient does): the parameters
    plus one bias per routed layer and expert are the published total exactly."""
    cfg = run_config([f"model={preset}"]).model
    total, active, active_card = PUBLISHED[preset]
    biases = (cfg.n_layers - cfg.first_k_dense) * cfg.n_experts
    assert count_params(cfg) + biases == total
    model = spec_for(cfg).meta_model(cfg)  # the one the count read
    assert sum(b.numel() for n, b in model.named_buffers() if n.endswith("expert_bias")) == biases
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert spec_for(cfg).active_params(cfg) == active and round(active / 1e9, 1) == active_card


def test_torchtitans_16b_flavour_is_a_full_query_projection_and_64_experts():
    cfg = run_config(["model=deepseek_v3_16b"]).model
    model = spec_for(cfg).meta_model(cfg)
    attention = model.layers["0"].attention
    assert hasattr(attention, "wq") and not hasattr(attention, "wq_a")
    assert len(moe_layers(model)) == 26 and type(moe_layers(model)[0].router).__name__ == "Router"
    assert count_params(cfg) == 15_706_484_224 and spec_for(cfg).active_params(cfg) == 2_661_150_208


def test_the_group_limited_router_picks_within_the_best_groups_and_scales_the_renormalized_weights():
    torch.manual_seed(0)
    router = GroupLimitedRouter(16, 8, 2, "sigmoid", True, groups=4, top_groups=2, scaling=2.5)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(64, 16)
    weights, experts, scores = router(x)
    choice = (scores + router.expert_bias).view(64, 4, 2)
    best_groups = choice.sum(-1).topk(2, dim=-1).indices  # groups of 2: the two best are the whole group
    for t in range(64):
        allowed = torch.cat([2 * best_groups[t], 2 * best_groups[t] + 1])
        assert set(experts[t].tolist()) <= set(allowed.tolist())
        ranked = sorted(allowed.tolist(), key=lambda e: -(scores[t, e] + router.expert_bias[e]).item())
        assert set(experts[t].tolist()) == set(ranked[:2])
    picked = scores.gather(-1, experts)
    torch.testing.assert_close(weights, 2.5 * picked / picked.sum(-1, keepdim=True))


def test_the_routed_layer_with_groups_and_scaling_equals_every_expert_mixed_densely():
    cfg = tiny()
    moe = moe_layers(built(cfg))[0]
    assert isinstance(moe.router, GroupLimitedRouter)
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_the_first_block_is_dense_and_the_others_route():
    cfg = tiny()
    model = spec_for(cfg).meta_model(cfg)
    assert type(model.layers["0"].feed_forward).__name__ == "FeedForward"
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == 128  # model.dense_hidden_dim
    assert [type(b.feed_forward).__name__ for b in model.blocks[1:]] == ["MoE", "MoE"]


def test_latent_attention_equals_a_reference_written_here():
    """Each head's scores: its query parts against the key without position (from the latent) and the one shared
    rotary key, scaled by 1/sqrt(qk width), causal; the values from the latent too."""
    cfg = tiny("model.n_experts=0")
    block = built(cfg).layers["0"]
    a = block.attention
    x = torch.randn(2, 10, cfg.dim, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_tables(cfg.qk_rope_head_dim, 10, cfg.rope_theta)
    h, nope, rope, v = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def rotate(t):  # interleaved pairs, angle per position
        pairs = t.unflatten(-1, (-1, 2))
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack((pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c), -1).flatten(
            -2
        )

    q = a.wq_b(a.q_norm(a.wq_a(x))).view(2, 10, h, nope + rope)
    latent, k_rot = a.wkv_a(x).split([cfg.kv_lora_rank, rope], -1)
    kv = a.wkv_b(a.kv_norm(latent)).view(2, 10, h, nope + v)
    k_rot = rotate(k_rot[:, :, None, :])
    q_rot = rotate(q[..., nope:])
    scores = torch.einsum("bshd,bthd->bhst", q[..., :nope], kv[..., :nope])
    scores = scores + torch.einsum("bshd,btd->bhst", q_rot, k_rot[:, :, 0])
    scores = scores / (nope + rope) ** 0.5
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), kv[..., nope:]).reshape(2, 10, h * v)
    torch.testing.assert_close(a(x, cos, sin), a.wo(out), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [[], ["model.q_lora_rank=null"]], ids=["query-bottleneck", "full-query"])
def test_a_tiny_deepseek_v3_exports_to_safetensors_that_transformers_loads_with_the_same_logits(tmp_path, overrides):
    """Every weight random, the norms and the loss-free biases too (which pick the experts in transformers as
    here), so a misplaced row, a rotary layout that differs or a bias left out shows in the logits."""
    transformers = pytest.importorskip("transformers")
    from fsdp_exp.export import write_export

    cfg = tiny(*overrides)
    model = built(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        for m in moe_layers(model):
            m.router.expert_bias.copy_(torch.randn(cfg.n_experts, generator=torch.Generator().manual_seed(7)) * 0.05)
    write_export({k: v.detach() for k, v in model.state_dict().items()}, cfg, tmp_path, "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [["model.n_experts=0"], ["model.first_k_dense=0", "model.q_lora_rank=null"]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_planner_counts_what_a_latent_attention_block_saves_within_5_percent_of_torchs_tracker(overrides, dtype):
    from torch.distributed._tools.mem_tracker import MemTracker

    from fsdp_exp.plan.activations import profile_for

    cfg = tiny(*overrides)
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(dtype)
    cos, sin = rope_tables(cfg.qk_rope_head_dim, 32, cfg.rope_theta)
    x = torch.randn(2, 32, cfg.dim, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        out = block(x, cos, sin)
        snapshot = tracker.get_tracker_snapshot()[torch.device("cpu")]
    tracked = next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")
    tracked -= out.untyped_storage().nbytes() + cos.nbytes + sin.nbytes
    profile = profile_for(cfg, 2, 32, 1, False)
    planned = profile.block_saved(dtype.itemsize, False, profile.math_attention("cpu", dtype.itemsize))["total"]
    assert abs(planned / tracked - 1) < 0.05, (planned, tracked)


def test_the_flop_count_of_latent_attention_is_what_torchs_counter_sees():
    from fsdp_exp.metrics.flops import counted_flops_per_token
    from fsdp_exp.models import flops_per_token

    for overrides in ([], ["model.n_experts=0", "model.q_lora_rank=null"]):
        cfg = run_config(["model=deepseek_v3_tiny", *overrides])
        counted, formula = counted_flops_per_token(cfg, 32), flops_per_token(cfg.model, 32)
        assert abs(counted / formula - 1) < 0.01, (overrides, counted, formula)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["parallel.tp=2"], "rotary key is shared"),
        (["model.attention=latent"], "model.attention=gqa"),
        (["model.expert_groups=3"], "model.expert_groups=2"),
        (["model.expert_groups_top_k=5"], "model.expert_groups_top_k=4"),
        (["model.experts_top_k=5"], "model.experts_top_k=4"),
        (["model.first_k_dense=4"], "model.first_k_dense=3"),
        (["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim=8"),
        (["model.routed_scaling=0"], "model.routed_scaling=1.0"),
        (["model.mtp_layers=1"], "model.mtp_layers=0"),
    ],
    ids=["tp", "attention", "groups", "top-groups", "top-k-in-groups", "dense-blocks", "odd-rope", "scaling", "mtp"],
)
def test_what_deepseek_v3_cannot_be_is_refused_by_name_before_any_rank_starts(overrides, needle):
    from fsdp_exp.config import ConfigError
    from fsdp_exp.preflight import validate

    with pytest.raises(ConfigError) as refused:
        validate(run_config(["model=deepseek_v3_tiny", "trainer.nproc_per_node=2", *overrides]), cuda_devices=0)
    assert needle in str(refused.value)


def test_an_export_transformers_deepseek_v3_cannot_hold_is_refused_by_name():
    assert "softmax router" in spec_for(tiny("model.router_score=softmax")).why_no_hf_export(
        tiny("model.router_score=softmax")
    )
    assert spec_for(tiny()).why_no_hf_export(tiny()) is None
