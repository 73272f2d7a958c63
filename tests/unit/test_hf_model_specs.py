"""Any Hugging Face causal LM as the model, without process groups: the shipped presets are the
published architectures (parameter counts on meta), the initialization draws what the architecture's
own ``_init_weights`` draws (against transformers' own), FLOPs per token agree with torch's
FlopCounterMode, the planner's measured activations are what a real CPU forward saves (mixtures of
experts too, planned in every precision) and repeat themselves exactly, tensor parallel comes from the
model's plan or is refused, and every bad input is refused by name before any rank starts."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from fsdp_exp.config import ConfigError  # noqa: E402
from fsdp_exp.preflight import validate  # noqa: E402
from fsdp_exp.metrics.flops import counted_flops_per_token  # noqa: E402
from fsdp_exp.models import build_meta, count_params, flops_per_token, init_weights, spec_for  # noqa: E402
from fsdp_exp.parallel.ac import apply as apply_checkpointing  # noqa: E402
from fsdp_exp.plan.activations import profile_for  # noqa: E402

from conftest import run_config  # noqa: E402

# Llama-shaped presets (Mistral, Qwen2, Gemma) shrunk to CPU size; Gemma keeps its head_dim of 256.
SHRINK = [
    "+model.hf_overrides.num_hidden_layers=2",
    "+model.hf_overrides.hidden_size=64",
    "+model.hf_overrides.intermediate_size=128",
    "+model.hf_overrides.num_attention_heads=4",
    "+model.hf_overrides.num_key_value_heads=2",
    "+model.hf_overrides.vocab_size=256",
]
SHRINK_GPT2 = [
    "+model.hf_overrides.n_layer=2",
    "+model.hf_overrides.n_embd=64",
    "+model.hf_overrides.n_head=4",
    "+model.hf_overrides.vocab_size=256",
]
SHRUNK = {"hf_mistral_7b": SHRINK, "hf_qwen2_7b": SHRINK, "hf_gemma_7b": SHRINK, "hf_gpt2_xl": SHRINK_GPT2}
PUBLISHED = {
    "hf_mistral_7b": 7_241_732_096,
    "hf_qwen2_7b": 7_615_616_512,
    "hf_gemma_7b": 8_537_680_896,
    "hf_gpt2_xl": 1_557_611_200,
}


# transformers' mixture-of-experts architectures at the same size: 4 experts, top-2 (DeepSeek-V3: a dense first
# block, then routed experts beside a shared one, picked by group).
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}


def shrunk(preset: str, *extra: str):
    return run_config([f"model={preset}", *SHRUNK[preset], "trainer.seq_len=32", *extra])


def saved_config(tmp_path, model_type: str, **fields):
    """A config.json written by transformers' own save_pretrained, as a user would bring it."""
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[model_type](**fields).save_pretrained(tmp_path)
    return tmp_path


def tiny_moe(tmp_path, model_type: str, *extra: str):
    folder = saved_config(tmp_path / model_type, model_type, **TINY, **MOE[model_type])
    return run_config(["model=hf", f"model.hf_config={folder}", "trainer.seq_len=32", *extra])


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_each_shipped_preset_has_the_published_parameter_count_on_meta(preset):
    cfg = run_config([f"model={preset}"])
    assert count_params(cfg.model) == PUBLISHED[preset]
    assert next(spec_for(cfg.model).meta_model(cfg.model).parameters()).is_meta


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_initialization_draws_what_the_architectures_own_init_weights_draws(preset):
    """Against transformers' own initialization of the same config on the CPU: constants are the same
    constants (ones, zeros, Gemma's zero-centred norms and embedding scale, rotary tables), drawn tensors
    have the same mean and spread (GPT-2's residual projections at 0.02 / sqrt(2 n_layer)); the tie holds."""
    from transformers import AutoModelForCausalLM

    cfg = shrunk(preset)
    spec = spec_for(cfg.model)
    ours = build_meta(cfg.model)
    ours.to_empty(device="cpu")
    init_weights(ours, seed=0, device=torch.device("cpu"))
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(spec.config(cfg.model))
    theirs_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        reference = theirs_params[name].detach()
        if (reference == reference.flatten()[0]).all():
            assert torch.equal(param.detach(), reference), name
        else:
            assert param.std().item() == pytest.approx(reference.std().item(), rel=0.1), name
            assert abs(param.mean().item()) < 3 * reference.std().item() / param.numel() ** 0.5 + 1e-6, name
    for name, buffer in ours.named_buffers():
        assert torch.equal(buffer, dict(theirs.named_buffers())[name]), name
    for name, target in spec.tied_weights(cfg.model).items():
        assert ours.get_parameter(name) is ours.get_parameter(target)
    if preset == "hf_gpt2_xl":
        std = ours.get_parameter("transformer.h.0.mlp.c_proj.weight").std().item()
        assert std == pytest.approx(0.02 / (2 * 2) ** 0.5, rel=0.1)


