"""The Llama model: published parameter counts, FLOPs arithmetic, deterministic initialization."""

from __future__ import annotations

import pytest
import torch

from fsdp_exp.models import build_meta, count_params, flops_per_token, init_weights
from fsdp_exp.models.llama import ffn_hidden_dim

from conftest import run_config

PUBLISHED = {"llama7b": 6.74e9, "llama13b": 13.0e9, "llama70b": 69.0e9, "llama3_8b": 8.03e9}


@pytest.mark.parametrize("preset,published", sorted(PUBLISHED.items()))
def test_parameter_count_matches_published(preset, published):
    cfg = run_config([f"model={preset}"]).model
    n = count_params(cfg)
    assert abs(n / published - 1) < 0.005, f"{preset}: {n:.4g} vs published {published:.4g}"


def test_swiglu_widths_match_the_papers():
    assert ffn_hidden_dim(run_config(["model=llama7b"]).model) == 11008
    assert ffn_hidden_dim(run_config(["model=llama13b"]).model) == 13824
    assert ffn_hidden_dim(run_config(["model=llama70b"]).model) == 28672
    assert ffn_hidden_dim(run_config(["model=llama3_8b"]).model) == 14336
    assert ffn_hidden_dim(run_config(["model=llama3_405b"]).model) == 53248


def test_llama3_405b_counts_exactly_what_meta_s_config_makes():
    # By hand from Meta's Llama 3.1 405B config (dim 16384, 126 layers, 128 heads of 128, 8 kv heads,
    # SwiGLU 53248, vocab 128256, untied): per block q,o 2 x 16384^2, k,v 2 x 16384 x 1024, the SwiGLU
    # 3 x 16384 x 53248 and two norms; then the embedding, the output projection and the final norm.
    block = 2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384
    by_hand = 126 * block + 2 * 128256 * 16384 + 16384
    assert by_hand == 405_853_388_800
    assert count_params(run_config(["model=llama3_405b"]).model) == by_hand


def test_flops_per_token_by_hand():
    cfg = run_config(["model=llama_tiny"]).model  # dim 64, 2 layers, 4 heads, 2 kv heads, vocab 256
    hidden = ffn_hidden_dim(cfg)
    head_dim = 64 // 4
    per_block = 64 * 64 * 2 + 64 * (2 * head_dim) * 2 + 3 * 64 * hidden + 2 * 64  # q,o + k,v + ffn + norms
    n_without_embedding = 2 * per_block + 64 + 64 * 256  # blocks + final norm + output projection
    assert count_params(cfg, exclude_embeddings=True) == n_without_embedding
    seq = 128
    assert flops_per_token(cfg, seq) == 6 * n_without_embedding + 12 * 2 * 64 * seq


def test_forward_on_cpu_and_init_depends_on_seed_and_name_only():
    cfg = run_config(["model=llama_tiny"]).model
    models = []
    for _ in range(2):
        model = build_meta(cfg)
        model.to_empty(device="cpu")
        init_weights(model, seed=3, device=torch.device("cpu"))
        models.append(model)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name
    other = build_meta(cfg)
    other.to_empty(device="cpu")
    init_weights(other, seed=4, device=torch.device("cpu"))
    assert not torch.equal(other.layers["0"].attention.wq.weight, models[0].layers["0"].attention.wq.weight)
    assert torch.equal(models[0].norm.weight, torch.ones(64))
    tokens = torch.randint(0, 256, (2, 16))
    logits = models[0](tokens)
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    # Causal: changing a later token leaves earlier logits unchanged.
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    assert torch.allclose(models[0](changed)[:, :-1], logits[:, :-1], atol=1e-6)


def _model_of(overrides):
    cfg = run_config(overrides)
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, 0, torch.device("cpu"))
    return model.eval()  # no dropout: the two losses see the same function


def _saved_config(tmp_path, name, config):
    config.save_pretrained(tmp_path / name)
    return [f"model.hf_config={tmp_path / name}", "model=hf"]


