"""The metric schema: every name fsdp_exp logs, with its unit, window and aggregation over ranks.

W&B, ``metrics.jsonl``, ``run.json["summary"]`` and the console all use these names. docs/metrics.md
is generated from this module (``python -m fsdp_exp.metrics.schema > docs/metrics.md``) and a test
keeps the two equal.

Units: GiB = 2**30 bytes; times in seconds; throughput in tokens per second; TFLOPS = 1e12 FLOP/s.
Windows: ``step`` = that optimizer step; ``interval`` = since the previous logged step (peaks are
reset after each log); ``cumulative`` = since the process started; ``run`` = over the post-warm-up
steps of the whole run (summary only).

W&B summary rules (``wandb_summary``, given to ``define_metric`` at ``wandb.init`` by
fsdp_exp.record.wandb_sink): what W&B keeps in a run's summary, and so in its runs table, for a logged
metric. Left alone, W&B keeps each metric's last value: one arbitrary step of a throughput, the last
interval of a peak. W&B has no median, so where the run's value is a median over the measured steps
(a ``summary/*`` key) the rule is ``none`` and only that key stands; peaks and holdings take ``max``;
the ``summary/*`` keys themselves are set once at the end and take ``none`` (W&B derives nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1
WANDB_SUMMARY_RULES = ("min", "max", "mean", "last", "none")  # define_metric(summary=...) options used here


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    window: str  # step | interval | cumulative | run
    ranks: str  # how ranks are combined: mean | max | min | rank0 | global
    description: str
    device: str = "any"  # any | cpu | cuda: where the metric exists
    wandb_summary: str = ""  # one of WANDB_SUMMARY_RULES; a test makes every per-step metric declare it

    def __post_init__(self):
        # A run-window metric is set once, in the summary, at the end: W&B has no steps to derive it from.
        if self.window == "run" and not self.wandb_summary:
            object.__setattr__(self, "wandb_summary", "none")


def _over_ranks(
    base: str,
    unit: str,
    window: str,
    description: str,
    device: str = "any",
    aggs: tuple[str, ...] = ("max", "mean"),
    wandb_summary: str = "max",
) -> list[Metric]:
    return [
        Metric(f"{base}_{agg}", unit, window, agg, f"{description} ({agg} over ranks)", device, wandb_summary)
        for agg in aggs
    ]


def _moe_metrics() -> list[Metric]:
    """A mixture of experts' routing (fsdp_exp.models.moe), in the rows of such models only: one step's
    routed copies of tokens per expert, summed over the ranks (every rank routes its own tokens); null in a
    dense model's rows."""
    per_expert = (
        "routed copies of tokens (top-k per token) an expert got in the step, summed over the ranks (before a "
        "capacity factor drops any: the load the balancing reads)"
    )
    return [
        Metric(
            "moe/tokens_per_expert_max",
            "tokens",
            "step",
            "global",
            f"{per_expert}: the busiest expert of any layer",
            wandb_summary="max",
        ),
        Metric(
            "moe/tokens_per_expert_mean",
            "tokens",
            "step",
            "global",
            f"{per_expert}: the mean over experts and layers",
            wandb_summary="mean",
        ),
        Metric(
            "moe/load_imbalance_max",
            "1",
            "step",
            "global",
            "the busiest expert's load over the mean expert's, in the most imbalanced layer (1 = balanced); expert "
            "parallel's slowest rank waits for the busiest expert",
            wandb_summary="max",
        ),
        Metric(
            "moe/load_imbalance_worst_layer",
            "index",
            "step",
            "global",
            "the MoE layer moe/load_imbalance_max is of (0 = the model's first MoE layer, in block order)",
            wandb_summary="last",
        ),
        Metric(
            "moe/load_imbalance_per_layer",
            "1 list",
            "step",
            "global",
            "each MoE layer's busiest expert's load over its mean expert's, block order, to 4 digits",
            wandb_summary="none",
        ),
        Metric(
            "moe/load_imbalance_mean",
            "1",
            "step",
            "global",
            "moe/load_imbalance_max's ratio averaged over the layers",
            wandb_summary="mean",
        ),
        Metric(
            "moe/aux_loss",
            "1",
            "step",
            "mean",
            "the load-balancing loss (model.aux_loss_coef x experts x sum of load share x mean router score) summed "
            "over the layers, per micro-batch; its gradient trains the router, train/loss excludes it; 0 when off",
            wandb_summary="mean",
        ),
        Metric(
            "moe/dropped_tokens",
            "tokens",
            "step",
            "global",
            "routed copies past an expert's capacity (model.capacity_factor), summed over layers and ranks; 0 when dropless",
            wandb_summary="max",
        ),
        Metric(
            "moe/dropped_fraction",
            "1",
            "step",
            "global",
            "moe/dropped_tokens over every routed copy",
            wandb_summary="max",
        ),
    ]


