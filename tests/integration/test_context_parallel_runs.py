"""Context parallel through the CLI, as a user runs it: the experiment=long_sequence preset (one sequence per
micro-batch at cp 1, 2 and 4 on 4 ranks, shortened here) trains the same losses at every cp, its tracked
peak per rank falls with cp as the planner says (within 5%), the profiled step shows the all-to-alls, and a
CP run whose rank is killed ends naming it and resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_exp.launch import RunFailed

from conftest import QUIET, read_metrics, run_cli, run_experiment

pytestmark = pytest.mark.slow

CPS = (1, 2, 4)
# The preset at a quarter of its sequence, checkpoints every 2 steps (the kill test resumes from them).
SHORT = ["trainer.seq_len=512", "model.max_seq_len=512", "checkpoint.every=2"]
PLANNER_BAND = 0.05


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("long_sequence")
    cmd = ["-m", "experiment=long_sequence", *SHORT, f"hydra.sweep.dir={root}"]
    result = run_cli(cmd, root / "cli", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = {cp: next(root.glob(f"{i}_*parallel.cp={cp}*")) for i, cp in enumerate(CPS)}  # Hydra's job folders
    return jobs


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_every_cp_trains_the_same_losses_and_gradient_norms(sweep):
    rows = {cp: [r for r in read_metrics(run_dir) if "train/loss" in r] for cp, run_dir in sweep.items()}
    for cp in (2, 4):
        assert len(rows[cp]) == len(rows[1]) == 5
        for one, split in zip(rows[1], rows[cp]):
            for key in ("train/loss", "train/grad_norm"):
                gap = abs(split[key] / one[key] - 1)
                assert gap < 1e-5, f"cp={cp} step {one['step']}: {key} {split[key]} vs cp=1 {one[key]}"


def test_the_tracked_peak_per_rank_falls_with_cp_as_planned(sweep):
    peaks, errors = {}, {}
    for cp, run_dir in sweep.items():
        summary = _record(run_dir)["summary"]
        peaks[cp], errors[cp] = summary["summary/tracked_peak_gib_max"], summary["summary/planner_peak_error"]
        assert abs(errors[cp]) < PLANNER_BAND, f"cp={cp}: planned peak off the tracked one by {errors[cp]:.1%}"
    # Activations dominate here: each doubling of cp nearly halves the peak (model states and buffers stay).
    assert peaks[2] < 0.65 * peaks[1] and peaks[4] < 0.65 * peaks[2], peaks


def test_the_profiled_step_shows_the_all_to_alls_and_tokens_count_each_sequence_once(sweep):
    for cp, run_dir in sweep.items():
        (profiled,) = [r for r in read_metrics(run_dir) if "comm/all_to_all_s" in r]
        assert (profiled["comm/all_to_all_s"] > 0) == (cp > 1), (cp, profiled["comm/all_to_all_s"])
        record = _record(run_dir)
        assert record["applied"].get("cp", {}).get("cp", 1) == cp
        # tokens per step: the global batch's 4 sequences x their length, however many ranks split each
        for row in read_metrics(run_dir):
            if "perf/tokens_per_s" in row:
                assert row["perf/tokens_per_s"] * row["perf/step_time_s"] == pytest.approx(4 * 512)


def test_a_killed_rank_of_a_cp_run_ends_the_job_naming_it_and_the_resume_is_bit_identical(sweep, tmp_path):
    overrides = ["experiment=long_sequence", *SHORT, "parallel.cp=2", *QUIET]
    with pytest.raises(RunFailed) as info:
        run_experiment([*overrides, "debug.fail_at_step=3", "debug.fail_rank=1", "debug.fail_signal=SIGKILL"], tmp_path)
    assert info.value.rank == 1 and "SIGKILL" in info.value.summary
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed" and record["resumed_from"]["step"] == 2
    expected = {r["step"]: r["train/loss"] for r in read_metrics(sweep[2]) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r}
    assert got == expected
