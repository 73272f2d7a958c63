"""Every check a model family makes of its own config (``ModelSpec.check`` / ``check_tensor_parallel``),
one case each: the bad value is refused by preflight's ``validate`` (the step ``python -m fsdp_exp`` runs
before any rank starts; a ConfigError there is exit 2, which tests/integration/test_config_cli.py checks
through the CLI), and the refusal names the key and the override that fixes it."""

from __future__ import annotations

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate

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
    "ffn-multiplier-positive": (
        ["model.ffn_dim_multiplier=-1.0"],
        "model.ffn_dim_multiplier=-1.0",
        "model.ffn_dim_multiplier=null",
    ),
    "norm-eps-not-negative": (["model.norm_eps=-1e-5"], "model.norm_eps=-1e-05", "model.norm_eps=1e-5"),
    "rope-theta-positive": (["model.rope_theta=0"], "model.rope_theta=0.0", "model.rope_theta=10000"),
    "init-std-not-negative": (["model.init_std=-0.02"], "model.init_std=-0.02", "model.init_std=0.02"),
    "experts-not-negative": (["model.n_experts=-1"], "model.n_experts=-1", "model.n_experts=0"),
    "top-k-at-most-experts": (
        ["model=moe_tiny", "model.experts_top_k=9"],
        "model.experts_top_k=9",
        "model.experts_top_k=4",
    ),
    "top-k-positive": (["model=moe_tiny", "model.experts_top_k=0"], "model.experts_top_k=0", "model.experts_top_k=2"),
    "head-dim-positive": (["model.head_dim=-2"], "model.head_dim=-2", "model.head_dim=null"),
    "router-known": (["model=moe_tiny", "model.router_score=relu"], "model.router_score='relu'", "sigmoid"),
    "expert-width-positive": (["model=moe_tiny", "model.moe_hidden_dim=0"], "model.moe_hidden_dim=0", "null"),
    "expert-width-aligned": (["model=moe_tiny", "model.moe_hidden_dim=60"], "is 60", "multiple of 8"),
    "shared-experts-not-negative": (["model=moe_tiny", "model.n_shared_experts=-1"], "=-1", "model.n_shared_experts=0"),
    "aux-loss-not-negative": (["model=moe_tiny", "model.aux_loss_coef=-1"], "=-1.0", "model.aux_loss_coef=0"),
    "bias-rate-not-negative": (["model=moe_tiny", "model.expert_bias_rate=-1"], "=-1.0", "model.expert_bias_rate=0"),
    "capacity-positive": (["model=moe_tiny", "model.capacity_factor=0"], "model.capacity_factor=0", "=null"),
    "no-tp-for-experts": (["model=moe_tiny", *TP4], "tensor parallel has no plan", "parallel.ep"),
    "tp-divides-heads": (
        [*TP4, "model.n_heads=2", "model.n_kv_heads=null"],
        "parallel.tp=4 does not divide model.n_heads (2)",
        "parallel.tp=2",
    ),
    "tp-divides-kv-heads": ([*TP4], "parallel.tp=4 does not divide model.n_kv_heads (2)", "parallel.tp=2"),
    "tp-divides-swiglu": (
        [*TP4, "model.n_kv_heads=null", "model.multiple_of=1"],
        "parallel.tp=4 does not divide the SwiGLU width (170",
        "model.multiple_of=4",
    ),
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


# ------------------------------------------------------------------------------ Hugging Face (model=hf)
MISTRAL = [
    "model=hf_mistral_7b",
    "+model.hf_overrides.num_hidden_layers=2",
    "+model.hf_overrides.hidden_size=64",
    "+model.hf_overrides.intermediate_size=128",
    "+model.hf_overrides.num_attention_heads=4",
    "+model.hf_overrides.num_key_value_heads=2",
    "+model.hf_overrides.vocab_size=256",
    "trainer.seq_len=32",
]
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny configs as a user brings them (transformers' own save_pretrained): Gemma-2 (no SDPA path in
    transformers) and a Mixtral of 4 experts, top-2."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_configs")
    transformers.Gemma2Config(**TINY).save_pretrained(root / "gemma2")
    transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2).save_pretrained(root / "mixtral")
    return root


