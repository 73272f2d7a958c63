"""What an offline W&B run holds and what a workspace spec names, read independently of fsdp_exp's code.

Offline runs are read with W&B's own reader (``wandb leet inspect --json <file.wandb>``: one record per
line; no server). A workspace spec is read in the wire format W&B saves (panels' ``config``, the runset's
filters, grouping and columns), not through the objects that built it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fsdp_exp.metrics.schema import ALL_METRICS

WANDB = Path(sys.executable).with_name("wandb")


def offline_folders(run_dir: Path) -> list[Path]:
    """A run folder's offline W&B folders, oldest first (the name starts with the start time)."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


def records(folder: Path) -> list[dict]:
    (log,) = Path(folder).glob("*.wandb")
    lines = subprocess.run(
        [str(WANDB), "leet", "inspect", "--json", str(log)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [json.loads(line) for line in lines]


def defined_metrics(recs: list[dict]) -> dict[str, dict]:
    """name -> its define_metric record (``{"name", "step_metric", "summary": {rule: true}, ...}``)."""
    return {r["metric"]["name"]: r["metric"] for r in recs if r["type"] == "metric"}


def summary(recs_in_order: list[list[dict]]) -> dict:
    """The summary the records leave once replayed in order (as ``wandb sync`` uploads a run's files), nulls
    included (``leet inspect --summary`` leaves them out)."""
    result: dict = {}
    for recs in recs_in_order:
        for r in recs:
            if r["type"] == "summary":
                result.update(r["summary"].get("update") or {})
    return result


def logged_config(recs: list[dict]) -> dict:
    """The W&B config the run started with (its ``run`` record)."""
    (run,) = [r["run"] for r in recs if r["type"] == "run"]
    return run["config"]["update"]


def has_config_path(config: dict, dotted: str) -> bool:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


# ------------------------------------------------------------------------------------ workspace specs
def spec_references(spec: dict) -> list[tuple[str, str]]:
    """Every (kind, name) the spec's panels and runs table name: kind is ``history`` (a logged metric),
    ``summary`` (a summary key), ``config`` (a config path, W&B's ``.value`` envelope removed) or ``run``
    (a run attribute such as displayName)."""
    found: list[tuple[str, str]] = []

    def accessor(text: str) -> tuple[str, str]:
        section, _, name = text.partition(":")
        if section == "config":
            top, _, rest = name.partition(".value")
            return "config", top + rest
        return section, name

    section = spec["spec"]["section"]
    for bank in section["panelBankConfig"]["sections"]:
        for panel in bank["panels"]:
            config, kind = panel["config"], panel["viewType"]
            if kind == "Run History Line Plot":
                found += [("history", m) for m in config["metrics"]]
                found.append(("history", config["xAxis"]))
            elif kind == "Bar Chart":
                for m in config["metrics"]:
                    assert m.startswith("summary_metrics."), m
                    found.append(("summary", m.removeprefix("summary_metrics.")))
            elif kind == "Scatter Plot":
                found += [accessor(config[axis]) for axis in ("xAxis", "yAxis")]
            elif kind == "Parallel Coordinates Plot":
                found += [accessor(c["accessor"]) for c in config["columns"]]
            else:
                raise AssertionError(f"a panel this reader does not know: {kind}")
    (runset,) = section["runSets"]
    found += [accessor(column) for column in runset["runFeed"]["columnOrder"]]
    found += [accessor(f"{key['section']}:{key['name']}") for key in runset["grouping"]]
    return found


def unknown_references(spec: dict, configs: list[dict]) -> list[str]:
    """What the spec names that no schema metric is (a history metric that is logged per step, a summary key
    as W&B keeps it: ``summary/*`` or ``<metric>.<its summary rule>``) and no config of ``configs`` has."""
    bad = []
    for kind, name in spec_references(spec):
        if kind == "history":
            ok = name == "_step" or (name in ALL_METRICS and ALL_METRICS[name].window != "run")
        elif kind == "summary":
            base, _, rule = name.rpartition(".")
            if name in ALL_METRICS:
                ok = ALL_METRICS[name].window == "run"
            else:
                ok = base in ALL_METRICS and ALL_METRICS[base].wandb_summary == rule != "none"
        elif kind == "config":
            ok = bool(configs) and all(has_config_path(c, name) for c in configs)
        else:
            ok = kind == "run" and name in ("displayName", "state")
        if not ok:
            bad.append(f"{kind}:{name}")
    return bad


def group_filter(spec: dict) -> list[tuple[str, str, object]]:
    """The runset's filters as (key, op, value), the disabled ones left out."""
    (runset,) = spec["spec"]["section"]["runSets"]
    filters = runset["filters"]
    assert filters["filterFormat"] == "filterV2", filters
    return [
        (f"{f['key']['section']}:{f['key']['name']}", f["op"], f["value"])
        for f in filters["filters"]
        if not f.get("disabled")
    ]
