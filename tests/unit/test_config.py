"""Composition and validation: every option of every group composes; bad input fails fast and clearly."""

from __future__ import annotations


import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate

from conftest import REPO, run_config

GROUPS = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "__pycache__")
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((REPO / "conf" / g).glob("*.yaml"))]


def test_groups_are_the_documented_ones():
    assert {
        "model",
        "sharding",
        "precision",
        "offload",
        "prefetch",
        "wrap",
        "optim",
        "data",
        "trainer",
        "logger",
    } <= set(GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):  # the bare family needs a config: one transformers wrote
        transformers = pytest.importorskip("transformers")
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256).save_pretrained(tmp_path)
        overrides.append(f"model.hf_config={tmp_path}")
    if (group, option) == ("sharding", "hybrid"):
        overrides.append("trainer.nproc_per_node=2")
    if (group, option) == ("wrap", "experts"):
        overrides.append("model=moe_tiny")  # experts need an MoE model
    if group == "precision" and option.startswith("float8"):  # float8, float8_all_gather
        pytest.importorskip("torchao", reason='precision=float8 needs pip install "fsdp_exp[float8]"')
    if (group, option) == ("offload", "optimizer"):
        overrides.append("sharding=zero2")  # the optimizer alone is offloaded by DeepSpeed's ZeRO
    cfg = run_config(overrides)
    from fsdp_exp.parallel.backend import backend_for

    if backend_for(cfg).missing_dependency():  # an optional backend's preset (sharding=zero1 ...)
        pytest.skip(f"{group}={option} needs {backend_for(cfg).missing_dependency()}")
    topology = validate(cfg, cuda_devices=0)
    # presets comparing layouts of 4 ranks
    four = {("experiment", "pp_vs_fsdp"), ("experiment", "moe_ep"), ("experiment", "long_sequence")}
    ranks = 4 if (group, option) in four else 2
    assert topology.world_size == ranks and topology.device_type == "cpu"


def test_auto_nproc_and_batch_split():
    t = validate(run_config(["trainer.global_batch_size=16", "trainer.micro_batch_size=2"]), cuda_devices=0)
    assert (t.nproc_per_node, t.micro_batch_size, t.grad_accum_steps) == (2, 2, 4)
    assert validate(run_config([]), cuda_devices=8).nproc_per_node == 8
    assert validate(
        run_config(["sharding=hybrid", "trainer.nproc_per_node=4", "sharding.shard_size=2"]), cuda_devices=0
    ).mesh_shape == (2, 2)
    assert validate(run_config(["sharding=no_shard"]), cuda_devices=0).mesh_shape == (2, 1)


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (["trainer.global_batch_size=5"], "trainer.global_batch_size=6"),
        (["trainer.micro_batch_size=3"], "trainer.micro_batch_size="),
        (["sharding=hybrid", "trainer.nproc_per_node=4", "sharding.shard_size=3"], "sharding.shard_size"),
        (["precision=fp16", "precision.loss_scaler=none"], "precision.loss_scaler=dynamic"),
        (["optim.lr=-0.1"], "optim.lr="),
        (["trainer.seq_len=4096"], "trainer.seq_len="),
        (["offload.pin_memory=true", "offload=params"], "offload.pin_memory"),
        (["prefetch.backward=0"], "prefetch.backward=null"),
        (["trainer.nproc_per_node=zero"], "trainer.nproc_per_node=auto"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["trainer.loss_chunks=0"], "trainer.loss_chunks=8"),
        (["trainer.seq_len=16", "trainer.loss_chunks=17"], "trainer.loss_chunks=16 or less"),
        (["precision=bf16_pure", "precision.output_dtype=bf16", "trainer.loss_chunks=8"], "trainer.loss_chunks=1"),
        (["trainer.loss_chunks=atuo"], "trainer.loss_chunks=auto"),
        (["precision.storage_dtype=fp16"], "precision.storage_dtype=fp32"),
        (["precision.storage_dtype=bf16"], "precision.param_dtype=bf16"),  # fp32 compute on bf16 storage
        (["precision=bf16", "precision.storage_dtype=bf16", "sharding=fsdp1"], "sharding.backend=fsdp2"),
        (["precision=bf16", "precision.storage_dtype=bf16", "sharding=ddp"], "sharding.backend=fsdp2"),
    ],
)
def test_validation_messages_name_the_fix(overrides, fix):
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    assert fix in str(err.value)


def test_loss_chunks_up_to_the_sequence_are_accepted_and_sequence_parallel_slices_the_batch_instead():
    """One token a chunk at most; under sequence parallel the loss is sliced over the micro-batch (the default 8
    chunks with a micro-batch of 1 is the usual case there), so the sequence does not bound it."""
    validate(run_config(["trainer.seq_len=16", "trainer.loss_chunks=16"]), cuda_devices=0)
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.nproc_per_node=4"]
    validate(run_config([*sp, "trainer.seq_len=16", "trainer.loss_chunks=32"]), cuda_devices=0)
