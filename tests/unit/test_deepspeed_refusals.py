"""What DeepSpeed (and ZeRO-1, offload=optimizer on the other backends) cannot honour is refused before any
rank starts, naming the knob and the equivalent; and the DeepSpeed config each knob becomes. No process group.
(The command line's exit 2 for such a refusal: tests/integration/test_config_cli.py.)"""

from __future__ import annotations

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate
from fsdp_exp.parallel.deepspeed import ds_config, installed

from conftest import run_config

needs_deepspeed = pytest.mark.skipif(
    not installed(),
    reason="DeepSpeed is not installed (pip install "
    "'fsdp_exp[deepspeed]'; the README's test command and CI install it)",
)

# overrides -> (the knob the message names, the fix it names)
REFUSED = {
    "bf16_pure": (["sharding=zero3", "precision=bf16_pure"], "precision=bf16_pure", "pass precision=bf16"),
    "fp16-on-cpu": (["sharding=zero2", "precision=fp16"], "precision=fp16 on the CPU", "pass precision=bf16"),
    "offload-params-below-stage-3": (
        ["sharding=zero2", "offload=params"],
        "offload=params with sharding=grad_op",
        "offload=optimizer",
    ),
    "offload-optimizer-stage-0": (
        ["sharding=no_shard", "sharding.backend=deepspeed", "offload=optimizer"],
        "offload=optimizer with sharding=no_shard",
        "sharding=optimizer|grad_op|full",
    ),
    "prefetch-below-stage-3": (
        ["sharding=zero2", "prefetch=deep"],
        "prefetch=deep with sharding=grad_op",
        "sharding=full",
    ),
    "prefetch-not-a-preset": (
        ["sharding=zero3", "prefetch.forward=3"],
        "prefetch forward=3",
        "prefetch=none|default|deep",
    ),
    "prefetch-post": (["sharding=zero3", "prefetch.backward_timing=post"], "timing=post", "prefetch=none|default|deep"),
    "wrap": (["sharding=zero3", "wrap=none"], "wrap=none", "drop wrap="),
    "tensor-parallel": (["sharding=zero3", "parallel.tp=2"], "parallel.tp=2", "sharding.backend=fsdp2"),
    "hybrid": (
        ["sharding=hybrid", "sharding.backend=deepspeed"],
        "sharding.strategy=hybrid",
        "sharding=full|grad_op|optimizer|no_shard",
    ),
    "async-save": (
        ["sharding=zero3", "checkpoint.async_save=true"],
        "checkpoint.async_save=true",
        "checkpoint.async_save=false",
    ),
    "scaler-without-fp16": (
        ["sharding=zero3", "precision=bf16", "precision.loss_scaler=dynamic"],
        "precision.loss_scaler=dynamic",
        "precision=fp16",
    ),
    "buffer-dtype": (
        ["sharding=zero3", "precision.buffer_dtype=fp32"],
        "precision.buffer_dtype",
        "drop precision.buffer_dtype",
    ),
}
# ZeRO-1 and an optimizer-only offload on the backends that do not have them.
REFUSED_ELSEWHERE = {
    "fsdp2-zero1": (
        ["sharding=full", "sharding.strategy=optimizer"],
        "sharding=optimizer",
        "sharding=optimizer (DDP + ZeroRedundancyOptimizer) or sharding=zero1",
    ),
    "fsdp1-zero1": (["sharding=fsdp1", "sharding.strategy=optimizer"], "sharding=optimizer", "sharding=zero1"),
    "fsdp2-offload-optimizer": (["sharding=full", "offload=optimizer"], "offload=optimizer", "pass offload=params"),
    "fsdp1-offload-optimizer": (["sharding=fsdp1", "offload=optimizer"], "offload=optimizer", "pass offload=params"),
    "ddp-offload-optimizer": (["sharding=optimizer", "offload=optimizer"], "offload=optimizer", "offload=none"),
}


@needs_deepspeed
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_deepspeed_cannot_honour_is_refused_naming_the_equivalent(name):
    overrides, knob, fix = REFUSED[name]
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    problem, _, remedy = str(err.value).partition("\n  fix: ")
    assert knob in problem, str(err.value)
    assert fix in remedy, str(err.value)


@pytest.mark.parametrize("name", sorted(REFUSED_ELSEWHERE))
def test_zero1_and_optimizer_offload_are_refused_where_they_do_not_exist(name):
    overrides, knob, fix = REFUSED_ELSEWHERE[name]
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    problem, _, remedy = str(err.value).partition("\n  fix: ")
    assert knob in problem and fix in remedy, str(err.value)


def test_without_deepspeed_the_backend_is_refused_naming_the_install(monkeypatch):
    import fsdp_exp.parallel.deepspeed as backend_module

    monkeypatch.setattr(backend_module, "installed", lambda: False)  # the import probe, not the backend
    with pytest.raises(ConfigError) as err:
        validate(run_config(["sharding=zero3"]), cuda_devices=0)
    assert "pip install 'fsdp_exp[deepspeed]'" in str(err.value)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["sharding=zero3", "prefetch=none"],
            {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 1_000_000_000},
        ),
        (["sharding=zero3"], {"stage": 3, "stage3_prefetch_bucket_size": 50_000_000}),
        (
            ["sharding=zero3", "prefetch=deep"],
            {"stage": 3, "stage3_prefetch_bucket_size": 100_000_000, "stage3_max_live_parameters": 2_000_000_000},
        ),
        (
            ["sharding=zero3", "offload=params"],
            {
                "offload_param": {"device": "cpu", "pin_memory": False},
                "offload_optimizer": {"device": "cpu", "pin_memory": False},
            },
        ),
        (
            ["sharding=zero1", "offload=optimizer"],
            {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        ),
        (["sharding=no_shard", "sharding.backend=deepspeed"], {"stage": 0}),
    ],
)
def test_each_knob_becomes_its_deepspeed_setting(overrides, expected):
    cfg = run_config(overrides)
    zero = ds_config(cfg, dp=2)["zero_optimization"]
    assert {k: zero[k] for k in expected} == expected
    assert "offload_param" in zero if "offload=params" in overrides else "offload_param" not in zero


def test_batch_precision_and_clipping_reach_the_deepspeed_config():
    cfg = run_config(
        [
            "sharding=zero2",
            "precision=bf16",
            "trainer.global_batch_size=16",
            "trainer.micro_batch_size=2",
            "trainer.grad_clip=0.5",
        ]
    )
    config = ds_config(cfg, dp=2)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (16, 2, 4)
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    assert config["communication_data_type"] == "fp32" and config["gradient_clipping"] == 0.5
