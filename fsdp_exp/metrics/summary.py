"""The run's summary (``summary/*``) from its logged rows: medians and spread of the measured steps,
the largest memory figures, and the memory peak the report ranks by.

Measured steps are those after ``trainer.warmup_steps``, less the profiled ones (the profiler slows
its step down); the report's repeats (fsdp_exp.report.repeats) apply the same rule.
"""

from __future__ import annotations

import statistics
from typing import Optional

from fsdp_exp.metrics.device_peak import DevicePeak
from fsdp_exp.metrics.peak import measured_peak


def summarize(history: list[dict], warmup_steps: int, peak: DevicePeak, cuda: bool) -> dict:
    """``history``: every logged row of the run (a resumed run's kept rows included), oldest first."""
    measured = [h for h in history if h["step"] > warmup_steps and "comm/total_s" not in h]
    times = sorted(h["perf/step_time_s"] for h in measured)
    speeds = sorted(h["perf/tokens_per_s"] for h in measured)  # the run's own spread, beside its median

    def median(key, rows=measured):
        values = [h[key] for h in rows if h.get(key) is not None]
        return statistics.median(values) if values else None

    def largest(key):
        values = [h[key] for h in history if h.get(key) is not None]
        return max(values) if values else None

    def last(key):
        values = [h[key] for h in history if h.get(key) is not None]
        return values[-1] if values else None

    profiled = [h for h in history if "comm/total_s" in h]
    tracked, predicted = largest("mem/tracked_total_gib_max"), last("mem/predicted_peak_gib")

    summary = {
        "summary/steps_measured": len(measured),
        "summary/step_time_s_median": median("perf/step_time_s"),
        "summary/step_time_s_p90": percentile(times, 0.9),
        "summary/tokens_per_s_median": median("perf/tokens_per_s"),
        "summary/tokens_per_s_p10": percentile(speeds, 0.1),
        "summary/tokens_per_s_p90": percentile(speeds, 0.9),
        "summary/tokens_per_s_per_rank_median": median("perf/tokens_per_s_per_rank"),
        "summary/tflops_per_rank_median": median("perf/tflops_per_rank"),
        "summary/mfu_median": median("perf/mfu"),
        "summary/hfu_median": median("perf/hfu"),
        "summary/mfu_fp8_median": median("perf/mfu_fp8"),
        "summary/peak_tflops_fp8": peak.fp8_tflops,
        "summary/peak_tflops": peak.tflops,
        "summary/peak_tflops_source": peak.source,
        "summary/final_loss": history[-1]["train/loss"] if history else None,
        "summary/model_states_gib_max": largest("mem/model_states_gib_max"),
        "summary/host_peak_rss_gib_max": largest("mem/host_peak_rss_gib_max"),
        "summary/setup_time_s": last("perf/setup_time_s"),
        "summary/first_step_time_s": last("perf/first_step_time_s"),
    }
    if tracked:  # memory breakdown and communication: only when a step was sampled for them
        summary["summary/tracked_peak_gib_max"] = tracked
        summary["summary/planner_peak_error"] = predicted / tracked - 1 if predicted else None
    if any("pp/bubble" in h for h in measured):  # a pipeline run (fsdp_exp.metrics.pipeline)
        summary["summary/pp_bubble_median"] = median("pp/bubble")
        summary["summary/comm_p2p_wait_s_median"] = median("comm/p2p_wait_s")
    if last("val/loss") is not None:  # a run with a validation split: its last evaluation
        summary["summary/val_loss"] = last("val/loss")
        summary["summary/val_perplexity"] = last("val/perplexity")
    if any(h.get("moe/load_imbalance_max") is not None for h in measured):  # a mixture of experts' routing
        summary.update(routing_summary(measured, median, last))
    if profiled:
        summary["summary/comm_total_s_median"] = median("comm/total_s", profiled)
        summary["summary/comm_exposed_s_median"] = median("comm/exposed_s", profiled)
    if cuda:
        summary["summary/peak_allocated_gib_max"] = largest("mem/peak_allocated_gib_max")
        summary["summary/peak_reserved_gib_max"] = largest("mem/peak_reserved_gib_max")
        summary["summary/peak_active_gib_max"] = largest("mem/peak_active_gib_max")
        summary["summary/alloc_retries_max"] = last("mem/alloc_retries_max")
        summary["summary/ooms_max"] = last("mem/ooms_max")
    # The peak the report ranks by, chosen once (fsdp_exp.metrics.peak), so that W&B shows the same.
    summary["summary/peak_gib"], summary["summary/peak_source"] = measured_peak(summary, last)
    return summary


def routing_summary(measured: list[dict], median, last) -> dict:
    """The measured steps' expert load: the median worst-layer ratio (what plan.expert_imbalance takes), the
    worst step's ratio and layer, each layer's median, the largest dropped share and the last aux loss."""
    rows = [h for h in measured if h.get("moe/load_imbalance_max") is not None]
    worst = max(rows, key=lambda h: h["moe/load_imbalance_max"])
    layers = [h["moe/load_imbalance_per_layer"] for h in rows if h.get("moe/load_imbalance_per_layer")]
    return {
        "summary/moe_load_imbalance_median": median("moe/load_imbalance_max"),
        "summary/moe_load_imbalance_worst": worst["moe/load_imbalance_max"],
        "summary/moe_worst_layer": worst.get("moe/load_imbalance_worst_layer"),
        "summary/moe_load_imbalance_per_layer": (
            [round(statistics.median(column), 4) for column in zip(*layers)] if layers else None
        ),
        "summary/moe_dropped_fraction_max": max(h.get("moe/dropped_fraction") or 0.0 for h in rows),
        "summary/moe_aux_loss_final": last("moe/aux_loss"),
    }


def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """The value at quantile ``q`` of ``sorted_values`` (nearest rank), None for none."""
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]
