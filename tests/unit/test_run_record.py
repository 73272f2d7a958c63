"""run.json has one writer, ``RunRecord``: each moment of a run's life merges its facts into the record,
which is replaced atomically, and the rules about whose words win hold (no process group needed)."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

from fsdp_exp.record import RUN_RECORD, RunRecord

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_exp"


def test_a_runs_life_merges_into_one_record_written_atomically(tmp_path):
    record = RunRecord(tmp_path)
    record.starting(
        config={"a": 1}, topology={"world_size": 2}, overrides=["x=1"], choices={}, sweep={"n": 0}, plan={"peak": 1.0}
    )
    record.running(applied={}, env={}, wandb={"mode": "disabled", "run_id": None})
    record.checkpoint_saved({"path": "p", "step": 3})
    record.ended("completed", summary={"summary/final_loss": math.nan})
    written = json.loads((tmp_path / RUN_RECORD).read_text())
    assert written["status"] == "completed" and written["sweep"] == {"n": 0} and written["checkpoint"]["step"] == 3
    assert written["config"] == {"a": 1} and written["plan"] == {"peak": 1.0}  # the launcher's, kept
    assert written["summary"]["summary/final_loss"] is None  # JSON has no NaN: null
    assert "schema_version" in written and not list(tmp_path.glob("*.tmp"))


def test_a_resumed_run_keeps_what_the_earlier_attempt_left(tmp_path):
    record = RunRecord(tmp_path)
    record.failed(1, "rank 1 was killed", config={"a": 1}, overrides=[])
    after = record.running(applied={}, env={}, wandb={}, resumed_from={"step": 6})
    assert after["resumed_from"]["previous_attempt"]["error"] == {"rank": 1, "message": "rank 1 was killed"}
    assert after["error"] is None and after["interrupted"] is None and after["status"] == "running"


def test_rank_0_does_not_overwrite_the_error_of_the_rank_that_caused_the_failure(tmp_path):
    record = RunRecord(tmp_path)
    record.failed(1, "ValueError: its own", overrides=[])
    assert record.ended("failed", error="the peer vanished")["error"] == {"rank": 1, "message": "ValueError: its own"}
    other = RunRecord(tmp_path / "other")
    assert other.ended("failed", error="its own")["error"] == {"rank": 0, "message": "its own"}


def test_a_failure_keeps_the_config_already_recorded(tmp_path):
    record = RunRecord(tmp_path)
    record.starting(config={"a": 1}, topology={}, overrides=[], choices={})
    assert record.failed(None, "gone", config={"a": 2}, slurm={"job_id": "7"})["config"] == {"a": 1}


def test_only_the_record_writes_run_json():
    """No module but fsdp_exp/record/run_record.py names the record's file or calls its private writer."""
    writers = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "record":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_write" and "RunRecord" in path.read_text():
                writers.append(f"{path.relative_to(PACKAGE)} calls _write")
            if isinstance(node, ast.Constant) and node.value == RUN_RECORD:
                writers.append(f"{path.relative_to(PACKAGE)} names {RUN_RECORD}")
    assert writers == []
