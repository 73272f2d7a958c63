"""The report's rows: configurations ranked by a throughput metric, duplicates, runs that did not complete.

Every number comes from the run's own record (``run.json["summary"]``, ``plan``, ``memory_breakdown``)
or, where the record lacks it, from its logged rows under the same metric name (fsdp_exp.metrics.schema).

A ranked row is a configuration: the runs that differ only in ``trainer.repeat`` (fsdp_exp.report.repeats),
summarized by the median over repeats of each run's median, with a 95% interval of that median
(fsdp_exp.report.intervals: over the repeats, or over the steps of a single run) and a mark for the
configurations whose interval overlaps the best one's. A configuration measured once is its run.
"""

from __future__ import annotations

import re

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from fsdp_exp.identity import repeat_index
from fsdp_exp.metrics.peak import PEAK_SOURCES
from fsdp_exp.metrics.peak import measured_peak as peak_of_run
from fsdp_exp.record import run_name
from fsdp_exp.report.breakdown import breakdown, describe
from fsdp_exp.report.duplicates import configuration_id, find_duplicates
from fsdp_exp.report.intervals import CONFIDENCE, RESAMPLES, SEED, Estimate, estimate, overlap
from fsdp_exp.report.load import Run
from fsdp_exp.units import GIB
from fsdp_exp.report.repeats import group_repeats, is_repeat_override, measured_step_values, without_repeat


@dataclass(frozen=True)
class RankMetric:
    summary_key: str
    header: str
    step_key: str  # the per-step metric whose median the summary holds


# What ranks the runs (--metric); all are higher-is-better medians over the measured steps.
METRICS = {
    "tokens_per_s": RankMetric("summary/tokens_per_s_median", "tokens/s", "perf/tokens_per_s"),
    "tokens_per_s_per_rank": RankMetric(
        "summary/tokens_per_s_per_rank_median", "tokens/s/rank", "perf/tokens_per_s_per_rank"
    ),
    "tflops_per_rank": RankMetric("summary/tflops_per_rank_median", "TFLOPS/rank", "perf/tflops_per_rank"),
    "mfu": RankMetric("summary/mfu_median", "MFU", "perf/mfu"),
}

# How the ranked rows' intervals are made (report.json "interval"; fsdp_exp.report.intervals).
INTERVAL_METHOD = {
    "confidence": CONFIDENCE,
    "of": "the median over repeats of each run's median over its measured steps",
    "method": f"percentile bootstrap, {RESAMPLES} resamples, seed {SEED}",
    "over": {
        "repeats": "the runs' medians, resampled: run-to-run variation on the machine that ran them",
        "steps": "a configuration measured once: its measured steps, resampled; within-run jitter only, "
        "narrower than run-to-run variation",
    },
    "not_covered": "what every run shares (machine, software, seed, data) and drift that lasts the whole sweep",
    "tied_with_best": "the interval overlaps the best configuration's",
    "pareto_tied": "off the Pareto front of medians, but tied with every configuration that beats it",
}


