"""The mixture-of-experts layer (fsdp_exp/models/moe.py) on one process: routing counted against a reference
computed here, the grouped matmul against the dense reference, dropping, both balancing methods, and the
presets' parameter counts against the published figures."""

from __future__ import annotations


import pytest
import torch

from fsdp_exp.models import build_meta, count_params, init_weights, spec_for
from fsdp_exp.models.llama import Llama
from fsdp_exp.models.moe import MoE, dense_reference, moe_layers, update_expert_bias

from conftest import run_config


def tiny(*overrides: str):
    return run_config(["model=moe_tiny", *overrides]).model


def built(cfg, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, seed, torch.device("cpu"))
    return model


def hidden(cfg, tokens: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, tokens // 2, cfg.dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.router_score=sigmoid"], ["model.n_shared_experts=1"], ["model.router_renormalize=false"]],
    ids=["softmax", "sigmoid", "shared-expert", "softmax-not-renormalized"],
)
def test_the_grouped_matmul_layer_equals_every_expert_on_every_token_mixed_densely(overrides):
    cfg = tiny(*overrides)
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg).requires_grad_()
    grouped = moe(x)
    dense = dense_reference(moe, x)
    torch.testing.assert_close(grouped, dense, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(grouped)
    grads = torch.autograd.grad(grouped, [x, moe.experts.w1, moe.experts.w2, moe.router.gate.weight], g)
    dense_grads = torch.autograd.grad(dense, [x, moe.experts.w1, moe.experts.w2, moe.router.gate.weight], g)
    for a, b in zip(grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_grouped_matmul_layer_runs_in_bf16_close_to_fp32():
    cfg = tiny()
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg)
    fp32 = moe(x)
    bf16 = moe.to(torch.bfloat16)(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=2e-2, atol=2e-2)


def test_the_routers_tokens_per_expert_equal_a_top_k_counted_here():
    cfg = tiny("model.n_experts=8", "model.experts_top_k=3")
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg, tokens=40)
    with torch.no_grad():
        moe(x)
    logits = x.reshape(-1, cfg.dim) @ moe.router.gate.weight.T
    picked = logits.topk(3, dim=-1).indices  # softmax keeps the order of the logits
    expected = torch.tensor([(picked == e).sum().item() for e in range(8)], dtype=torch.float32)
    assert torch.equal(moe.tokens_per_expert, expected)
    assert moe.tokens_per_expert.sum() == 40 * 3 and moe.dropped == 0


def test_a_capacity_factor_drops_and_counts_the_copies_past_each_experts_capacity():
    cfg = tiny("model.capacity_factor=0.5")
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg, tokens=32).requires_grad_()
    y = moe(x)
    capacity = int(0.5 * 32 * 2 / 4)
    _, experts, _ = moe.router(x.reshape(-1, cfg.dim))
    loads = torch.bincount(experts.flatten(), minlength=4)
    assert moe.dropped.item() == (loads - capacity).clamp(min=0).sum().item() > 0
    # The load (what the loss-free bias and the metrics read) is the assignment before dropping, as Switch and
    # GShard balance on it: a dropped copy still says its expert was wanted.
    assert torch.equal(moe.tokens_per_expert, loads.float())
    # Within each expert the earliest copies (by token, then slot) keep their place; the rest count for nothing,
    # forward and backward (torch's grouped matmul leaves the rows past its groups unwritten both ways).
    flat = experts.flatten()
    rank_in_expert = torch.stack([(flat[:i] == flat[i]).sum() for i in range(flat.numel())])
    keep = (rank_in_expert < capacity).view(-1, 2)
    dense = dense_reference(moe, x, keep)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    params = [x, moe.experts.w1, moe.experts.w2, moe.router.gate.weight]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(dense, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_aux_loss_is_counted_and_its_gradient_reaches_the_router_only_through_it():
    cfg = tiny("model.aux_loss_coef=0.5")
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg)
    y = moe(x)
    scores = (x.reshape(-1, cfg.dim) @ moe.router.gate.weight.T).softmax(-1)
    share = moe.tokens_per_expert / scores.shape[0]
    expected = 0.5 * 4 * (share * scores.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, expected.detach())
    (grad,) = torch.autograd.grad(y.sum() * 0, moe.router.gate.weight)  # only the aux loss's gradient remains
    (expected_grad,) = torch.autograd.grad(expected, moe.router.gate.weight)
    torch.testing.assert_close(grad, expected_grad)


