"""Transformers causal LMs cut into pipeline stages (models/hf.py's ``cut_stage``), and the export gathering
every stage (export.py): checked against independent yardsticks, the whole model's own forward, the
single-process reference (tests/reference.py) and transformers' from_pretrained.

About 40 s on 2 idle cores: the architectures PIPELINE_MODEL_TYPES names, each cut in two in this process,
and one CLI run (2 gloo ranks, pp=2, a shrunk Qwen2) that trains, saves its stages and exports.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TINY_QWEN2, read_metrics, run_cli, run_config  # noqa: E402
from reference import reference_run  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 5
# Qwen2 shrunk to 4 layers (so that each stage holds 2), fp32, 8 sequences of 32 tokens a step.
QWEN2 = [
    *TINY_QWEN2,
    "trainer.seq_len=32",
    "trainer.global_batch_size=8",
    f"trainer.steps={STEPS}",
    "trainer.warmup_steps=2",
    "precision=fp32",
]
PIPELINE = ["trainer.nproc_per_node=2", "parallel.pp=2", "parallel.pp_microbatches=4", "logger.wandb.mode=disabled"]
LOSS_RTOL = 1e-5  # the bar: the stages compute what one process does, up to float rounding
LOGITS_ATOL = 1e-4  # the export against the run's own model (the same tensors, another implementation's forward)


def _tiny_fields(model_type: str) -> dict:
    """A config.json of ``model_type``, 4 layers of width 64, untied, special tokens inside its 256 ids."""
    return dict(
        model_type=model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _materialized(module: torch.nn.Module) -> torch.nn.Module:
    from fsdp_exp.models import init_weights

    module.to_empty(device="cpu")
    init_weights(module, 0, torch.device("cpu"))
    return module.eval()


def test_every_architecture_pipeline_stages_accept_gives_the_whole_models_logits_when_cut_in_two():
    """Each stage is the model's own modules under their full names, seeded as the whole model is; the first
    stage's hidden states through the second give the whole model's logits exactly (float for float)."""
    from fsdp_exp.config.schema import HfModelConfig
    from fsdp_exp.models import build_meta, spec_for
    from fsdp_exp.models.hf import PIPELINE_MODEL_TYPES
    from fsdp_exp.parallel.pipeline import build_stage_module

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for model_type in PIPELINE_MODEL_TYPES:
        cfg = HfModelConfig(hf_fields=_tiny_fields(model_type))
        spec_for(cfg).check_pipeline(cfg)
        whole = _materialized(build_meta(cfg))
        first = _materialized(build_stage_module(cfg, [0, 1], first=True, last=False))
        last = _materialized(build_stage_module(cfg, [2, 3], first=False, last=True))
        names = [*dict(first.named_parameters()), *dict(last.named_parameters())]
        assert sorted(names) == sorted(dict(whole.named_parameters())), f"{model_type}: every parameter once"
        with torch.no_grad():
            torch.testing.assert_close(last(first(tokens)), whole(tokens), rtol=0, atol=0, msg=model_type)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """The CLI run: 2 stages of a shrunk Qwen2 (1F1B, 4 micro-batches), its final checkpoint, its export."""
    run_dir = tmp_path_factory.mktemp("pp_hf") / "run"
    result = run_cli([*QWEN2, *PIPELINE, "checkpoint.every=5", "checkpoint.export=hf"], run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_a_transformers_model_in_two_pipeline_stages_trains_like_one_process(pipeline_run):
    record = json.loads((pipeline_run / "run.json").read_text())
    assert record["applied"]["pipeline"]["stage_blocks"] == [[0, 1], [2, 3]]
    got = [row["train/loss"] for row in read_metrics(pipeline_run) if "train/loss" in row]
    expected, _ = reference_run(run_config(QWEN2), STEPS)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: loss {a} vs single process {b}"


def _run_model(checkpoint):
    """The model a pipeline run's checkpoint holds (every rank's stages, under the full model's names),
    rebuilt whole in this process by fsdp_exp's own build."""
    from fsdp_exp.export import load_checkpoint_model, model_config
    from fsdp_exp.models import build_meta, spec_of

    state, model_cfg = load_checkpoint_model(checkpoint)
    model = build_meta(model_config(model_cfg))
    model.to_empty(device="cpu")
    spec_of(model).init_buffers(model, torch.device("cpu"))
    model.load_state_dict(state)  # strict: the stages together hold every parameter
    return model.eval(), state


def test_the_export_of_a_pipeline_run_gathers_every_stage_into_one_model_transformers_loads(pipeline_run, tmp_path):
    """Each pp rank writes its stages' file, rank 0 the index: from_pretrained loads the whole model, with the
    logits of the run's own trained model; exporting the run's checkpoint afterwards gives the same tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_exp.export import main as export_main

    export = pipeline_run / "export"
    record = json.loads((pipeline_run / "run.json").read_text())["export"]
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert record["file"] == str(export / "model.safetensors.index.json") and len(record["files"]) == 2
    ours, state = _run_model(pipeline_run / "checkpoints" / f"step_{STEPS}")
    assert sorted(index["weight_map"]) == sorted(state)
    theirs = AutoModelForCausalLM.from_pretrained(export).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=LOGITS_ATOL)
    export_main([str(pipeline_run / "checkpoints" / f"step_{STEPS}"), str(tmp_path / "offline"), "--format", "hf"])
    offline = load_file(tmp_path / "offline" / "model.safetensors")
    exported = {k: v for f in record["files"] for k, v in load_file(f).items()}
    assert sorted(offline) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(offline[name], tensor), name
