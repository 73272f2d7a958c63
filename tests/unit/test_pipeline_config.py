"""Pipeline parallel from the config (parallel.pp*): preflight makes the (pp, dp[, tp]) mesh and feeds each dp rank's
whole batch to the schedule, and refuses, before any rank starts, what stages do not run (yet), naming the
override that fixes it."""

from __future__ import annotations

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.parallel.pipeline import settings_from
from fsdp_exp.preflight import validate

from conftest import run_cli, run_config


def test_a_pipeline_run_is_a_pp_by_dp_mesh_whose_dp_ranks_take_their_whole_batch_at_once():
    cfg = run_config(
        [
            "trainer.nproc_per_node=4",
            "parallel.pp=2",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=2",
            "model.n_layers=4",
        ]
    )
    topology = validate(cfg, cuda_devices=0)
    assert (topology.mesh_shape, topology.mesh_dim_names, topology.dp_size) == ((2, 2), ("pp", "dp"), 2)
    assert (topology.micro_batch_size, topology.grad_accum_steps) == (4, 1)  # one batch a step to the schedule
    assert settings_from(cfg, 4).n_microbatches == 2  # trainer.micro_batch_size is the pipeline's micro-batch


def test_pipeline_with_tensor_parallel_is_a_pp_dp_tp_mesh_tp_innermost():
    cfg = run_config(["trainer.nproc_per_node=8", "parallel.pp=2", "parallel.tp=2", "model.n_layers=4"])
    topology = validate(cfg, cuda_devices=0)
    assert (topology.mesh_shape, topology.mesh_dim_names) == ((2, 2, 2), ("pp", "dp", "tp"))
    assert (topology.dp_size, topology.tp_size, topology.micro_batch_size) == (2, 2, 4)  # 8 sequences over dp=2


@pytest.mark.parametrize("overrides", [["ac=full"], ["ac=selective"], ["ac=selective_op"], ["compile=true", "ac=full"]])
def test_activation_checkpointing_and_compile_run_inside_pipeline_stages(overrides):
    cfg = run_config(["trainer.nproc_per_node=2", "parallel.pp=2", "model.n_layers=4", *overrides])
    assert validate(cfg, cuda_devices=0).mesh_dim_names == ("pp", "dp")


def test_a_stage_compiles_its_checkpointed_blocks_keeping_the_full_models_parameter_names():
    """A stage of blocks 1-3 as the recipe (parallel.apply_recipe) prepares it before FSDP2 (AC, then compile, as
    at pp=1): every block compiled (nn.Module.compile: inductor runs at the first forward), around the checkpoint
    wrapper where AC chose the block (the full model's every 2nd block: 2); the canonical names are the full
    model's."""
    from fsdp_exp.models import canonical_name
    from fsdp_exp.parallel import ac, compile
    from fsdp_exp.parallel.pipeline import build_stage_module

    cfg = run_config(["parallel.pp=2", "model.n_layers=4", "ac=selective", "compile=true"])
    stage = build_stage_module(cfg.model, [1, 2, 3], first=False, last=True)
    chosen = ac.chosen(stage, cfg, first_block=1)  # what apply_recipe asks, with the stage's first block
    assert ac.apply(stage, cfg, targets=chosen)["checkpointed"] == ["layers.2"]
    assert compile.apply(stage, cfg)["modules"] == ["layers.1", "layers.2", "layers.3"]
    assert all(block._compiled_call_impl is not None for block in stage.layers.values())
    assert type(stage.layers["2"]).__name__ == "CheckpointWrapper"
    names = {canonical_name(n) for n, _ in stage.named_parameters()}
    assert (
        "layers.2.attention.wq.weight" in names and "output.weight" in names and not any("layers.0" in n for n in names)
    )


