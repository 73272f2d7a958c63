"""The metric schema: every name fsdp_exp logs, with its unit, window and aggregation over ranks.

W&B, ``metrics.jsonl``, ``run.json["summary"]`` and the console all use these names. docs/metrics.md
is generated from this module (``python -m fsdp_exp.metrics.schema > docs/metrics.md``) and a test
keeps the two equal.

Units: GiB = 2**30 bytes; times in seconds; throughput in tokens per second; TFLOPS = 1e12 FLOP/s.
Windows: ``step`` = that optimizer step; ``interval`` = since the previous logged step (peaks are
reset after each log); ``cumulative`` = since the process started; ``run`` = over the post-warm-up
steps of the whole run (summary only).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    window: str  # step | interval | cumulative | run
    ranks: str  # how ranks are combined: mean | max | min | rank0 | global
    description: str
    device: str = "any"  # any | cpu | cuda: where the metric exists


def _over_ranks(base: str, unit: str, window: str, description: str, device: str = "any",
                aggs: tuple[str, ...] = ("max", "mean")) -> list[Metric]:
    return [Metric(f"{base}_{agg}", unit, window, agg, f"{description} ({agg} over ranks)", device) for agg in aggs]


STEP_METRICS: list[Metric] = [
    Metric("step", "count", "step", "rank0", "optimizer steps completed (1-based)"),
    Metric("train/loss", "nats", "step", "mean", "cross-entropy per token, averaged over the global batch"),
    Metric("train/lr", "1", "step", "rank0", "learning rate used by this step's update"),
    Metric("train/grad_norm", "1", "step", "global", "L2 norm of the full gradient before clipping"),
    Metric("perf/step_time_s", "s", "step", "rank0",
           "wall time of the step: forward, backward, optimizer and the metric all-reduces"),
    Metric("perf/tokens_per_s", "tokens/s", "step", "global", "tokens of the global batch / step time"),
    Metric("perf/tokens_per_s_per_rank", "tokens/s", "step", "mean", "perf/tokens_per_s / world size"),
    Metric("perf/tflops_per_rank", "TFLOPS", "step", "mean",
           "model FLOPs per token x tokens/s per rank / 1e12 (6N + 12LdS, no recompute)"),
    Metric("perf/mfu", "fraction", "step", "mean",
           "perf/tflops_per_rank / the device's peak TFLOPS for the compute dtype; null when unknown"),
    Metric("perf/data_time_s", "s", "step", "max",
           "time the step waited for its data (fetch, and copy to the device; part of perf/step_time_s); "
           "near 0 when loading keeps up, a large share of the step when it starves"),
    *_over_ranks("mem/params_gib", "GiB", "step", "parameter bytes this rank holds (its shards)"),
    *_over_ranks("mem/grads_gib", "GiB", "step", "gradient bytes this rank holds after backward"),
    *_over_ranks("mem/optim_state_gib", "GiB", "step", "optimizer state bytes this rank holds"),
    *_over_ranks("mem/model_states_gib", "GiB", "step", "params + grads + optimizer state of this rank"),
    Metric("mem/predicted_model_states_gib", "GiB", "step", "max",
           "the memory planner's (fsdp_exp.plan) params + grads + optimizer state of the largest rank, device "
           "and host; the same in every row; compare with mem/model_states_gib_max"),
    Metric("mem/predicted_peak_gib", "GiB", "step", "max",
           "the memory planner's peak of the largest rank during a step, before its allocator margin; the same "
           "in every row; compare with mem/tracked_total_gib_max (CUDA: mem/peak_allocated_gib_max)"),
    *_over_ranks("mem/host_rss_gib", "GiB", "step", "resident host memory of the rank's process, now"),
    *_over_ranks("mem/host_peak_rss_gib", "GiB", "cumulative", "peak resident host memory of the rank's process"),
    *_over_ranks("mem/peak_allocated_gib", "GiB", "interval", "CUDA allocator peak allocated bytes", "cuda"),
    *_over_ranks("mem/peak_reserved_gib", "GiB", "interval", "CUDA allocator peak reserved bytes", "cuda"),
    *_over_ranks("mem/peak_active_gib", "GiB", "interval", "CUDA allocator peak active bytes", "cuda"),
    *_over_ranks("mem/alloc_retries", "count", "cumulative", "CUDA allocator retries after a failed cudaMalloc",
                 "cuda", aggs=("max",)),
    *_over_ranks("mem/ooms", "count", "cumulative", "CUDA out-of-memory errors caught by the allocator",
                 "cuda", aggs=("max",)),
]

# Logged in the row of each step that is a multiple of trainer.eval_every (only with trainer.eval_every > 0).
EVAL_METRICS: list[Metric] = [
    Metric("val/loss", "nats", "step", "mean",
           "cross-entropy per token on data.val_batches global batches of the validation data (the same "
           "blocks at every evaluation); measured after the step, outside perf/step_time_s"),
    Metric("val/perplexity", "1", "step", "mean", "exp(val/loss)"),
]

# Logged in the row of the sampled step (trainer.track_memory_step, by default the last warm-up step):
# the peak of that step as torch's memory tracker broke it down (fsdp_exp.metrics.tracker).
_TRACKED_KINDS = {
    "params": "parameters, sharded and unsharded", "unsharded_params": "unsharded (all-gathered) parameters",
    "grads": "gradients, sharded and unsharded", "optim_state": "optimizer state",
    "activations": "activations saved for backward (and recomputed ones)", "temp": "temporaries of backward",
    "comm_buffers": "all-gather and reduce-scatter buffers", "buffers": "module buffers",
    "inputs": "input batch", "other": "anything else the tracker saw",
    "model_states": "params + grads + optimizer state", "total": "all of the above",
}
TRACKED_METRICS: list[Metric] = [
    metric for kind, what in _TRACKED_KINDS.items()
    for metric in _over_ranks(f"mem/tracked_{kind}_gib", "GiB", "step", f"at the sampled step's peak: {what}")
]

SUMMARY_METRICS: list[Metric] = [
    Metric("summary/steps_measured", "count", "run", "rank0", "post-warm-up steps the medians use"),
    Metric("summary/step_time_s_median", "s", "run", "rank0", "median of perf/step_time_s"),
    Metric("summary/step_time_s_p90", "s", "run", "rank0", "90th percentile of perf/step_time_s"),
    Metric("summary/tokens_per_s_median", "tokens/s", "run", "global", "median of perf/tokens_per_s"),
    Metric("summary/tokens_per_s_per_rank_median", "tokens/s", "run", "mean", "median of perf/tokens_per_s_per_rank"),
    Metric("summary/tflops_per_rank_median", "TFLOPS", "run", "mean", "median of perf/tflops_per_rank"),
    Metric("summary/mfu_median", "fraction", "run", "mean", "median of perf/mfu; null when the peak is unknown"),
    Metric("summary/final_loss", "nats", "run", "mean", "train/loss of the last step"),
    Metric("summary/model_states_gib_max", "GiB", "run", "max", "largest mem/model_states_gib_max of the run"),
    Metric("summary/host_peak_rss_gib_max", "GiB", "run", "max", "largest mem/host_peak_rss_gib_max of the run"),
    Metric("summary/peak_allocated_gib_max", "GiB", "run", "max", "largest mem/peak_allocated_gib_max", "cuda"),
    Metric("summary/peak_reserved_gib_max", "GiB", "run", "max", "largest mem/peak_reserved_gib_max", "cuda"),
]

ALL_METRICS = {m.name: m for m in STEP_METRICS + EVAL_METRICS + TRACKED_METRICS + SUMMARY_METRICS}


def render_markdown() -> str:
    lines = [
        "# Metric schema",
        "",
        f"Schema version {SCHEMA_VERSION}. Generated by `python -m fsdp_exp.metrics.schema`; do not edit by hand.",
        "",
        "GiB = 2^30 bytes. Windows: `step` = that optimizer step; `interval` = since the previous logged step "
        "(peaks are reset after each log); `cumulative` = since the process started; `run` = over the "
        "post-warm-up steps (summary only). Ranks: how the per-rank values are combined.",
        "",
    ]
    for title, metrics in (("Per logged step (W&B history, metrics.jsonl)", STEP_METRICS),
                           ("Per evaluation (in the step's row, every trainer.eval_every steps)", EVAL_METRICS),
                           ("Memory breakdown of the sampled step (in its row, and run.json[\"memory_breakdown\"])",
                            TRACKED_METRICS),
                           ("Run summary (W&B summary, run.json[\"summary\"])", SUMMARY_METRICS)):
        lines += [f"## {title}", "", "| name | unit | window | ranks | device | meaning |", "|---|---|---|---|---|---|"]
        lines += [f"| `{m.name}` | {m.unit} | {m.window} | {m.ranks} | {m.device} | {m.description} |" for m in metrics]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
