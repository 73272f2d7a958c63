"""W&B for comparing sweeps, on a real sweep of 4 jobs logged offline, and on a run resumed after a killed
rank: what each offline run file declares and holds (read with W&B's own reader; first for a bare sink,
which gives every schema metric its summary rule and x axis), the workspace the report writes for the sweep,
and ``python -m fsdp_exp.sync`` where no W&B server answers.

What needs a network (saving the workspace, uploading runs) is not tested here; docs/reports.md says so.
Budget: the sweep ~40 s, the resumed run ~25 s, the rest a few seconds each (2 idle cores).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fsdp_exp.launch import RunFailed
from fsdp_exp.metrics.schema import ALL_METRICS
from fsdp_exp.record import WandbSink, note_failure_in_wandb
from fsdp_exp.sync import find_offline_runs

from conftest import BASE_ENV, QUIET, REPO, TINY_BATCH, TINY_MODEL, run_config, run_experiment
from wandb_files import (
    defined_metrics,
    group_filter,
    logged_config,
    offline_folders,
    records,
    summary,
    unknown_references,
)

GRID = ["sharding=full,grad_op", "precision=fp32,bf16"]
FAST = [*TINY_MODEL, *TINY_BATCH, "trainer.steps=4", "trainer.warmup_steps=1", "logger.wandb.mode=offline", *QUIET]


def _env(home: Path) -> dict:
    # The module's fixtures run before the per-test environment fixture, so they isolate themselves.
    return {
        **os.environ,
        **BASE_ENV,
        "WANDB_CONFIG_DIR": str(home / "wandb_config"),
        "WANDB_CACHE_DIR": str(home / "wandb_cache"),
        "WANDB_DATA_DIR": str(home / "wandb_data"),
        "HF_HOME": str(home / "hf"),
        "XDG_CACHE_HOME": str(home / "xdg_cache"),
    }


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wandb_sweep")
    sweep_dir = root / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "-m", *GRID, *FAST, f"hydra.sweep.dir={sweep_dir}"],
        cwd=root,
        env=_env(root / "home"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(sweep_dir.glob("*/run.json"))) == 4
    return sweep_dir


def _jobs(sweep: Path) -> dict[Path, dict]:
    return {p.parent: json.loads(p.read_text()) for p in sorted(sweep.glob("*/run.json"))}


def _assert_declares_every_metric(recs: list[dict]) -> None:
    defined = defined_metrics(recs)
    assert set(defined) == set(ALL_METRICS), set(ALL_METRICS) ^ set(defined)
    for name, metric in ALL_METRICS.items():
        assert defined[name]["summary"] == {metric.wandb_summary: True}, name


def test_the_sink_declares_every_schema_metric_with_its_rule(tmp_path, monkeypatch):
    """A real offline W&B run, read back with W&B's reader: one define_metric record per schema metric, with
    the schema's summary rule, and ``step`` as the x axis of every per-step metric."""
    monkeypatch.chdir(tmp_path)
    wandb_cfg = run_config(["logger.wandb.mode=offline"]).logger.wandb
    sink = WandbSink(wandb_cfg, tmp_path, {"trainer": {"repeat": 0}}, [], {})
    sink.log({"step": 1, "perf/tokens_per_s": 10.0, "mem/params_gib_max": 0.5})
    sink.summary({"summary/tokens_per_s_median": 10.0})
    sink.close()
    (folder,) = offline_folders(tmp_path)
    defined = defined_metrics(records(folder))
    assert set(defined) == set(ALL_METRICS)
    for name, metric in ALL_METRICS.items():
        assert defined[name]["summary"] == {metric.wandb_summary: True}, name
        expected_step = None if metric.window == "run" or name == "step" else "step"
        assert defined[name].get("step_metric") == expected_step, name


