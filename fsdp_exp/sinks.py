"""Where a run's numbers go: ``run.json`` (the record), ``metrics.jsonl``, Weights & Biases, the console.

Only rank 0 writes. Every sink takes the same metric names (fsdp_exp.metrics.schema). Files are
written so that a crash loses nothing already logged: run.json is replaced atomically, metrics.jsonl
is flushed line by line.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

from fsdp_exp.metrics.schema import SCHEMA_VERSION

RUN_RECORD = "run.json"
METRICS_FILE = "metrics.jsonl"
# The config groups whose choices become W&B tags and the default run name.
TAGGED_GROUPS = ("model", "sharding", "precision", "offload", "prefetch", "wrap", "ac", "optim", "data")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null says "no number" without breaking readers
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class RunRecord:
    """``run.json``: config, applied settings, environment, status, summary; rewritten atomically."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RUN_RECORD

    def read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def update(self, **fields: Any) -> dict:
        record = self.read()
        record.setdefault("schema_version", SCHEMA_VERSION)
        record.update(_json_safe(fields))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.path)
        return record


class JsonlSink:
    """``metrics.jsonl``, one row per logged step. ``keep_through_step``: on a (re)start in a run directory
    that already has rows, keep those with ``step <= keep_through_step`` (``kept``) and drop the rest,
    which a resumed run logs again; None appends to whatever is there."""

    def __init__(self, run_dir: Path, keep_through_step: Optional[int] = None):
        path = Path(run_dir) / METRICS_FILE
        self.kept: list[dict] = []
        if keep_through_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if row.get("step", 0) <= keep_through_step:
                    self.kept.append(row)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.kept))
            os.replace(tmp, path)
        self.file = open(path, "a", buffering=1)  # line-buffered

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(_json_safe(metrics)) + "\n")

    def close(self) -> None:
        self.file.close()


def run_name(overrides: list[str]) -> str:
    """A readable name from the command-line overrides: 'sharding=grad_op,precision=bf16'."""
    shown = [o for o in overrides if not o.startswith(("hydra.", "logger.", "hydra/"))]
    return ",".join(shown) if shown else "default"


def run_tags(choices: dict[str, str], extra: list[str]) -> list[str]:
    return [f"{g}:{choices[g]}" for g in TAGGED_GROUPS if choices.get(g)] + list(extra)


class WandbSink:
    """One W&B run per experiment, opened by rank 0 in the run directory (offline by default)."""

    def __init__(self, wandb_cfg, run_dir: Path, config: dict, overrides: list[str], choices: dict[str, str],
                 run_id: Optional[str] = None):
        import wandb

        self.wandb = wandb
        # A run resumed from a checkpoint continues the W&B run the checkpoint names (offline: a new
        # offline-run-*-<id> folder with the same id; `wandb sync` appends it to that run).
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(
            **resume,
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=wandb_cfg.group,
            name=wandb_cfg.name or run_name(overrides),
            tags=run_tags(choices, wandb_cfg.tags),
            config=_json_safe(config),
            dir=str(run_dir),
            mode=wandb_cfg.mode,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

        if run_id:  # a run continued after a failure is no longer failed (note_failure_in_wandb)
            self.run.summary.update({"error": None})
        self.error: Optional[str] = None  # set when W&B stopped working during the run

    @property
    def run_id(self) -> Optional[str]:
        return self.run.id if self.run else None

    def _guarded(self, what: str, call) -> None:
        """W&B is a copy of what metrics.jsonl and run.json hold: if it stops working mid-run (its service
        process killed by a scheduler's SIGTERM to the whole job step, a full disk), the run goes on
        without it instead of failing; ``error`` says what happened and run.json records it."""
        if self.error is not None:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any W&B failure: stop using it
            self.error = f"{what}: {type(exc).__name__}: {exc}"
            print(f"fsdp_exp: W&B stopped working ({self.error}); the run goes on without it, its metrics "
                  f"stay in metrics.jsonl", file=sys.stderr)

    def log(self, metrics: dict) -> None:
        row = _json_safe({k: v for k, v in metrics.items() if k != "step"})
        self._guarded("log", lambda: self.run.log(row, step=metrics["step"]))

    def summary(self, summary: dict) -> None:
        self._guarded("summary", lambda: self.run.summary.update(_json_safe(summary)))

    def log_files(self, files: list[Path], run_dir: Path) -> None:
        """The run's profiler traces and memory snapshots (every rank's: all in the shared run directory
        by the time rank 0 closes) as one W&B artifact, named by their paths in the run directory."""
        artifact = self.wandb.Artifact(f"profile-{self.run_id}", type="profile",
                                       description="torch.profiler chrome traces (traces/) and CUDA memory "
                                                   "snapshots (memory/) of the sampled steps, every rank")
        for path in files:
            artifact.add_file(str(path), name=str(Path(path).relative_to(run_dir)))
        self._guarded("log_artifact", lambda: self.run.log_artifact(artifact))

    def close(self, exit_code: int = 0) -> None:
        self._guarded("finish", lambda: self.run.finish(exit_code=exit_code))


def note_failure_in_wandb(wandb_cfg, run_dir: Path, config: dict, overrides: list[str], choices: dict[str, str],
                          run_id: Optional[str], error: dict) -> Optional[str]:
    """Put a failed run's error into W&B: into the run rank 0 opened (continued by id), or into a new run
    when the job failed before any rank started (an invalid combination in a sweep). Returns its id."""
    sink = WandbSink(wandb_cfg, run_dir, config, overrides, choices, run_id=run_id)
    sink.summary({"status": "failed", "error": error})
    sink.close(exit_code=1)
    return sink.run_id


class ConsoleSink:
    """A progress bar during the run and a summary table at the end (rank 0)."""

    def __init__(self, total_steps: int, progress: bool, summary_table: bool):
        from tqdm import tqdm

        self.summary_table = summary_table
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, disable=not progress)

    def log(self, metrics: dict) -> None:
        self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}",
                             refresh=False)
        self.bar.update(metrics["step"] - self.bar.n)

    def summary(self, summary: dict, title: str) -> None:
        self.bar.close()
        if not self.summary_table:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=True, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.items():
            table.add_row(key.removeprefix("summary/"), _fmt(value))
        Console().print(table)

    def close(self) -> None:
        self.bar.close()


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
