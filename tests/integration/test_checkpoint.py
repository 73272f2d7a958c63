"""Checkpoints, exact resume and faults, on real gloo process groups.

One uninterrupted reference run (module fixture, async saves) is the yardstick: a run killed at a
step, killed in the middle of a save, stopped by SIGTERM or resharded must continue it exactly (bit
for bit at the same layout, within 1e-5 relative at another world size)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_exp.checkpoint import META_FILE, TMP_SUFFIX, CheckpointError, complete_checkpoints, read_meta, resolve_resume
from fsdp_exp.config import ConfigError
from fsdp_exp.debug import compare_init_digests
from fsdp_exp.preflight import validate
from fsdp_exp.launch import RunFailed

from conftest import (
    TINY_BATCH,
    TINY_MODEL,
    BASE_ENV,
    MARKER,
    QUIET,
    REPO,
    leftover_processes,
    read_metrics,
    run_config,
    run_experiment,
)

STEPS = 24
TINY = [*TINY_MODEL, *TINY_BATCH, "trainer.warmup_steps=1"]
BASE = [*TINY, f"trainer.steps={STEPS}", "logger.wandb.mode=disabled"]
EVERY = 3


def _losses(run_dir: Path) -> dict[int, float]:
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {r["step"]: r["train/loss"] for r in rows}


def _assert_bit_identical(run_dir: Path, reference: dict[int, float]) -> None:
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), f"missing or extra steps: {sorted(got)}"
    different = {s: (got[s], reference[s]) for s in got if got[s] != reference[s]}
    assert not different, f"losses differ from the uninterrupted run: {different}"


def _fails(overrides: list[str], run_dir: Path) -> RunFailed:
    with pytest.raises(RunFailed) as info:
        run_experiment(overrides, run_dir)
    return info.value


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run saving every EVERY steps (asynchronously), keeping the newest 2."""
    run_dir = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in BASE_ENV.items():
            mp.setenv(key, value)
        record = run_experiment(
            [*BASE, f"checkpoint.every={EVERY}", "checkpoint.keep=2", "checkpoint.async_save=true"], run_dir
        )
    assert record["status"] == "completed"
    return run_dir, _losses(run_dir)