@dataclass
class Row:
    """One run, or (in ``Report.ranked``) one configuration: its repeats' medians of the run values.

    A configuration's ``path``, ``overrides`` and ``choices`` are its first repeat's (less the repeat
    override); its ``steps_measured`` is the sum over its repeats.
    """

    label: str
    status: str
    path: str
    overrides: list[str]
    choices: dict
    rank: Optional[int] = None
    tokens_per_s: Optional[float] = None
    tokens_per_s_per_rank: Optional[float] = None
    tflops_per_rank: Optional[float] = None
    mfu: Optional[float] = None
    step_time_s: Optional[float] = None
    steps_measured: Optional[int] = None
    peak_gib: Optional[float] = None
    peak_source: Optional[str] = None
    predicted_peak_gib: Optional[float] = None
    final_loss: Optional[float] = None
    world_size: Optional[int] = None
    pareto: bool = False
    duplicate_of: Optional[str] = None  # the ranked run with the same settings
    duplicates: list[str] = field(default_factory=list)  # labels of runs with this one's settings
    error: Optional[str] = None  # why it is not ranked
    # One run's own spread: p10 and p90 of its per-step tokens/s (None for a configuration of several runs).
    tokens_per_s_p10: Optional[float] = None
    tokens_per_s_p90: Optional[float] = None
    repeat: Optional[int] = None  # the run's trainer.repeat (None for a configuration of several runs)
    config_id: Optional[str] = None  # the configuration's short key: W&B job type of each of its runs
    # A ranked configuration, by the report's metric: the median's 95% interval, what it resampled
    # ("repeats", or "steps" of its single run), why there is none, and its runs.
    repeat_count: int = 1
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    interval_over: Optional[str] = None
    interval_note: Optional[str] = None
    tied_with_best: Optional[bool] = None  # interval overlaps #1's (None: #1 itself, or no interval to say)
    pareto_tied: bool = False  # off the Pareto front by medians, but tied with every row that beats it
    repeats: list["Row"] = field(default_factory=list)  # a ranked configuration's runs, in job order
    repeat_of: Optional[str] = None  # a run listed under a configuration: that configuration's label
    flops_convention: Optional[str] = None  # what its MFU counts (run.json env; None: a run from before, fsdp_exp's)
    # A pipeline run (parallel.pp > 1): the pp rank and stages holding the largest peak, and the bubble the
    # schedule predicts and the one measured (fsdp_exp/metrics/pipeline.py); None otherwise.
    pp_peak_stage: Optional[str] = None
    pp_bubble_predicted: Optional[float] = None
    pp_bubble: Optional[float] = None
    # A mixture of experts: its routing as measured (summary/moe_*): the median over measured steps of the most
    # imbalanced layer's max/mean expert load, the worst step's ratio and its layer, the largest dropped share.
    expert_imbalance: Optional[float] = None
    expert_imbalance_worst: Optional[float] = None
    expert_worst_layer: Optional[int] = None
    expert_dropped_fraction: Optional[float] = None
    # Where the step's time went and where the peak sits, measured and predicted (fsdp_exp.report.breakdown)
    breakdown: Optional[dict] = None

    def value(self, metric: str) -> Optional[float]:
        return getattr(self, metric)


@dataclass
class Report:
    sources: list[str]
    metric: str
    ranked: list[Row]
    duplicates: list[Row]
    not_ranked: list[Row]
    common_overrides: list[str]
    # config group (or override key) that varies over the completed runs -> [(option, median, runs)]: the
    # ranking's statistic (the median of the runs' medians), so that the two never disagree on what "faster" is
    option_means: dict[str, list[tuple[str, float, int]]]

    @property
    def completed(self) -> list[Row]:
        """Every completed run with a value: each ranked configuration's runs, then the duplicates."""
        return [run for row in self.ranked for run in row.repeats] + self.duplicates

    def as_dict(self) -> dict:
        return {
            "sources": self.sources,
            "metric": self.metric,
            "metric_summary_key": METRICS[self.metric].summary_key,
            "interval": INTERVAL_METHOD,
            "common_overrides": self.common_overrides,
            "peak_sources": PEAK_SOURCES,
            "ranked": [asdict(r) for r in self.ranked],
            "duplicates": [asdict(r) for r in self.duplicates],
            "not_ranked": [asdict(r) for r in self.not_ranked],
            "option_means": {
                k: [{"option": o, "median": m, "runs": n} for o, m, n in v] for k, v in self.option_means.items()
            },
        }


# ------------------------------------------------------------------------------------ one run's numbers
def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def measured_peak(run: Run) -> tuple[Optional[float], Optional[str]]:
    """The peak per rank and its source, chosen as the run's summary/peak_gib and summary/peak_source were
    (fsdp_exp.metrics.peak), so that a record written before those keys existed gets the same choice."""
    return peak_of_run(run.summary, run.last_value, run.record.get("memory_breakdown"))


def predicted_peak(run: Run) -> Optional[float]:
    """The planner's peak of the largest rank before its allocator margin, in GiB."""
    logged = _number(run.last_value("mem/predicted_peak_gib"))
    if logged is not None:
        return logged
    plan = run.record.get("plan")  # a run that failed before its first logged step still has its plan
    if isinstance(plan, dict) and isinstance(plan.get("peak"), dict):
        total = _number(plan["peak"].get("total"))
        if total is not None:
            return total / GIB
    return None


