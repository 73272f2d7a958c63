"""The report's rows: completed runs ranked by a throughput metric, duplicates, runs that did not complete.

Every number comes from the run's own record (``run.json["summary"]``, ``plan``, ``memory_breakdown``)
or, where the record lacks it, from its logged rows under the same metric name (fsdp_exp.metrics.schema).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from fsdp_exp.report.duplicates import find_duplicates
from fsdp_exp.report.load import GIB, Run
from fsdp_exp.sinks import run_name


@dataclass(frozen=True)
class RankMetric:
    summary_key: str
    header: str


# What ranks the runs (--metric); all are higher-is-better medians over the measured steps.
METRICS = {
    "tokens_per_s": RankMetric("summary/tokens_per_s_median", "tokens/s"),
    "tokens_per_s_per_rank": RankMetric("summary/tokens_per_s_per_rank_median", "tokens/s/rank"),
    "tflops_per_rank": RankMetric("summary/tflops_per_rank_median", "TFLOPS/rank"),
    "mfu": RankMetric("summary/mfu_median", "MFU"),
}

# Which measured peak a row shows, best first (see measured_peak).
PEAK_SOURCES = {
    "cuda": "CUDA allocator's peak allocated bytes (summary/peak_allocated_gib_max)",
    "tracked": "torch's memory tracker, peak of the sampled step (mem/tracked_total_gib_max)",
    "model states": "params + grads + optimizer state only, no activations: a lower bound "
                    "(summary/model_states_gib_max)",
}


@dataclass
class Row:
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
    # config group (or override key) that varies over the completed runs -> [(option, mean, runs)]
    option_means: dict[str, list[tuple[str, float, int]]]

    @property
    def completed(self) -> list[Row]:
        """Every completed run with a value: the ranked ones and their duplicates (what the scatter plots)."""
        return self.ranked + self.duplicates

    def as_dict(self) -> dict:
        return {
            "sources": self.sources,
            "metric": self.metric,
            "metric_summary_key": METRICS[self.metric].summary_key,
            "common_overrides": self.common_overrides,
            "peak_sources": PEAK_SOURCES,
            "ranked": [asdict(r) for r in self.ranked],
            "duplicates": [asdict(r) for r in self.duplicates],
            "not_ranked": [asdict(r) for r in self.not_ranked],
            "option_means": {k: [{"option": o, "mean": m, "runs": n} for o, m, n in v]
                             for k, v in self.option_means.items()},
        }


# ------------------------------------------------------------------------------------ one run's numbers
def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def measured_peak(run: Run) -> tuple[Optional[float], Optional[str]]:
    """The best measured peak per rank (max over ranks) the record has, in GiB, and which one it is."""
    cuda = _number(run.summary.get("summary/peak_allocated_gib_max"))
    if cuda is not None:
        return cuda, "cuda"
    # By metric name first (the schema is the contract); older records have only memory_breakdown.
    tracked = _number(run.summary.get("summary/tracked_peak_gib_max"))
    if tracked is None:
        tracked = _number(run.last_value("mem/tracked_total_gib_max"))
    breakdown = run.record.get("memory_breakdown")
    if tracked is None and isinstance(breakdown, dict):
        tracked = _number(breakdown.get("total_gib_max"))
    if tracked is not None:  # FSDP1 and trainer.track_memory=false runs have none
        return tracked, "tracked"
    states = _number(run.summary.get("summary/model_states_gib_max"))
    if states is None:
        states = _number(run.last_value("mem/model_states_gib_max"))
    return (states, "model states") if states is not None else (None, None)


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
    return Row(label=label, status=run.status, path=run.path, overrides=run.overrides, choices=run.choices,
               tokens_per_s=_number(s.get("summary/tokens_per_s_median")),
               tokens_per_s_per_rank=_number(s.get("summary/tokens_per_s_per_rank_median")),
               tflops_per_rank=_number(s.get("summary/tflops_per_rank_median")),
               mfu=_number(s.get("summary/mfu_median")),
               step_time_s=_number(s.get("summary/step_time_s_median")),
               steps_measured=int(steps) if isinstance(steps, (int, float)) else None,
               peak_gib=peak, peak_source=source, predicted_peak_gib=predicted_peak(run),
               final_loss=_number(s.get("summary/final_loss")),
               world_size=int(world) if isinstance(world, int) else None)


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


def labels(runs: list[Run], common: list[str]) -> list[str]:
    """Each run's overrides minus the common ones; a folder name is added where two labels would clash."""
    names = []
    for run in runs:
        if isinstance(run.record.get("overrides"), list):
            names.append(run_name([o for o in run.overrides if o not in common]))
        else:
            names.append(run.label)
    clashes = {n for n in names if names.count(n) > 1}
    return [f"{n} [{run.name or run.path.rstrip('/').rsplit('/', 1)[-1]}]" if n in clashes else n
            for n, run in zip(names, runs)]


