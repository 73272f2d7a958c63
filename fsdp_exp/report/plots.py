"""The report's figure: throughput against peak memory per rank with intervals and the Pareto front, and
per-option bars.

Each ranked configuration is one marker at its medians with an error bar: the table's 95% interval (solid
over repeats, dashed over the steps of a configuration measured once); the repeats of a configuration
measured more than once are grey dots under it.

Built on a bare ``matplotlib.figure.Figure`` (no pyplot): no global figure state, no GUI backend, the same
figure in a terminal, a test and a notebook. ``plot_report`` returns the figure and the data it drew, so
that callers (the HTML, the tests) can check what is on it without reading pixels.
"""

from __future__ import annotations

import io
import math
from typing import Optional

from matplotlib.collections import LineCollection, PathCollection
from matplotlib.figure import Figure

from fsdp_exp.report.intervals import CONFIDENCE
from fsdp_exp.report.table import METRICS, Report, Row, fmt_metric

MARKERS = {"tracked": "o", "cuda": "s", "model states": "^", None: "x"}
# Beyond this many points, names would cover each other: points show their rank and the table maps it.
MAX_NAMED_POINTS = 12
BARS_PER_ROW = 3


def _memory_unit(values: list[float]) -> tuple[str, float]:
    largest = max(values, default=0.0)
    if largest >= 1:
        return "GiB", 1.0
    if largest * 1024 >= 1:
        return "MiB", 1024.0
    return "KiB", 1024.0**2


DODGE = 0.012  # of the memory axis' span: how far apart intervals at the same memory are drawn


def dodged(rows: list[Row], scale: float) -> dict[str, float]:
    """Each configuration's x on the scatter: its peak memory, moved a little sideways where configurations share
    the same memory (within half a dodge), so that their intervals stand side by side instead of on top of each
    other. The table and ``report.json`` keep the measured peak; only the drawing moves."""
    xs = sorted((r.peak_gib * scale, r.label) for r in rows)
    if not xs:
        return {}
    span = (xs[-1][0] - xs[0][0]) or xs[-1][0] or 1.0
    step = DODGE * span
    out: dict[str, float] = {}
    group: list[tuple[float, str]] = []
    for x, label in xs + [(float("inf"), "")]:
        if group and x - group[0][0] > step / 2:
            middle = (len(group) - 1) / 2
            for i, (gx, glabel) in enumerate(group):
                out[glabel] = group[0][0] + (i - middle) * step
            group = []
        group.append((x, label))
    return out