@pytest.mark.slow
def test_each_offline_run_declares_every_metric_and_its_summary_equals_run_json(sweep):
    for job, record in _jobs(sweep).items():
        (folder,) = offline_folders(job)
        recs = records(folder)
        _assert_declares_every_metric(recs)
        logged = summary([recs])
        assert {k: v for k, v in logged.items() if k.startswith("summary/")} == record["summary"], job.name
        # The peak the report ranks by, with its source; W&B's own summaries follow the declared rules.
        assert record["summary"]["summary/peak_source"] == "tracked"
        assert logged["summary/peak_gib"] == record["summary"]["summary/tracked_peak_gib_max"]
        assert "perf/tokens_per_s" not in logged and logged["train/loss"].keys() == {"min"}
        assert logged["mem/tracked_total_gib_max"] == {"max": record["summary"]["summary/tracked_peak_gib_max"]}


@pytest.mark.slow
def test_the_sweeps_workspace_is_written_offline_and_names_only_what_its_runs_logged(sweep, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.report", str(sweep), "--out", str(out), "--wandb-workspace", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec_path = out / "wandb_workspace.json"
    assert f"python -m fsdp_exp.report.wandb_workspace {spec_path}" in proc.stdout
    assert f"python -m fsdp_exp.sync {sweep}" in proc.stdout
    spec = json.loads(spec_path.read_text())
    assert (spec["project"], spec["entity"]) == ("fsdp_exp", "")

    # Every panel and column names a schema metric, or a config key every run's W&B config holds.
    configs = [logged_config(records(offline_folders(job)[0])) for job in _jobs(sweep)]
    assert not unknown_references(spec, configs)
    assert group_filter(spec) == [("run:group", "=", sweep.name)]  # exactly the sweep's W&B group
    (runset,) = spec["spec"]["section"]["runSets"]
    assert [g["name"] for g in runset["grouping"]] == ["choices.value.sharding", "choices.value.precision"]

    from fsdp_exp.report.wandb_workspace import read_spec

    assert read_spec(spec_path)._spec == spec  # the library's own models read it back unchanged

    # The report ranks by the peak each run's summary (and so W&B) holds.
    report = json.loads((out / "report.json").read_text())
    peaks = {Path(r["path"]).name: r["peak_gib"] for row in report["ranked"] for r in row["repeats"]}
    assert peaks == {job.name: rec["summary"]["summary/peak_gib"] for job, rec in _jobs(sweep).items()}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once closed: connections are refused


def _sync(paths: list[Path], env: dict, cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    # No proxy, no login: the server each test names is the one tried.
    env = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "wandb_api_key")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.sync", *map(str, paths), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize("server", ["refused", "unresolvable"])
@pytest.mark.slow
def test_sync_without_a_w_and_b_server_fails_fast_naming_every_run(sweep, tmp_path, server):
    url = f"http://127.0.0.1:{_closed_port()}" if server == "refused" else "https://wandb-server.invalid"
    env = {**os.environ, "WANDB_BASE_URL": url}
    proc, seconds = _sync([sweep], env, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert seconds < 30
    assert "4 of 4 W&B run(s) not uploaded" in proc.stderr and "cannot reach the W&B server" in proc.stderr
    for job in _jobs(sweep):
        run_id = offline_folders(job)[0].name.rsplit("-", 1)[1]
        assert run_id in proc.stderr and job.name in proc.stderr
        assert run_id in proc.stdout  # the table
    assert not list(sweep.rglob("*.wandb.synced"))


class _NotWandb(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_sync_skips_uploaded_runs_and_reports_why_wandb_sync_failed(sweep, tmp_path):
    """A server answers (not W&B's) and nobody is logged in: ``wandb sync`` itself refuses each run, and the
    table gives its reason; a run whose file W&B marked synced is not sent again."""
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    jobs = sorted(_jobs(copy))
    (uploaded,) = offline_folders(jobs[0])
    (log,) = uploaded.glob("*.wandb")
    log.with_name(log.name + ".synced").touch()  # what wandb sync leaves after an upload

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotWandb)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {
            **os.environ,
            "WANDB_BASE_URL": f"http://127.0.0.1:{server.server_port}",
            "WANDB_CONFIG_DIR": str(tmp_path / "no_login"),
            "NETRC": str(tmp_path / "no_netrc"),
        }
        proc, _ = _sync([copy], env, tmp_path, "--jobs", "3")
    finally:
        server.shutdown()
    assert proc.returncode == 1, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()[:1].isalnum()}
    first_id = uploaded.name.rsplit("-", 1)[1]
    assert "already uploaded" in rows[first_id]
    assert "3 of 4 W&B run(s) not uploaded" in proc.stderr and first_id not in proc.stderr
    assert "No API key configured" in proc.stderr  # wandb sync's own reason, exit 1


def _clock_stopped_at(seconds: float) -> types.ModuleType:
    frozen = types.ModuleType("time")
    frozen.__dict__.update(vars(time))
    frozen.time = lambda: seconds
    return frozen


def test_sync_finds_every_folder_of_a_run_started_several_times_within_one_second(tmp_path, monkeypatch):
    """A run, the launcher's note of its failure and its resumption, all started within one second (the
    clock wandb.init reads for a run's start held at one second): W&B itself names their folders
    offline-run-<time>-<id>, -<id>-1 and -<id>-2, and sync sends all three, in the order they started."""
    from wandb.sdk import wandb_init

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(wandb_init, "time", _clock_stopped_at(time.time()))
    wandb_cfg = run_config(["logger.wandb.mode=offline"]).logger.wandb
    run_dir, config = tmp_path / "run", {"trainer": {"repeat": 0}}
    first = WandbSink(wandb_cfg, run_dir, config, [], {})
    first.log({"step": 1, "train/loss": 2.0})
    first.close()
    note_failure_in_wandb(wandb_cfg, run_dir, config, [], {}, first.run_id, {"type": "RuntimeError"})
    resumed = WandbSink(wandb_cfg, run_dir, config, [], {}, run_id=first.run_id)
    resumed.log({"step": 2, "train/loss": 1.0})
    resumed.close()

    folders = offline_folders(run_dir)
    base = folders[0].name
    assert base.endswith(f"-{first.run_id}") and [f.name for f in folders] == [base, f"{base}-1", f"{base}-2"]
    (run,) = find_offline_runs([tmp_path])
    assert run.run_id == first.run_id and [f.parent for f in run.files] == folders
    listed = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.sync", str(tmp_path), "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert run.run_id in listed.stdout and "3 of 3 file(s)" in listed.stdout


@pytest.mark.slow
def test_a_resumed_run_is_one_wandb_run_and_its_summary_equals_run_json(tmp_path):
    """Rank 1 is SIGKILLed at step 6; the rerun resumes exactly from step_3. Three offline folders carry one
    id (the first attempt, the launcher's note of the failure, the resumed attempt): sync sends them
    together, oldest first; each declares every metric; replayed in order, their summary/* keys are
    run.json's."""
    overrides = [
        *TINY_MODEL,
        *TINY_BATCH,
        "trainer.steps=8",
        "trainer.warmup_steps=1",
        "checkpoint.every=3",
        "logger.wandb.mode=offline",
    ]
    with pytest.raises(RunFailed):
        run_experiment([*overrides, "debug.fail_at_step=5", "debug.fail_rank=1", "debug.fail_signal=SIGKILL"], tmp_path)
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed" and record["resumed_from"]["step"] == 3

    folders = offline_folders(tmp_path)
    assert len(folders) == 3
    (run,) = find_offline_runs([tmp_path])
    assert run.run_id == record["wandb"]["run_id"] and [f.parent for f in run.files] == folders
    each = [records(folder) for folder in folders]
    _assert_declares_every_metric(each[0])
    _assert_declares_every_metric(each[-1])
    replayed = {k: v for k, v in summary(each).items() if k.startswith("summary/")}
    assert replayed == record["summary"]
    assert {k: v for k, v in summary(each[-1:]).items() if k.startswith("summary/")} == record["summary"]

    listed = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.sync", str(tmp_path), "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert run.run_id in listed.stdout and "would upload" in listed.stdout and "3 of 3 file(s)" in listed.stdout