@pytest.mark.parametrize("family", ["llama", "llama-tied", "hf-gpt2-tied", "hf-gemma2-softcap"])
def test_the_chunked_loss_equals_the_loss_on_all_logits_with_the_same_gradients(tmp_path, family):
    """trainer.loss_chunks: the output projection and loss over slices of the sequence (an uneven split
    too: 7 slices of 32 positions) give the plain F.cross_entropy of the model's logits, fp32, and the same
    gradient for every parameter (tied embeddings and a family's soft cap included)."""
    from fsdp_exp.models.loss import mean_cross_entropy

    tiny = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=256"]
    if family.startswith("llama"):
        overrides = [*tiny, f"model.tie_embeddings={str(family == 'llama-tied').lower()}"]
    else:
        transformers = pytest.importorskip("transformers")
        if family == "hf-gpt2-tied":
            overrides = _saved_config(
                tmp_path,
                "gpt2",
                transformers.GPT2Config(
                    n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
                ),
            )
        else:
            overrides = [
                *_saved_config(
                    tmp_path,
                    "gemma2",
                    transformers.Gemma2Config(
                        hidden_size=64,
                        intermediate_size=128,
                        num_hidden_layers=2,
                        num_attention_heads=4,
                        num_key_value_heads=2,
                        head_dim=16,
                        vocab_size=256,
                        final_logit_softcapping=5.0,
                    ),
                ),
                "model.attn_implementation=eager",
            ]
    model = _model_of(overrides)
    tokens, targets = torch.randint(0, 256, (2, 2, 32), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(loss_of):
        model.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, whole_grads = loss_and_grads(
        lambda: torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
    )
    chunked, chunked_grads = loss_and_grads(lambda: mean_cross_entropy(model, tokens, targets, 7))
    assert abs(chunked / whole - 1) < 1e-6, (chunked, whole)
    assert set(chunked_grads) == set(whole_grads)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation takes the same path without checkpoints
        assert abs(mean_cross_entropy(model, tokens, targets, 7).item() / whole - 1) < 1e-6


def _saved_bytes(module_call, exclude) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``module_call`` runs, but ``exclude``'s."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module_call()
    for t in exclude:
        saved.pop(t.untyped_storage().data_ptr(), None)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_planner_counts_what_a_llama_block_and_the_final_norm_save_for_backward(dtype):
    """Measured with autograd's saved-tensor hooks on one block at dim 256. Under bf16 the RMSNorm once made two
    fp32 copies of its input (``x.float()`` twice, both kept): 8 bytes a residual element more per block than
    torchtitan's norm, 15% of a Llama 2 13B block's activations (issue 34, item 2: its 13B row)."""
    from fsdp_exp.models import llama
    from fsdp_exp.plan.activations import profile_for

    cfg = run_config(["model=llama_tiny", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2"]).model
    batch, seq = 2, 64
    block, norm = llama.TransformerBlock(cfg).to(dtype), llama.RMSNorm(cfg.dim, cfg.norm_eps).to(dtype)
    cos, sin = (t[:seq] for t in llama.rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta))
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    e = torch.finfo(dtype).bits // 8
    profile = profile_for(cfg, batch, seq, 1, False)
    params = [*block.parameters(), *norm.parameters(), cos, sin]
    # The block's input is counted by the planner with the block (the previous block's output): in fp32 the norm
    # keeps it; in bf16 only its fp32 copy.
    measured = _saved_bytes(lambda: block(x, cos, sin), params)
    assert measured == profile.block_saved(e)["total"]
    if dtype == torch.bfloat16:  # by hand, as torchtitan's block keeps them
        tokens, hidden, kv = batch * seq, ffn_hidden_dim(cfg), cfg.dim // 2
        norms = 2 * (4 + 2 + 2) * tokens * cfg.dim + 2 * 4 * tokens  # fp32 copy, normed, weighted; rsqrt
        attention = 2 * 2 * tokens * cfg.dim + 2 * 2 * tokens * kv + 4 * batch * cfg.n_heads * seq  # q, out; k, v; lse
        assert measured == norms + attention + 4 * 2 * tokens * hidden  # w1's, w3's, silu's outputs, the product
    assert _saved_bytes(lambda: norm(x), params) + e * batch * seq * cfg.dim == profile.head_saved(e, False)
