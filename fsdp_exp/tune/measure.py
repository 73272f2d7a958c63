"""Measure what can win: the best predicted candidates and the baselines, each with repeats, in one sweep.

A multirun is a Cartesian product, and k unrelated candidates are not one grid. So each chosen candidate
becomes an option of a config group written in the tune folder (``<tune.out>/conf/tune_candidate/<id>.yaml``,
a ``# @package _global_`` file that selects the candidate's presets with ``override /<group>: <option>`` and
sets its keys), the folder joins Hydra's search path (``--config-dir``), and the sweep runs over that one group:

    python -m fsdp_exp --config-dir <tune.out>/conf -m +tune_candidate=c0003,c0017,...
        trainer.repeat=0,1,2 hydra.sweep.dir=<tune.out>/sweep <the run's overrides>

exactly those candidates, each ``tune.repeats`` times, repeats interleaved (fsdp_exp's sweeper), locally or
on SLURM (``hydra/launcher=slurm`` among the run's overrides). Each run records its candidate as the
``tune_candidate`` choice, which is how the results find their way back.

Reading back: per candidate, the median over its runs of each run's median tokens/s with the report's 95%
bootstrap interval (``fsdp_exp.report.intervals``), its measured peak (the report's choice of source),
then the Spearman rank correlation of predicted and measured tokens/s over the measured candidates, the
measured winner, and whether the predicted winner ties with it (the intervals overlap) or is it.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from fsdp_exp.errors import fail
from fsdp_exp.tune.recommend import eligible

if TYPE_CHECKING:
    from fsdp_exp.tune.options import TuneOptions
    from fsdp_exp.tune.search import Tuning

GROUP = "tune_candidate"


def choose(tuning: "Tuning", opts: "TuneOptions") -> list[str]:
    """The candidates to measure, by id: the top k, the baselines, ``tune.spread`` more evenly over the
    ranking, and ``tune.extra``. Each gets its roles."""
    from fsdp_exp.tune.search import time_candidate

    ranked = tuning.ranked
    chosen: dict[str, None] = {}

    def take(cid: str, role: str) -> None:
        weighed = tuning.by_id(cid)
        chosen.setdefault(cid, None)
        time_candidate(weighed, tuning.perf, opts.expert_imbalance)
        if role not in weighed.roles:
            weighed.roles.append(role)

    # the top k of what a recommendation may be (fsdp_exp.tune.recommend.eligible: keeping the memory the rule
    # keeps free), so that the measurement includes the recommendation and no candidate the rule would refuse
    for w in eligible(tuning)[: opts.top_k]:
        take(w.candidate.id, f"top {opts.top_k}")
    for name, cid in tuning.baselines.items():
        if cid is not None:
            take(cid, f"baseline: {name}")
    rest = [w for w in ranked if w.candidate.id not in chosen]
    if opts.spread and rest:
        step = len(rest) / opts.spread
        for i in range(min(opts.spread, len(rest))):
            take(rest[min(len(rest) - 1, int((i + 0.5) * step))].candidate.id, "spread")
    known = {w.candidate.id for w in tuning.candidates}
    for cid in opts.extra:
        if cid not in known:
            fail(
                f"tune.extra names {cid}, which is not a candidate of this space.",
                f"pass ids from tune.json (c0000 to c{len(known) - 1:04d})",
            )
        if tuning.by_id(cid).refused:
            fail(
                f"tune.extra names {cid}, which preflight refuses: {tuning.by_id(cid).refused}",
                "pass a candidate that can run",
            )
        take(cid, "extra")
    return list(chosen)


def candidate_yaml(choices: list[str]) -> str:
    """The candidate's overrides as a global config: group choices become defaults overrides, keys values."""
    import yaml

    groups = [c for c in choices if "." not in c.partition("=")[0]]
    values: dict = {}
    for choice in choices:
        key, _, raw = choice.partition("=")
        if "." not in key:
            continue
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    lines = ["# @package _global_", "# written by python -m fsdp_exp.tune: " + " ".join(choices), "defaults:"]
    lines += [f"  - override /{g.partition('=')[0]}: {g.partition('=')[2]}" for g in groups] + ["  - _self_"]
    return "\n".join(lines) + "\n" + (yaml.safe_dump(values, sort_keys=False) if values else "")