MOE_METRICS = tuple(m.name for m in _moe_metrics())  # null in a dense model's rows


# The phases of a training step, as the memory tracker and the planner split it (fsdp_exp.metrics.tracker).
_PHASES = {
    "forward": "forward (zero_grad, the model's forward and the loss, every micro-batch)",
    "backward": "backward (loss.backward() of every micro-batch, with FSDP's gathers and reductions)",
    "optimizer": "optimizer (unscale, gradient clipping, optimizer and LR scheduler steps)",
}
PHASES = tuple(_PHASES)  # the one tuple the tracker, the planner (its "stages") and the W&B workspace read

STEP_METRICS: list[Metric] = [
    Metric(
        "step",
        "count",
        "step",
        "rank0",
        "optimizer steps completed (1-based); W&B's x axis for every per-step metric (its step_metric)",
        wandb_summary="max",
    ),
    Metric(
        "train/loss",
        "nats",
        "step",
        "mean",
        "cross-entropy per token, averaged over the global batch",
        wandb_summary="min",
    ),
    Metric("train/lr", "1", "step", "rank0", "learning rate used by this step's update", wandb_summary="last"),
    Metric(
        "train/grad_norm", "1", "step", "global", "L2 norm of the full gradient before clipping", wandb_summary="max"
    ),
    Metric(
        "perf/step_time_s",
        "s",
        "step",
        "rank0",
        "wall time of the step: forward, backward, optimizer and the metrics' all-gather over ranks",
        wandb_summary="none",
    ),
    Metric(
        "perf/tokens_per_s",
        "tokens/s",
        "step",
        "global",
        "tokens of the global batch / step time",
        wandb_summary="none",
    ),
    Metric(
        "perf/tokens_per_s_per_rank", "tokens/s", "step", "mean", "perf/tokens_per_s / world size", wandb_summary="none"
    ),
    Metric(
        "perf/tflops_per_rank",
        "TFLOPS",
        "step",
        "mean",
        "model FLOPs per token x tokens/s per rank / 1e12 (no recompute; the FLOPs under trainer.flops_convention, "
        "default fsdp_exp: 6N + 12LdS, see the conventions below)",
        wandb_summary="none",
    ),
    Metric(
        "perf/mfu",
        "fraction",
        "step",
        "mean",
        "perf/tflops_per_rank / the peak TFLOPS of one rank's device in the compute dtype (GPU: data "
        "sheet; CPU: measured, see run.json env.peak_tflops_source); null when unknown",
        wandb_summary="none",
    ),
    Metric(
        "perf/hfu",
        "fraction",
        "step",
        "mean",
        "as perf/mfu, with the FLOPs that activation checkpointing recomputes and a chunked loss's second pass "
        "through the output projection (trainer.loss_chunks > 1) added (counted by torch's FlopCounterMode on the "
        "meta model; equals perf/mfu without either); null when the peak is unknown",
        wandb_summary="none",
    ),
    Metric(
        "perf/mfu_fp8",
        "fraction",
        "step",
        "mean",
        "precision=float8 only: perf/tflops_per_rank / the device's dense FP8 peak (e.g. H100 SXM 1979 TFLOPS), "
        "beside perf/mfu, which stays against the compute dtype's (bf16) peak; null otherwise and on devices "
        "without FP8 tensor cores (a CPU)",
        wandb_summary="none",
    ),
    Metric(
        "perf/data_time_s",
        "s",
        "step",
        "max",
        "time the step waited for its data (fetch, and copy to the device; part of perf/step_time_s); "
        "near 0 when loading keeps up, a large share of the step when it starves",
        wandb_summary="mean",
    ),
    *_moe_metrics(),
    *_over_ranks("mem/params_gib", "GiB", "step", "parameter bytes this rank holds (its shards)"),
    *_over_ranks("mem/grads_gib", "GiB", "step", "gradient bytes this rank holds after backward"),
    *_over_ranks("mem/optim_state_gib", "GiB", "step", "optimizer state bytes this rank holds"),
    *_over_ranks("mem/model_states_gib", "GiB", "step", "params + grads + optimizer state of this rank"),
    Metric(
        "mem/predicted_model_states_gib",
        "GiB",
        "step",
        "max",
        "the memory planner's (fsdp_exp.plan) params + grads + optimizer state of the largest rank, device "
        "and host; the same in every row; compare with mem/model_states_gib_max",
        wandb_summary="max",
    ),
    Metric(
        "mem/predicted_peak_gib",
        "GiB",
        "step",
        "max",
        "the memory planner's peak of the largest rank during a step, before its allocator margin; the same "
        "in every row; compare with mem/tracked_total_gib_max (CUDA: mem/peak_allocated_gib_max)",
        wandb_summary="max",
    ),
    *_over_ranks("mem/host_rss_gib", "GiB", "step", "resident host memory of the rank's process, now"),
    *_over_ranks("mem/host_peak_rss_gib", "GiB", "cumulative", "peak resident host memory of the rank's process"),
    *_over_ranks("mem/peak_allocated_gib", "GiB", "interval", "CUDA allocator peak allocated bytes", "cuda"),
    *_over_ranks("mem/peak_reserved_gib", "GiB", "interval", "CUDA allocator peak reserved bytes", "cuda"),
    *_over_ranks("mem/peak_active_gib", "GiB", "interval", "CUDA allocator peak active bytes", "cuda"),
    *_over_ranks(
        "mem/alloc_retries",
        "count",
        "cumulative",
        "CUDA allocator retries after a failed cudaMalloc",
        "cuda",
        aggs=("max",),
    ),
    *_over_ranks(
        "mem/ooms", "count", "cumulative", "CUDA out-of-memory errors caught by the allocator", "cuda", aggs=("max",)
    ),
]