def test_recomputing_the_experts_activation_gives_the_same_gradients_and_keeps_half_their_intermediates():
    """model.recompute_expert_activation: silu, the product and w2's grouped matmul recomputed in backward from
    w1's and w3's outputs. The same outputs and gradients; per routed copy 2 x the experts' width kept instead
    of 4 (silu's input and output, w3's output and the product), measured on the saved tensors' storages."""
    grads, kept = [], []
    for recompute in (False, True):
        cfg = tiny(f"model.recompute_expert_activation={str(recompute).lower()}", "model.moe_hidden_dim=128")
        moe = built(cfg).layers["0"].feed_forward
        x = hidden(cfg, tokens=32).requires_grad_()
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = moe(x)
        kept.append(sum(storages.values()))
        g = torch.randn_like(y, generator=torch.Generator().manual_seed(2))
        grads.append(torch.autograd.grad(y, [x, moe.experts.w1, moe.experts.w3, moe.experts.w2], g))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    copies, width = 32 * 2, 128
    assert kept[0] - kept[1] == 2 * copies * width * 4, kept  # two fp32 widths a copy fewer


def test_the_aux_loss_reads_the_routed_copies_before_a_capacity_drops_any():
    """With a capacity that drops copies, the aux loss is the dropless layer's (the same router, the same
    assignment): before, it read the counts after dropping, and a crowded expert looked less crowded."""
    dropless = built(tiny("model.aux_loss_coef=0.5")).layers["0"].feed_forward
    capped = built(tiny("model.aux_loss_coef=0.5", "model.capacity_factor=0.5")).layers["0"].feed_forward
    x = hidden(tiny(), tokens=32)
    dropless(x), capped(x)
    assert capped.dropped > 0 and dropless.dropped == 0
    torch.testing.assert_close(capped.aux_loss, dropless.aux_loss)
    torch.testing.assert_close(capped.tokens_per_expert, dropless.tokens_per_expert)


def test_the_aux_losss_gradient_is_loss_scaled_as_the_training_loss_is_so_fp16_keeps_it():
    """fp16 multiplies the loss by the scaler's scale (2^16 at first) and divides every gradient by it before
    the step. The aux loss's gradient rides on the layer's backward and must be scaled the same way: its share
    of the router's gradient is then the same in fp16 as in fp32 (to fp16's precision). Before, it was never
    multiplied, so the unscale left 1/65536 of it (a grad norm rise of 2.8e-6 against fp32's 4.1e-2)."""
    from fsdp_exp.models.moe import reset_routing_counts

    def aux_part(dtype: torch.dtype, scale: float) -> torch.Tensor:
        grads = []
        for coef in (0.0, 1.0):
            cfg = tiny(f"model.aux_loss_coef={coef}")
            model = built(cfg).to(dtype)
            moe = model.layers["0"].feed_forward
            reset_routing_counts(model, 1, scale)
            y = moe(hidden(cfg, tokens=32).to(dtype))
            (y.float().square().mean() * scale).backward()
            grads.append(moe.router.gate.weight.grad.float() / scale)
        return grads[1] - grads[0]  # the aux loss's part of the router's gradient

    fp32, fp16 = aux_part(torch.float32, 1.0), aux_part(torch.float16, 2.0**16)
    assert fp32.norm() > 1e-3
    torch.testing.assert_close(fp16.norm(), fp32.norm(), rtol=2e-2, atol=0)
    torch.testing.assert_close(fp16, fp32, rtol=5e-2, atol=5e-2 * fp32.abs().max().item())