def test_each_parameter_is_a_function_of_the_seed_and_its_name_only():
    cfg = shrunk("hf_qwen2_7b")
    a, b = build_meta(cfg.model), build_meta(cfg.model)
    for model in (a, b):
        model.to_empty(device="cpu")
    init_weights(a, seed=3, device=torch.device("cpu"))
    init_weights(b, seed=3, device=torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    init_weights(b, seed=4, device=torch.device("cpu"))
    assert not torch.equal(a.get_parameter("model.embed_tokens.weight"), b.get_parameter("model.embed_tokens.weight"))


@pytest.mark.parametrize("preset", sorted(SHRUNK))
def test_flops_per_token_agree_with_torchs_flop_counter(preset):
    """6N + 12LwS against FlopCounterMode on the meta model: they differ by exactly the parameters that
    are not matmuls (norm weights, biases: 6 FLOPs per token each), and ac=full recomputes something."""
    cfg = shrunk(preset)
    spec = spec_for(cfg.model)
    inventory = spec.inventory(cfg.model)
    not_matmuls = sum(p.numel for p in inventory.params if len(p.shape) < 2 and p.name not in inventory.input_params)
    assert flops_per_token(cfg.model, 32) - counted_flops_per_token(cfg, 32) == 6 * not_matmuls
    assert counted_flops_per_token(shrunk(preset, "ac=full"), 32, apply_checkpointing) > counted_flops_per_token(
        cfg, 32
    )


@pytest.mark.parametrize("preset", ["hf_mistral_7b", "hf_gemma_7b", "hf_gpt2_xl", "mixtral"])
def test_the_planners_block_activations_are_what_a_real_forward_saves(preset, tmp_path):
    """The activation profile measured under FakeTensorMode against a real CPU forward of the same model,
    saved tensors counted by storage: one block keeps the same bytes (the shared rotary tables aside).
    Mixtral's experts run torch's grouped matmul, in fp32 here, which its meta kernel alone refuses."""
    cfg = tiny_moe(tmp_path, preset) if preset in MOE else shrunk(preset)
    spec = spec_for(cfg.model)
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, 0, torch.device("cpu"))
    block_class = spec.block_class_of(cfg.model)
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    region, saved, made = {"now": "root"}, {}, {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: region.__setitem__("now", i))
        block.register_forward_hook(lambda module, args, out: region.__setitem__("now", "root"))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(region["now"], {})[storage.data_ptr()] = storage.nbytes()
            made.setdefault(storage.data_ptr(), t.shape)
        return t

    tokens = torch.randint(0, 256, (4, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    shared = set(saved[0]) & set(saved[1])  # the rotary tables every block saves
    real = sum(n for key, n in saved[1].items() if key not in shared)
    measured = profile_for(cfg.model, 4, 32, 1, False).block_saved(4)["total"]
    assert measured == real


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_mixture_of_experts_architectures_are_planned_in_every_precision(model_type, tmp_path):
    """fp32, bf16 and fp16 plans of each MoE architecture (they crashed in torch's grouped-matmul meta kernel,
    which takes bf16 only): a block keeps less in 16 bits than in 32, and fp16 plans as bf16 does."""
    from fsdp_exp.plan import plan

    plans = {}
    for precision in ("fp32", "bf16", "fp16"):
        cfg = tiny_moe(tmp_path, model_type, f"precision={precision}")
        plans[precision] = plan(cfg, validate(cfg, cuda_devices=0)).per_rank_bytes
    assert plans["fp16"] == plans["bf16"]
    profile = profile_for(cfg.model, 4, 32, 1, False)
    assert 0 < profile.block_saved(2)["total"] < profile.block_saved(4)["total"]


def test_a_config_whose_class_derives_its_layer_types_is_measured_on_two_blocks(tmp_path):
    """Jamba (Mamba blocks, experts every other one) derives ``layer_types`` from its depth: the two-block
    measurement used to set it and crash (a property without a setter)."""
    folder = saved_config(
        tmp_path,
        "jamba",
        **TINY,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=4,
        mamba_dt_rank=8,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg = run_config(["model=hf", f"model.hf_config={folder}", "trainer.seq_len=8"])
    assert profile_for(cfg.model, 2, 8, 1, False).block_saved(4)["total"] > 0


def test_experts_sized_by_the_routed_tokens_are_refused_by_the_planner_naming_the_op_and_a_run_to_measure(tmp_path):
    """JetMoe sizes each expert's batch from the routing's values (``tolist``), which fake tensors do not have:
    the planner refuses it (exit 2 in the plan CLI; a run records no plan and trains) instead of crashing."""
    folder = saved_config(
        tmp_path,
        "jetmoe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg = run_config(["model=hf", f"model.hf_config={folder}", "trainer.seq_len=32"])
    with pytest.raises(ConfigError, match="JetMoeForCausalLM's activations on fake tensors") as err:
        profile_for(cfg.model, 4, 32, 1, False).block_saved(4)
    assert "_local_scalar_dense" in str(err.value) and "summary/tracked_peak_gib_max" in str(err.value)


# A GPT-2 whose measurement wavered before storages were told apart by object, not address: 3 to 6 different
# results of 6 (two fresh processes, three each) in each of 6 tries; this test failed in each of 3.
REPEATED_MEASUREMENT = """
from transformers import GPT2Config
from fsdp_exp.models.hf import HF
from fsdp_exp.plan.activations.hf import measure
config = GPT2Config(n_embd=256, n_head=4, n_layer=2, n_positions=128, vocab_size=256, bos_token_id=0, eos_token_id=0)
for _ in range(3):
    print(measure(config, "GPT2Block", 4, 128, e=4, autocast=False, tp=1, attn_implementation="sdpa",
                  shapes_only=HF.shapes_only()))
"""


def test_tensor_parallel_comes_from_the_models_plan_or_is_refused():
    plan = spec_for(shrunk("hf_mistral_7b").model).tensor_parallel_plan(shrunk("hf_mistral_7b").model)
    assert plan.block == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    assert plan.root == {"lm_head": "colwise", "model.embed_tokens": "rowwise"}
    with pytest.raises(ConfigError, match="GPT2LMHeadModel carries no tensor-parallel plan") as err:
        validate(shrunk("hf_gpt2_xl", "parallel.tp=2", "trainer.nproc_per_node=2"), cuda_devices=0)
    assert "parallel.tp=1" in str(err.value)
    with pytest.raises(ConfigError, match="plan names none"):
        validate(
            shrunk("hf_mistral_7b", "parallel.tp=2", "trainer.nproc_per_node=2", "parallel.sequence_parallel=true"),
            cuda_devices=0,
        )
    with pytest.raises(ConfigError, match="does not divide num_key_value_heads=2"):
        validate(shrunk("hf_mistral_7b", "parallel.tp=4", "trainer.nproc_per_node=4"), cuda_devices=0)


def test_the_export_is_the_identity_less_tied_duplicates_and_the_config_round_trips():
    from transformers import AutoConfig

    cfg = shrunk("hf_gpt2_xl")
    spec = spec_for(cfg.model)
    state = {
        "transformer.wte.weight": torch.ones(2),
        "lm_head.weight": torch.ones(2),
        "transformer.ln_f.bias": torch.zeros(2),
    }
    assert set(spec.to_hf(state, cfg.model)) == {"transformer.wte.weight", "transformer.ln_f.bias"}
    config = AutoConfig.for_model(**spec.hf_config(cfg.model))
    assert (config.n_layer, config.n_embd, config.architectures) == (2, 64, ["GPT2LMHeadModel"])


def test_a_saved_config_of_an_unshipped_architecture_builds_and_plans(tmp_path):
    folder = saved_config(
        tmp_path,
        "starcoder2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    cfg = run_config(["model=hf", f"model.hf_config={folder}", "trainer.seq_len=32"])
    validate(cfg, cuda_devices=0)
    spec = spec_for(cfg.model)
    assert spec.architecture(cfg.model) == "Starcoder2ForCausalLM"
    assert spec.inventory(cfg.model).blocks == ("model.layers.0", "model.layers.1")
    # the same file named directly, not its folder
    assert count_params(run_config(["model=hf", f"model.hf_config={folder / 'config.json'}"]).model) == count_params(
        cfg.model
    )


# ------------------------------------------------------------------------------------ bad input
def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    assert "fix:" in str(err.value)
    return str(err.value)


def test_bad_configs_are_refused_by_name_before_any_rank(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    assert "no such file" in refusal(["model=hf", f"model.hf_config={missing}"])
    (tmp_path / "empty").mkdir()
    assert "a folder needs a config.json" in refusal(["model=hf", f"model.hf_config={tmp_path / 'empty'}"])
    vit = saved_config(tmp_path / "vit", "vit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert "no causal language model" in refusal(["model=hf", f"model.hf_config={vit}"])
    assert "needs exactly one of model.hf_config" in refusal(["model=hf"])
    assert "has no field 'num_hiden_layers' (did you mean num_hidden_layers?)" in refusal(
        ["model=hf_mistral_7b", "+model.hf_overrides.num_hiden_layers=2"]
    )
    wrong_type = refusal(["model=hf_mistral_7b", "+model.hf_overrides.num_hidden_layers=two"])
    assert "model.hf_overrides.num_hidden_layers" in wrong_type and "int" in wrong_type
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "mistrall"}))
    assert "model_type='mistrall'" in refusal(["model=hf", f"model.hf_config={tmp_path / 'odd.json'}"])
    assert "not in the local hub cache" in refusal(["model=hf", "model.hf_config=acme/never-downloaded"])


def test_strict_keys_leave_the_overrides_to_the_architecture_and_refuse_the_rest():
    assert run_config(["model=hf_gpt2_xl", "+model.hf_overrides.n_layer=3"]).model.hf_overrides == {"n_layer": 3}
    with pytest.raises(ConfigError, match="did you mean model.hf_fields"):
        run_config(["model=hf_gpt2_xl", "+model.hf_fieldz=1"])
    with pytest.raises(ConfigError, match="model.hf_overrides is a setting of the hf model family"):
        run_config(["model=llama_tiny", "+model.hf_overrides.n_layer=3"])


def test_without_transformers_model_hf_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is absent
    from fsdp_exp.models import REGISTRY

    REGISTRY["hf"].__dict__.pop("_configs", None)
    assert 'pip install "fsdp_exp[hf]"' in refusal(["model=hf_mistral_7b"])


def test_data_tokenizer_model_is_the_models_own_where_it_is_here_else_bytes(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from fsdp_exp.data import check_config, tokenizer_name

    folder = saved_config(
        tmp_path / "model",
        "mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    text = [
        "model=hf",
        f"model.hf_config={folder}",
        "data=text",
        "data.tokenizer=model",
        "data.files=[pkg://fsdp_exp/data/corpus/train.txt]",
    ]
    assert tokenizer_name(run_config(text)) == "byte"  # none beside the config: bytes fit 256 ids
    tokenizer = Tokenizer(WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "the": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    cfg = run_config(text)
    assert tokenizer_name(cfg) == str(folder / "tokenizer.json")
    check_config(cfg)
    small = run_config(["model=hf_gpt2_xl", "+model.hf_overrides.vocab_size=100", "data.tokenizer=model"])
    with pytest.raises(ConfigError, match="cannot hold the byte tokenizer"):
        tokenizer_name(small)


def test_a_sweep_jobs_folder_name_stays_a_valid_file_name_with_many_overrides():
    from fsdp_exp.config import job_dirname

    assert job_dirname("model=hf_mistral_7b,sharding=full") == "model=hf_mistral_7b,sharding=full"
    long_a = ",".join(f"+model.hf_overrides.field_{i}=64" for i in range(12))
    long_b = long_a.replace("=64", "=65")
    assert len(job_dirname(long_a).encode()) <= 200 and job_dirname(long_a) != job_dirname(long_b)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_counts_the_flops_of_its_routed_experts_only(model_type, tmp_path):
    """6 N counts what a token computes with: more experts at the same top-k add only the router's columns,
    one more routed expert per token adds one expert's matmuls."""

    def flops(name, **moe):
        folder = saved_config(tmp_path / name, model_type, **TINY, **{**MOE[model_type], **moe})
        cfg = run_config(["model=hf", f"model.hf_config={folder}", "trainer.seq_len=32"])
        return flops_per_token(cfg.model, 32)

    experts = next(f for f in ("num_local_experts", "num_experts") if f in MOE[model_type])
    ffn = MOE[model_type].get("moe_intermediate_size", TINY["intermediate_size"])
    layers, d = TINY["num_hidden_layers"], TINY["hidden_size"]
    base = flops("base")
    assert flops("more", **{experts: 8}) - base == 6 * layers * d * 4  # the router: 4 more outputs per block
    assert base - flops("top1", num_experts_per_tok=1) == 6 * layers * 3 * d * ffn  # gate, up, down of one expert


def test_the_planners_measurement_is_kept_on_disk_under_everything_it_depends_on_and_read_back(monkeypatch, tmp_path):
    """A measurement lands in the cache folder keyed on the model, micro-batch, sequence, dtype (and the
    measuring code's versions); with the process's own cache emptied it is read back equal; another micro-batch
    is another key."""
    from dataclasses import asdict

    from fsdp_exp.plan.activations import hf as hf_memory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hf_memory, "_CACHE", {})
    cfg = shrunk(next(iter(SHRUNK)))
    profile = profile_for(cfg.model, 4, 32, 1, False)
    measured = profile._measured(2)
    stored = json.loads(hf_memory.disk_cache_path().read_text())
    assert stored == {hf_memory._disk_key((*profile._key, 2, False)): asdict(measured)}
    hf_memory._CACHE.clear()
    assert profile._measured(2) == measured
    other = profile_for(cfg.model, 2, 32, 1, False)
    assert hf_memory._disk_key((*other._key, 2, False)) not in stored


def test_a_model_built_on_meta_draws_no_values_and_is_the_same_model():
    """The family's build on the meta device runs none of torch's random initializers (each costs about a
    millisecond on meta) and gives the same parameters, shapes and tying as transformers' own construction."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    cfg = shrunk("hf_gpt2_xl")
    spec = spec_for(cfg.model)

    class Draws(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.normal_, torch.ops.aten.uniform_):
                self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with torch.device("meta"), Draws():
        built = spec.build(cfg.model)
    assert Draws.ops == []
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(copy.deepcopy(spec.config(cfg.model)), dtype=torch.float32)

    def shapes(model):
        return [(n, p.shape, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)]

    assert shapes(built) == shapes(plain)
    assert built.lm_head.weight is built.transformer.wte.weight