def _row(run: Run, label: str) -> Row:
    s = run.summary
    peak, source = measured_peak(run)
    world = run.topology.get("world_size") or run.env.get("world_size")
    steps = s.get("summary/steps_measured")
    return Row(
        label=label,
        status=run.status,
        path=run.path,
        overrides=run.overrides,
        choices=run.choices,
        tokens_per_s=_number(s.get("summary/tokens_per_s_median")),
        tokens_per_s_per_rank=_number(s.get("summary/tokens_per_s_per_rank_median")),
        tflops_per_rank=_number(s.get("summary/tflops_per_rank_median")),
        mfu=_number(s.get("summary/mfu_median")),
        step_time_s=_number(s.get("summary/step_time_s_median")),
        steps_measured=int(steps) if isinstance(steps, (int, float)) else None,
        peak_gib=peak,
        peak_source=source,
        predicted_peak_gib=predicted_peak(run),
        final_loss=_number(s.get("summary/final_loss")),
        world_size=int(world) if isinstance(world, int) else None,
        tokens_per_s_p10=_number(s.get("summary/tokens_per_s_p10")),
        tokens_per_s_p90=_number(s.get("summary/tokens_per_s_p90")),
        repeat=repeat_index(run.config) if run.config else None,
        config_id=configuration_id(run),
        flops_convention=run.env.get("flops_convention"),
        pp_peak_stage=peak_stage(s),
        pp_bubble_predicted=_number(s.get("summary/pp_bubble_predicted")),
        pp_bubble=_number(s.get("summary/pp_bubble_median")),
        expert_imbalance=_number(s.get("summary/moe_load_imbalance_median")),
        expert_imbalance_worst=_number(s.get("summary/moe_load_imbalance_worst")),
        expert_worst_layer=s.get("summary/moe_worst_layer"),
        expert_dropped_fraction=_number(s.get("summary/moe_dropped_fraction_max")),
        breakdown=breakdown(run) if run.status == "completed" else None,
    )


def peak_stage(summary: dict) -> Optional[str]:
    """Which pp rank (and its stages) holds a pipeline run's largest peak, e.g. "pp 0: 0,2"."""
    rank, stages = summary.get("summary/pp_peak_pp_rank"), summary.get("summary/pp_peak_stages")
    if rank is None:
        return None
    return f"pp {rank}: {stages}"


def _why_not_ranked(run: Run, row: Row, metric: str) -> str:
    if run.status != "completed":
        return run.error or f"status '{run.status}', no error recorded"
    if not run.summary:
        return run.error or "completed, but run.json has no summary"
    if row.steps_measured == 0:
        return "no measured steps: trainer.steps must exceed trainer.warmup_steps"
    if metric == "mfu":
        return "no MFU: the device's peak is unknown; pass trainer.peak_tflops=<peak> when running"
    return f"run.json summary has no {METRICS[metric].summary_key}"


# ------------------------------------------------------------------------------------ labels and options
def _excluded(override: str) -> bool:
    """Hydra's own settings and where records go (logger): not options of the experiment."""
    key = override.lstrip("+~").partition("=")[0]
    return key.startswith("hydra") or key == "logger" or key.startswith("logger.")


def _override_key(override: str) -> tuple[str, str]:
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def common_overrides(runs: list[Run]) -> list[str]:
    """Overrides every run has (a sweep's fixed settings); empty for a single run, whose label is all of them."""
    lists = [r.overrides for r in runs if isinstance(r.record.get("overrides"), list)]
    if len(lists) < 2:
        return []
    return [o for o in lists[0] if all(o in other for other in lists[1:])]


def labels(runs: list[Run], common: list[str], configuration: bool = False) -> list[str]:
    """Each run's overrides minus the common ones; a folder name is added where two labels would clash.
    ``configuration``: less ``trainer.repeat`` too, naming what the run's repeats share."""
    names = []
    for run in runs:
        if isinstance(run.record.get("overrides"), list):
            shown = [o for o in run.overrides if o not in common]
            names.append(run_name(without_repeat(shown) if configuration else shown))
        elif configuration:  # a W&B run's name, built from the overrides the same way
            names.append(",".join(without_repeat(run.label.split(","))) or "default")
        else:
            names.append(run.label)
    clashes = {n for n in names if names.count(n) > 1}
    return [
        f"{n} [{run.name or run.path.rstrip('/').rsplit('/', 1)[-1]}]" if n in clashes else n
        for n, run in zip(names, runs)
    ]