@pytest.mark.slow
def test_periodic_checkpoints_are_complete_and_pruned(reference):
    run_dir, losses = reference
    root = run_dir / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [21, 24]  # keep=2 (the last step is always saved)
    assert not list(root.glob(f"*{TMP_SUFFIX}"))
    meta = read_meta(root / "step_21")
    assert meta["step"] == 21 and meta["world_size"] == 2 and meta["mesh_shape"] == [2]
    assert meta["mesh_dim_names"] == ["shard"] and meta["backend"] == "fsdp2" and len(meta["config_hash"]) == 16
    assert meta["data"]["step"] == 21 and meta["data"]["samples_seen"] == 21 * 8
    assert len(meta["devices"]) == 2 and meta["bytes"] > 0
    files = {p.name for p in (root / "step_21").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.pt", "rng", META_FILE} <= files
    assert {p.name for p in (root / "step_21" / "rng").iterdir()} == {"rank0.pt", "rank1.pt"}
    record = json.loads((run_dir / "run.json").read_text())
    assert record["checkpoint"]["step"] == STEPS and record["checkpoint"]["path"] == str(root / f"step_{STEPS}")
    assert sorted(losses) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_resume_after_a_killed_rank_is_bit_identical(tmp_path, reference):
    """Rank 1 is SIGKILLed at step 8: the job fails naming it; the rerun in the same run directory resumes
    from step_6, continues the same W&B run, and its losses equal the uninterrupted run's bit for bit."""
    _, expected = reference
    overrides = [*BASE, f"checkpoint.every={EVERY}", "logger.wandb.mode=offline"]
    failure = _fails([*overrides, "debug.fail_at_step=7", "debug.fail_rank=1", "debug.fail_signal=SIGKILL"], tmp_path)
    assert failure.rank == 1 and "SIGKILL" in failure.summary
    assert [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")] == [3, 6]
    assert max(_losses(tmp_path)) == 7  # step 7 was logged, then the rank died
    first_id = read_meta(tmp_path / "checkpoints" / "step_6")["wandb_run_id"]
    assert first_id

    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed" and record.get("error") is None
    assert record["resumed_from"]["step"] == 6 and not record["resumed_from"]["resharded"]
    assert record["resumed_from"]["previous_attempt"]["error"]["rank"] == 1
    _assert_bit_identical(tmp_path, expected)
    # One W&B run, continued: three offline folders with the same id (rank 0's first attempt, the
    # launcher's note of rank 1's failure, the resumed attempt), the last from step 7 on.
    assert record["wandb"]["run_id"] == first_id
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 3 and all(first_id in f.name for f in folders)
    history = _wandb_history(folders[-1])
    assert [h["_step"] for h in history] == list(range(7, STEPS + 1))


def _wandb_history(folder: Path) -> list[dict]:
    wandb_bin = Path(sys.executable).with_name("wandb")
    (log,) = folder.glob("*.wandb")
    records = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--json", str(log)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [r["history"]["item"] for r in map(json.loads, records) if r["type"] == "history"]


@pytest.mark.slow
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path, reference):
    """Rank 0 is SIGKILLed after writing its shards of step_6, before the checkpoint is complete: only
    step_6.tmp exists, resume ignores it and continues from step_3, bit-identically."""
    _, expected = reference
    overrides = [*BASE, f"checkpoint.every={EVERY}"]
    failure = _fails(
        [
            *overrides,
            "debug.fail_during=save",
            "debug.fail_at_step=6",
            "debug.fail_rank=0",
            "debug.fail_signal=SIGKILL",
        ],
        tmp_path,
    )
    assert failure.rank == 0 and "SIGKILL" in failure.summary
    root = tmp_path / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [3]
    partial = root / f"step_6{TMP_SUFFIX}"
    assert partial.is_dir() and list(partial.glob("*.distcp")) and not (partial / META_FILE).exists()

    record = run_experiment(overrides, tmp_path)
    assert record["resumed_from"]["step"] == 3
    _assert_bit_identical(tmp_path, expected)
    assert not partial.exists() and [s for s, _ in complete_checkpoints(root)] == [21, 24]


@pytest.mark.parametrize("nproc", [1, 4])
@pytest.mark.slow
def test_two_rank_checkpoint_resumes_at_another_world_size(tmp_path, reference, nproc):
    ref_dir, expected = reference
    record = run_experiment(
        [*BASE, f"trainer.nproc_per_node={nproc}", f"checkpoint.resume={ref_dir / 'checkpoints' / 'step_21'}"], tmp_path
    )
    resumed = record["resumed_from"]
    assert resumed["resharded"] and resumed["saved_layout"]["world_size"] == 2
    assert resumed["layout"]["world_size"] == nproc
    got = _losses(tmp_path)
    assert sorted(got) == list(range(22, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - expected[step]) / abs(expected[step]) < 1e-5, (step, loss, expected[step])


@pytest.mark.parametrize("backend", ["sharding.backend=fsdp1", "sharding=ddp"])
@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_under_another_backend(tmp_path, reference, backend):
    ref_dir, expected = reference
    record = run_experiment([*BASE, backend, f"checkpoint.resume={ref_dir / 'checkpoints' / 'step_21'}"], tmp_path)
    assert record["resumed_from"]["saved_layout"]["backend"] == "fsdp2"
    for step, loss in _losses(tmp_path).items():
        assert abs(loss - expected[step]) / abs(expected[step]) < 1e-5, (step, loss, expected[step])


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.n_layers=3"], "another architecture (model.n_layers: 2 in the checkpoint, 3 now)"),
        (
            ["sharding.backend=fsdp1", "sharding.use_orig_params=false", "optim.weight_decay=0"],
            "cannot convert checkpoint",
        ),
    ],
)
@pytest.mark.slow
def test_what_cannot_be_converted_is_refused(tmp_path, reference, overrides, needle):
    ref_dir, _ = reference
    failure = _fails([*BASE, *overrides, f"checkpoint.resume={ref_dir / 'checkpoints' / 'step_21'}"], tmp_path)
    assert "CheckpointError" in failure.summary and needle in failure.summary, failure.summary
    assert "checkpoint.resume=none" in failure.summary


