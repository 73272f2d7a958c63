"""The report's figure: throughput against peak memory per rank with the Pareto front, and per-option bars.

Built on a bare ``matplotlib.figure.Figure`` (no pyplot): no global figure state, no GUI backend, the same
figure in a terminal, a test and a notebook. ``plot_report`` returns the figure and the data it drew, so
that callers (the HTML, the tests) can check what is on it without reading pixels.
"""

from __future__ import annotations

import io
import math

from matplotlib.figure import Figure

from fsdp_exp.report.table import METRICS, Report, fmt_metric

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


def plot_report(report: Report) -> tuple[Figure, dict]:
    """The figure and what it shows: ``points`` (one per completed run), ``front`` and ``bars``."""
    header = METRICS[report.metric].header
    bar_keys = list(report.option_means)
    bar_rows = math.ceil(len(bar_keys) / BARS_PER_ROW)
    fig = Figure(figsize=(12, 6 + 3.6 * bar_rows), layout="constrained")
    grid = fig.add_gridspec(1 + bar_rows, BARS_PER_ROW, height_ratios=[2.0] + [1.0] * bar_rows)
    ax = fig.add_subplot(grid[0, :])
    ax.set_gid("scatter")

    points = [r for r in report.completed if r.peak_gib is not None and r.value(report.metric) is not None]
    unit, scale = _memory_unit([r.peak_gib for r in points])
    data = {"metric": report.metric, "memory_unit": unit, "points": [], "front": [], "bars": {}}
    named = len(points) <= MAX_NAMED_POINTS
    ranks = {r.label: r.rank for r in report.ranked}
    # One scatter call per (kind of peak, duplicate or not) so that each gets one legend entry.
    for source in MARKERS:
        for duplicate in (False, True):
            group = [r for r in points if r.peak_source == source and (r.duplicate_of is not None) == duplicate]
            if not group:
                continue
            what = f"peak from {source}" if source else "peak unknown"
            ax.scatter([r.peak_gib * scale for r in group], [r.value(report.metric) for r in group],
                       marker=MARKERS[source], s=60, zorder=3,
                       facecolors="none" if duplicate else "tab:blue", edgecolors="tab:blue",
                       label=f"{what}, same settings as a ranked run" if duplicate else what)
    for r in points:
        x, y = r.peak_gib * scale, r.value(report.metric)
        if named:
            text = r.label if r.duplicate_of is None else f"{r.label} (= {r.duplicate_of})"
        else:
            text = f"#{r.rank}" if r.duplicate_of is None else f"=#{ranks.get(r.duplicate_of)}"
        ax.annotate(text, (x, y), xytext=(5, 5), textcoords="offset points", fontsize=8)
        data["points"].append({"label": r.label, "peak": x, "value": y, "peak_source": r.peak_source,
                               "duplicate_of": r.duplicate_of, "pareto": r.pareto})

    front = sorted((r for r in report.ranked if r.pareto), key=lambda r: r.peak_gib)
    if front:
        # A staircase: with memory up to the next front run's, the best throughput on offer is this run's.
        ax.plot([r.peak_gib * scale for r in front], [r.value(report.metric) for r in front], "--", color="tab:red",
                drawstyle="steps-post", marker="o", markersize=11, markerfacecolor="none", zorder=2,
                label="Pareto front (higher throughput, lower memory)")
        data["front"] = [r.label for r in front]
    if points:
        ax.legend(loc="best", fontsize=8)
        ax.margins(0.15)
    else:
        ax.text(0.5, 0.5, f"no completed run with a measured {header} and peak memory", ha="center",
                va="center", transform=ax.transAxes)
    ax.set_xlabel(f"peak memory per rank ({unit}, max over ranks)")
    ax.set_ylabel(f"{header} (median over measured steps)")
    ax.set_title(f"{header} vs peak memory per rank: {len(points)} completed runs")
    ax.grid(True, alpha=0.3)

    for index, key in enumerate(bar_keys):
        bar_ax = fig.add_subplot(grid[1 + index // BARS_PER_ROW, index % BARS_PER_ROW])
        options = report.option_means[key]
        positions = range(len(options))
        bars = bar_ax.bar(positions, [mean for _, mean, _ in options], color="tab:blue")
        bar_ax.bar_label(bars, labels=[f"{fmt_metric(report.metric, m)}\n{n} run{'s' * (n > 1)}"
                                       for _, m, n in options], fontsize=7)
        bar_ax.set_xticks(list(positions), [o for o, _, _ in options], rotation=20 if len(options) > 3 else 0,
                          fontsize=8)
        bar_ax.set_title(f"{key}: mean {header}", fontsize=9)
        bar_ax.margins(y=0.25)
        data["bars"][key] = [{"option": o, "mean": m, "runs": n} for o, m, n in options]
    return fig, data


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def plotted_point_count(fig: Figure) -> int:
    """Markers on the scatter (the Pareto line's rings are not counted): what a reader sees as runs."""
    ax = next(a for a in fig.axes if a.get_gid() == "scatter")
    return sum(len(c.get_offsets()) for c in ax.collections)