# Logged once, in the first row a process logs (a resumed run logs them again, for its own start): how long
# the run took to become ready, measured the same way for every backend.
START_METRICS: list[Metric] = [
    Metric(
        "perf/setup_time_s",
        "s",
        "step",
        "max",
        "from the start of building the model to the optimizer being ready (build on meta, shard or wrap, "
        "materialize and initialize, engine creation, the backend library's first import; process-group "
        "start-up excluded), slowest rank",
        wandb_summary="max",
    ),
    Metric(
        "perf/first_step_time_s",
        "s",
        "step",
        "rank0",
        "wall time of the first step this process ran (where lazy buffers are allocated)",
        wandb_summary="max",
    ),
]

# Logged in the row of each step that is a multiple of trainer.eval_every (only with trainer.eval_every > 0).
EVAL_METRICS: list[Metric] = [
    Metric(
        "val/loss",
        "nats",
        "step",
        "mean",
        "cross-entropy per token on data.val_batches global batches of the validation data (the same "
        "blocks at every evaluation); measured after the step, outside perf/step_time_s",
        wandb_summary="min",
    ),
    Metric("val/perplexity", "1", "step", "mean", "exp(val/loss)", wandb_summary="min"),
]

# Logged in the row of the sampled step (trainer.track_memory_step, by default the last warm-up step):
# the peak of that step, and of each of its phases, as torch's memory tracker broke it down
# (fsdp_exp.metrics.tracker).
_TRACKED_KINDS = {
    "params": "parameters, sharded and unsharded",
    "unsharded_params": "unsharded (all-gathered) parameters",
    "grads": "gradients, sharded and unsharded",
    "unsharded_grads": "unsharded gradients (FSDP2, before reduction)",
    "optim_state": "optimizer state",
    "activations": "activations saved for backward (and recomputed ones)",
    "temp": "temporaries of backward",
    "comm_buffers": "all-gather and reduce-scatter buffers",
    "all_gather": "all-gather output buffers (FSDP2)",
    "reduce_scatter": "reduce-scatter input buffers (FSDP2)",
    "buffers": "module buffers",
    "inputs": "input batch",
    "other": "anything else the tracker saw",
    "model_states": "params + grads + optimizer state",
    "total": "all of the above (unsharded_*, all_gather and reduce_scatter are parts of params, grads and "
    "comm_buffers)",
}
TRACKED_METRICS: list[Metric] = (
    [
        metric
        for kind, what in _TRACKED_KINDS.items()
        for metric in _over_ranks(f"mem/tracked_{kind}_gib", "GiB", "step", f"at the sampled step's peak: {what}")
    ]
    + [
        Metric(
            f"mem/tracked_{phase}_{kind}_gib_max",
            "GiB",
            "step",
            "max",
            f"at the peak of the sampled step's {where}: {what} (max over ranks; each rank's in "
            f'run.json["memory_breakdown"]["phases"])',
            wandb_summary="max",
        )
        for phase, where in _PHASES.items()
        for kind, what in _TRACKED_KINDS.items()
    ]
    + [
        Metric(
            f"mem/predicted_{phase}_peak_gib",
            "GiB",
            "step",
            "max",
            f'the memory planner\'s peak of the largest rank during the {phase} phase (run.json["plan"]'
            f'["stage_peaks"]); compare with mem/tracked_{phase}_total_gib_max',
            wandb_summary="max",
        )
        for phase in _PHASES
    ]
    + [
        Metric(
            "summary/tracked_peak_gib_max",
            "GiB",
            "run",
            "max",
            "in the summary: mem/tracked_total_gib_max of the sampled step (absent when no step was tracked)",
        ),
        Metric(
            "summary/planner_peak_error",
            "fraction",
            "run",
            "max",
            "in the summary: mem/predicted_peak_gib / summary/tracked_peak_gib_max - 1",
        ),
    ]
)