def option_values(runs: list[Run]) -> dict[str, list[Optional[str]]]:
    """Per config group (from choices) and per dotted override key: each run's option, as text."""
    keys: dict[str, None] = {}
    for run in runs:
        for group in run.choices:
            if not _excluded(group):
                keys.setdefault(group, None)
        for override in run.overrides:
            key, _ = _override_key(override)
            # trainer.repeat is no option of the experiment: the report groups repeats instead
            if "." in key and not _excluded(override) and not is_repeat_override(override):
                keys.setdefault(key, None)
    values: dict[str, list[Optional[str]]] = {}
    for key in keys:
        column = []
        for run in runs:
            if "." not in key:
                value = run.choices.get(key)
            else:
                # The resolved value, so that runs which did not override the key show their default.
                value = run.config_value(key)
                if value is None:
                    value = next((v for o in run.overrides for k, v in [_override_key(o)] if k == key), None)
            column.append(value if value is None or isinstance(value, str) else json.dumps(value))
        values[key] = column
    return values


def option_means(runs: list[Run], rows: list[Row], metric: str) -> dict[str, list[tuple[str, float, int]]]:
    """For each group or key with more than one option among these runs: the median metric per option.

    The median of the runs with that option, whatever else they vary (in a full grid, the option's main effect;
    in a partial sweep, confounded with the rest). A median, as the ranking's: a mean here once put grad_op above
    full while the ranking put full above grad_op, one slow run pulling a mean and not a median.
    """
    result = {}
    for key, column in option_values(runs).items():
        by_option: dict[str, list[float]] = {}
        for value, row in zip(column, rows):
            if value is not None and row.value(metric) is not None:
                by_option.setdefault(value, []).append(row.value(metric))
        if len(by_option) > 1:
            result[key] = [(o, statistics.median(v), len(v)) for o, v in by_option.items()]
    return result


def dominates(o: Row, r: Row, metric: str) -> bool:
    """``o`` is at least as fast and as small as ``r``, and better on one count."""
    return (
        o.value(metric) >= r.value(metric)
        and o.peak_gib <= r.peak_gib
        and (o.value(metric) > r.value(metric) or o.peak_gib < r.peak_gib)
    )


def pareto_front(rows: list[Row], metric: str) -> list[Row]:
    """Rows no other row beats on both counts: higher metric and lower peak memory per rank."""
    candidates = [r for r in rows if r.value(metric) is not None and r.peak_gib is not None]
    return [r for r in candidates if not any(dominates(o, r, metric) for o in candidates)]


def pareto_ties(rows: list[Row], metric: str, estimates: dict[int, Estimate]) -> list[Row]:
    """Rows off the front whose every dominator is tied with them on the metric (overlapping intervals):
    the order of medians that puts them off could be the noise's. Memory counts as exact (the same
    configuration peaks alike run after run); only throughput has an interval."""
    candidates = [r for r in rows if r.value(metric) is not None and r.peak_gib is not None]
    tied = []
    for r in candidates:
        beaten_by = [o for o in candidates if dominates(o, r, metric)]
        if beaten_by and all(overlap(estimates[id(o)], estimates[id(r)]) for o in beaten_by):
            tied.append(r)
    return tied


