"""The same runs, read from a W&B project instead of run folders (``--wandb entity/project[/group]``).

Each fsdp_exp run logs its resolved config plus ``applied``, ``topology``, ``env`` and ``choices`` as the
W&B config, and ``summary/*`` as the W&B summary; W&B also keeps each logged metric's value by its
summary rule (``{"max": v}``: ``fsdp_exp.record.wandb_sink``), which holds the planner's predicted peak
and the sampled step's tracked memory. That is enough to rebuild a ``Run`` the report treats like a
local one. Not exercised by the tests (they run without a network); it uses only ``wandb.Api().runs``
and each run's ``config``, ``summary_metrics``, ``state``, ``name`` and ``url``. Unlike local records
there are no ``overrides`` (labels are the run names, built from the overrides unless
``logger.wandb.name`` is set), no error message (only the state) and no ``plan`` beyond the predicted peak.
"""

from __future__ import annotations

from fsdp_exp.metrics.schema import WANDB_SUMMARY_RULES
from fsdp_exp.report.load import NoRuns, Run

# W&B run state -> fsdp_exp status. A run stopped by a signal exits 0 ("finished") without a summary.
_STATES = {"failed": "failed", "crashed": "failed", "killed": "failed", "running": "running", "pending": "starting"}
_RECORD_KEYS = ("applied", "topology", "env", "choices")


def _summary_value(value):
    """A per-step metric's W&B summary is ``{rule: value}`` (its define_metric rule, fsdp_exp.record.wandb_sink)."""
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in WANDB_SUMMARY_RULES:
        return next(iter(value.values()))
    return value


def _to_run(api_run) -> Run:
    config = dict(api_run.config or {})
    summary_metrics = dict(api_run.summary_metrics or {})
    record = {key: config.pop(key) for key in _RECORD_KEYS if key in config}
    summary = {k: v for k, v in summary_metrics.items() if k.startswith("summary/")}
    state = str(api_run.state).lower()
    if state == "finished":
        status = "completed" if summary else "interrupted"
    else:
        status = _STATES.get(state, state)
    record.update(status=status, config=config, summary=summary)
    if status == "failed":
        record["error"] = f"W&B state '{state}' (the traceback is in the run's errors/rank<N>.txt, not in W&B)"
    # The summary doubles as the run's only row: each metric's last logged value.
    row = {k: _summary_value(v) for k, v in summary_metrics.items() if k.startswith("mem/")}
    return Run(
        path=str(api_run.url),
        record=record,
        rows=[row] if row else [],
        source="wandb",
        name=str(api_run.name or api_run.id),
    )


def load_wandb(path: str) -> list[Run]:
    """Runs of ``entity/project`` (all of them) or ``entity/project/group`` (one sweep), oldest first."""
    parts = path.strip("/").split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise NoRuns(f"--wandb {path!r}: expected entity/project or entity/project/group")
    import wandb

    filters = {"group": parts[2]} if len(parts) == 3 else None
    try:
        api_runs = list(wandb.Api().runs("/".join(parts[:2]), filters=filters, order="+created_at", lazy=False))
    except Exception as err:  # no network, no API key, no such project: wandb raises several kinds
        raise NoRuns(
            f"could not read W&B project {'/'.join(parts[:2])}: {err} (log in with `wandb login`, "
            f"or pass the runs' folders instead)"
        ) from err
    if not api_runs:
        raise NoRuns(f"no runs in W&B {path}" + (" (is the group name right?)" if filters else ""))
    return [_to_run(r) for r in api_runs]