# Logged in the row of each profiled step (trainer.profile_steps): collective times read from the step's
# torch.profiler trace (fsdp_exp.metrics.comm; traces/rank<N>_step<S>.json in the run directory).
_COMM = {
    "all_gather_s": "time all-gathers were in flight (union of their intervals)",
    "reduce_scatter_s": "time reduce-scatters were in flight (FSDP's gradient reduction)",
    "all_reduce_s": "time all-reduces were in flight (DDP's buckets, HSDP's replicas, the grad norm)",
    "all_to_all_s": "time all-to-alls were in flight (expert parallel's token dispatch and combine with the "
    "counts exchanged before them; context parallel's exchange of heads for sequence, parallel.cp_method="
    "all_to_all; 0 without either)",
    "other_s": "time other collectives were in flight (broadcast, send/recv)",
    **{
        f"exposed_{kind}_s": f"part of comm/{kind}_s with no compute running (as comm/exposed_s counts it): the "
        f"{what} the step waited for; kinds in flight at once each count it"
        for kind, what in (
            ("all_gather", "all-gathers"),
            ("reduce_scatter", "reduce-scatters"),
            ("all_reduce", "all-reduces"),
            ("all_to_all", "all-to-alls"),
            ("other", "other collectives"),
        )
    },
    "total_s": "time any collective was in flight",
    "exposed_s": "part of comm/total_s with no compute running (CUDA: no other kernel on any stream; CPU: the "
    "training thread in no aten/fsdp operator): communication the step waited for",
    "compute_s": "time compute ran (CUDA: non-NCCL kernels; CPU: the training thread inside aten/fsdp operators)",
    "step_s": "wall time of the profiled step (with the profiler's overhead; not in the summary)",
    "exposed_fraction": "comm/exposed_s / comm/step_s",
}
# comm/*: the mean over the profiled steps, but none where a summary median stands, and none for the step
# time the profiler slowed down.
_COMM_SUMMARY = {"total_s": "none", "exposed_s": "none", "step_s": "none"}
COMM_METRICS: list[Metric] = [
    Metric(
        f"comm/{name}",
        "fraction" if name.endswith("fraction") else "s",
        "step",
        "max",
        f'{what} (max over ranks; each rank\'s in run.json["comm"])',
        wandb_summary=_COMM_SUMMARY.get(name, "mean"),
    )
    for name, what in _COMM.items()
] + [
    Metric(
        f"summary/comm_{name}_median",
        "s",
        "run",
        "max",
        f"in the summary: median of comm/{name} over the profiled steps",
    )
    for name in ("total_s", "exposed_s")
]

