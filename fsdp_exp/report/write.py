"""Write the report's four files: report.png, report.html, report.json, report.csv."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict
from pathlib import Path

from matplotlib.figure import Figure

from fsdp_exp.report.html import render_html
from fsdp_exp.report.plots import plot_breakdown, png_bytes
from fsdp_exp.report.table import Report, Row, repeated

CSV_COLUMNS = [
    "kind",
    "rank",
    "label",
    "status",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "tflops_per_rank",
    "mfu",
    "metric",
    "ci_low",
    "ci_high",
    "interval_over",
    "interval_note",
    "repeat_count",
    "tied_with_best",
    "pareto_tied",
    "repeat",
    "repeat_of",
    "tokens_per_s_p10",
    "tokens_per_s_p90",
    "config_id",
    "step_time_s",
    "steps_measured",
    "peak_gib",
    "peak_source",
    "predicted_peak_gib",
    "final_loss",
    "world_size",
    "pareto",
    "duplicate_of",
    "error",
    "overrides",
    "path",
]


def csv_rows(report: Report) -> list[dict]:
    """One flat row each: the ranked configurations (in rank order; ``ci_low``/``ci_high`` are the interval of
    ``metric``), the runs of those measured more than once (``repeat``, with ``repeat_of`` naming the
    configuration; a configuration measured once is its run), then duplicates, then the rest."""

    def flat(row: Row, kind: str) -> dict:
        values = asdict(row)
        values["kind"] = kind
        values["metric"] = report.metric
        values["overrides"] = " ".join(row.overrides)
        return {k: values.get(k) for k in CSV_COLUMNS}

    return (
        [flat(r, "ranked") for r in report.ranked]
        + [flat(r, "repeat") for r in repeated(report)]
        + [flat(r, "duplicate") for r in report.duplicates]
        + [flat(r, "not_ranked") for r in report.not_ranked]
    )


def _replace(path: Path, data: bytes) -> None:
    # Write then rename: a report being rewritten never shows half a file to a browser or a reader.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_outputs(report: Report, fig: Figure, out_dir: Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = png_bytes(fig)
    paths = {name: out_dir / f"report.{name}" for name in ("png", "html", "json", "csv")}
    _replace(paths["png"], png)
    why = plot_breakdown(report)  # where each configuration's time and memory went, measured and predicted
    why_png = png_bytes(why) if why is not None else None
    _replace(paths["html"], render_html(report, png, why_png).encode())
    _replace(paths["json"], (json.dumps(report.as_dict(), indent=2) + "\n").encode())
    tmp = paths["csv"].with_name("report.csv.tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(report))
    os.replace(tmp, paths["csv"])
    if why_png is not None:
        paths["breakdown"] = out_dir / "report_breakdown.png"
        _replace(paths["breakdown"], why_png)
    return paths
