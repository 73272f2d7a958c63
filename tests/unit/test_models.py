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
