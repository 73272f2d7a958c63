"""Rank 0's W&B writer process (fsdp_exp.record.wandb_process): a real offline W&B run written by the
child, read back with W&B's own reader; a run W&B cannot open; a parent that dies. ~5 s on 2 cores."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from fsdp_exp.record.wandb_process import WandbProcess

from conftest import REPO
from wandb_files import offline_folders, records, summary

OFFLINE = SimpleNamespace(project="fsdp_exp", entity=None, group=None, name=None, tags=[], mode="offline")


def test_the_wandb_process_writes_every_row_and_the_summary_into_the_run_it_named_before_opening(tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    # The run's env holds torch.__version__ (a str subclass): the child gets a str, and never loads torch.
    config = {"trainer": {"repeat": 0}, "env": {"torch_version": torch.__version__}}
    sink = WandbProcess(OFFLINE, tmp_path, config, ["sharding=full"], {"sharding": "full"})
    run_id = sink.run_id  # known before W&B has opened the run: run.json and checkpoints name it at once
    deadline = time.monotonic() + 60
    while not offline_folders(tmp_path) and time.monotonic() < deadline:  # the child has opened the run
        time.sleep(0.05)
    assert "libtorch" not in Path(f"/proc/{sink._child.pid}/maps").read_text()
    rows = [{"step": s, "train/loss": 3.0 - s, "perf/mfu_fp8": None} for s in (1, 2, 3)]
    for row in rows:
        sink.log(row)
    sink.summary({"summary/tokens_per_s_median": 10.0})
    sink.close()
    assert sink.error is None
    (folder,) = offline_folders(tmp_path)
    assert folder.name.endswith(f"-{run_id}")
    recs = records(folder)
    history = [r["history"]["item"] for r in recs if r["type"] == "history"]
    logged = [(h["_step"], h["train/loss"], h["perf/mfu_fp8"]) for h in history]
    assert logged == [(1, 2.0, None), (2, 1.0, None), (3, 0.0, None)]
    assert summary([recs])["summary/tokens_per_s_median"] == 10.0
    (run,) = [r["run"] for r in recs if r["type"] == "run"]
    assert run["display_name"] == "sharding=full" and "sharding:full" in run["tags"]
    assert run["config"]["update"]["env"] == {"torch_version": str(torch.__version__)}


def test_a_wandb_run_that_cannot_be_opened_lets_the_run_go_on_and_says_why(tmp_path, monkeypatch, capfd):
    """W&B is a copy of metrics.jsonl and run.json: W&B failing to open the run (it opens while rank 0
    trains) is W&B stopping at the start, not the run failing."""
    monkeypatch.chdir(tmp_path)
    broken = SimpleNamespace(**{**vars(OFFLINE), "mode": "no-such-mode"})
    sink = WandbProcess(broken, tmp_path, {"trainer": {"repeat": 0}}, [], {})
    sink.log({"step": 1, "train/loss": 1.0})
    sink.close()
    assert sink.error.startswith("open: ") and "no-such-mode" in sink.error, sink.error
    assert "W&B stopped working" in capfd.readouterr().err


def test_the_wandb_process_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """A rank killed by SIGKILL leaves no W&B writer behind (it would outlive the job otherwise)."""
    script = (
        "import os, signal, sys, time\n"
        "from types import SimpleNamespace\n"
        "from fsdp_exp.record.wandb_process import WandbProcess\n"
        "cfg = SimpleNamespace(project='fsdp_exp', entity=None, group=None, name=None, tags=[], mode='offline')\n"
        f"sink = WandbProcess(cfg, {str(tmp_path)!r}, {{'trainer': {{'repeat': 0}}}}, [], {{}})\n"
        "sink.log({'step': 1, 'train/loss': 1.0})\n"
        "print(sink._child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()


def test_a_wandb_process_whose_parent_ends_before_handing_it_a_run_ends_without_a_word():
    """A launcher that refused the config, or a rank 0 that failed while building, closes the pipe of the
    writer it started ahead before sending it anything: the run's own error is the only thing to print."""
    child = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.record.wandb_process"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,  # the end of its input at once
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stderr == "" and child.stdout == ""
