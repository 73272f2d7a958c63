"""Every check a model family makes of its own config (``ModelSpec.check`` / ``check_tensor_parallel``),
one case each: the bad value is refused by preflight's ``validate`` (the step ``python -m fsdp_exp`` runs
before any rank starts; a ConfigError there is exit 2, which tests/integration/test_config_cli.py checks
through the CLI), and the refusal names the key and the override that fixes it."""

from __future__ import annotations

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.config.preflight import validate

from conftest import run_config

TP4 = ["trainer.nproc_per_node=4", "parallel.tp=4"]

# (overrides on the tiny Llama, the key the refusal names, what its fix says)
LLAMA_CASES = {
    "dim-positive": (["model.dim=0"], "model.dim=0", "model.dim"),
    "layers-positive": (["model.n_layers=0"], "model.n_layers=0", "model.n_layers"),
    "heads-positive": (["model.n_heads=0"], "model.n_heads=0", "model.n_heads"),
    "vocab-positive": (["model.vocab_size=0"], "model.vocab_size=0", "model.vocab_size"),
    "length-positive": (["model.max_seq_len=0"], "model.max_seq_len=0", "model.max_seq_len"),
    "heads-divide-dim": (["model.n_heads=3", "model.n_kv_heads=null"], "model.n_heads=3", "model.n_heads"),
    "kv-heads-divide-heads": (["model.n_kv_heads=3"], "model.n_kv_heads=3", "model.n_kv_heads"),
    "kv-heads-positive": (["model.n_kv_heads=-2"], "model.n_kv_heads=-2", "model.n_kv_heads=null"),
    "head-dim-even": (["model.dim=96", "model.n_heads=32"], "model.dim/model.n_heads=3", "model.n_heads"),
    "multiple-of-positive": (["model.multiple_of=0"], "model.multiple_of=0", "model.multiple_of=256"),
    "ffn-multiplier-positive": (["model.ffn_dim_multiplier=-1.0"], "model.ffn_dim_multiplier=-1.0",
                                "model.ffn_dim_multiplier=null"),
    "norm-eps-not-negative": (["model.norm_eps=-1e-5"], "model.norm_eps=-1e-05", "model.norm_eps=1e-5"),
    "rope-theta-positive": (["model.rope_theta=0"], "model.rope_theta=0.0", "model.rope_theta=10000"),
    "init-std-not-negative": (["model.init_std=-0.02"], "model.init_std=-0.02", "model.init_std=0.02"),
    "experts-not-negative": (["model.n_experts=-1"], "model.n_experts=-1", "model.n_experts=0"),
    "top-k-at-most-experts": (["model=moe_tiny", "model.experts_top_k=9"], "model.experts_top_k=9",
                              "model.experts_top_k=4"),
    "top-k-positive": (["model=moe_tiny", "model.experts_top_k=0"], "model.experts_top_k=0",
                       "model.experts_top_k=2"),
    "tp-divides-heads": ([*TP4, "model.n_heads=2", "model.n_kv_heads=null"],
                         "parallel.tp=4 does not divide model.n_heads (2)", "parallel.tp=2"),
    "tp-divides-kv-heads": ([*TP4], "parallel.tp=4 does not divide model.n_kv_heads (2)", "parallel.tp=2"),
    "tp-divides-swiglu": ([*TP4, "model.n_kv_heads=null", "model.multiple_of=1"],
                          "parallel.tp=4 does not divide the SwiGLU width (170", "model.multiple_of=4"),
}


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    return str(err.value)


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_each_llama_check_refuses_its_bad_value_naming_the_key_and_the_fix(case):
    overrides, key, fix = LLAMA_CASES[case]
    problem, _, fix_line = refusal(overrides).partition("\n  fix: ")
    assert key in problem, problem
    assert fix in fix_line, fix_line


def test_the_shipped_mixture_of_experts_passes_its_checks():
    validate(run_config(["model=moe_tiny"]), cuda_devices=0)
    validate(run_config(["model=moe_tiny", "model.experts_top_k=4"]), cuda_devices=0)
