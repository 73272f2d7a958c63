"""Why a configuration won: where each one's step time went and where its peak memory sits, as measured, beside
what the step-time model and the memory planner predicted for the same parts.

Measured (the run's own records):

- time: the profiled steps' rows (``trainer.profile_steps``: ``comm/compute_s``, ``comm/exposed_<kind>_s``,
  ``comm/step_s``, max over ranks, median over the profiled steps); a pipeline run's bubble is ``pp/bubble`` of
  the measured steps times the profiled step. What the parts leave of the step is ``other`` (the host between
  operators, the data, the profiler's own cost). On a CPU "compute" is the training thread inside aten
  operators, which holds the optimizer's; the prediction's optimizer is therefore shown beside it, not apart.
- memory: the memory-sampled step's tracked peak per phase (``mem/tracked_<phase>_total_gib_max``) against the
  planner's (``mem/predicted_<phase>_peak_gib``), both in the run's rows.

Predicted time: what the run recorded when it started (``run.json["plan"]["step_time"]``: the step-time model
on its config and topology, with the figures of the device it ran on, a GPU's from the device table, a CPU
host's from its cached probe; ``fsdp_exp.tune.step_time.run_prediction``). Its exposed communication is split
over the collective kinds in proportion to their time in flight (``StepPrediction.exposed_by_kind``).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Optional

from fsdp_exp.metrics.comm import COMM_KINDS
from fsdp_exp.metrics.schema import PHASES

if TYPE_CHECKING:
    from fsdp_exp.report.load import Run

# The parts of a step, in the order they are drawn and listed; compute first, what is left last.
TIME_PARTS = ("compute", *(f"exposed {k.replace('_', '-')}" for k in COMM_KINDS), "bubble", "optimizer", "other")


def _median(values: list) -> Optional[float]:
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def measured_time(run: "Run") -> tuple[Optional[dict], str]:
    """(seconds per part of the profiled step, a note); None and why where no step was profiled."""
    profiled = [r for r in run.rows if isinstance(r.get("comm/step_s"), (int, float))]
    if not profiled:
        return None, "no profiled step (trainer.profile_steps=[<step>] measures where the time goes)"
    step = _median([r["comm/step_s"] for r in profiled])
    parts = {"compute": _median([r.get("comm/compute_s") for r in profiled]) or 0.0}
    for kind in COMM_KINDS:
        parts[f"exposed {kind.replace('_', '-')}"] = _median([r.get(f"comm/exposed_{kind}_s") for r in profiled]) or 0.0
    bubble = _median([r.get("pp/bubble") for r in run.rows])
    parts["bubble"] = bubble * step if bubble is not None else 0.0
    parts["optimizer"] = 0.0  # inside compute on the profiled trace (module docstring)
    parts["other"] = max(0.0, step - sum(parts.values()))
    return parts, f"median of {len(profiled)} profiled step(s), {step:.3g} s with the profiler"


def predicted_time(run: "Run") -> tuple[Optional[dict], str]:
    """(seconds per part the step-time model predicted for the run when it started, a note); None and why where
    it has none (``fsdp_exp.tune.step_time.run_prediction``, in run.json["plan"]["step_time"])."""
    plan = run.record.get("plan")
    found = plan.get("step_time") if isinstance(plan, dict) else None
    if not isinstance(found, dict):
        return None, "the run recorded no step-time prediction (a run from before it did)"
    if "parts" not in found:
        return None, f"no step-time prediction: {found.get('error', 'unknown')}"
    parts = {p: float(found["parts"].get(p, 0.0)) for p in TIME_PARTS}
    return parts, f"{found['step_time_s']:.3g} s ({found.get('perf', '')})"


def memory_by_phase(run: "Run") -> dict[str, dict[str, Optional[float]]]:
    """{phase: {"measured": GiB, "predicted": GiB}} of the memory-sampled step (None where not recorded)."""

    def last(key: str) -> Optional[float]:
        values = [r[key] for r in run.rows if isinstance(r.get(key), (int, float))]
        return float(values[-1]) if values else None

    return {
        phase: {
            "measured": last(f"mem/tracked_{phase}_total_gib_max"),
            "predicted": last(f"mem/predicted_{phase}_peak_gib"),
        }
        for phase in PHASES
    }


def breakdown(run: "Run") -> dict:
    """One run's time and memory, measured and predicted (``report.json``'s ``breakdown`` of a row)."""
    measured, measured_note = measured_time(run)
    predicted, predicted_note = predicted_time(run)
    return {
        "time_s": {"measured": measured, "predicted": predicted},
        "time_notes": {"measured": measured_note, "predicted": predicted_note},
        "memory_gib": memory_by_phase(run),
    }


def describe(label: str, found: dict) -> list[str]:
    """The console's lines of one configuration: each part measured / predicted, in seconds."""
    measured, predicted = found["time_s"]["measured"], found["time_s"]["predicted"]
    lines = [f"{label}:"]

    def cell(parts: Optional[dict], part: str) -> str:
        return "n/a" if parts is None else f"{parts[part]:.3g}"

    if measured is None and predicted is None:
        lines.append(f"  time: {found['time_notes']['measured']}; {found['time_notes']['predicted']}")
    else:
        shown = [p for p in TIME_PARTS if any(x is not None and x[p] > 0 for x in (measured, predicted))]
        lines.append(
            "  time (s, measured / predicted): "
            + " · ".join(f"{p} {cell(measured, p)} / {cell(predicted, p)}" for p in shown)
        )
        for which in ("measured", "predicted"):
            if found["time_s"][which] is None:
                lines.append(f"  {which}: {found['time_notes'][which]}")
    memory = found["memory_gib"]
    if any(v["measured"] is not None or v["predicted"] is not None for v in memory.values()):
        lines.append(
            "  peak by phase (tracked / planned): "
            + " · ".join(f"{phase} {_gib(v['measured'])} / {_gib(v['predicted'])}" for phase, v in memory.items())
        )
    return lines


def _gib(value: Optional[float]) -> str:
    """GiB, or MiB / KiB below them (a CPU test model's peaks are a few MiB)."""
    if value is None:
        return "n/a"
    if value >= 1:
        return f"{value:.3g} GiB"
    return f"{value * 1024:.3g} MiB" if value * 1024 >= 1 else f"{value * 1024**2:.3g} KiB"