def plot_report(report: Report) -> tuple[Figure, dict]:
    """The figure and what it shows: ``points`` (each marker: a ranked configuration with its interval, a
    duplicate, or one repeat of a configuration measured more than once), ``front`` and ``bars``."""
    header = METRICS[report.metric].header
    bar_keys = list(report.option_means)
    bar_rows = math.ceil(len(bar_keys) / BARS_PER_ROW)
    fig = Figure(figsize=(12, 6 + 3.6 * bar_rows), layout="constrained")
    grid = fig.add_gridspec(1 + bar_rows, BARS_PER_ROW, height_ratios=[2.0] + [1.0] * bar_rows)
    ax = fig.add_subplot(grid[0, :])
    ax.set_gid("scatter")

    def shown(rows: list[Row]) -> list[Row]:
        return [r for r in rows if r.peak_gib is not None and r.value(report.metric) is not None]

    configurations, duplicates = shown(report.ranked), shown(report.duplicates)
    repeats = shown([run for row in configurations if row.repeat_count > 1 for run in row.repeats])
    unit, scale = _memory_unit([r.peak_gib for r in configurations + duplicates + repeats])
    data = {"metric": report.metric, "memory_unit": unit, "points": [], "front": [], "bars": {}}
    named = len(configurations) + len(duplicates) <= MAX_NAMED_POINTS
    # A duplicate names the run it repeats; the table ranks that run's configuration.
    ranks = {run.label: row.rank for row in report.ranked for run in row.repeats}
    at = dodged(configurations, scale)  # x of each configuration (and of its repeats): side by side where tied

    def x_of(r: Row) -> float:
        return at.get(r.repeat_of if r.repeat_of in at else r.label, r.peak_gib * scale)

    # The repeats sit on their configuration's error bar (same memory): grey with a white rim, above the bar
    # and under the configuration's marker.
    if repeats:
        ax.scatter(
            [x_of(r) for r in repeats],
            [r.value(report.metric) for r in repeats],
            marker="o",
            s=28,
            color="tab:gray",
            edgecolors="white",
            linewidths=0.8,
            zorder=2.8,
            label="one repeat (its run's median)",
        )
        for r in repeats:
            data["points"].append(
                {
                    "kind": "repeat",
                    "label": r.label,
                    "configuration": r.repeat_of,
                    "peak": r.peak_gib * scale,
                    "value": r.value(report.metric),
                }
            )
    # One scatter call per (kind of peak, duplicate or not) so that each gets one legend entry.
    for source in MARKERS:
        for duplicate in (False, True):
            group = [r for r in (duplicates if duplicate else configurations) if r.peak_source == source]
            if not group:
                continue
            what = f"peak from {source}" if source else "peak unknown"
            ax.scatter(
                [x_of(r) for r in group],
                [r.value(report.metric) for r in group],
                marker=MARKERS[source],
                s=60,
                zorder=3,
                facecolors="none" if duplicate else "tab:blue",
                edgecolors="tab:blue",
                label=f"{what}, same settings as a ranked run" if duplicate else what,
            )
    # Error bars: the table's interval of each configuration; dashed where it only resamples one run's steps.
    for over, style in (("repeats", "-"), ("steps", "--")):
        group = [r for r in configurations if r.interval_over == over and r.ci_low is not None]
        if not group:
            continue
        values = [r.value(report.metric) for r in group]
        bars = ax.errorbar(
            [x_of(r) for r in group],
            values,
            yerr=[[v - r.ci_low for v, r in zip(values, group)], [r.ci_high - v for v, r in zip(values, group)]],
            fmt="none",
            ecolor="tab:blue",
            elinewidth=1.2,
            capsize=4,
            zorder=2.5,
            label=f"{int(CONFIDENCE * 100)}% interval over "
            + ("repeats" if over == "repeats" else "one run's steps (within-run only)"),
        )
        bars[2][0].set_linestyle(style)
        bars[2][0].set_gid(f"interval-{over}")
    for r in configurations + duplicates:
        x, y = r.peak_gib * scale, r.value(report.metric)
        if r.duplicate_of is None:
            tie = " (tied #1)" if r.tied_with_best else ""
            repeat = f" x{r.repeat_count}" if r.repeat_count > 1 else ""
            text = (r.label if named else f"#{r.rank}") + repeat + tie
        else:
            text = f"{r.label} (= {r.duplicate_of})" if named else f"=#{ranks.get(r.duplicate_of)}"
        ax.annotate(text, (x_of(r), y), xytext=(5, 5), textcoords="offset points", fontsize=8)
        point = {
            "kind": "duplicate" if r.duplicate_of else "configuration",
            "label": r.label,
            "peak": x,
            "drawn_at": x_of(r),
            "value": y,
            "peak_source": r.peak_source,
            "duplicate_of": r.duplicate_of,
            "pareto": r.pareto,
        }
        if r.duplicate_of is None:
            point.update(
                interval=None if r.ci_low is None else [r.ci_low, r.ci_high],
                interval_over=r.interval_over,
                repeats=r.repeat_count,
                tied_with_best=r.tied_with_best,
                pareto_tied=r.pareto_tied,
            )
        data["points"].append(point)

    front = sorted((r for r in report.ranked if r.pareto), key=lambda r: r.peak_gib)
    if front:
        # A staircase: with memory up to the next front run's, the best throughput on offer is this run's.
        ax.plot(
            [x_of(r) for r in front],
            [r.value(report.metric) for r in front],
            "--",
            color="tab:red",
            drawstyle="steps-post",
            marker="o",
            markersize=11,
            markerfacecolor="none",
            zorder=2,
            label="Pareto front of the medians (higher throughput, lower memory)",
        )
        data["front"] = [r.label for r in front]
    front_ties = [r for r in configurations if r.pareto_tied]
    if front_ties:
        ax.scatter(
            [x_of(r) for r in front_ties],
            [r.value(report.metric) for r in front_ties],
            marker="o",
            s=150,
            facecolors="none",
            edgecolors="tab:red",
            linestyles=":",
            zorder=2,
            label="off the front, tied with what beats it",
        ).set_gid("front-ties")
        data["front_tied"] = [r.label for r in front_ties]
    if configurations or duplicates:
        ax.legend(loc="best", fontsize=8)
        ax.margins(0.15)
    else:
        ax.text(
            0.5,
            0.5,
            f"no completed run with a measured {header} and peak memory",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel(f"peak memory per rank ({unit}, max over ranks)")
    ax.set_ylabel(f"{header}: median over repeats of run medians")
    runs = len(report.completed) - len(report.duplicates)
    ax.set_title(
        f"{header} vs peak memory per rank: {len(configurations)} configurations from {runs} runs, "
        f"{int(CONFIDENCE * 100)}% intervals"
    )
    ax.grid(True, alpha=0.3)

    for index, key in enumerate(bar_keys):
        # The panels of a row share its width: a row of one or two panels leaves no empty slot beside them.
        row = index // BARS_PER_ROW
        in_row = min(BARS_PER_ROW, len(bar_keys) - row * BARS_PER_ROW)
        bar_ax = fig.add_subplot(grid[1 + row, :].subgridspec(1, in_row)[0, index % BARS_PER_ROW])
        options = report.option_means[key]
        positions = range(len(options))
        bars = bar_ax.bar(positions, [median for _, median, _ in options], color="tab:blue")
        bar_ax.bar_label(
            bars, labels=[f"{fmt_metric(report.metric, m)}\n{n} run{'s' * (n > 1)}" for _, m, n in options], fontsize=7
        )
        bar_ax.set_xticks(
            list(positions), [o for o, _, _ in options], rotation=20 if len(options) > 3 else 0, fontsize=8
        )
        bar_ax.set_title(f"{key}: median {header}", fontsize=9)
        bar_ax.margins(y=0.25)
        data["bars"][key] = [{"option": o, "median": m, "runs": n} for o, m, n in options]
    return fig, data


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def plotted_point_count(fig: Figure) -> int:
    """Markers on the scatter: configurations, duplicates and single repeats (not the Pareto rings, not the
    error bars): what a reader sees as points."""
    ax = next(a for a in fig.axes if a.get_gid() == "scatter")
    return sum(
        len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection) and c.get_gid() != "front-ties"
    )


