"""The report's ranking at 100 columns (fsdp_exp/report/table.py, fsdp_exp/narrow.py), on crafted run records (no
process group): every row names its configuration in whole overrides, the ranking statistic stays, and the
columns that go are the ones DROP_ORDER names, first to last."""

from __future__ import annotations

import os

from rich.console import Console

from fsdp_exp.report import build_report
from fsdp_exp.report.load import Run
from fsdp_exp.report.table import DROP_ORDER, ranking_table, table_columns


def crafted(overrides: list[str], tokens_per_s: float) -> Run:
    record = {
        "status": "completed",
        "overrides": ["model=llama3_8b", "trainer.seq_len=8192", *overrides],
        "choices": {},
        "config": {"trainer": {"steps": 6, "warmup_steps": 2, "seed": 0, "repeat": 0}},
        "topology": {"world_size": 8},
        "env": {"device_type": "cuda"},
        "summary": {
            "summary/tokens_per_s_median": tokens_per_s,
            "summary/steps_measured": 4,
            "summary/tracked_peak_gib_max": 40.0,
            "summary/final_loss": 7.0,
        },
    }
    return Run(path="/sweep/" + ",".join(overrides), record=record, rows=[])


SWEEP = [
    ["sharding=full", "precision=bf16_pure", "ac=selective_op", "trainer.micro_batch_size=2"],
    ["sharding=grad_op", "precision=bf16_pure", "ac=selective_op", "trainer.micro_batch_size=2"],
    ["sharding=hybrid", "sharding.shard_size=4", "sharding.replicate_size=2", "precision=bf16", "ac=full"],
    ["sharding=ddp", "precision=bf16", "ac=full", "offload=optimizer", "trainer.micro_batch_size=1"],
]


def _render(table, width: int) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


def test_the_reports_ranking_at_100_columns_names_every_runs_configuration_in_whole_overrides():
    report = build_report([crafted(o, 50_000.0 - 1000 * i) for i, o in enumerate(SWEEP)])
    table = ranking_table(report, 100)
    text = _render(table, 100)
    assert max(len(line) for line in text.splitlines()) <= 100
    words = set(text.replace(",", " ").split())
    for overrides in SWEEP:
        for override in overrides:  # what differs between runs: each override whole, none broken over lines
            assert override in words, f"{override!r} is broken or missing at 100 columns"
    kept = [column.header for column in table.columns]
    assert {"#", "run", "tokens/s", "95% interval", "peak / rank"} <= set(kept)  # the ranking and memory stay
    every = table_columns(report)
    dropped = [c for c in every if c not in kept]
    assert dropped == [c for c in DROP_ORDER if c in every][: len(dropped)] and dropped  # first to last


def test_a_wide_console_keeps_every_column_of_the_ranking():
    report = build_report([crafted(o, 50_000.0 - 1000 * i) for i, o in enumerate(SWEEP)])
    kept = [column.header for column in ranking_table(report, 300).columns]
    assert kept == table_columns(report)
