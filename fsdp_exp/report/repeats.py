"""Which runs repeat one configuration, and the per-step values a single run's interval resamples.

``trainer.repeat`` changes nothing in a run but its identity (fsdp_exp.identity): runs whose settings
agree once it is left out are repeats of one configuration, and the report ranks the configuration
once, from all of them. Runs that agree with it included are duplicates (fsdp_exp.report.duplicates).
"""

from __future__ import annotations

from typing import Optional

from fsdp_exp.identity import REPEAT_KEY
from fsdp_exp.report.duplicates import configuration_key
from fsdp_exp.report.load import Run


def is_repeat_override(override: str) -> bool:
    return override.lstrip("+~").partition("=")[0] == REPEAT_KEY


def without_repeat(overrides: list[str]) -> list[str]:
    """Overrides less ``trainer.repeat=<n>``: a configuration's label."""
    return [o for o in overrides if not is_repeat_override(o)]


def group_repeats(runs: list[Run]) -> list[list[int]]:
    """Indices of ``runs`` grouped by configuration, each group and the groups in first-seen order. A run
    whose record cannot say what it ran (no ``applied``) is a configuration of its own."""
    groups: dict[object, list[int]] = {}
    for index, run in enumerate(runs):
        key = configuration_key(run)
        groups.setdefault(key if key is not None else ("alone", index), []).append(index)
    return list(groups.values())


def measured_step_values(run: Run, step_key: str) -> tuple[Optional[list[float]], Optional[str]]:
    """The run's per-step ``step_key`` values over the steps its summary's medians used, or (None, why).

    The same rule as the trainer's summary: logged steps after ``trainer.warmup_steps``, less the
    profiled ones (``comm/*`` in the row: the profiler slows its step). The count must match the
    summary's ``summary/steps_measured``; a log that lost rows (cut by a crash, W&B's summary-only rows)
    gives no values rather than an interval over the wrong steps.
    """
    warmup = run.config_value("trainer.warmup_steps")
    if not isinstance(warmup, int):
        return None, "the record has no trainer.warmup_steps"
    values = [
        row[step_key]
        for row in run.rows
        if isinstance(row.get("step"), int)
        and row["step"] > warmup
        and "comm/total_s" not in row
        and isinstance(row.get(step_key), (int, float))
    ]
    expected = run.summary.get("summary/steps_measured")
    if isinstance(expected, int) and len(values) != expected:
        return None, f"metrics.jsonl has {len(values)} of the {expected} measured steps"
    return values, None