def _launcher_children(pid: int) -> list:
    """The launcher's ranks (forked or spawned): its child processes less multiprocessing's resource
    tracker and rank 0's W&B writer."""
    import psutil

    helpers = ("resource_tracker", "fsdp_exp.record.wandb_process")
    return sorted(
        (p for p in psutil.Process(pid).children() if not any(h in " ".join(p.cmdline()) for h in helpers)),
        key=lambda p: (p.create_time(), p.pid),
    )


def _start_cli(overrides: list[str], run_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fsdp_exp", *overrides, *QUIET, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, MARKER: str(run_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_rows(run_dir: Path, proc: subprocess.Popen, rows: int, timeout: float = 120) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the run logged too few steps in time")


@pytest.mark.slow
def test_sigkill_of_a_rank_ends_the_job_naming_it(tmp_path):
    """A rank killed from outside: the job ends well within 60 s, exit 1, naming the rank; no process of
    it (ranks, the W&B service) is left."""
    run_dir = tmp_path / "run"
    proc = _start_cli([*TINY, "trainer.steps=100000", "logger.wandb.mode=offline"], run_dir)
    _wait_for_rows(run_dir, proc, 2)
    ranks = _launcher_children(proc.pid)
    assert len(ranks) == 2
    killed = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=90)
    took = time.monotonic() - killed
    assert proc.returncode == 1, stderr
    assert took < 60, f"the job took {took:.1f}s to end"
    assert "rank 1 failed" in stderr and "SIGKILL" in stderr, stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error"]["rank"] == 1
    time.sleep(1)
    assert leftover_processes(run_dir) == []
    print(f"SIGKILL of rank 1 -> job ended in {took:.2f}s")


