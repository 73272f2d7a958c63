"""The run's peak memory per rank: one choice, made here, that the run's summary (``summary/peak_gib``,
``summary/peak_source``), the report's ranking and the W&B panels all show.

The best measurement the run has wins: the CUDA allocator's peak, else torch's memory tracker on the
sampled step, else the model states alone (params + grads + optimizer state: a lower bound, no
activations). Each is the max over ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# Which measured peak is shown, best first: source -> what it measures.
PEAK_SOURCES = {
    "cuda": "CUDA allocator's peak allocated bytes (summary/peak_allocated_gib_max)",
    "tracked": "torch's memory tracker, peak of the sampled step (mem/tracked_total_gib_max)",
    "model states": "params + grads + optimizer state only, no activations: a lower bound "
    "(summary/model_states_gib_max)",
}


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _no_rows(_key: str) -> Any:
    return None


def measured_peak(
    summary: dict, last_value: Callable[[str], Any] = _no_rows, breakdown: Optional[dict] = None
) -> tuple[Optional[float], Optional[str]]:
    """The best measured peak per rank (max over ranks) in GiB, and its source (a key of PEAK_SOURCES).

    ``summary``: the run's ``summary/*`` values; ``last_value``: the newest logged value of a per-step
    metric (for records whose summary lacks a key); ``breakdown``: run.json's ``memory_breakdown``
    (older records have only that).
    """
    cuda = _number(summary.get("summary/peak_allocated_gib_max"))
    if cuda is not None:
        return cuda, "cuda"
    tracked = _number(summary.get("summary/tracked_peak_gib_max"))
    if tracked is None:
        tracked = _number(last_value("mem/tracked_total_gib_max"))
    if tracked is None and isinstance(breakdown, dict):
        tracked = _number(breakdown.get("total_gib_max"))
    if tracked is not None:  # FSDP1 and trainer.track_memory=false runs have none
        return tracked, "tracked"
    states = _number(summary.get("summary/model_states_gib_max"))
    if states is None:
        states = _number(last_value("mem/model_states_gib_max"))
    return (states, "model states") if states is not None else (None, None)
