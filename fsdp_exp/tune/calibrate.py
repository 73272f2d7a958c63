"""Fit the step-time model to measured runs, and cache the fit per device (``tune.calibrate_from=<sweep>``), or
to a published table (``tune.calibrate_from=benchmarks/published``: ``calibrate_published``).

Every completed run of the sweep is read back (``run.json``: its config, topology, device and median
tokens/s) and the repeats of a configuration become one sample (the median of their medians); the model
counts what each configuration's step did (``step_time.costs_for``, from the config alone; a pipeline run's stages
too) and times it with
the device's figures. The fit changes the figures the model is least sure of, in log space, to minimise
the mean absolute error of tokens/s (the error ``tune.json`` reports):

- ``efficiency``: the share of the peak the matmuls reach;
- ``intra.latency_us``, ``intra.gbps`` (and ``inter.*`` when some run's groups spanned nodes): the
  alpha-beta figures of each link, backend software per collective included;
- ``dispatch_us`` and ``step_overhead_ms``: the host's cost per operator and per step.

A sweep of n configurations fits the first n - 1 of them in the order of ``PARAMS`` (efficiency first, then
the latency of the node's link, ...): fewer figures than measurements, so the fit cannot simply reproduce
them.

A weak prior (a factor of 10 in a figure costs as much as 0.01% of error) keeps a figure the runs cannot
tell apart near its data-sheet or probed value. The search is Nelder-Mead over the log figures.
The fit is cached in ``$XDG_CACHE_HOME/fsdp_exp/tune_calibration.json`` under the device's key (the GPU's
table name; for a CPU host its model, ranks per node, threads per rank and torch version), with the sweep
it came from and the mean absolute error of tokens/s before and after; later predictions for that device
use it and say so.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from fsdp_exp.cache import read_entry, write_entry
from fsdp_exp.errors import fail

if TYPE_CHECKING:
    from fsdp_exp.plan.devices import DevicePerf

# In the order they are fitted: a sweep of n configurations fits the first n - 1 (fewer figures than
# measurements, so that the fit cannot merely reproduce them).
PARAMS = (
    "efficiency",
    "intra.latency_us",
    "step_overhead_ms",
    "dispatch_us",
    "intra.gbps",
    "inter.latency_us",
    "inter.gbps",
)
PRIOR_WEIGHT = 1e-4  # per (ln 10)^2 of a figure's change, against the relative mean absolute error
BOUNDS = {"efficiency": (1e-4, 1.0), "attention_efficiency": (1e-4, 1.0)}
# A published table (benchmarks/published/*.csv) fits the kernel figures the data sheets cannot tell
# (fsdp_exp/plan/devices.py FITTED_A100 says what each is); its runs do not tell the links apart.
PUBLISHED_PARAMS = ("efficiency", "attention_efficiency")


def cache_path() -> Path:
    from fsdp_exp.metrics.flops import cache_path as peak_cache

    return peak_cache().with_name("tune_calibration.json")


def load(key: str) -> Optional[dict]:
    return read_entry(cache_path(), key)


def save(key: str, entry: dict) -> None:
    write_entry(cache_path(), key, entry)


def value(perf: "DevicePerf", name: str) -> float:
    """A figure by name: ``efficiency``, a link's ``intra.gbps``, or a table's entry ``unit_us.flat``."""
    link, _, field = name.partition(".")
    if not field:
        return getattr(perf, name)
    holder = getattr(perf, link)
    return holder.get(field, 0.0) if isinstance(holder, dict) else getattr(holder, field)


def apply(perf: "DevicePerf", params: dict) -> "DevicePerf":
    """``perf`` with the fitted figures in place (the sources say so)."""
    changes: dict = {}
    for name, fitted in params.items():
        link, _, field = name.partition(".")
        if field and isinstance(getattr(perf, link), dict):
            changes[link] = {**changes.get(link, getattr(perf, link)), field: fitted}
        elif field:
            current = changes.get(link, getattr(perf, link))
            changes[link] = dataclasses.replace(
                current,
                **{field: fitted},
                source=current.source + " (calibrated)" if "(calibrated)" not in current.source else current.source,
            )
        else:
            changes[name] = fitted
    return dataclasses.replace(perf, **changes)


# ------------------------------------------------------------------------------------------------- fitting
def nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.7, iterations: int = 600, tolerance: float = 1e-10
) -> np.ndarray:
    """The minimum of ``f`` near ``x0`` by the Nelder-Mead simplex (reflect, expand, contract, shrink)."""
    n = len(x0)
    points = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(p) for p in points]
    for _ in range(iterations):
        order = np.argsort(values)
        points, values = [points[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tolerance:
            break
        centroid = np.mean(points[:-1], axis=0)
        reflected = centroid + (centroid - points[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - points[-1])
            fe = f(expanded)
            points[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            points[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (points[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                points[-1], values[-1] = contracted, fc
            else:
                points = [points[0] + 0.5 * (p - points[0]) for p in points]
                values = [f(p) for p in points]
    return points[int(np.argmin(values))]


def fit(samples: list, perf: "DevicePerf", names: tuple[str, ...], relative: bool = False) -> tuple[dict, float, float]:
    """(fitted figures, MAE of tokens/s before, after) for ``samples`` of (costs, measured tokens/s), or of
    (costs, tokens/s, the DevicePerf of that run: its own network) where runs differ in more than the fit; costs
    as ``step_time.costs_for`` counts them (``StepCosts``, or a pipeline run's ``PipelineCosts``).

    The objective is the mean absolute error of tokens/s relative to the mean measured (the error the tuner
    reports), or with ``relative`` the mean |log(predicted / measured)| (a published record whose runs span
    three orders of magnitude of tokens/s: each run counts alike), plus the prior; the search starts at the
    prior, so the error after is never above the error before on these samples."""
    from fsdp_exp.tune.step_time import time_costs

    x0 = np.array([math.log(value(perf, n) or 1e-9) for n in names])
    measured = np.array([s[1] for s in samples])

    def predicted(x: np.ndarray) -> np.ndarray:
        params = {}
        for n, v in zip(names, x):
            low, high = BOUNDS.get(n, (1e-9, 1e12))
            params[n] = min(max(math.exp(v), low), high)
        return np.array([time_costs(s[0], apply(s[2] if len(s) > 2 else perf, params)).tokens_per_s for s in samples])

    scale = float(np.mean(measured))

    def loss(x: np.ndarray) -> float:
        p = predicted(x)
        error = np.mean(np.abs(np.log(p / measured))) if relative else np.mean(np.abs(p - measured)) / scale
        return float(error + PRIOR_WEIGHT * np.sum(((x - x0) / math.log(10)) ** 2))

    best = nelder_mead(loss, x0)
    params = {
        n: min(max(math.exp(v), BOUNDS.get(n, (1e-9, 1e12))[0]), BOUNDS.get(n, (1e-9, 1e12))[1])
        for n, v in zip(names, best)
    }
    before = float(np.mean(np.abs(predicted(x0) - measured)))
    after = float(np.mean(np.abs(predicted(best) - measured)))
    return params, before, after


# ------------------------------------------------------------------------------------------- the sweep
def run_samples(sweep_dir: Path) -> dict[str, dict]:
    """The sweep's configurations by device key: {key: {"samples", "perf", "runs"}}. A configuration measured
    several times (``trainer.repeat``, fsdp_exp.report.repeats) is one sample: the median of its runs' medians,
    as the tuner and the report compare it."""
    from fsdp_exp.config import to_run_config
    from fsdp_exp.config.topology import Topology
    from fsdp_exp.plan.devices import table_device
    from fsdp_exp.report.load import load_runs
    from fsdp_exp.report.repeats import group_repeats
    from fsdp_exp.tune.step_time import costs_for
    from fsdp_exp.tune.probe import block_shape, cpu_perf, probe_key

    groups: dict[str, dict] = {}
    runs = [
        r
        for r in load_runs([sweep_dir])
        if r.status == "completed"
        and r.config
        and r.topology
        and isinstance(r.summary.get("summary/tokens_per_s_median"), (int, float))
    ]
    for members in group_repeats(runs):
        run = runs[members[0]]
        tokens = statistics.median(runs[i].summary["summary/tokens_per_s_median"] for i in members)
        cfg = to_run_config(run.config)
        topology = Topology.from_dict(run.topology)
        if run.env.get("device_type") == "cuda":
            device = table_device(" ".join(run.env.get("devices") or []))
            if device is None:
                continue
            key, perf = device.name, device.perf
        else:
            threads = int(run.env.get("threads_per_rank") or 1)
            key = probe_key(topology.nproc_per_node, threads)
            perf = cpu_perf(topology.nproc_per_node, threads, block_shape(cfg))[0]
        # A mixture of experts' routing as measured (summary/moe_load_imbalance_median): the step it times is the
        # step that ran, so the fit does not absorb the imbalance into the device's figures, and it is carried
        imbalances = [
            float(runs[i].summary["summary/moe_load_imbalance_median"])
            for i in members
            if isinstance(runs[i].summary.get("summary/moe_load_imbalance_median"), (int, float))
        ]
        imbalance = max(1.0, statistics.median(imbalances)) if imbalances else 1.0
        group = groups.setdefault(key, {"samples": [], "perf": perf, "runs": [], "expert_imbalance": []})
        group["samples"].append((costs_for(cfg, topology, imbalance), float(tokens)))
        group["runs"] += [runs[i].path for i in members]
        group["expert_imbalance"] += imbalances
    return groups


def is_published(path: Path) -> bool:
    """A published table (a CSV file, or a folder of them and no run records), not a measured sweep."""
    from fsdp_exp.record.run_record import RUN_RECORD

    path = Path(path)
    return path.suffix == ".csv" or (path.is_dir() and any(path.glob("*.csv")) and not any(path.rglob(RUN_RECORD)))


def calibrate_published(path: Path) -> dict[str, dict]:
    """Fit ``PUBLISHED_PARAMS`` per device to the published runs of ``path`` (fsdp_exp.tune.published) and cache
    them like a sweep's fit: in relative error, the runs' own networks kept."""
    from fsdp_exp.tune.published import step_samples

    groups = step_samples([Path(path)])
    if not groups:
        fail(
            f"tune.calibrate_from={path}: no published run there that fsdp_exp can express.",
            "pass a table with the columns of benchmarks/published/README.md (e.g. benchmarks/published)",
        )
    cached = {}
    for key, group in groups.items():
        params, before, after = fit(group["samples"], group["perf"], PUBLISHED_PARAMS, relative=True)
        entry = {
            "params": params,
            "from": str(Path(path).resolve()),
            "runs": group["runs"],
            "configurations": len(group["samples"]),
            "mae_tokens_per_s_before": before,
            "mae_tokens_per_s_after": after,
            "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "prior": {n: value(group["perf"], n) for n in PUBLISHED_PARAMS},
            "published": True,
        }
        save(key, entry)
        cached[key] = entry
    return cached


def _spans_nodes(costs) -> bool:
    """Whether a step's collectives cross nodes: a one-stage step's (``StepCosts``), or a pipeline's
    (``PipelineCosts``: each pp rank's FSDP2 collectives and the sends between stages)."""
    if hasattr(costs, "traffic"):
        return any(t.nodes > 1 for t in costs.traffic)
    return any(t.nodes > 1 for r in costs.ranks for t in r.traffic) or any(b.nodes > 1 for b in costs.boundaries)


def calibrate_from(sweep_dir: Path) -> dict[str, dict]:
    """Fit and cache per device; returns what was cached, by device key. ``sweep_dir`` may be a published table
    instead (``is_published``)."""
    if is_published(sweep_dir):
        return calibrate_published(sweep_dir)
    groups = run_samples(sweep_dir)
    if not groups:
        fail(
            f"tune.calibrate_from={sweep_dir}: no completed run with a record to fit to.",
            "pass the folder of a sweep whose runs completed (tune.run=true writes <tune.out>/sweep)",
        )
    cached = {}
    for key, group in groups.items():
        spans_nodes = any(_spans_nodes(costs) for costs, _ in group["samples"])
        names = tuple(n for n in PARAMS if spans_nodes or not n.startswith("inter."))
        names = names[: max(1, len(group["samples"]) - 1)]
        params, before, after = fit(group["samples"], group["perf"], names)
        entry = {
            "params": params,
            "from": str(Path(sweep_dir).resolve()),
            "runs": len(group["runs"]),
            "configurations": len(group["samples"]),
            "mae_tokens_per_s_before": before,
            "mae_tokens_per_s_after": after,
            "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "prior": {n: value(group["perf"], n) for n in names},
        }
        if group["expert_imbalance"]:  # the MoE runs' measured expert load: later searches plan and time with it
            entry["expert_imbalance"] = statistics.median(group["expert_imbalance"])
        save(key, entry)
        cached[key] = entry
    return cached