@pytest.mark.slow
def test_sigterm_saves_and_the_requeued_run_continues_bit_identically(tmp_path, reference):
    """SIGTERM to the launcher (a scheduler's preemption): it forwards the signal, every rank saves at the
    same step and exits cleanly (exit 0, status interrupted); the rerun continues bit-identically."""
    _, expected = reference
    run_dir = tmp_path / "run"
    proc = _start_cli(BASE, run_dir)
    _wait_for_rows(run_dir, proc, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "interrupted", stderr
    stop = record["interrupted"]
    assert stop["signal"] == "SIGTERM" and 3 <= stop["checkpoint"]["step"] < STEPS
    assert f"stopped by SIGTERM after step {stop['checkpoint']['step']}" in stderr
    assert [s for s, _ in complete_checkpoints(run_dir / "checkpoints")] == [stop["checkpoint"]["step"]]
    assert max(_losses(run_dir)) == stop["checkpoint"]["step"]
    assert leftover_processes(run_dir) == []

    record = run_experiment(BASE, run_dir)  # the requeued job: same command, same run directory
    assert record["status"] == "completed" and record["interrupted"] is None
    assert record["resumed_from"]["step"] == stop["checkpoint"]["step"]
    _assert_bit_identical(run_dir, expected)


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path):
    failure = _fails([*BASE, f"checkpoint.every={EVERY}", "debug.nan_at_step=4", "debug.fail_rank=1"], tmp_path)
    assert "NonFiniteLoss" in failure.summary and "at step 5 (seen on rank 1)" in failure.summary, failure.summary
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / 'step_3'}" in failure.summary
    assert [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")] == [3]
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert rows[5]["train/loss"] is None and rows[4]["train/loss"] is not None  # logged as null (not finite)
    assert max(rows) == 6  # step 5's flags are read at step 6, a save step: agreed before it would save
    from fsdp_exp.export import load_checkpoint_model

    state, _ = load_checkpoint_model(tmp_path / "checkpoints" / "step_3")
    assert state and all(t.isfinite().all() for t in state.values())


def test_exports_and_identical_init_check(tmp_path, monkeypatch):
    """checkpoint.export=hf: transformers' LlamaForCausalLM loads it offline and its logits match the
    model in the final checkpoint within 1e-4. The same checkpoint exported offline as safetensors holds
    fsdp_exp's names. debug.check_identical_init passes on a healthy run."""
    import torch
    from safetensors.torch import load_file

    from fsdp_exp.export import main as export_main
    from reference import hf_export_logits_gap

    record = run_experiment(
        [
            *TINY,
            "trainer.steps=2",
            "logger.wandb.mode=disabled",
            "checkpoint.every=2",
            "checkpoint.export=hf",
            "debug.check_identical_init=true",
        ],
        tmp_path,
    )
    assert record["init_check"]["result"] == "identical" and record["init_check"]["shards_checked"] > 0
    assert record["export"]["format"] == "hf"
    # Offline for this test only: a variable left set changes how later tests' hub names are refused.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    diff, state = hf_export_logits_gap(tmp_path / "export", tmp_path / "checkpoints" / "step_2")
    assert diff < 1e-4, diff

    export_main([str(tmp_path / "checkpoints" / "step_2"), str(tmp_path / "flat"), "--format", "safetensors"])
    flat = load_file(tmp_path / "flat" / "model.safetensors")
    assert set(flat) == set(state) and all(torch.equal(flat[k], state[k]) for k in state)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp1"])
def test_tied_embeddings_stay_one_tensor(tmp_path, sharding):
    """model.tie_embeddings=true: materializing the model on its device (to_empty; FSDP1's param_init_fn,
    module by module) makes each module's parameters anew, which would untie the output projection from
    the embedding and train two tensors. The model ties them again (LlamaSpec.retie, for every backend that
    materializes with to_empty: DDP here, ZeRO-1/2 alike), FSDP1 materializes a tied tensor once: the
    exported model has one tensor under both names, seeded as the embedding (the identical-init check)."""
    import torch
    from safetensors.torch import load_file

    record = run_experiment(
        [
            *TINY,
            "model.tie_embeddings=true",
            f"sharding={sharding}",
            "trainer.steps=2",
            "logger.wandb.mode=disabled",
            "checkpoint.export=safetensors",
            "debug.check_identical_init=true",
        ],
        tmp_path,
    )
    assert record["init_check"]["result"] == "identical"
    state = load_file(tmp_path / "export" / "model.safetensors")
    assert "output.weight" not in state or torch.equal(state["output.weight"], state["tok_embeddings.weight"])


def test_init_digest_comparison_names_ranks_and_tensors():
    ok = {"name": "w", "slice": "whole", "hash": "a", "expected": "a"}
    assert compare_init_digests([[ok], [ok]]) == []
    bad = {**ok, "hash": "b"}
    problems = compare_init_digests([[ok], [bad], [ok]])
    assert "w (whole): replicas differ between ranks [0, 2] vs ranks [1]" in problems
    assert "rank 1: w (whole) is not the seeded initial value" in problems
    shard0 = {"name": "v", "slice": "shape [2] at [0]", "hash": "x", "expected": "x"}
    shard1 = {"name": "v", "slice": "shape [2] at [2]", "hash": "y", "expected": "y"}
    assert compare_init_digests([[shard0], [shard1]]) == []  # different slices are not replicas


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (["checkpoint.every=-1"], "checkpoint.every=0"),
        (["checkpoint.keep=-2"], "checkpoint.keep=2"),
        (["checkpoint.export=onnx"], "checkpoint.export=safetensors"),
        (["checkpoint.export=hf", "model=moe_tiny", "model.n_shared_experts=1"], "checkpoint.export=safetensors"),
        (["checkpoint.signals=[SIGKILL]"], "checkpoint.signals=[SIGTERM,SIGUSR1]"),
        (["debug.fail_during=save", "debug.fail_at_step=3"], "checkpoint.every=N"),
        (["debug.fail_signal=KILL"], "debug.fail_signal=SIGKILL"),
    ],
)
def test_checkpoint_knobs_are_validated(overrides, fix):
    with pytest.raises(ConfigError) as info:
        validate(run_config(overrides), cuda_devices=0)
    assert fix in str(info.value)


def test_resume_finds_only_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_4.tmp").mkdir(parents=True)
    cfg = run_config([])
    assert resolve_resume(cfg, tmp_path) is None  # auto: nothing complete yet
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(run_config([f"checkpoint.resume={root / 'step_4.tmp'}"]), tmp_path)
    done = root / "step_2"
    done.mkdir()
    (done / ".metadata").write_bytes(b"")
    (done / META_FILE).write_text("{}")
    assert resolve_resume(cfg, tmp_path) == done
    assert resolve_resume(run_config([f"checkpoint.resume={root}"]), tmp_path) == done  # a dir: its newest
    assert resolve_resume(run_config(["checkpoint.resume=none"]), tmp_path) is None