# Pipeline-parallel runs only (parallel.pp > 1; fsdp_exp.metrics.pipeline): the time each pp rank's schedule
# step spends in its stages' own compute and waiting on its neighbours (every logged step), and the sampled
# step's memory per pp rank (its stages' peak).
_PP_STEP = "the schedule's step (its forwards, losses and backwards over the micro-batches)"
PIPELINE_METRICS: list[Metric] = [
    Metric(
        "pp/bubble",
        "fraction",
        "step",
        "mean",
        f"measured bubble: 1 - (time in the stage's own forward/backward chunks) / (time of {_PP_STEP}), on each "
        "rank; beside pp/bubble_predicted. On a CPU it also holds Python and gloo overheads",
        wandb_summary="none",
    ),
    Metric("pp/bubble_max", "fraction", "step", "max", "pp/bubble of the idlest rank", wandb_summary="mean"),
    Metric(
        "pp/bubble_predicted",
        "fraction",
        "step",
        "rank0",
        "the schedule's bubble for equal stages and free sends, (pp - 1) / (v m + pp - 1) (run.json "
        "applied.pipeline.bubble); the same in every row",
        wandb_summary="last",
    ),
    Metric(
        "pp/compute_s_max",
        "s",
        "step",
        "max",
        "time in the stages' forward_one_chunk / backward_one_chunk / backward_weight_one_chunk (the slowest rank)",
        wandb_summary="mean",
    ),
    Metric(
        "pp/schedule_time_s_max", "s", "step", "max", f"wall time of {_PP_STEP}, slowest rank", wandb_summary="mean"
    ),
    Metric(
        "comm/p2p_wait_s",
        "s",
        "step",
        "max",
        "time the schedule's step waited on sends and receives between stages (torch's _wait_batch_p2p), the "
        "longest-waiting rank; part of pp/schedule_time_s_max beside pp/compute_s_max",
        wandb_summary="none",
    ),
    Metric(
        "mem/pp_peak_pp_rank",
        "index",
        "step",
        "rank0",
        "in the sampled step's row: the pp rank whose stages hold the largest tracked peak (mem/tracked_total_gib_max; "
        'each pp rank\'s in run.json["memory_breakdown"]["pipeline"])',
        wandb_summary="last",
    ),
    Metric(
        "mem/pp_peak_gib_min",
        "GiB",
        "step",
        "min",
        "in the sampled step's row: the tracked peak of the lightest pp rank (its stages), beside "
        "mem/tracked_total_gib_max, the heaviest's",
        wandb_summary="last",
    ),
    Metric("summary/pp_bubble_median", "fraction", "run", "mean", "in the summary: median of pp/bubble"),
    Metric("summary/pp_bubble_predicted", "fraction", "run", "rank0", "in the summary: pp/bubble_predicted"),
    Metric("summary/comm_p2p_wait_s_median", "s", "run", "max", "in the summary: median of comm/p2p_wait_s"),
    Metric(
        "summary/pp_peak_gib_per_pp_rank",
        "GiB list",
        "run",
        "max",
        "in the summary: the sampled step's tracked peak of each pp rank (max over its dp ranks), pp rank order, "
        'to 4 digits (exact in run.json["memory_breakdown"]["pipeline"])',
    ),
    Metric(
        "summary/pp_peak_pp_rank",
        "index",
        "run",
        "rank0",
        "in the summary: the pp rank holding the largest of those (summary/tracked_peak_gib_max)",
    ),
    Metric("summary/pp_peak_stages", "text", "run", "rank0", "in the summary: the stages that pp rank holds, e.g. 0,2"),
    *[
        Metric(
            f"summary/{key}_per_rank",
            f"{unit} list",
            "run",
            "rank0",
            f"in the summary: each rank's median over the measured steps of {what}, rank order (its pp rank: "
            'run.json["memory_breakdown"]["pipeline"]["pp_rank_of_rank"])',
        )
        for key, unit, what in (
            ("pp_compute_s", "s", "its stages' compute"),
            ("comm_p2p_wait_s", "s", "its P2P waits"),
            ("pp_schedule_time_s", "s", "the schedule's step"),
            ("pp_bubble", "fraction", "its measured bubble"),
        )
    ],
]

