"""A mixture of experts' routing in the run's summary (fsdp_exp.metrics.summary) and read back by the planner
(``plan.expert_imbalance=<run folder>``): the measured load, not a guess, plans the next run."""

from __future__ import annotations

import json

import pytest

from fsdp_exp.metrics.summary import routing_summary
from fsdp_exp.plan.cli import PlanOptionError, expert_imbalance


def test_the_summary_holds_the_median_worst_layer_ratio_the_worst_step_and_each_layers_median():
    rows = [
        {
            "moe/load_imbalance_max": 1.5,
            "moe/load_imbalance_worst_layer": 1,
            "moe/load_imbalance_per_layer": [1.2, 1.5],
            "moe/dropped_fraction": 0.0,
            "moe/aux_loss": 0.03,
        },
        {
            "moe/load_imbalance_max": 2.5,
            "moe/load_imbalance_worst_layer": 0,
            "moe/load_imbalance_per_layer": [2.5, 1.1],
            "moe/dropped_fraction": 0.1,
            "moe/aux_loss": 0.02,
        },
        {
            "moe/load_imbalance_max": 1.7,
            "moe/load_imbalance_worst_layer": 1,
            "moe/load_imbalance_per_layer": [1.4, 1.7],
            "moe/dropped_fraction": 0.05,
            "moe/aux_loss": 0.01,
        },
    ]

    def median(key):
        return sorted(r[key] for r in rows)[len(rows) // 2]

    def last(key):
        return rows[-1][key]

    s = routing_summary(rows, median, last)
    assert s["summary/moe_load_imbalance_median"] == 1.7
    assert (s["summary/moe_load_imbalance_worst"], s["summary/moe_worst_layer"]) == (2.5, 0)
    assert s["summary/moe_load_imbalance_per_layer"] == [1.4, 1.5]
    assert s["summary/moe_dropped_fraction_max"] == 0.1 and s["summary/moe_aux_loss_final"] == 0.01


def test_plan_expert_imbalance_takes_a_runs_folder_and_reads_its_measured_load(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"summary": {"summary/moe_load_imbalance_median": 1.8}}))
    assert expert_imbalance(str(run)) == 1.8
    assert expert_imbalance(str(run / "run.json")) == 1.8
    (run / "run.json").write_text(json.dumps({"summary": {}}))  # a dense run: no load to take
    with pytest.raises(PlanOptionError, match="folder of a completed MoE run"):
        expert_imbalance(str(run))


def test_favouring_an_expert_the_model_does_not_have_is_refused_before_any_rank_starts():
    from conftest import compose_config

    from fsdp_exp.config import to_run_config
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.preflight import validate

    with pytest.raises(ConfigError, match="debug.favour_expert=0 names no expert"):
        validate(to_run_config(compose_config(["debug.favour_expert=0"])), cuda_devices=0)  # a dense model
    with pytest.raises(ConfigError, match="debug.favour_expert=4 names no expert"):
        validate(to_run_config(compose_config(["model=moe_tiny", "debug.favour_expert=4"])), cuda_devices=0)
    validate(to_run_config(compose_config(["model=moe_tiny", "debug.favour_expert=3"])), cuda_devices=0)
