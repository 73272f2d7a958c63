"""``report.html``: one self-contained file, safe to mail or attach to an issue.

No external assets: the figure is embedded as a base64 PNG, the style is inline, and the report's
rows are embedded once more as JSON (``<script type="application/json" id="report-data">``) so that a
script can read the page without parsing tables.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone
from typing import Optional
from html import escape

from fsdp_exp.report.breakdown import describe
from fsdp_exp.report.table import (
    METRICS,
    Report,
    caption,
    fmt_metric,
    repeat_cells,
    repeat_columns,
    repeated,
    table_cells,
    table_columns,
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0 2em; font-size: 0.9em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; vertical-align: top; }
th { background: #f3f3f3; }
td.text, th.text { text-align: left; }
tr.pareto td:first-child { font-weight: bold; color: #b00; }
p.caption { white-space: pre-line; color: #555; font-size: 0.85em; }
img { max-width: 100%; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""

_TEXT_COLUMNS = {
    "run",
    "peak from",
    "status",
    "same as",
    "error",
    "group",
    "option",
    "folder",
    "configuration",
    "interval over",
    "vs #1",
}


def _cls(column: str) -> str:
    return ' class="text"' if column in _TEXT_COLUMNS else ""


def _table(columns: list[str], rows: list[list[str]], row_classes: list[str] | None = None, table_id: str = "") -> str:
    head = "".join(f"<th{_cls(c)}>{escape(c)}</th>" for c in columns)
    body = []
    for index, cells in enumerate(rows):
        cls = f' class="{row_classes[index]}"' if row_classes and row_classes[index] else ""
        body.append(
            f"<tr{cls}>" + "".join(f"<td{_cls(c)}>{escape(str(v))}</td>" for c, v in zip(columns, cells)) + "</tr>"
        )
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(report: Report, png: bytes, breakdown_png: Optional[bytes] = None) -> str:
    header = METRICS[report.metric].header
    sections = [
        f"<h1>fsdp_exp report</h1><p>{escape(', '.join(report.sources))}<br>"
        f"generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</p>",
        f'<img alt="{escape(header)} vs peak memory per rank" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">',
        f"<h2>Ranked by {escape(header)}</h2>",
        _table(
            table_columns(report),
            [table_cells(report, r) for r in report.ranked],
            ["pareto" if r.pareto else "" for r in report.ranked],
            table_id="ranked",
        ),
        f'<p class="caption">{escape(caption(report))}</p>',
    ]
    if breakdown_png is not None:  # why: each configuration's time and memory in parts, measured and predicted
        lines = [line for r in report.ranked if r.breakdown for line in describe(f"#{r.rank} {r.label}", r.breakdown)]
        sections += [
            "<h2>Where the time and the memory went (measured against predicted)</h2>",
            f'<img alt="time and memory by part, measured and predicted" src="data:image/png;base64,'
            f'{base64.b64encode(breakdown_png).decode()}">',
            "<pre>" + escape("\n".join(lines)) + "</pre>",
        ]
    runs = repeated(report)
    if runs:
        sections += [
            "<h2>Runs of the configurations measured more than once</h2>",
            _table(
                repeat_columns(report) + ["folder"],
                [repeat_cells(report, r) + [r.path] for r in runs],
                table_id="repeats",
            ),
        ]
    if report.duplicates:
        sections += [
            "<h2>Same applied settings as a ranked run (counted once)</h2>",
            _table(
                ["run", "same as", header, "folder"],
                [
                    [r.label, r.duplicate_of, fmt_metric(report.metric, r.value(report.metric)), r.path]
                    for r in report.duplicates
                ],
                table_id="duplicates",
            ),
        ]
    if report.not_ranked:
        sections += [
            "<h2>Not ranked: failed, interrupted or incomplete runs</h2>",
            _table(
                ["run", "status", "error", "folder"],
                [[r.label, r.status, r.error or "", r.path] for r in report.not_ranked],
                table_id="not-ranked",
            ),
        ]
    if report.option_means:
        sections += [
            f"<h2>Median {escape(header)} by option (the ranking's statistic)</h2>",
            _table(
                ["group", "option", "runs", header],
                [
                    [key, o, n, fmt_metric(report.metric, m)]
                    for key, options in report.option_means.items()
                    for o, m, n in options
                ],
                table_id="option-means",
            ),
        ]
    # "</" inside a script element would end it early; JSON allows the escaped form.
    data = json.dumps(report.as_dict(), indent=1).replace("</", "<\\/")
    sections.append(f'<script type="application/json" id="report-data">\n{data}\n</script>')
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>fsdp_exp report</title><style>{STYLE}</style></head><body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