def option_values(runs: list[Run]) -> dict[str, list[Optional[str]]]:
    """Per config group (from choices) and per dotted override key: each run's option, as text."""
    keys: dict[str, None] = {}
    for run in runs:
        for group in run.choices:
            if not _excluded(group):
                keys.setdefault(group, None)
        for override in run.overrides:
            key, _ = _override_key(override)
            if "." in key and not _excluded(override):
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
    """For each group or key with more than one option among these runs: mean metric per option.

    A mean over the runs with that option, whatever else they vary: in a full grid that is the option's
    main effect, in a partial sweep it is confounded with the rest.
    """
    result = {}
    for key, column in option_values(runs).items():
        by_option: dict[str, list[float]] = {}
        for value, row in zip(column, rows):
            if value is not None and row.value(metric) is not None:
                by_option.setdefault(value, []).append(row.value(metric))
        if len(by_option) > 1:
            result[key] = [(o, statistics.fmean(v), len(v)) for o, v in by_option.items()]
    return result


def pareto_front(rows: list[Row], metric: str) -> list[Row]:
    """Rows no other row beats on both counts: higher metric and lower peak memory per rank."""
    candidates = [r for r in rows if r.value(metric) is not None and r.peak_gib is not None]

    def dominated(r: Row) -> bool:
        return any(o.value(metric) >= r.value(metric) and o.peak_gib <= r.peak_gib
                   and (o.value(metric) > r.value(metric) or o.peak_gib < r.peak_gib) for o in candidates)

    return [r for r in candidates if not dominated(r)]


# ------------------------------------------------------------------------------------ the report
def build_report(runs: list[Run], metric: str = "tokens_per_s", sources: Optional[list[str]] = None) -> Report:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}")
    common = common_overrides(runs)
    names = labels(runs, common)
    rows = [_row(run, name) for run, name in zip(runs, names)]
    usable = [i for i, (run, row) in enumerate(zip(runs, rows))
              if run.status == "completed" and row.value(metric) is not None]
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
    ranked = sorted((rows[i] for i in usable if i not in same_as), key=lambda r: -r.value(metric))
    for position, row in enumerate(ranked, start=1):
        row.rank = position
    for row in pareto_front(ranked, metric):
        row.pareto = True
    completed_runs = [runs[i] for i in usable]
    return Report(sources=sources or [], metric=metric, ranked=ranked, duplicates=duplicates,
                  not_ranked=not_ranked, common_overrides=[o for o in common if not _excluded(o)],
                  option_means=option_means(completed_runs, [rows[i] for i in usable], metric))


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


def table_columns(report: Report) -> list[str]:
    """The ranked table's columns, shared by the console and the HTML."""
    shown = ["tokens_per_s", "mfu"] + ([report.metric] if report.metric not in ("tokens_per_s", "mfu") else [])
    return ["#", "run"] + [METRICS[m].header for m in shown] + \
        ["peak / rank", "peak from", "predicted peak", "final loss", "status"]


def table_cells(report: Report, row: Row) -> list[str]:
    shown = ["tokens_per_s", "mfu"] + ([report.metric] if report.metric not in ("tokens_per_s", "mfu") else [])
    status = row.status + (f" (+{len(row.duplicates)} same)" if row.duplicates else "")
    return [f"{row.rank}{'*' if row.pareto else ''}", row.label] + [fmt_metric(m, row.value(m)) for m in shown] + \
        [fmt_gib(row.peak_gib), row.peak_source or "n/a", fmt_gib(row.predicted_peak_gib),
         fmt_number(row.final_loss), status]


def caption(report: Report) -> str:
    parts = [f"ranked by {METRICS[report.metric].header}, median over measured steps; "
             "* = Pareto front (no other run is both faster and smaller)"]
    if report.common_overrides:
        parts.append("all runs: " + " ".join(report.common_overrides))
    sources = {r.peak_source for r in report.ranked if r.peak_source}
    parts += [f"peak from {s}: {PEAK_SOURCES[s]}" for s in PEAK_SOURCES if s in sources]
    return "\n".join(parts)


def print_report(report: Report, console=None) -> None:
    """The ranked table, then duplicates, runs that did not complete and per-option means (rich)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    def cells(*values: str) -> list[Text]:
        # Text, not markup: labels and errors hold brackets ("data.files=[a,b]", gloo's "[/pytorch/...]")
        return [Text(value) for value in values]

    console = console or Console()
    total = len(report.ranked) + len(report.duplicates) + len(report.not_ranked)

    def heading(text: str) -> None:
        # Printed apart from the tables: rich wraps a title to its table's width, and these are short tables.
        console.print(f"[bold]{text}[/bold]", highlight=False)

    heading(f"fsdp_exp report: {len(report.ranked)} ranked of {total} runs ({escape(', '.join(report.sources))})")
    table = Table(caption=Text(caption(report)), caption_justify="left", box=box.SIMPLE_HEAD)
    for column in table_columns(report):
        table.add_column(column, justify="left" if column in ("run", "peak from", "status") else "right",
                         overflow="fold")
    for row in report.ranked:
        table.add_row(*cells(*table_cells(report, row)))
    console.print(table)

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
        heading(f"Mean {METRICS[report.metric].header} by option (completed runs, duplicates included)")
        means = Table(box=box.SIMPLE_HEAD)
        means.add_column("group")
        means.add_column("option", overflow="fold")
        means.add_column("runs", justify="right")
        means.add_column(METRICS[report.metric].header, justify="right")
        for key, options in report.option_means.items():
            for option, mean, n in options:
                means.add_row(*cells(key, option, str(n), fmt_metric(report.metric, mean)))
        console.print(means)