def test_the_aux_losss_gradient_is_split_over_a_steps_micro_batches_as_the_training_loss_is():
    """Two micro-batches of the same tokens, each loss divided by 2 (the trainer's accumulation), give the router
    the gradient one micro-batch gives: before, each carried the aux loss's whole gradient, so accumulation
    doubled the balance's weight against the cross-entropy."""
    from fsdp_exp.models.moe import reset_routing_counts

    cfg = tiny("model.aux_loss_coef=0.5")
    model, x = built(cfg), hidden(cfg)
    moe = model.layers["0"].feed_forward

    def router_grad(micro_batches: int) -> torch.Tensor:
        model.zero_grad()
        reset_routing_counts(model, micro_batches)
        for _ in range(micro_batches):
            (moe(x).square().mean() / micro_batches).backward()
        return moe.router.gate.weight.grad.clone()

    torch.testing.assert_close(router_grad(2), router_grad(1))
    torch.testing.assert_close(router_grad(4), router_grad(1))


def test_the_loss_free_bias_moves_the_load_toward_balance():
    cfg = tiny("model.n_experts=8", "model.experts_top_k=2", "model.router_score=sigmoid")  # DeepSeek-V3's pair
    model = built(cfg)
    moe = model.layers["0"].feed_forward
    with torch.no_grad():  # a router that prefers expert 0 strongly
        moe.router.gate.weight[0] = moe.router.gate.weight[0] + 0.05 * moe.router.gate.weight.new_ones(cfg.dim)
    x = torch.randn(4, 32, cfg.dim, generator=torch.Generator().manual_seed(3)).abs()

    def spread() -> float:
        for m in moe_layers(model):
            m.reset_counts()
        with torch.no_grad():
            moe(x)
        return (moe.tokens_per_expert.max() / moe.tokens_per_expert.mean()).item()

    before = spread()
    for _ in range(40):
        spread()
        update_expert_bias(model, 0.02, lambda t: None)
    after = spread()
    assert before > 2 and after < 0.5 * before, (before, after)
    assert moe.router.expert_bias[0] < 0 and moe.router.expert_bias.sum().abs() < moe.router.expert_bias.abs().sum()


def test_activation_checkpointing_recompute_counts_no_token_twice():
    from torch.utils.checkpoint import checkpoint

    cfg = tiny()
    moe = built(cfg).layers["0"].feed_forward
    x = hidden(cfg).requires_grad_()
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * cfg.experts_top_k


