"""The report's pipeline columns (fsdp_exp/report/table.py), on crafted run records (no process group): a
pipeline run shows which pp rank and stages hold its peak and its bubble, predicted / measured; a report
without pipeline runs keeps its columns."""

from __future__ import annotations

from fsdp_exp.report import build_report
from fsdp_exp.report.load import Run
from fsdp_exp.report.table import table_cells, table_columns


def crafted(pp: int, tokens_per_s: float, pipeline: dict) -> Run:
    """A completed run of the pp_vs_fsdp preset as run.json describes it (its summary's pipeline keys)."""
    record = {
        "status": "completed",
        "overrides": [f"parallel.pp={pp}"],
        "choices": {},
        "config": {"trainer": {"steps": 6, "warmup_steps": 2, "seed": 0, "repeat": 0}, "parallel": {"pp": pp}},
        "topology": {"world_size": 4},
        "env": {"device_type": "cpu"},
        "summary": {
            "summary/tokens_per_s_median": tokens_per_s,
            "summary/steps_measured": 4,
            "summary/tracked_peak_gib_max": 4.0 / 1024,
            **pipeline,
        },
    }
    return Run(path=f"/sweep/{pp}_parallel.pp={pp}", record=record, rows=[])


INTERLEAVED = {
    "summary/pp_peak_pp_rank": 0,
    "summary/pp_peak_stages": "0,2",
    "summary/pp_bubble_predicted": 1 / 9,
    "summary/pp_bubble_median": 0.4567,
}
FOUR_STAGES = {
    "summary/pp_peak_pp_rank": 3,
    "summary/pp_peak_stages": "3",
    "summary/pp_bubble_predicted": 3 / 7,
    "summary/pp_bubble_median": None,  # no measured step (all warm-up)
}


def test_a_pipeline_run_shows_its_peak_stage_and_its_bubble_predicted_and_measured():
    report = build_report([crafted(1, 3000.0, {}), crafted(2, 2000.0, INTERLEAVED), crafted(4, 1000.0, FOUR_STAGES)])
    columns = table_columns(report)
    assert columns.index("peak on stages") == columns.index("predicted peak") + 1
    cells = {r.label: dict(zip(columns, table_cells(report, r))) for r in report.ranked}
    assert (cells["parallel.pp=2"]["peak on stages"], cells["parallel.pp=2"]["bubble pred/meas"]) == (
        "pp 0: 0,2",
        "11%/46%",
    )
    assert (cells["parallel.pp=4"]["peak on stages"], cells["parallel.pp=4"]["bubble pred/meas"]) == (
        "pp 3: 3",
        "43%/n/a",
    )
    assert (cells["parallel.pp=1"]["peak on stages"], cells["parallel.pp=1"]["bubble pred/meas"]) == ("n/a", "n/a")
    assert all(len(table_cells(report, r)) == len(columns) for r in report.ranked)


def test_a_report_without_pipeline_runs_has_no_pipeline_columns():
    report = build_report([crafted(1, 3000.0, {}), crafted(1, 2000.0, {"summary/final_loss": 5.0})])
    columns = table_columns(report)
    assert "peak on stages" not in columns and "bubble pred/meas" not in columns
    assert all(len(table_cells(report, r)) == len(columns) for r in report.ranked)