def write_group(tuning: "Tuning", ids: list[str], out: Path) -> Path:
    folder = out / "conf" / GROUP
    folder.mkdir(parents=True, exist_ok=True)
    for cid in ids:
        (folder / f"{cid}.yaml").write_text(candidate_yaml(tuning.by_id(cid).candidate.choices))
    return out / "conf"


def sweep_command(tuning: "Tuning", ids: list[str], out: Path, repeats: int) -> list[str]:
    """``--config-dir`` adds the tune folder to Hydra's search path from the start, so that the sweep's own
    checks (fsdp_exp.sweep) know the group's options as they know the shipped ones."""
    repeat = f"trainer.repeat={','.join(map(str, range(repeats)))}"
    return [
        sys.executable,
        "-m",
        "fsdp_exp",
        "--config-dir",
        str((out / "conf").resolve()),
        "-m",
        f"+{GROUP}={','.join(ids)}",
        repeat,
        f"hydra.sweep.dir={(out / 'sweep').resolve()}",
        *tuning.overrides,
    ]


def shown(command: list[str]) -> str:
    return shlex.join(["python", *command[1:]])


def run_sweep(command: list[str], to_stderr: bool = False) -> int:
    """Run the sweep as a user would (its jobs' output goes to the console, or to stderr when stdout is for
    tune.format=json); its exit status."""
    return subprocess.run(command, stdout=sys.stderr if to_stderr else None).returncode


# ------------------------------------------------------------------------------------------- reading back
def collect(tuning: "Tuning", ids: list[str], sweep_dir: Path) -> dict:
    """Fill ``measured`` of each measured candidate from the sweep's records; the comparison."""
    from fsdp_exp.report.intervals import estimate
    from fsdp_exp.report.load import NoRuns, load_runs
    from fsdp_exp.report.repeats import measured_step_values
    from fsdp_exp.metrics.peak import measured_peak
    from fsdp_exp.report.table import METRICS

    try:
        runs = load_runs([sweep_dir])
    except NoRuns:
        runs = []
    by_candidate: dict[str, list] = {}
    for run in runs:
        cid = run.choices.get(GROUP)
        if cid in ids:
            by_candidate.setdefault(cid, []).append(run)
    for cid in ids:
        weighed = tuning.by_id(cid)
        done = [
            r
            for r in by_candidate.get(cid, [])
            if r.status == "completed" and isinstance(r.summary.get("summary/tokens_per_s_median"), (int, float))
        ]
        failed = [r for r in by_candidate.get(cid, []) if r not in done]
        if not done:
            weighed.measured = {
                "tokens_per_s": None,
                "tokens_per_s_ci": None,
                "peak_gib": None,
                "errors": [r.error or r.status for r in failed] or ["no run recorded"],
            }
            continue
        medians = [float(r.summary["summary/tokens_per_s_median"]) for r in done]
        steps = measured_step_values(done[0], METRICS["tokens_per_s"].step_key)[0] if len(done) == 1 else None
        found = estimate(medians, steps)
        peaks = [measured_peak(r.summary, r.last_value, r.record.get("memory_breakdown")) for r in done]
        known = [p for p, _ in peaks if p is not None]
        weighed.measured = {
            "tokens_per_s": found.median,
            "tokens_per_s_ci": [found.low, found.high] if found.has_interval else None,
            "interval_over": found.over,
            "runs": len(done),
            "failed": len(failed),
            "peak_gib": statistics.median(known) if known else None,
            "peak_source": next((s for p, s in peaks if p is not None), None),
            "run_dirs": [r.path for r in done],
            "errors": [r.error or r.status for r in failed],
        }
    return compare(tuning)


def spearman(x: list[float], y: list[float]) -> Optional[float]:
    """Spearman's rank correlation (ties share their mean rank); None below 3 points or for a constant."""
    if len(x) < 3:
        return None

    def ranks(values: list[float]) -> np.ndarray:
        values = np.asarray(values, dtype=float)
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        out[order] = np.arange(len(values), dtype=float)
        for v in np.unique(values):  # ties: the mean of their ranks
            out[values == v] = out[values == v].mean()
        return out

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _estimate(measured: dict):
    from fsdp_exp.report.intervals import Estimate

    ci = measured.get("tokens_per_s_ci") or [None, None]
    return Estimate(measured["tokens_per_s"], ci[0], ci[1], measured.get("interval_over"), measured.get("runs") or 1)


