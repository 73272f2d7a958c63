"""Weights & Biases: one W&B run per experiment, opened by rank 0 in the run directory (offline by
default). W&B is a copy of what metrics.jsonl and run.json hold: when it stops working mid-run the run
goes on without it.

At ``wandb.init`` every metric of the schema (fsdp_exp.metrics.schema) is declared with
``define_metric``: ``step`` as the x axis of the per-step metrics, and each metric's summary rule, so
that W&B's runs table shows the run's ``summary/*`` medians and peaks instead of each metric's last
logged value."""

from __future__ import annotations

import secrets
import string
import sys
from pathlib import Path
from typing import Optional

from fsdp_exp import identity
from fsdp_exp.metrics.schema import ALL_METRICS
from fsdp_exp.record.values import json_safe

# The config groups whose choices become W&B tags and the default run name.
TAGGED_GROUPS = ("model", "sharding", "precision", "offload", "prefetch", "wrap", "ac", "optim", "data")


def run_name(overrides: list[str]) -> str:
    """A readable name from the command-line overrides: 'sharding=grad_op,precision=bf16'."""
    shown = [o for o in overrides if not o.startswith(("hydra.", "logger.", "hydra/"))]
    return ",".join(shown) if shown else "default"


def run_tags(choices: dict[str, str], extra: list[str]) -> list[str]:
    return [f"{g}:{choices[g]}" for g in TAGGED_GROUPS if choices.get(g)] + list(extra)


def define_metrics(run) -> None:
    """Declare every schema metric: the per-step ones against ``step`` (their x axis in W&B's charts, also
    in a resumed run), each with its summary rule (``Metric.wandb_summary``)."""
    run.define_metric("step", summary=ALL_METRICS["step"].wandb_summary)
    for metric in ALL_METRICS.values():
        if metric.name == "step":
            continue
        step_metric = None if metric.window == "run" else "step"
        run.define_metric(metric.name, step_metric=step_metric, summary=metric.wandb_summary)


def new_run_id() -> str:
    """A W&B run id (eight lowercase letters and digits, as W&B makes them), for a run not opened yet."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def configuration_job_type(config: dict) -> Optional[str]:
    """``cfg-<12 hex>``: the run's settings less trainer.repeat (fsdp_exp.identity), as the report keys them;
    None before the backend's applied settings exist (a job refused before any rank started)."""
    logged = json_safe(config)
    return identity.configuration_id(logged, logged.get("applied"), logged.get("topology"), logged.get("env"))


class WandbSink:
    """One W&B run per experiment, opened by rank 0 in the run directory (offline by default)."""

    def __init__(
        self,
        wandb_cfg,
        run_dir: Path,
        config: dict,
        overrides: list[str],
        choices: dict[str, str],
        run_id: Optional[str] = None,
        new_id: Optional[str] = None,
    ):
        """``run_id``: the W&B run to continue; else a new run, with id ``new_id`` where the caller chose it."""
        import wandb

        self.wandb = wandb
        # A run resumed from a checkpoint continues the W&B run the checkpoint names (offline: a new
        # offline-run-*-<id> folder with the same id; `wandb sync` appends it to that run).
        resume = {"id": run_id, "resume": "allow"} if run_id else {"id": new_id} if new_id else {}
        self.run = wandb.init(
            **resume,
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=wandb_cfg.group,
            name=wandb_cfg.name or run_name(overrides),
            # Repeats of one configuration (trainer.repeat=0,1,2) share a job type: W&B groups them by it.
            job_type=configuration_job_type(config),
            tags=run_tags(choices, wandb_cfg.tags)
            + [f"repeat:{identity.repeat_index(config)}"]
            + ([f"arch:{config['env']['architecture']}"] if (config.get("env") or {}).get("architecture") else []),
            config=json_safe(config),
            dir=str(run_dir),
            mode=wandb_cfg.mode,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        define_metrics(self.run)

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
            print(
                f"fsdp_exp: W&B stopped working ({self.error}); the run goes on without it, its metrics "
                f"stay in metrics.jsonl",
                file=sys.stderr,
            )

    def log(self, metrics: dict) -> None:
        # ``step`` is also in the row: it is the step_metric of every per-step metric (define_metrics).
        row = json_safe(metrics)
        self._guarded("log", lambda: self.run.log(row, step=metrics["step"]))

    def summary(self, summary: dict) -> None:
        self._guarded("summary", lambda: self.run.summary.update(json_safe(summary)))

    def log_files(self, files: list[Path], run_dir: Path) -> None:
        """The run's profiler traces and memory snapshots (every rank's: all in the shared run directory
        by the time rank 0 closes) as one W&B artifact, named by their paths in the run directory."""
        artifact = self.wandb.Artifact(
            f"profile-{self.run_id}",
            type="profile",
            description="torch.profiler chrome traces (traces/) and CUDA memory "
            "snapshots (memory/) of the sampled steps, every rank",
        )
        for path in files:
            artifact.add_file(str(path), name=str(Path(path).relative_to(run_dir)))
        self._guarded("log_artifact", lambda: self.run.log_artifact(artifact))

    def close(self, exit_code: int = 0) -> None:
        self._guarded("finish", lambda: self.run.finish(exit_code=exit_code))


def note_failure_in_wandb(
    wandb_cfg,
    run_dir: Path,
    config: dict,
    overrides: list[str],
    choices: dict[str, str],
    run_id: Optional[str],
    error: dict,
) -> Optional[str]:
    """Put a failed run's error into W&B: into the run rank 0 opened (continued by id), or into a new run
    when the job failed before any rank started (an invalid combination in a sweep). Returns its id."""
    sink = WandbSink(wandb_cfg, run_dir, config, overrides, choices, run_id=run_id)
    sink.summary({"status": "failed", "error": error})
    sink.close(exit_code=1)
    return sink.run_id


def check_logger(cfg) -> None:
    """Preflight's check of the logger group: the W&B mode."""
    from fsdp_exp.config.schema import WANDB_MODES
    from fsdp_exp.errors import fail

    if cfg.logger.wandb.mode not in WANDB_MODES:
        fail(
            f"logger.wandb.mode={cfg.logger.wandb.mode!r} is not one of {', '.join(WANDB_MODES)}.",
            "pass logger.wandb.mode=offline",
        )