PUBLISHED = {  # total and active parameters: exact (the released checkpoints'), and as the model cards round them
    "mixtral_8x7b": (46_702_792_704, 12_879_925_248, 46.7, 12.9),
    "qwen3_moe_30b_a3b": (30_532_122_624, 3_353_032_704, 30.5, 3.3),  # Qwen's card truncates 3.35 to 3.3
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_parameter_counts_equal_the_published_ones(preset):
    cfg = run_config([f"model={preset}"]).model
    total, active, total_card, active_card = PUBLISHED[preset]
    spec = spec_for(cfg)
    assert count_params(cfg) == total and spec.active_params(cfg) == active
    assert abs(total / 1e9 - total_card) < 0.06 and abs(active / 1e9 - active_card) < 0.06
    # The inventory's count is the built model's: one stacked tensor per projection, every expert inside.
    assert count_params(cfg) == sum(p.numel() for p in build_meta(cfg).parameters())


def test_the_mixture_is_one_grouped_module_per_layer_that_wrap_experts_can_shard():
    cfg = tiny()
    model = build_meta(cfg)
    assert spec_for(cfg).expert_modules(model) == ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]
    assert all(isinstance(m, MoE) for m in (model.layers["0"].feed_forward, model.layers["1"].feed_forward))


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute-activation"])
@pytest.mark.parametrize("shared", [0, 1], ids=["routed-only", "with-a-shared-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_planner_counts_what_a_mixture_of_experts_block_saves_within_5_percent_of_torchs_tracker(
    shared, dtype, recompute
):
    from torch.distributed._tools.mem_tracker import MemTracker

    from fsdp_exp.models.llama import TransformerBlock, rope_tables
    from fsdp_exp.plan.activations import profile_for

    cfg = tiny(f"model.n_shared_experts={shared}", f"model.recompute_expert_activation={str(recompute).lower()}")
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(dtype)
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, 32, cfg.rope_theta)
    x = torch.randn(2, 32, cfg.dim, dtype=dtype, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        out = block(x, cos, sin)
        snapshot = tracker.get_tracker_snapshot()[torch.device("cpu")]
    tracked = next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")
    tracked -= out.untyped_storage().nbytes() + cos.nbytes + sin.nbytes  # what the block was handed or gives
    planned = profile_for(cfg, 2, 32, 1, False).block_saved(dtype.itemsize)["total"]
    assert abs(planned / tracked - 1) < 0.05, (planned, tracked)


def test_the_flop_count_of_a_routed_model_is_its_active_parameters_as_torchs_counter_sees_them():
    """torch's FlopCounterMode has no grouped-matmul formula (fsdp_exp.ops adds one); on the meta model in fp32
    (whose grouped-matmul meta kernel takes bf16 only) it counts what 6 x active parameters says."""
    from fsdp_exp.metrics.flops import counted_flops_per_token
    from fsdp_exp.models import flops_per_token

    for preset in ("moe_tiny", "llama_tiny"):  # the dense model shows the counter's own margin
        cfg = run_config([f"model={preset}"])
        counted, formula = counted_flops_per_token(cfg, 32), flops_per_token(cfg.model, 32)
        assert abs(counted / formula - 1) < 0.005, (preset, counted, formula)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["parallel.ep=3"], "parallel.ep=2 (a divisor of 4)"),
        (["parallel.ep=4", "model.n_experts=6"], "does not divide model.n_experts=6"),
        (["parallel.ep=2", "sharding.backend=fsdp1"], "sharding.backend=fsdp2"),
        (["parallel.ep=2", "model=llama_tiny"], "no experts to split"),
        (["parallel.ep=2", "compile=true"], "compile=false"),
        # an expert's capacity counts one rank's tokens: cp would change which copies drop (issue 43 A)
        (["parallel.cp=2", "model.capacity_factor=1.0"], "model.capacity_factor=null"),
    ],
    ids=["ep-divides-shard-ranks", "ep-divides-experts", "fsdp2-only", "dense-model", "compile", "capacity-cp"],
)
def test_expert_parallel_refuses_what_it_cannot_do_by_name_before_any_rank_starts(overrides, needle):
    from fsdp_exp.config import ConfigError
    from fsdp_exp.preflight import validate

    with pytest.raises(ConfigError) as refused:
        validate(run_config(["model=moe_tiny", "trainer.nproc_per_node=4", *overrides]), cuda_devices=0)
    assert needle in str(refused.value)


def test_expert_parallel_passes_preflight_where_it_composes():
    from fsdp_exp.preflight import validate

    for ep in (2, 4):
        topology = validate(
            run_config(["model=moe_tiny", "trainer.nproc_per_node=4", f"parallel.ep={ep}"]), cuda_devices=0
        )
        assert topology.ep_size == ep


@pytest.mark.parametrize(
    "overrides,architecture",
    [([], "MixtralForCausalLM"), (["model.qk_norm=true", "model.head_dim=32"], "Qwen3MoeForCausalLM")],
    ids=["mixtral", "qwen3-moe"],
)
def test_a_tiny_mixtral_and_qwen3_moe_export_to_safetensors_that_transformers_loads_with_the_same_logits(
    tmp_path, overrides, architecture
):
    """The presets' layouts at tiny size (mixtral_8x7b: softmax top-k, renormalized; qwen3_moe_30b_a3b: query /
    key norms and a wider head). Every weight random, the norms too, so a misplaced row or a norm left
    unpermuted by the rotary reordering shows in the logits."""
    transformers = pytest.importorskip("transformers")
    from fsdp_exp.export import write_export

    cfg = tiny(*overrides)
    model = built(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    write_export({k: v.detach() for k, v in model.state_dict().items()}, cfg, tmp_path, "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert type(hf).__name__ == architecture
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)