def compare(tuning: "Tuning") -> dict:
    """Spearman, the winners and the mean absolute error over the candidates measured with a prediction."""
    from fsdp_exp.report.intervals import overlap

    done = [w for w in tuning.candidates if w.measured and w.measured.get("tokens_per_s") and w.prediction]
    if not done:
        return {"spearman": None, "winner": None, "mae_tokens_per_s": None}
    rho = spearman([w.prediction.tokens_per_s for w in done], [w.measured["tokens_per_s"] for w in done])
    best = max(done, key=lambda w: w.measured["tokens_per_s"])
    predicted = min(done, key=lambda w: w.rank or 1 << 30)
    ties = True if predicted is best else overlap(_estimate(predicted.measured), _estimate(best.measured))
    verdict = (
        "the predicted winner is the measured winner"
        if predicted is best
        else "the predicted winner ties with the measured winner (intervals overlap)"
        if ties
        else "the predicted winner is slower than the measured winner (intervals apart)"
        if ties is False
        else "the predicted winner is slower; no interval to say whether it ties (measure with repeats)"
    )
    mae = float(np.mean([abs(w.prediction.tokens_per_s - w.measured["tokens_per_s"]) for w in done]))
    return {
        "spearman": rho,
        "winner": {
            "predicted": predicted.candidate.id,
            "measured": best.candidate.id,
            "predicted_ties_measured": ties,
            "verdict": verdict,
        },
        "mae_tokens_per_s": mae,
        "measured_candidates": len(done),
    }


def carry_measurements(tuning: "Tuning", previous: Path) -> int:
    """Copy the measurements of an earlier ``tune.json`` onto the same candidates (same choices) of this one:
    after a calibration, the same space predicted again is compared with the same measurements."""
    import json

    try:
        data = json.loads(Path(previous).read_text())
    except (OSError, ValueError):
        return 0
    measured = {tuple(c["choices"]): c["measured"] for c in data.get("candidates", []) if c.get("measured")}
    carried = 0
    for w in tuning.candidates:
        if tuple(w.candidate.choices) in measured:
            w.measured = measured[tuple(w.candidate.choices)]
            w.roles.append("measured before")
            carried += 1
    return carried


def budget_check(tuning: "Tuning") -> Optional[dict]:
    """Measured peaks against the memory limit, judged only where the prediction is clear of it by 5% or more:
    a candidate predicted to fit must measure under the limit, one predicted over must measure over. Within
    5% a candidate is borderline (listed, not judged). Backends whose peak torch's tracker cannot measure
    are left out, named."""
    from fsdp_exp.units import GIB

    limit = tuning.limit_bytes / GIB
    held, broken, borderline, left_out = [], [], [], {}
    for w in tuning.candidates:
        m = w.measured
        if not m or m.get("peak_gib") is None:
            continue
        if not w.tracks_memory or m.get("peak_source") == "model states":
            left_out.setdefault(w.candidate.cfg.sharding.backend, []).append(w.candidate.id)
            continue
        need = w.need_bytes if w.need_bytes is not None else w.floor_bytes
        entry = {
            "id": w.candidate.id,
            "predicted_gib": need / GIB,
            "measured_gib": m["peak_gib"],
            "headroom": w.headroom,
        }
        if w.borderline:
            borderline.append(entry)
        elif (w.fits and m["peak_gib"] <= limit) or (not w.fits and m["peak_gib"] > limit):
            held.append(entry)
        else:
            broken.append(entry)
    return {
        "limit": tuning.limit_name,
        "limit_gib": limit,
        "held": held,
        "broken": broken,
        "borderline": borderline,
        "left_out": {
            b: f"{len(ids)} candidate(s): torch's tracker cannot measure sharding.backend={b}"
            for b, ids in left_out.items()
        },
    }