def hf_cases(saved):
    gemma2 = ["model=hf", f"model.hf_config={saved / 'gemma2'}"]
    mixtral = ["model=hf", f"model.hf_config={saved / 'mixtral'}", "trainer.seq_len=32"]
    return {
        "attention-kernel-known": (
            [*MISTRAL, "model.attn_implementation=flash"],
            "model.attn_implementation='flash'",
            "model.attn_implementation=sdpa",
        ),
        "sdpa-path-exists": (gemma2, "Gemma2ForCausalLM", "model.attn_implementation=eager"),
        "kv-heads-divide-heads": (
            [*MISTRAL, "++model.hf_overrides.num_key_value_heads=3"],
            "num_key_value_heads=3",
            "model.hf_overrides.num_key_value_heads=2",
        ),
        "experts-per-token-at-most-experts": (
            [*mixtral, "+model.hf_overrides.num_experts_per_tok=9"],
            "num_experts_per_tok=9",
            "model.hf_overrides.num_experts_per_tok=4",
        ),
        "experts-per-token-positive": (
            [*mixtral, "+model.hf_overrides.num_experts_per_tok=0"],
            "num_experts_per_tok=0",
            "model.hf_overrides.num_experts_per_tok=2",
        ),
        "config-class-refusal-names-the-override": (
            [*MISTRAL, "+model.hf_overrides.head_dim=7"],
            "model.hf_overrides.head_dim",
            "model.hf_overrides.head_dim",
        ),
        "tp-has-a-plan": (
            [
                "model=hf_gpt2_xl",
                "+model.hf_overrides.n_layer=1",
                "+model.hf_overrides.n_embd=64",
                "+model.hf_overrides.n_head=4",
                "trainer.seq_len=32",
                "parallel.tp=2",
                "trainer.nproc_per_node=2",
            ],
            "parallel.tp=2",
            "parallel.tp=1",
        ),
        "tp-divides-heads": ([*MISTRAL, *TP4], "does not divide num_key_value_heads=2", "parallel.tp"),
        "no-expert-parallel-for-transformers-moe": (
            [*mixtral, "trainer.nproc_per_node=4", "parallel.ep=2"],
            "expert parallel is not built for MixtralForCausalLM",
            "parallel.ep=1",
        ),
    }


HF_CASES = (
    "attention-kernel-known",
    "sdpa-path-exists",
    "kv-heads-divide-heads",
    "experts-per-token-at-most-experts",
    "experts-per-token-positive",
    "config-class-refusal-names-the-override",
    "tp-has-a-plan",
    "tp-divides-heads",
    "no-expert-parallel-for-transformers-moe",
)


@pytest.mark.parametrize("case", HF_CASES)
def test_each_hugging_face_check_refuses_its_bad_value_naming_the_key_and_the_fix(case, saved):
    overrides, key, fix = hf_cases(saved)[case]
    problem, _, fix_line = refusal(overrides).partition("\n  fix: ")
    assert key in problem, problem
    assert fix in fix_line, fix_line


def test_an_architecture_without_sdpa_passes_with_eager_attention_and_the_moe_with_its_own_top_k(saved):
    validate(
        run_config(["model=hf", f"model.hf_config={saved / 'gemma2'}", "model.attn_implementation=eager"]),
        cuda_devices=0,
    )
    validate(run_config(["model=hf", f"model.hf_config={saved / 'mixtral'}", "trainer.seq_len=32"]), cuda_devices=0)


def test_tune_passes_on_a_refusal_no_dimension_of_its_search_changes_with_its_own_fix(saved, tmp_path, capsys):
    from fsdp_exp.tune.cli import main

    narrow = [
        "tune.space.backend=[fsdp2]",
        "tune.space.ac=[none,full]",
        "tune.space.precision=[bf16]",
        "tune.space.offload=[none]",
        "tune.space.prefetch=[default]",
        "tune.space.micro_batch_size=[1]",
    ]
    assert (
        main(
            [
                "model=hf",
                f"model.hf_config={saved / 'gemma2'}",
                "trainer.nproc_per_node=8",
                "plan.device=h100_80gb",
                *narrow,
                f"tune.out={tmp_path}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "Gemma2ForCausalLM has no SDPA attention" in err and "fix: pass model.attn_implementation=eager" in err, err
    assert "tune.space" not in err, err
