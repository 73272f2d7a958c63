"""Block-causal attention on the shipped corpus, through the launcher as a user runs it (data=text, one document
per paragraph, 2 gloo ranks): the loss falls as the causal run's does, the two differ (the corpus's blocks hold
document boundaries), run.json says which mask, position scheme and attention span ran, the planner's peak is
within 5% of torch's tracker (the mask included), and a run whose rank is killed resumes bit for bit.
docs/data.md quotes the same comparison at 200 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_exp.launch import RunFailed

from conftest import TINY_MODEL, read_metrics, run_experiment

pytestmark = pytest.mark.slow

STEPS = 12
COMMON = [
    *TINY_MODEL,
    "data=text",
    "trainer.seq_len=256",
    "model.max_seq_len=256",
    "trainer.global_batch_size=8",
    f"trainer.steps={STEPS}",
    "trainer.warmup_steps=2",
    "trainer.nproc_per_node=2",
    "optim.lr=3e-3",
    "checkpoint=periodic",
    "checkpoint.every=4",
]
BLOCK = [*COMMON, "model.attention_mask=block_causal", "data.positions=document"]
PLANNER_BAND = 0.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed_corpus")
    for name, overrides in (("block_causal", BLOCK), ("causal", COMMON)):
        record = run_experiment([*overrides, f"data.cache_dir={root / 'cache'}"], root / name)
        assert record["status"] == "completed"
    return {name: root / name for name in ("block_causal", "causal")}


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def _env(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())["env"]


def test_block_causal_trains_like_causal_and_the_record_says_what_ran(runs):
    block, causal = _losses(runs["block_causal"]), _losses(runs["causal"])
    assert len(block) == len(causal) == STEPS
    fall_block, fall_causal = block[1] - block[STEPS], causal[1] - causal[STEPS]
    assert fall_block > 0.5 and 0.5 < fall_block / fall_causal < 2, (block, causal)
    assert block != causal  # the corpus's blocks hold document boundaries: the mask changes what is trained
    env = _env(runs["block_causal"])
    assert (env["attention_mask"], env["positions"]) == ("block_causal", "document")
    # the paragraphs (about 760 bytes) are longer than a block: the span is most of it, less the boundaries
    assert 128 < env["attention_span"] < 256 and "packed blocks" in env["attention_span_source"]
    assert (_env(runs["causal"])["attention_mask"], _env(runs["causal"])["attention_span"]) == ("causal", 256)


def test_the_planner_counts_the_mask(runs):
    summary = json.loads((runs["block_causal"] / "run.json").read_text())["summary"]
    assert abs(summary["summary/planner_peak_error"]) < PLANNER_BAND, summary["summary/planner_peak_error"]


def test_a_killed_block_causal_run_resumes_bit_for_bit(runs, tmp_path):
    overrides = [*BLOCK, f"data.cache_dir={runs['block_causal'].parent / 'cache'}"]
    with pytest.raises(RunFailed):
        run_experiment([*overrides, "debug.fail_at_step=6", "debug.fail_rank=1", "debug.fail_signal=SIGKILL"], tmp_path)
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed" and record["resumed_from"]["step"] == 4
    assert _losses(tmp_path) == _losses(runs["block_causal"])
