"""Find run folders and read their records, whatever state a run was left in.

A run folder is one that holds ``run.json`` or ``metrics.jsonl`` (fsdp_exp.record). A sweep folder holds
run folders at any depth (Hydra's ``<num>_<override_dirname>/``, or folders a user gathered by hand).
Nothing here raises on a damaged run: a missing or unreadable ``run.json``, fields an older or
interrupted run never wrote, a ``metrics.jsonl`` whose last line a crash cut short. Each problem is
written into ``Run.problems`` so that the report can say why a run is not ranked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from fsdp_exp.record import METRICS_FILE, RUN_RECORD, run_name

# Folders inside a run (or next to runs) that never hold a run of their own; not descending into them
# keeps discovery fast on sweeps with W&B files and checkpoints.
_NOT_RUNS = {"wandb", "checkpoints", "export", "errors", ".hydra", ".submitit", "__pycache__"}


class NoRuns(Exception):
    """Nothing to report on; the message names what was searched and what a run folder looks like."""


@dataclass
class Run:
    """One run as the report sees it: its record (the ``run.json`` fields) and its logged rows."""

    path: str  # the run folder, or the W&B run's URL
    record: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, oldest first
    problems: list[str] = field(default_factory=list)  # what is missing or damaged in its files
    source: str = "local"  # local | wandb
    name: Optional[str] = None  # W&B runs: the run's display name

    # ------------------------------------------------------------------ fields, tolerant of absence
    def _dict(self, key: str) -> dict:
        value = self.record.get(key)
        return value if isinstance(value, dict) else {}

    @property
    def status(self) -> str:
        if not self.record:
            return "unknown"
        return str(self.record.get("status") or "unknown")

    @property
    def overrides(self) -> list[str]:
        value = self.record.get("overrides")
        return [str(o) for o in value] if isinstance(value, list) else []

    @property
    def choices(self) -> dict:
        return self._dict("choices")

    @property
    def config(self) -> dict:
        return self._dict("config")

    @property
    def summary(self) -> dict:
        return self._dict("summary")

    @property
    def applied(self) -> Optional[dict]:
        value = self.record.get("applied")
        return value if isinstance(value, dict) else None

    @property
    def topology(self) -> dict:
        return self._dict("topology")

    @property
    def env(self) -> dict:
        return self._dict("env")

    @property
    def label(self) -> str:
        """The run's overrides, as its W&B name says them; the folder name when there is no record."""
        if isinstance(self.record.get("overrides"), list):
            return run_name(self.overrides)
        return self.name or Path(self.path).name

    def last_value(self, key: str) -> Any:
        """The newest logged value of a metric (rows without it are skipped)."""
        for row in reversed(self.rows):
            if row.get(key) is not None:
                return row[key]
        return None

    def config_value(self, dotted: str) -> Any:
        """A resolved config value by its override key (``trainer.micro_batch_size``); None if absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    @property
    def error(self) -> Optional[str]:
        """Why the run did not complete, in one line: its recorded error, or what its files say."""
        err = self.record.get("error")
        if isinstance(err, dict):
            rank, message = err.get("rank"), err.get("message") or "no message recorded"
            return f"rank {rank}: {message}" if rank is not None else str(message)
        if err:
            return str(err)
        stop = self.record.get("interrupted")
        if self.status == "interrupted" and isinstance(stop, dict):
            saved = stop.get("checkpoint") or {}
            said = f"stopped by {stop.get('signal')} after step {saved.get('step')}; checkpoint {saved.get('path')}"
            not_requeued = (self.record.get("slurm") or {}).get("not_requeued")  # written by fsdp_exp.slurm
            return f"{said}; not requeued: {not_requeued}" if not_requeued else said
        if self.problems:
            return "; ".join(self.problems)
        if self.status in ("running", "starting"):
            # The launcher updates the status on every way out but SIGKILL; a sweep that is over and
            # still shows "running" lost its launcher.
            return f"status '{self.status}': still running, or its launcher was killed"
        return None


def _natural_key(path: Path) -> list:
    # "10_x" after "9_x": Hydra numbers jobs without padding.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_run_dirs(path: Path) -> list[Path]:
    """Run folders at or under ``path``, in job order."""
    path = Path(path)
    if (path / RUN_RECORD).is_file() or (path / METRICS_FILE).is_file():
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        if RUN_RECORD in files or METRICS_FILE in files:
            found.append(Path(root))
            dirs[:] = []  # a run folder holds no other runs
            continue
        dirs[:] = [d for d in dirs if d not in _NOT_RUNS]
    return sorted(found, key=_natural_key)


def read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """Rows of a ``metrics.jsonl``, skipping lines that do not parse (a crash mid-write cuts the last)."""
    rows, bad = [], []
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return [], [f"{path.name} unreadable: {err}"]
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    problems = [f"{path.name}: skipped {len(bad)} unreadable line(s) ({', '.join(map(str, bad[:5]))})"] if bad else []
    return rows, problems


def read_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    run = Run(path=str(run_dir))
    record_path = run_dir / RUN_RECORD
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            if isinstance(record, dict):
                run.record = record
            else:
                run.problems.append(f"{RUN_RECORD} holds a {type(record).__name__}, not an object")
        except (OSError, json.JSONDecodeError) as err:
            run.problems.append(f"{RUN_RECORD} unreadable: {err}")
    else:
        # The launcher writes run.json before any rank starts, so a folder without it was copied in
        # part or written by something else; its rows alone carry no config to label or rank them by.
        run.problems.append(f"{RUN_RECORD} missing")
    metrics_path = run_dir / METRICS_FILE
    if metrics_path.is_file():
        run.rows, problems = read_metrics(metrics_path)
        run.problems += problems
    if run.record and run.status == "completed":
        for key in ("summary", "config", "applied"):
            if not isinstance(run.record.get(key), dict):
                run.problems.append(f"{RUN_RECORD} has no '{key}'")
    return run


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run at or under the given paths (sweep folders or run folders), each read once.

    Raises NoRuns naming the paths when there is none, or when a path does not exist.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise NoRuns("no path given: pass a sweep folder (outputs/sweeps/<time>) or run folders")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise NoRuns(f"no such file or folder: {', '.join(missing)}")
    seen: dict[Path, None] = {}
    for path in paths:
        for run_dir in find_run_dirs(path):
            seen.setdefault(run_dir.resolve(), None)
    if not seen:
        raise NoRuns(
            f"no runs under {', '.join(map(str, paths))}: a run folder holds {RUN_RECORD} (written by "
            f"python -m fsdp_exp); pass a sweep folder (outputs/sweeps/<time>) or run folders"
        )
    return [read_run(run_dir) for run_dir in seen]