# ------------------------------------------------------------------------------------ the report
def _median(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def configuration_row(label: str, members: list[tuple[Run, Row]], metric: str) -> tuple[Row, Estimate]:
    """One ranked row from the runs of one configuration (job order), and its estimate of the metric."""
    run0, first = members[0]
    runs = [replace(row, repeat_of=label) for _, row in members]
    steps, why = measured_step_values(run0, METRICS[metric].step_key) if len(runs) == 1 else (None, None)
    found = estimate([r.value(metric) for r in runs], steps)
    note = f"one run, and {why}" if why else found.note
    single = len(runs) == 1
    measured = [r.steps_measured for r in runs]
    row = Row(
        label=label,
        status="completed",
        path=first.path,
        overrides=without_repeat(first.overrides),
        choices=first.choices,
        **{m: _median([r.value(m) for r in runs]) for m in METRICS},
        step_time_s=_median([r.step_time_s for r in runs]),
        steps_measured=sum(measured) if None not in measured else None,
        peak_gib=_median([r.peak_gib for r in runs]),
        peak_source=first.peak_source,
        predicted_peak_gib=first.predicted_peak_gib,
        final_loss=_median([r.final_loss for r in runs]),
        world_size=first.world_size,
        duplicates=[d for r in runs for d in r.duplicates],
        tokens_per_s_p10=first.tokens_per_s_p10 if single else None,
        tokens_per_s_p90=first.tokens_per_s_p90 if single else None,
        repeat=first.repeat if single else None,
        config_id=first.config_id,
        repeat_count=len(runs),
        flops_convention=first.flops_convention,
        pp_peak_stage=first.pp_peak_stage,
        pp_bubble_predicted=first.pp_bubble_predicted,
        pp_bubble=_median([r.pp_bubble for r in runs]),
        expert_imbalance=_median([r.expert_imbalance for r in runs]),
        expert_imbalance_worst=max((r.expert_imbalance_worst for r in runs if r.expert_imbalance_worst), default=None),
        expert_worst_layer=max(runs, key=lambda r: r.expert_imbalance_worst or 0).expert_worst_layer,
        expert_dropped_fraction=max(
            (r.expert_dropped_fraction for r in runs if r.expert_dropped_fraction is not None), default=None
        ),
        # the first repeat with a profiled step: the parts of one step, measured on one run
        breakdown=next(
            (r.breakdown for r in runs if r.breakdown and r.breakdown["time_s"]["measured"]), first.breakdown
        ),
        ci_low=found.low,
        ci_high=found.high,
        interval_over=found.over,
        interval_note=note,
        repeats=runs,
    )
    return row, found


def build_report(runs: list[Run], metric: str = "tokens_per_s", sources: Optional[list[str]] = None) -> Report:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}")
    common = common_overrides(runs)
    names = labels(runs, common)
    rows = [_row(run, name) for run, name in zip(runs, names)]
    usable = [
        i for i, (run, row) in enumerate(zip(runs, rows)) if run.status == "completed" and row.value(metric) is not None
    ]
    not_ranked = []
    for i, (run, row) in enumerate(zip(runs, rows)):
        if i not in usable:
            row.error = _why_not_ranked(run, row, metric)
            not_ranked.append(row)

    same_as = {usable[d]: usable[f] for d, f in find_duplicates([runs[i] for i in usable]).items()}
    duplicates = []
    for dup, first in same_as.items():
        rows[dup].duplicate_of = rows[first].label
        rows[first].duplicates.append(rows[dup].label)
        duplicates.append(rows[dup])

    # Repeats of one configuration become one row (duplicates are left out: they are counted once).
    counted = [i for i in usable if i not in same_as]
    groups = [[counted[g] for g in group] for group in group_repeats([runs[i] for i in counted])]
    names = labels([runs[group[0]] for group in groups], common, configuration=True)
    estimates: dict[int, Estimate] = {}
    configurations = []
    for name, group in zip(names, groups):
        row, found = configuration_row(name, [(runs[i], rows[i]) for i in group], metric)
        estimates[id(row)] = found
        configurations.append(row)

    ranked = sorted(configurations, key=lambda r: -r.value(metric))
    for position, row in enumerate(ranked, start=1):
        row.rank = position
    for row in ranked[1:]:
        row.tied_with_best = overlap(estimates[id(row)], estimates[id(ranked[0])])
    for row in pareto_front(ranked, metric):
        row.pareto = True
    for row in pareto_ties(ranked, metric, estimates):
        row.pareto_tied = True
    completed_runs = [runs[i] for i in usable]
    return Report(
        sources=sources or [],
        metric=metric,
        ranked=ranked,
        duplicates=duplicates,
        not_ranked=not_ranked,
        common_overrides=[o for o in common if not _excluded(o)],
        option_means=option_means(completed_runs, [rows[i] for i in usable], metric),
    )