SUMMARY_METRICS: list[Metric] = [
    Metric(
        "summary/steps_measured",
        "count",
        "run",
        "rank0",
        "post-warm-up steps the medians use (profiled steps, slowed by the profiler, left out)",
    ),
    Metric("summary/step_time_s_median", "s", "run", "rank0", "median of perf/step_time_s"),
    Metric("summary/step_time_s_p90", "s", "run", "rank0", "90th percentile of perf/step_time_s"),
    Metric("summary/tokens_per_s_median", "tokens/s", "run", "global", "median of perf/tokens_per_s"),
    Metric(
        "summary/tokens_per_s_p10",
        "tokens/s",
        "run",
        "global",
        "10th percentile of perf/tokens_per_s (nearest rank): with p90, the run's own step-to-step spread",
    ),
    Metric(
        "summary/tokens_per_s_p90", "tokens/s", "run", "global", "90th percentile of perf/tokens_per_s (nearest rank)"
    ),
    Metric("summary/tokens_per_s_per_rank_median", "tokens/s", "run", "mean", "median of perf/tokens_per_s_per_rank"),
    Metric("summary/tflops_per_rank_median", "TFLOPS", "run", "mean", "median of perf/tflops_per_rank"),
    Metric("summary/mfu_median", "fraction", "run", "mean", "median of perf/mfu; null when the peak is unknown"),
    Metric("summary/hfu_median", "fraction", "run", "mean", "median of perf/hfu; null when the peak is unknown"),
    Metric(
        "summary/mfu_fp8_median",
        "fraction",
        "run",
        "mean",
        "median of perf/mfu_fp8 (precision=float8: MFU against the FP8 peak); null otherwise",
    ),
    Metric(
        "summary/peak_tflops_fp8",
        "TFLOPS",
        "run",
        "rank0",
        "the dense FP8 peak of one rank's device that perf/mfu_fp8 divides by (precision=float8); null otherwise",
    ),
    Metric("summary/peak_tflops", "TFLOPS", "run", "rank0", "the peak of one rank's device that MFU and HFU divide by"),
    Metric(
        "summary/peak_tflops_source",
        "text",
        "run",
        "rank0",
        "where that peak comes from: trainer.peak_tflops, the GPU table, or a CPU measurement (cached)",
    ),
    Metric("summary/final_loss", "nats", "run", "mean", "train/loss of the last step"),
    Metric("summary/model_states_gib_max", "GiB", "run", "max", "largest mem/model_states_gib_max of the run"),
    Metric("summary/host_peak_rss_gib_max", "GiB", "run", "max", "largest mem/host_peak_rss_gib_max of the run"),
    Metric(
        "summary/setup_time_s", "s", "run", "max", "perf/setup_time_s of this run (of its last start, when resumed)"
    ),
    Metric("summary/first_step_time_s", "s", "run", "rank0", "perf/first_step_time_s of this run (of its last start)"),
    Metric("summary/peak_allocated_gib_max", "GiB", "run", "max", "largest mem/peak_allocated_gib_max", "cuda"),
    Metric("summary/peak_reserved_gib_max", "GiB", "run", "max", "largest mem/peak_reserved_gib_max", "cuda"),
    Metric("summary/peak_active_gib_max", "GiB", "run", "max", "largest mem/peak_active_gib_max", "cuda"),
    Metric("summary/alloc_retries_max", "count", "run", "max", "mem/alloc_retries_max at the end of the run", "cuda"),
    Metric("summary/ooms_max", "count", "run", "max", "mem/ooms_max at the end of the run", "cuda"),
    Metric(
        "summary/peak_gib",
        "GiB",
        "run",
        "max",
        "the peak memory per rank the report ranks and plots by: the best measurement the run has, "
        "summary/peak_allocated_gib_max, else summary/tracked_peak_gib_max, else summary/model_states_gib_max "
        "(fsdp_exp.metrics.peak)",
    ),
    Metric(
        "summary/peak_source",
        "text",
        "run",
        "max",
        "which of those summary/peak_gib is: cuda, tracked or model states (a lower bound: no activations)",
    ),
    Metric("summary/val_loss", "nats", "run", "mean", "val/loss of the last evaluation (data with a validation split)"),
    Metric("summary/val_perplexity", "1", "run", "mean", "val/perplexity of the last evaluation"),
    # a mixture of experts' routing as measured (models with experts only)
    Metric(
        "summary/moe_load_imbalance_median",
        "1",
        "run",
        "global",
        "in the summary: median of moe/load_imbalance_max over the measured steps: the ratio plan.expert_imbalance "
        "takes (tune.calibrate_from of a sweep of MoE runs carries it)",
    ),
    Metric(
        "summary/moe_load_imbalance_worst",
        "1",
        "run",
        "global",
        "in the summary: the largest moe/load_imbalance_max of the run",
    ),
    Metric(
        "summary/moe_worst_layer",
        "index",
        "run",
        "global",
        "in the summary: the MoE layer of summary/moe_load_imbalance_worst (0 = the first MoE layer)",
    ),
    Metric(
        "summary/moe_load_imbalance_per_layer",
        "1 list",
        "run",
        "global",
        "in the summary: each MoE layer's median over the measured steps of its max/mean expert load, block order",
    ),
    Metric(
        "summary/moe_dropped_fraction_max",
        "1",
        "run",
        "global",
        "in the summary: the largest moe/dropped_fraction of the run (0 when dropless)",
    ),
    Metric("summary/moe_aux_loss_final", "1", "run", "mean", "in the summary: moe/aux_loss of the last step"),
]

