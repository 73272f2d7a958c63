"""The W&B side of comparing runs, without a network or a process group: the summary rule of every metric
(declared by the schema), and the workspace built for a sweep of 4 jobs (composed with Hydra as the sweep
composes them).

The same checks run on a real sweep's offline W&B files in tests/integration/test_wandb_sync.py, and there
the sink gives W&B each metric's rule (a real offline W&B run: it starts W&B's service process).
"""

from __future__ import annotations

import itertools
import json

import pytest

from fsdp_exp.config import ConfigError, plain
from fsdp_exp.metrics.schema import ALL_METRICS, WANDB_SUMMARY_RULES, render_markdown
from fsdp_exp.report.load import Run
from fsdp_exp.report.wandb_workspace import (
    SPEC_FILE,
    build_workspace,
    keep_saved_view,
    read_spec,
    summary_name,
    sweep_view,
    write_spec,
)

from conftest import compose_config, run_config
from wandb_files import group_filter, spec_references, unknown_references

GROUP = "2026-11-30_09-00-00"
GRID = {"sharding": ["full", "grad_op"], "precision": ["fp32", "bf16"]}


def _job(overrides: list[str]) -> tuple[Run, dict]:
    """A job of the sweep as the report reads it back, and the W&B config the trainer gives its run
    (the resolved config plus the choices; fsdp_exp.trainer)."""
    overrides = [*overrides, f"logger.wandb.group={GROUP}"]
    cfg = compose_config(overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    config = plain(run_config(overrides))
    record = {"status": "completed", "config": config, "choices": choices, "overrides": overrides, "summary": {}}
    return Run(path=f"/sweep/{'_'.join(overrides[:2])}", record=record), {**config, "choices": choices}


@pytest.fixture(scope="module")
def sweep() -> tuple[list[Run], list[dict]]:
    jobs = [_job([f"sharding={s}", f"precision={p}"]) for s, p in itertools.product(*GRID.values())]
    return [run for run, _ in jobs], [config for _, config in jobs]


@pytest.fixture(scope="module")
def spec(sweep) -> dict:
    runs, _ = sweep
    return build_workspace(sweep_view(runs))._spec


def test_every_metric_declares_a_wandb_summary_rule_and_the_docs_show_it():
    undeclared = [m.name for m in ALL_METRICS.values() if m.wandb_summary not in WANDB_SUMMARY_RULES]
    assert not undeclared, f"give these a wandb_summary rule in fsdp_exp/metrics/schema.py: {undeclared}"
    # W&B has no median: the per-step metrics whose run value is a summary median keep only that key.
    for name in ("perf/step_time_s", "perf/tokens_per_s", "perf/tokens_per_s_per_rank", "perf/mfu"):
        assert ALL_METRICS[name].wandb_summary == "none", name
    assert ALL_METRICS["mem/tracked_total_gib_max"].wandb_summary == "max"
    assert all(m.wandb_summary == "none" for m in ALL_METRICS.values() if m.window == "run")
    assert "| W&B summary |" in render_markdown()


def test_every_panel_and_column_names_a_schema_metric_or_a_logged_config_key(sweep, spec):
    _, configs = sweep
    assert not unknown_references(spec, configs)
    kinds = {kind for kind, _ in spec_references(spec)}
    assert kinds == {"history", "summary", "config", "run"}
    # A summary value is named as W&B keeps it: the medians as set, a peak by its rule.
    names = {name for kind, name in spec_references(spec) if kind == "summary"}
    assert {"summary/tokens_per_s_median", "summary/peak_gib", "mem/tracked_forward_total_gib_max.max"} <= names
    assert summary_name("mem/predicted_peak_gib") == "mem/predicted_peak_gib.max"
    with pytest.raises(ValueError, match="rule is 'none'"):
        summary_name("perf/tokens_per_s")


def test_the_runset_selects_exactly_the_sweeps_group_grouped_by_its_varied_choices(spec):
    assert group_filter(spec) == [("run:group", "=", GROUP)]
    (runset,) = spec["spec"]["section"]["runSets"]
    assert [g["name"] for g in runset["grouping"]] == ["choices.value.sharding", "choices.value.precision"]
    columns = runset["runFeed"]["columnOrder"]
    assert columns[:4] == [
        "run:displayName",
        "run:state",
        "config:choices.value.sharding",
        "config:choices.value.precision",
    ]
    assert "summary:summary/peak_gib" in columns and "summary:summary/tokens_per_s_median" in columns


def test_the_comparison_section_comes_first(spec):
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"].split(" ")[0] for s in sections] == ["Compare", "Throughput", "Memory", "Communication", "Loss"]
    scatter, parallel, bars = sections[0]["panels"]
    assert (scatter["config"]["xAxis"], scatter["config"]["yAxis"]) == (
        "summary:summary/peak_gib",
        "summary:summary/tokens_per_s_median",
    )
    assert [c["accessor"] for c in parallel["config"]["columns"]] == [
        "config:choices.value.sharding",
        "config:choices.value.precision",
        "summary:summary/tokens_per_s_median",
        "summary:summary/mfu_median",
        "summary:summary/peak_gib",
    ]
    assert bars["config"]["metrics"] == [f"summary_metrics.summary/tokens_per_s_{q}" for q in ("p10", "median", "p90")]


def test_the_written_spec_round_trips_through_the_librarys_models(sweep, tmp_path):
    runs, _ = sweep
    workspace = build_workspace(sweep_view(runs, "my-team/my-project"))
    path = write_spec(workspace, tmp_path)
    assert path.name == SPEC_FILE and not list(tmp_path.glob("*.tmp"))
    written = json.loads(path.read_text())
    assert written == workspace._spec and (written["entity"], written["project"]) == ("my-team", "my-project")
    assert read_spec(path)._spec == written


def test_running_the_report_again_updates_the_saved_view_instead_of_adding_one(sweep, tmp_path):
    runs, _ = sweep
    path = write_spec(build_workspace(sweep_view(runs)), tmp_path)
    saved = {**json.loads(path.read_text()), "entity": "my-team", "name": "nw3abc", "id": "VmlldzoxMjM="}
    path.write_text(json.dumps(saved))  # as publishing leaves it: the view's W&B name and id
    again = build_workspace(sweep_view(runs))
    keep_saved_view(again, path)
    assert (again._spec["name"], again._spec["id"], again._spec["entity"]) == ("nw3abc", "VmlldzoxMjM=", "my-team")
    assert read_spec(path)._spec["name"] == "nw3abc"  # publishing the written spec updates that view too
    elsewhere = build_workspace(sweep_view(runs, "other-team/fsdp_exp"))
    keep_saved_view(elsewhere, path)
    assert elsewhere._spec["name"] == ""


def test_runs_that_are_not_one_group_are_refused_with_the_fix(sweep):
    runs, _ = sweep
    alone = Run(
        path="/run", record={**runs[0].record, "config": {**runs[0].config, "logger": {"wandb": {"group": None}}}}
    )
    with pytest.raises(ConfigError, match="logger.wandb.group=<name>"):
        sweep_view([alone])
    other = Run(
        path="/other",
        record={
            **runs[0].record,
            "config": {
                **runs[0].config,
                "logger": {"wandb": {**runs[0].config["logger"]["wandb"], "group": "another"}},
            },
        },
    )
    with pytest.raises(ConfigError, match="more than one W&B group"):
        sweep_view([*runs, other])