# ------------------------------------------------------------------------------------ formatting
def fmt_gib(gib: Optional[float]) -> str:
    if gib is None:
        return "n/a"
    if gib >= 1:
        return f"{gib:.2f} GiB"
    if gib * 1024 >= 1:
        return f"{gib * 1024:.2f} MiB"
    return f"{gib * 1024**2:.1f} KiB"


def fmt_metric(metric: str, value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if metric == "mfu":
        return f"{100 * value:.1f}%"
    if metric == "tflops_per_rank":
        return f"{value:.4g}"
    return f"{value:,.0f}"


def fmt_number(value: Optional[float], digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def _shown(report: Report) -> list[str]:
    return ["tokens_per_s", "mfu"] + ([report.metric] if report.metric not in ("tokens_per_s", "mfu") else [])


def table_columns(report: Report) -> list[str]:
    """The ranked table's columns, shared by the console and the HTML; the interval, what it resampled and
    the tie mark follow the ranking metric's column."""
    columns = ["#", "run"]
    for m in _shown(report):
        columns.append(METRICS[m].header)
        if m == report.metric:
            columns += [f"{int(CONFIDENCE * 100)}% interval", "interval over", "vs #1"]
    return columns + [
        "peak / rank",
        "peak from",
        "predicted peak",
        *pipeline_columns(report),
        *expert_columns(report),
        "final loss",
        "status",
    ]


def expert_columns(report: Report) -> list[str]:
    """Where a report holds mixture-of-experts runs: their expert load as measured (max/mean, the median step's
    most imbalanced layer; the worst step's and its layer) and the share of routed copies dropped."""
    return ["expert load", "dropped"] if any(r.expert_imbalance is not None for r in report.ranked) else []


def fmt_expert_load(row: Row) -> str:
    """``1.31 (worst 1.52, layer 3)``: max/mean expert load, median over the measured steps, then the worst step."""
    if row.expert_imbalance is None:
        return "n/a"
    worst = row.expert_imbalance_worst
    return f"{row.expert_imbalance:.2f}" + (
        f" (worst {worst:.2f}, layer {row.expert_worst_layer})" if worst is not None else ""
    )


def pipeline_columns(report: Report) -> list[str]:
    """Where a report holds pipeline runs: which stage has the peak, and the bubble predicted / measured."""
    return (
        ["peak on stages", "bubble pred/meas"] if any(r.pp_bubble_predicted is not None for r in report.ranked) else []
    )


def fmt_bubble(row: Row) -> str:
    if row.pp_bubble_predicted is None:
        return "n/a"
    measured = "n/a" if row.pp_bubble is None else f"{row.pp_bubble:.0%}"
    return f"{row.pp_bubble_predicted:.0%}/{measured}"


def fmt_interval(metric: str, row: Row) -> str:
    if row.ci_low is None or row.ci_high is None:
        return "n/a"
    return f"{fmt_metric(metric, row.ci_low)} – {fmt_metric(metric, row.ci_high)}"


def fmt_over(row: Row) -> str:
    """What the interval resampled: "3 repeats", or "6 steps, 1 run" (a single run's jitter only)."""
    if row.interval_over == "repeats":
        return f"{row.repeat_count} repeats"
    if row.interval_over == "steps":
        return f"{row.steps_measured} steps, 1 run"
    return f"none ({row.repeat_count} run{'s' * (row.repeat_count > 1)})"


def fmt_vs_best(row: Row) -> str:
    if row.rank == 1:
        return "best"
    return {True: "tied", False: "below", None: "n/a"}[row.tied_with_best]


def rank_mark(row: Row) -> str:
    return f"{row.rank}{'*' if row.pareto else ''}{'~' if row.pareto_tied else ''}"


def table_cells(report: Report, row: Row) -> list[str]:
    status = row.status + (f" (+{len(row.duplicates)} same)" if row.duplicates else "")
    cells = [rank_mark(row), row.label]
    for m in _shown(report):
        cells.append(fmt_metric(m, row.value(m)))
        if m == report.metric:
            cells += [fmt_interval(m, row), fmt_over(row), fmt_vs_best(row)]
    return cells + [
        fmt_gib(row.peak_gib),
        row.peak_source or "n/a",
        fmt_gib(row.predicted_peak_gib),
        *([row.pp_peak_stage or "n/a", fmt_bubble(row)] if pipeline_columns(report) else []),
        *(
            [
                fmt_expert_load(row),
                "n/a" if row.expert_dropped_fraction is None else f"{row.expert_dropped_fraction:.1%}",
            ]
            if expert_columns(report)
            else []
        ),
        fmt_number(row.final_loss),
        status,
    ]


def caption(report: Report) -> str:
    header = METRICS[report.metric].header
    parts = [
        f"ranked by {header}: per configuration, the median over its repeats (trainer.repeat) of each run's "
        f"median over its measured steps",
        f"{int(CONFIDENCE * 100)}% interval of that median: bootstrap over the repeats' medians, or over the "
        f"steps of a configuration measured once (narrower: it misses run-to-run variation)",
        "vs #1: tied = the interval overlaps #1's; * = Pareto front of the medians (no other configuration is "
        "both faster and smaller); ~ = off it, but tied with every configuration that beats it",
    ]
    if report.common_overrides:
        parts.append("all runs: " + " ".join(report.common_overrides))
    sources = {r.peak_source for r in report.ranked if r.peak_source}
    parts += [f"peak from {s}: {PEAK_SOURCES[s]}" for s in PEAK_SOURCES if s in sources]
    parts.append(mfu_note(report.ranked))
    return "\n".join(parts)


def mfu_note(rows: list[Row]) -> str:
    """What the MFU column counts (trainer.flops_convention, docs/metrics.md), and a warning where runs differ."""
    from fsdp_exp.metrics.flops import DEFAULT_CONVENTION

    used = sorted({r.flops_convention or DEFAULT_CONVENTION for r in rows})
    if len(used) > 1:
        return (
            f"MFU counts FLOPs by different conventions here ({', '.join(used)}: docs/metrics.md): not "
            "comparable across them; compare tokens/s"
        )
    return f"MFU counts FLOPs by the {used[0] if used else DEFAULT_CONVENTION} convention (docs/metrics.md)"


def repeated(report: Report) -> list[Row]:
    """The runs of every configuration measured more than once, by rank then job order."""
    return [run for row in report.ranked if row.repeat_count > 1 for run in row.repeats]


def repeat_columns(report: Report) -> list[str]:
    return ["configuration", "repeat", METRICS[report.metric].header, "tokens/s p10 – p90", "steps", "run"]


def repeat_cells(report: Report, run: Row) -> list[str]:
    spread = (
        "n/a"
        if run.tokens_per_s_p10 is None or run.tokens_per_s_p90 is None
        else f"{fmt_metric('tokens_per_s', run.tokens_per_s_p10)} – {fmt_metric('tokens_per_s', run.tokens_per_s_p90)}"
    )
    return [
        run.repeat_of or "",
        "n/a" if run.repeat is None else str(run.repeat),
        fmt_metric(report.metric, run.value(report.metric)),
        spread,
        "n/a" if run.steps_measured is None else str(run.steps_measured),
        run.label,
    ]


# The ranking's columns dropped first to last where the console is too narrow for all of them (the CSV and the
# HTML keep every one): how the interval was made and where the peak came from, then the secondary figures. The
# rank, the run's configuration, the ranking statistic, its interval and the peak stay at any width.
DROP_ORDER = (
    "interval over",
    "peak from",
    "predicted peak",
    "peak on stages",
    "bubble pred/meas",
    "final loss",
    "status",
    "vs #1",
    METRICS["mfu"].header,
)
RUN_MIN_WIDTH = 28  # narrower, a run's label breaks every override onto its own line


def readable(label: str) -> str:
    """A run's label with a space after each comma that starts another override, so that the console wraps it by
    overrides (``sharding=full, precision=bf16``) rather than inside one; commas inside a value stay."""
    return re.sub(r",(?=[\w.+~/]+=)", ", ", label)


def ranking_table(report: Report, width: Optional[int] = None):
    """The ranked table; at ``width`` columns, the columns of ``DROP_ORDER`` go first until it fits."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from fsdp_exp.narrow import fit_columns

    every = table_columns(report)

    def build(columns: list[str]):
        # collapse_padding: two spaces between columns, not three; the ranked table has many of them.
        table = Table(caption=Text(caption(report)), caption_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True)
        for column in columns:
            # Only the label wraps (by words, then folds): a number or an interval over two lines reads as two values.
            table.add_column(
                column,
                justify="left" if column in ("run", "peak from", "status") else "right",
                overflow="fold",
                no_wrap=column != "run",
                min_width=RUN_MIN_WIDTH if column == "run" else None,
            )
        for row in report.ranked:
            values = dict(zip(every, table_cells(report, row)))
            values["run"] = readable(values["run"])
            table.add_row(*[Text(values[c]) for c in columns])
        return table

    keep = [c for c in DROP_ORDER if c != METRICS[report.metric].header]  # never the ranking statistic
    return build(every) if width is None else fit_columns(build, every, keep, width)


def print_report(report: Report, console=None) -> None:
    """The ranked table, the runs of repeated configurations, duplicates, runs that did not complete and
    per-option means (rich)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    def cells(*values: str) -> list[Text]:
        # Text, not markup: labels and errors hold brackets ("data.files=[a,b]", gloo's "[/pytorch/...]")
        return [Text(value) for value in values]

    console = console or Console()
    total = len(report.completed) + len(report.not_ranked)

    def heading(text: str) -> None:
        # Printed apart from the tables: rich wraps a title to its table's width, and these are short tables.
        console.print(f"[bold]{text}[/bold]", highlight=False)

    heading(
        f"fsdp_exp report: {len(report.ranked)} configurations ranked, from {len(report.completed)} completed "
        f"of {total} runs ({escape(', '.join(report.sources))})"
    )
    console.print(ranking_table(report, console.width))
    if any(r.breakdown for r in report.ranked):
        heading(
            "Where each configuration's step went (measured / the step-time model's) and its peak by phase "
            "(tracked / the planner's)"
        )
        for row in report.ranked:
            if row.breakdown:
                for line in describe(f"#{row.rank} {row.label}", row.breakdown):
                    console.print(line, markup=False, highlight=False)

    runs = repeated(report)
    if runs:
        heading("Runs of the configurations measured more than once (the repeats the medians and intervals use)")
        each = Table(box=box.SIMPLE_HEAD)
        for column in repeat_columns(report):
            each.add_column(column, justify="left" if column in ("configuration", "run") else "right", overflow="fold")
        for run in runs:
            each.add_row(*cells(*repeat_cells(report, run)))
        console.print(each)

    if report.duplicates:
        heading("Same applied settings as a ranked run (counted once)")
        dups = Table(box=box.SIMPLE_HEAD)
        dups.add_column("run", overflow="fold")
        dups.add_column("same as", overflow="fold")
        dups.add_column(METRICS[report.metric].header, justify="right")
        for row in report.duplicates:
            dups.add_row(*cells(row.label, row.duplicate_of, fmt_metric(report.metric, row.value(report.metric))))
        console.print(dups)

    if report.not_ranked:
        heading("Not ranked: failed, interrupted or incomplete runs")
        failed = Table(box=box.SIMPLE_HEAD)
        failed.add_column("run", overflow="fold")
        failed.add_column("status")
        failed.add_column("error", overflow="fold")
        for row in report.not_ranked:
            failed.add_row(*cells(row.label, row.status, row.error or ""))
        console.print(failed)

    if report.option_means:
        heading(
            f"Median {METRICS[report.metric].header} by option (the ranking's statistic, over the completed runs, "
            "duplicates included)"
        )
        means = Table(box=box.SIMPLE_HEAD)
        means.add_column("group")
        means.add_column("option", overflow="fold")
        means.add_column("runs", justify="right")
        means.add_column(METRICS[report.metric].header, justify="right")
        for key, options in report.option_means.items():
            for option, mean, n in options:
                means.add_row(*cells(key, option, str(n), fmt_metric(report.metric, mean)))
        console.print(means)