ALL_METRICS = {
    m.name: m
    for m in STEP_METRICS
    + START_METRICS
    + EVAL_METRICS
    + TRACKED_METRICS
    + COMM_METRICS
    + PIPELINE_METRICS
    + SUMMARY_METRICS
}


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
        "W&B summary: what W&B keeps in the run's summary (its runs table) for the metric, declared with "
        "`define_metric` when the run starts: `min`/`max`/`mean`/`last` over the logged steps (shown as "
        "`<name>.<rule>`), or `none` (nothing derived: for throughput and step time the `summary/*` medians are "
        "the run's values; the `summary/*` keys are set once at the end). W&B has no median.",
        "",
    ]
    for title, metrics in (
        ("Per logged step (W&B history, metrics.jsonl)", STEP_METRICS),
        ("At start (in the first row a process logs)", START_METRICS),
        ("Per evaluation (in the step's row, every trainer.eval_every steps)", EVAL_METRICS),
        (
            'Memory breakdown of the sampled step, whole and by phase (in its row, and run.json["memory_breakdown"])',
            TRACKED_METRICS,
        ),
        ('Communication of a profiled step (trainer.profile_steps; in its row, and run.json["comm"])', COMM_METRICS),
        ("Pipeline parallel (parallel.pp > 1): per stage, every logged step and the sampled one", PIPELINE_METRICS),
        ('Run summary (W&B summary, run.json["summary"])', SUMMARY_METRICS),
    ):
        lines += [
            f"## {title}",
            "",
            "| name | unit | window | ranks | device | W&B summary | meaning |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| `{m.name}` | {m.unit} | {m.window} | {m.ranks} | {m.device} | {m.wandb_summary} | {m.description} |"
            for m in metrics
        ]
        lines.append("")
    lines += flops_conventions_markdown()
    return "\n".join(lines)


def flops_conventions_markdown() -> list[str]:
    """The FLOPs conventions MFU can count by (``trainer.flops_convention``; fsdp_exp/metrics/flops.py)."""
    from fsdp_exp.metrics.flops import CONVENTIONS, DEFAULT_CONVENTION

    lines = [
        "## MFU's FLOPs conventions (`trainer.flops_convention`)",
        "",
        "`perf/mfu`, `perf/tflops_per_rank` and `summary/mfu_median` count the model's FLOPs per token (forward "
        "and backward, no recompute) under one named convention, recorded beside them in run.json "
        "`env.flops_convention` (and the W&B config's `env`); the default is "
        f"`{DEFAULT_CONVENTION}`. N: every parameter (tied ones once, position tables too); N_in: the input "
        "embeddings (token and position lookups); L: blocks; d: width; w = H x Q: attention's width (query "
        "heads x head dim); S = T: the sequence; N_mm: the matmuls' parameters (N less N_in and the 1-D norms "
        "and biases, the output projection counted even when tied).",
        "",
        "| convention | FLOPs per token |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {text} |" for name, text in CONVENTIONS.items()]
    lines.append("")
    return lines


if __name__ == "__main__":
    print(render_markdown(), end="")
