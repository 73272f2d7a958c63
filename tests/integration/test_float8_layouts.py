"""precision=float8 (torchao) beyond one data-parallel dimension, on 4 gloo ranks: tensor parallel 2 x FSDP2 2
with torchao's float8 styles, and pipeline stages 2 x FSDP2 2, each with float8 all-gathers, train 20 steps to
within 5% of the same layout in bf16 (the bar test_float8.py holds the plain FSDP2 run to).

Two spawned runs serve each test: its layout in bf16 and in float8, over the same 20 steps of the same data.
Float8 with sequence parallel gathers activations in float8, which gloo cannot carry: preflight refuses it on a
CPU (tests/unit/test_float8_settings.py) and benchmarks/gpu_check.py's float8_tp_sp runs it on CUDA.

And torchtitan's float8 layouts at their size, weighed by tune without a process group (seconds each, so here
rather than in the unit tier)."""

from __future__ import annotations

import pytest

from conftest import BASE_ENV, TINY_BATCH, TINY_MODEL, read_metrics, run_experiment
from fsdp_exp.tune.options import split_argv
from fsdp_exp.tune.search import weigh

pytest.importorskip("torchao", reason='float8 training needs torchao: pip install "fsdp_exp[float8]"')

pytestmark = pytest.mark.slow

STEPS = 20
BASE = [
    *TINY_MODEL,
    *TINY_BATCH,
    "trainer.nproc_per_node=4",
    "trainer.warmup_steps=1",
    f"trainer.steps={STEPS}",
    "logger.wandb.mode=disabled",
]
FLOAT8 = ["precision=float8", "precision.float8_all_gather=true"]
LAYOUTS = {"tp": ["parallel.tp=2"], "pp": ["parallel.pp=2"]}


def _run_layout(layout: str, tmp_path_factory) -> tuple[dict, dict]:
    """The layout in bf16 and in float8: (folders, records) by precision."""
    folders, records = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in BASE_ENV.items():
            mp.setenv(key, value)
        for precision, chosen in (("bf16", ["precision=bf16"]), ("float8", FLOAT8)):
            folders[precision] = tmp_path_factory.mktemp(f"{layout}_{precision}")
            records[precision] = run_experiment([*BASE, *LAYOUTS[layout], *chosen], folders[precision])
    assert all(r["status"] == "completed" for r in records.values()), {k: r["status"] for k, r in records.items()}
    return folders, records


# One fixture per layout: each test's time limit covers its own two runs.
@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return _run_layout("tp", tmp_path_factory)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    return _run_layout("pp", tmp_path_factory)


def _final_losses(folders: dict) -> tuple[float, float]:
    losses = {name: read_metrics(folders[name])[-1] for name in ("bf16", "float8")}
    assert all(row["step"] == STEPS for row in losses.values())
    return losses["bf16"]["train/loss"], losses["float8"]["train/loss"]


def _converted(float8_applied: dict) -> list[str]:
    return float8_applied["converted"]


def test_float8_with_tensor_parallel_trains_within_5_percent_of_bf16_through_torchaos_float8_styles(tp_runs):
    folders, records = tp_runs
    bf16, float8 = _final_losses(folders)
    assert float8 != bf16 and abs(float8 - bf16) < 0.05 * bf16, (float8, bf16)
    applied = records["float8"]["applied"]
    assert len(_converted(applied["float8"])) == 14  # 7 linears in each of 2 blocks; the output kept high precision
    assert applied["tp"]["float8_styles"] and applied["tp"]["block_plan"] == {
        "attention.wq": "Float8ColwiseParallel",
        "attention.wk": "Float8ColwiseParallel",
        "attention.wv": "Float8ColwiseParallel",
        "attention.wo": "Float8RowwiseParallel",
        "feed_forward.w1": "Float8ColwiseParallel",
        "feed_forward.w3": "Float8ColwiseParallel",
        "feed_forward.w2": "Float8RowwiseParallel",
    }
    assert applied["tp"]["root_plan"] == {"tok_embeddings": "RowwiseParallel", "output": "ColwiseParallel"}
    assert records["bf16"]["applied"]["tp"]["block_plan"]["attention.wq"] == "ColwiseParallel"


def test_float8_inside_pipeline_stages_trains_within_5_percent_of_bf16_with_float8_all_gathers(pp_runs):
    folders, records = pp_runs
    bf16, float8 = _final_losses(folders)
    assert float8 != bf16 and abs(float8 - bf16) < 0.05 * bf16, (float8, bf16)
    # run.json holds rank 0's stages: stage 0, the first block, converted like the whole model at pp=1
    stage = _stage0(records["float8"])
    assert stage["float8"]["enable_fsdp_float8_all_gather"]
    assert _converted(stage["float8"]) == [
        f"layers.0.{part}"
        for part in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w3",
            "feed_forward.w2",
        )
    ]
    assert "float8" not in _stage0(records["bf16"])


def _stage0(record: dict) -> dict:
    stages = record["applied"]["pipeline"]["stages"]
    return stages.get("0", stages.get(0))


# torchtitan's float8 layouts (its Llama 3 float8 tables: FSDP x TP 8, tensorwise with float8 all-gathers and
# rowwise; the 405B rows' FSDP x TP 8 x PP 8 are weighed in test_tune_pipeline.py) on 8 nodes of 8 H100.
TITAN_TP8 = [
    "model=llama70b",
    "model.max_seq_len=8192",
    "trainer.seq_len=8192",
    "trainer.nproc_per_node=8",
    "trainer.nnodes=8",
    "trainer.device=cuda",
    "sharding=full",
    "parallel.tp=8",
    "parallel.sequence_parallel=true",
    "ac=full",
    "compile=true",
    "offload=none",
    "prefetch=default",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=2",
    "plan.device=h100_80gb",
    "tune.space.pp=[1]",
]


@pytest.mark.parametrize(
    "recipe", [["precision.float8_all_gather=true"], ["precision.float8_recipe=rowwise"]], ids=["tensorwise", "rowwise"]
)
def test_torchtitans_float8_tensor_parallel_layouts_are_one_fixed_tune_candidate_with_a_prediction(recipe):
    opts, overrides = split_argv([*TITAN_TP8, "precision=float8", *recipe])
    tuning = weigh(overrides, opts)
    (only,) = tuning.candidates
    assert only.refused is None and only.fits and only.prediction.tokens_per_s > 0
    assert only.candidate.cfg.parallel.tp == 8 and only.candidate.cfg.precision.float8_recipe is not None