def test_ddp_and_hsdp_inside_pipeline_stages_are_accepted():
    for overrides in (["sharding=ddp"], ["sharding=hybrid", "sharding.replicate_size=2"]):
        topology = validate(run_config(["parallel.pp=2", "trainer.nproc_per_node=4", *overrides]), cuda_devices=0)
        assert topology.mesh_dim_names == ("pp", "dp") and topology.dp_size == 2


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (["parallel.pp=3"], "parallel.pp=2"),
        (["parallel.pp=2", "sharding.backend=fsdp1"], "sharding=hybrid or sharding=ddp, or parallel.pp=1"),
        (["parallel.pp=2", "sharding=zero2"], "sharding=hybrid or sharding=ddp, or parallel.pp=1"),
        (["parallel.pp=2", "sharding=grad_op"], "sharding=hybrid or sharding=ddp, or parallel.pp=1"),
        (["parallel.pp=2", "sharding=optimizer"], "sharding=hybrid or sharding=ddp, or parallel.pp=1"),
        (
            ["parallel.pp=2", "sharding=hybrid", "trainer.nproc_per_node=4"],
            "pass sharding.replicate_size (or sharding.shard_size) dividing 2",
        ),
        (
            ["parallel.pp=2", "sharding=hybrid", "sharding.replicate_size=3", "trainer.nproc_per_node=4"],
            "whose product is 2",
        ),
        (
            ["parallel.pp=2", "parallel.tp=4", "trainer.nproc_per_node=4", "model.n_kv_heads=4"],
            "parallel.tp=2 (a divisor of 2)",
        ),
        (["parallel.pp=2", "prefetch=deep"], "leave the prefetch group at its default (drop prefetch=...)"),
        (["parallel.pp=2", "sharding.reshard_after_forward=true"], "sharding.reshard_after_forward=auto"),
        (["parallel.pp=2", "trainer.grad_sync=every_micro_batch"], "trainer.grad_sync=auto (or last_micro_batch)"),
        (["parallel.pp=2", "parallel.pp_schedule=zigzag"], "parallel.pp_schedule=gpipe|1f1b"),
        (["parallel.pp=2", "parallel.pp_microbatches=3"], "parallel.pp_microbatches"),
        (["parallel.pp=2", "parallel.pp_stages_per_rank=2"], "parallel.pp_stages_per_rank=1"),
        (["parallel.pp=2", "parallel.pp_split=[5]"], "parallel.pp_split=null"),
        (
            ["parallel.pp=2", "trainer.micro_batch_size=2", "parallel.pp_microbatches=2"],
            "trainer.micro_batch_size=null",
        ),
    ],
)
def test_pipeline_settings_that_cannot_run_are_refused_naming_the_override(overrides, fix):
    with pytest.raises(ConfigError) as err:
        validate(run_config(overrides), cuda_devices=0)
    assert fix in str(err.value)


def test_a_transformers_architecture_whose_forward_stages_cannot_replay_is_refused_by_name(tmp_path):
    """GPT-2 adds its position embeddings in the base model's forward, so a later stage would add them again."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(run_config(["model=hf", f"model.hf_config={tmp_path}", "parallel.pp=2"]), cuda_devices=0)
    assert "GPT2LMHeadModel (gpt2)" in str(err.value) and "parallel.pp=1" in str(err.value)


def test_a_transformers_model_tying_its_head_to_its_embedding_is_refused_under_pipeline_stages():
    pytest.importorskip("transformers")
    shrunk = ["+model.hf_overrides.num_hidden_layers=2", "+model.hf_overrides.vocab_size=256"]
    with pytest.raises(ConfigError) as err:
        validate(
            run_config(
                ["model=hf_qwen2_7b", *shrunk, "++model.hf_overrides.tie_word_embeddings=true", "parallel.pp=2"]
            ),
            cuda_devices=0,
        )
    assert "++model.hf_overrides.tie_word_embeddings=false" in str(err.value)


def test_the_cli_exits_2_naming_parallel_pp_before_any_rank_starts(tmp_path):
    result = run_cli(["parallel.pp=3"], tmp_path / "run", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "parallel.pp=3" in result.stderr and "pass parallel.pp=2" in result.stderr
    assert not (tmp_path / "run" / "run.json").exists()


def test_the_planner_sizes_a_pipeline_run_by_its_worst_stage_and_says_so():
    from fsdp_exp.plan import plan
    from fsdp_exp.plan.pipeline import pipeline_plan

    cfg = run_config(["parallel.pp=2"])
    result = plan(cfg, validate(cfg, cuda_devices=0))  # what the fit check reads
    worst = pipeline_plan(cfg, settings_from(cfg, cfg.trainer.global_batch_size), dp=1).peak_rank
    assert result.peak["total"] == worst.peak
    assert result.per_rank_bytes["total"] == worst.peak + result.margin_bytes
    assert result.model_states["device"]["total"] == worst.model_states
    assert f"pp rank {worst.rank}'s, the worst of 2" in result.assumptions[-1]
