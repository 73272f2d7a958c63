"""precision=float8 (torchao): which layers are converted, and what is refused before any rank starts."""

from __future__ import annotations

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate

from conftest import TINY_BATCH, TINY_MODEL, run_config

pytest.importorskip("torchao", reason='float8 training needs torchao: pip install "fsdp_exp[float8]"')


def test_float8_converts_the_block_linears_and_keeps_the_output_and_odd_sized_layers_high_precision():
    """dim=80 with 4 heads of 20 and 2 key/value heads: wk and wv are 80x40, not multiples of 16."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from fsdp_exp.models import build_meta
    from fsdp_exp.parallel import float8

    cfg = run_config(
        [
            "model.dim=80",
            "model.n_layers=1",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.vocab_size=256",
            "precision=float8",
            "precision.float8_recipe=rowwise",
        ]
    )
    model = build_meta(cfg.model)
    applied = float8.apply(model, cfg)
    assert applied["kept_high_precision"] == {
        "output": "precision.float8_filter_fqns",
        "layers.0.attention.wk": "dims 80x40 not multiples of 16",
        "layers.0.attention.wv": "dims 80x40 not multiples of 16",
    }
    assert applied["converted"] == [
        "layers.0.attention.wq",
        "layers.0.attention.wo",
        "layers.0.feed_forward.w1",
        "layers.0.feed_forward.w3",
        "layers.0.feed_forward.w2",
    ]
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in applied["converted"])
    assert applied["recipe"] == "rowwise" and applied["emulate"] is False
    # The parameters keep their dtype: only the matmuls run in float8.
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_float8_filter_setting_names_the_layers_kept_high_precision():
    from fsdp_exp.models import build_meta
    from fsdp_exp.parallel import float8

    cfg = run_config([*TINY_MODEL, "precision=float8", "precision.float8_filter_fqns=[feed_forward]"])
    applied = float8.apply(build_meta(cfg.model), cfg)
    assert "output" in applied["converted"] and not any("feed_forward" in n for n in applied["converted"])
    assert set(applied["kept_high_precision"]) == {
        f"layers.{i}.feed_forward.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("emulate", [False, True])
def test_float8_layers_train_on_the_cpu_with_and_without_emulation(recipe, emulate):
    """A forward and backward of the converted tiny Llama on the CPU: finite, and not the unconverted model's."""
    import torch

    from fsdp_exp.models import spec_for
    from fsdp_exp.parallel import float8

    cfg = run_config(
        [
            *TINY_MODEL,
            "precision=float8",
            f"precision.float8_recipe={recipe}",
            f"precision.float8_emulate={str(emulate).lower()}",
        ]
    )
    torch.manual_seed(0)
    reference = spec_for(cfg.model).build(cfg.model)
    model = spec_for(cfg.model).build(cfg.model)
    model.load_state_dict(reference.state_dict())
    float8.apply(model, cfg)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    logits.float().square().mean().backward()
    assert torch.isfinite(logits).all() and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        exact = reference(tokens)
    assert not torch.equal(logits.detach(), exact)  # float8 rounding happened
    assert (logits.detach() - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["sharding.backend=fsdp1"], "precision.float8_recipe=tensorwise cannot be honoured by sharding.backend=fsdp1"),
        (["sharding=zero2"], "precision.float8_recipe=tensorwise cannot be honoured by sharding.backend=deepspeed"),
        (
            ["sharding=ddp", "precision.float8_all_gather=true"],
            "precision.float8_all_gather=true cannot be honoured by sharding.backend=ddp",
        ),
        (["precision.float8_recipe=rowwise", "precision.float8_all_gather=true"], "precision.float8_recipe=tensorwise"),
        (["precision.float8_recipe=mxfp8"], "precision.float8_recipe=mxfp8"),
        (["precision.float8_recipe=tensorwize"], "precision.float8_recipe=tensorwise"),
        (
            ["trainer.nproc_per_node=4", "parallel.tp=2", "parallel.sequence_parallel=true"],
            "gloo (this CPU run's backend) cannot carry float8 tensors",
        ),
        (["precision=bf16", "precision.float8_all_gather=true"], "precision=float8"),
    ],
)
def test_float8_refusals_name_the_setting_and_the_fix(overrides, named):
    with pytest.raises(ConfigError) as err:
        validate(run_config([*TINY_MODEL, *TINY_BATCH, "precision=float8", *overrides]), cuda_devices=0)
    assert named in str(err.value) and "fix:" in str(err.value)


def test_float8_is_accepted_on_fsdp2_and_ddp():
    for overrides in ([], ["sharding=ddp"]):
        validate(run_config([*TINY_MODEL, *TINY_BATCH, "precision=float8", *overrides]), cuda_devices=0)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.tp=2", "precision.float8_all_gather=true"],
        ["parallel.tp=2", "precision.float8_recipe=rowwise"],
        ["parallel.tp=2", "precision.float8_recipe=rowwise", "parallel.sequence_parallel=true"],
        ["parallel.pp=2", "precision.float8_all_gather=true"],
        ["parallel.pp=2", "parallel.tp=2", "precision.float8_recipe=rowwise"],
    ],
)
def test_float8_composes_with_tensor_parallel_and_pipeline_stages_on_a_cpu(overrides):
    validate(
        run_config([*TINY_MODEL, *TINY_BATCH, "trainer.nproc_per_node=4", "precision=float8", *overrides]),
        cuda_devices=0,
    )


def test_float8_with_sequence_parallel_is_accepted_where_nccl_carries_float8():
    cfg = run_config(
        [
            *TINY_MODEL,
            *TINY_BATCH,
            "trainer.device=cuda",
            "trainer.nproc_per_node=4",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "precision=float8",
        ]
    )
    assert validate(cfg, cuda_devices=4).tp_size == 2


def test_a_float8_refusal_exits_2_before_any_rank_starts(tmp_path):
    from conftest import run_cli

    result = run_cli([*TINY_MODEL, *TINY_BATCH, "precision=float8", "sharding.backend=fsdp1"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "precision.float8_recipe=tensorwise cannot be honoured by sharding.backend=fsdp1" in result.stderr
    assert "fix: pass sharding.backend=fsdp2" in result.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_fp8_peaks_are_the_dense_data_sheet_figures_and_absent_without_fp8_tensor_cores():
    from fsdp_exp.metrics.flops import lookup_peak_tflops

    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None


def test_a_float8_filter_naming_no_linear_layer_is_refused_by_name():
    """A misspelt filter ("feedforward") would keep nothing high precision and convert those layers unnoticed."""
    with pytest.raises(ConfigError) as err:
        validate(
            run_config([*TINY_MODEL, "precision=float8", "precision.float8_filter_fqns=[output,feedforward]"]),
            cuda_devices=0,
        )
    message = str(err.value)
    assert (
        "'feedforward'" in message and "'output'" not in message and "precision.float8_filter_fqns=[output]" in message
    )
    # A whole part of a name matches; a prefix of one does not (the rule that picks the layers kept).
    validate(
        run_config([*TINY_MODEL, "precision=float8", "precision.float8_filter_fqns=[layers.1,wq]"]), cuda_devices=0
    )
    with pytest.raises(ConfigError, match="'feed'"):
        validate(run_config([*TINY_MODEL, "precision=float8", "precision.float8_filter_fqns=[feed]"]), cuda_devices=0)
