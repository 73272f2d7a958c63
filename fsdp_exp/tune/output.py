"""What the tuner shows and writes: the ranked table (console), ``tune.json``, and once measured the figure of
predicted against measured tokens/s (``tune.png``) in a self-contained page (``tune.html``)."""

from __future__ import annotations

import base64
import json
import os
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fsdp_exp.tune.space import label
from fsdp_exp.units import GIB

if TYPE_CHECKING:
    from fsdp_exp.tune.search import Tuning, Weighed


def _gib(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    gib = n / GIB
    return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"


def _fits(w: "Weighed") -> str:
    if w.fits is None:
        return "refused"
    text = (
        (f"yes, {w.headroom:.0%} left" if w.headroom >= 0 else f"yes, {-w.headroom:.0%} over, in the planner's band")
        if w.fits
        else f"no, over by {-w.headroom:.0%}" + (" (a lower bound)" if w.floor_bytes is not None else "")
    )
    return text + (" (borderline)" if w.borderline else "")


def _tokens(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def candidate_json(w: "Weighed", tuning: "Tuning") -> dict:
    p = w.prediction
    return {
        "id": w.candidate.id,
        "overrides": tuning.overrides + w.candidate.choices,
        "choices": w.candidate.choices,
        "rank": w.rank,
        "roles": w.roles,
        "fits": bool(w.fits),
        "borderline": w.borderline,
        "headroom": w.headroom,
        "why_not": w.why_not(tuning.limit_name) or None,
        "predicted": {
            "peak_gib": None if w.need_bytes is None else w.need_bytes / GIB,
            "peak_at_least_gib": None if w.floor_bytes is None else w.floor_bytes / GIB,
            "peak_before_margin_gib": None if w.peak_bytes is None else w.peak_bytes / GIB,
            "tokens_per_s": p.tokens_per_s if p else None,
            "step_time_s": p.step_time_s if p else None,
            "mfu": p.mfu if p else None,
            "mfu_fp8": p.mfu_fp8 if p else None,  # precision=float8: against the FP8 peak
            "breakdown_s": p.breakdown if p else None,
            "comm_s": p.comm if p else None,
            "dominant": p.dominant if p else None,
            "explain": p.explain() if p else None,
        },
        "measured": w.measured,
    }


def tune_json(
    tuning: "Tuning", argv: list[str], measure: dict, comparison: Optional[dict], budget: Optional[dict]
) -> dict:
    from dataclasses import asdict

    from fsdp_exp.tune.recommend import recommend

    order = tuning.ranked + [w for w in tuning.candidates if w.rank is None]
    return {
        "command": "python -m fsdp_exp.tune " + " ".join(argv),
        "overrides": tuning.overrides,
        "device": {
            "name": tuning.device.name,
            "description": tuning.device.description,
            "kind": tuning.device.kind,
            "figures": asdict(tuning.perf),
            "source": tuning.perf_note,
            "calibration": tuning.calibration,
            "key": tuning.device_key,
        },
        "limit": {"name": tuning.limit_name, "gib_per_rank": tuning.limit_bytes / GIB},
        "space": {"values": tuning.space.values, "fixed": tuning.space.fixed, "notes": tuning.space.notes},
        "counts": tuning.counts(),
        "refusals": [{"reason": r, "candidates": n} for r, n in tuning.refusals(10)],
        "timing": tuning.timing,
        "baselines": tuning.baselines,
        "measure": measure,
        "candidates": [candidate_json(w, tuning) for w in order],
        "spearman": (comparison or {}).get("spearman"),
        "winner": (comparison or {}).get("winner")
        or {"predicted": tuning.ranked[0].candidate.id, "measured": None, "predicted_ties_measured": None},
        "mae_tokens_per_s": (comparison or {}).get("mae_tokens_per_s"),
        "budget_check": budget,
        "missing_packages": {m: {"needed_by": w, "install": i} for m, (w, i) in tuning.missing_packages.items()},
        "recommendation": recommend(tuning, argv),
    }


def write_json(data: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tune.json"
    tmp = path.with_name("tune.json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------- table
def rows_shown(tuning: "Tuning", show: int) -> list["Weighed"]:
    """The top ``show`` ranked, then every candidate with a role (baselines, measured) not among them."""
    top = tuning.ranked[:show]
    extra = [w for w in tuning.candidates if w.roles and w not in top]
    return top + sorted(extra, key=lambda w: (w.rank or 1 << 30, w.candidate.id))


# The table's columns, and the order they are dropped in when the terminal is too narrow for all of them: how
# the time splits first (tune.json keeps it), then the step time (tokens/s says it), the MFU, the id (the
# recommendation names the ids that matter), the role. The rank, the candidate, whether it fits, its peak and
# its tokens/s stay at any width.
COLUMNS = ("#", "id", "candidate", "fits", "peak/rank", "tokens/s", "step", "MFU", "where the time goes")
MEASURED_COLUMNS = ("measured tokens/s", "95% interval", "measured peak")
DROP_ORDER = ("where the time goes", "95% interval", "step", "MFU", "measured peak", "id", "role")
# The narrowest the wrapping columns may get before a column is dropped: below these a label breaks every word
# onto its own line. The longest single words of a label ("precision=float8_all_gather") still fold.
MIN_WIDTHS = {"candidate": 30, "fits": 13, "where the time goes": 22, "role": 11}


def render_table(tuning: "Tuning", show: int, width: Optional[int] = None):
    """The ranked candidates, each named by what it changes in the run as given (``recommend.differences``); at
    ``width`` columns, the columns of ``DROP_ORDER`` go first until the rest fits."""
    from fsdp_exp.narrow import fit_columns

    measured = any(w.measured for w in tuning.candidates)
    columns = list(COLUMNS) + (list(MEASURED_COLUMNS) if measured else []) + ["role"]
    if not any(w.roles for w in rows_shown(tuning, show)):
        columns.remove("role")
    if width is None:
        return _table(tuning, show, columns)
    return fit_columns(lambda kept: _table(tuning, show, kept), columns, DROP_ORDER, width)


def _table(tuning: "Tuning", show: int, columns: list[str]):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from fsdp_exp.tune.recommend import changes

    table = Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    wraps = ("candidate", "fits", "where the time goes", "role")
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in wraps + ("id",) else "right",
            overflow="fold",
            no_wrap=column not in wraps,
            min_width=MIN_WIDTHS.get(column),
        )
    for w in rows_shown(tuning, show):
        p, m = w.prediction, w.measured or {}
        ci = m.get("tokens_per_s_ci")
        cells = {
            "#": str(w.rank or "-"),
            "id": w.candidate.id,
            "candidate": label(changes(tuning, w)),
            "fits": _fits(w),
            "peak/rank": _gib(w.need_bytes),
            "tokens/s": _tokens(p.tokens_per_s) if p else "n/a",
            "step": f"{p.step_time_s:.3g} s" if p else "n/a",
            "MFU": f"{p.mfu:.0%}" if p and p.mfu is not None else "n/a",
            "where the time goes": (p.explain() if p else w.why_not(tuning.limit_name)),
            "measured tokens/s": _tokens(m.get("tokens_per_s")) if m else "",
            "95% interval": f"{_tokens(ci[0])} – {_tokens(ci[1])}" if ci else ("" if not m else "n/a"),
            "measured peak": _gib(m["peak_gib"] * GIB) if m.get("peak_gib") is not None else "",
            "role": ", ".join(w.roles),
        }
        table.add_row(*[Text(cells[c]) for c in columns])
    return table


def summary_lines(tuning: "Tuning") -> list[str]:
    c, t = tuning.counts(), tuning.timing
    rate = t.get("candidates_per_s_after_first")
    lines = [
        f"weighed {c['weighed']:,} candidates for {tuning.device.name} ({tuning.device.description}): "
        f"{c['refused']:,} refused by preflight, {c['over']:,} over {tuning.limit_name} "
        f"({tuning.limit_bytes / GIB:.3g} GiB per rank), {c['fit']:,} fit ({c['borderline']} within 5% of the "
        f"limit: borderline); {c['ranked']:,} ranked",
        f"in {t['total_s']:.1f} s ({t['cpu_s']:.1f} s of CPU): the first candidate {t['first_candidate_s']:.2f} s "
        f"(model on meta, inventory), then {rate:,.0f} candidates/s ({t['planned_per_s_after_first']:,.0f}/s "
        f"through the planner; per CPU second {t['candidates_per_cpu_s_after_first']:,.0f} and "
        f"{t['planned_per_cpu_s_after_first']:,.0f})"
        if rate
        else f"in {t['total_s']:.1f} s",
        "space: " + tuning.space.describe(),
    ]
    from fsdp_exp.tune.search import BASELINES

    for name, cid in tuning.baselines.items():
        if cid is None:
            lines.append(f"no {name} baseline: no candidate with {BASELINES[name]} can run and fit here")
    # the near-ties, preflight's refusals and the space's notes: the recommendation's lines (tune.recommend)
    cal = tuning.calibration
    lines.append(
        f"model: {tuning.perf_note}"
        + (
            f"; calibrated from {cal['runs']} runs ({cal.get('configurations', '?')} configurations) of {cal['from']} "
            f"(MAE {cal['mae_tokens_per_s_before']:,.0f} -> "
            f"{cal['mae_tokens_per_s_after']:,.0f} tokens/s)"
            if cal
            else "; not calibrated (tune.calibrate_from)"
        )
    )
    return lines


# ------------------------------------------------------------------------------------- predicted vs measured
def figure(tuning: "Tuning", comparison: dict):
    """Predicted against measured tokens/s of the measured candidates, with their intervals."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax = fig.add_subplot()
    points = [w for w in tuning.candidates if w.measured and w.measured.get("tokens_per_s") and w.prediction]
    points.sort(key=lambda w: w.measured["tokens_per_s"])
    xs = [w.prediction.tokens_per_s for w in points]
    ys = [w.measured["tokens_per_s"] for w in points]
    for i, (w, x, y) in enumerate(zip(points, xs, ys)):
        ci = w.measured.get("tokens_per_s_ci")
        err = [[y - ci[0]], [ci[1] - y]] if ci else None
        baseline = any(r.startswith("baseline") for r in w.roles)
        ax.errorbar(
            [x], [y], yerr=err, fmt="s" if baseline else "o", capsize=3, color="tab:orange" if baseline else "tab:blue"
        )
        # neighbours in measured tokens/s take turns above and below their point: labels do not print over
        # each other where points crowd
        ax.annotate(
            f"{w.candidate.id} (#{w.rank})",
            (x, y),
            textcoords="offset points",
            xytext=(6, 5 if i % 2 else -11),
            fontsize=8,
        )
    if xs:
        # zoomed to the measured points and the diagonal through them; logarithmic where they span more than a
        # factor of 10 (a slow baseline beside the fast candidates), so that no cluster sits in one corner
        low, high = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        if high / low > 10:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.plot([low, high], [low, high], ls="--", color="grey", lw=1, label="measured = predicted")
        ax.legend(loc="upper left")
    rho = comparison.get("spearman")
    winner = comparison.get("winner") or {}
    ax.set_title(f"{tuning.device.name}: Spearman {rho:.2f}" if rho is not None else tuning.device.name)
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s (median over repeats, 95% interval)")
    if winner:
        fig.suptitle(winner.get("verdict", ""), fontsize=9)
    return fig


def write_page(tuning: "Tuning", data: dict, out: Path) -> tuple[Path, Path]:
    from fsdp_exp.report.plots import png_bytes

    png = png_bytes(figure(tuning, data))
    png_path, html_path = out / "tune.png", out / "tune.html"
    png_path.write_bytes(png)
    rows = []
    for cand in data["candidates"]:
        if not cand["roles"]:
            continue
        p, m = cand["predicted"], cand["measured"] or {}
        ci = m.get("tokens_per_s_ci")
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{escape(str(v))}</td>"
                for v in (
                    cand["rank"],
                    cand["id"],
                    label(cand["choices"]),
                    ", ".join(cand["roles"]),
                    _tokens(p["tokens_per_s"]),
                    _tokens(m.get("tokens_per_s")),
                    f"{_tokens(ci[0])} – {_tokens(ci[1])}" if ci else "n/a",
                    _gib(p["peak_gib"] * GIB) if p["peak_gib"] is not None else "n/a",
                    _gib(m["peak_gib"] * GIB) if m.get("peak_gib") is not None else "n/a",
                    p["explain"] or "",
                )
            )
            + "</tr>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "#",
            "id",
            "candidate",
            "role",
            "predicted tokens/s",
            "measured tokens/s",
            "95% interval",
            "predicted peak",
            "measured peak",
            "predicted time",
        )
    )
    winner = data.get("winner") or {}
    html = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>fsdp_exp tune</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em}td,th{border-bottom:1px solid #ddd;padding:.3em .6em;"
        "text-align:left}table{border-collapse:collapse}img{max-width:100%}</style></head><body>"
        f"<h1>fsdp_exp tune: predicted vs measured</h1><p><code>{escape(data['command'])}</code></p>"
        f"<p>Spearman {data.get('spearman')}; {escape(str(winner.get('verdict', '')))}; "
        f"mean absolute error {data.get('mae_tokens_per_s')} tokens/s</p>"
        f"<img alt='predicted vs measured tokens/s' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        f"<script type='application/json' id='tune-data'>{escape(json.dumps(data, default=str))}</script>"
        "</body></html>"
    )
    html_path.write_text(html)
    return png_path, html_path