def plotted_intervals(fig: Figure) -> list[tuple[float, float, float]]:
    """(x, low, high) of every error bar drawn on the scatter, read back from the figure."""
    ax = next(a for a in fig.axes if a.get_gid() == "scatter")
    bars = []
    for collection in ax.collections:
        if isinstance(collection, LineCollection) and str(collection.get_gid()).startswith("interval-"):
            bars += [
                (float(seg[0][0]), float(min(seg[0][1], seg[1][1])), float(max(seg[0][1], seg[1][1])))
                for seg in collection.get_segments()
            ]
    return bars


def plot_breakdown(report: Report) -> Optional[Figure]:
    """Why a configuration won: for each ranked configuration, its step's time in parts (compute, exposed
    collectives by kind, pipeline bubble, optimizer, the rest) as measured on its profiled step and as the
    step-time model predicts it, two stacked bars side by side; and its peak memory by phase, tracked against
    planned. None where no configuration has either (fsdp_exp.report.breakdown)."""
    from fsdp_exp.metrics.schema import PHASES
    from fsdp_exp.report.breakdown import TIME_PARTS

    rows = [r for r in report.ranked if r.breakdown]
    timed = [r for r in rows if any(r.breakdown["time_s"].values())]
    memory = [r for r in rows if any(v["measured"] is not None for v in r.breakdown["memory_gib"].values())]
    if not timed and not memory:
        return None
    fig = Figure(figsize=(12, 2.2 + 1.1 * max(len(rows), 2)), layout="constrained")
    time_ax, memory_ax = fig.subplots(1, 2, width_ratios=(3, 2))
    colors = dict(zip(TIME_PARTS, [f"C{i}" for i in range(len(TIME_PARTS))]))
    labels, positions = [], []
    drawn: set[str] = set()
    for i, row in enumerate(timed):
        for j, which in enumerate(("measured", "predicted")):
            parts = row.breakdown["time_s"][which]
            y = i * 3 + j
            labels.append(f"#{row.rank} {_short(row.label)}\n{which}" if j == 0 else which)
            positions.append(y)
            if parts is None:
                time_ax.text(0, y, " not predicted" if which == "predicted" else " not profiled", va="center")
                continue
            left = 0.0
            for part in TIME_PARTS:
                width = parts.get(part, 0.0)
                if width <= 0:
                    continue
                time_ax.barh(
                    y,
                    width,
                    left=left,
                    color=colors[part],
                    hatch="//" if which == "predicted" else None,
                    label=part if part not in drawn else None,
                    edgecolor="white",
                )
                drawn.add(part)
                left += width
    time_ax.set_yticks(positions, labels)
    time_ax.invert_yaxis()
    time_ax.set_xlabel("seconds per step (measured: a profiled step; predicted: hatched)")
    time_ax.set_title("Where the step's time went")
    if drawn:  # under the axis: the bars run to its right edge
        time_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize="small")
    width = 0.38
    peaks = [v[w] or 0.0 for r in memory for v in r.breakdown["memory_gib"].values() for w in ("measured", "predicted")]
    unit, scale = _memory_unit(peaks) if peaks else ("GiB", 1.0)
    for k, row in enumerate(memory):
        for j, which in enumerate(("measured", "predicted")):
            values = [(row.breakdown["memory_gib"][p][which] or 0.0) * scale for p in PHASES]
            xs = [p * (len(memory) + 1) + k for p in range(len(PHASES))]
            memory_ax.bar(
                [x + (j - 0.5) * width for x in xs],
                values,
                width,
                color=f"C{k}",
                hatch="//" if which == "predicted" else None,
                edgecolor="white",
                label=f"#{row.rank} {'tracked' if which == 'measured' else 'planned'}",
            )
    memory_ax.set_xticks([p * (len(memory) + 1) + (len(memory) - 1) / 2 for p in range(len(PHASES))], list(PHASES))
    memory_ax.set_ylabel(f"peak per rank by phase ({unit})")
    memory_ax.set_title("Where the peak memory sits (planned: hatched)")
    if memory:
        memory_ax.legend(fontsize="small")
    return fig


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"
