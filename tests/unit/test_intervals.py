"""How sure a comparison is, on crafted run records (no process group): the bootstrap interval of a median,
repeats grouped into one configuration, ties with the best, the fallback to one run's steps, Pareto ties,
the figure's error bars, and the order a multirun gives its repeats."""

from __future__ import annotations

import json
import statistics

import pytest

from fsdp_exp.identity import configuration_id
from fsdp_exp.record.wandb_sink import configuration_job_type
from fsdp_exp.report import build_report, configuration_key, plot_report, plotted_intervals, settings_key
from fsdp_exp.report.intervals import bootstrap_median, estimate, overlap
from fsdp_exp.report.load import Run
from fsdp_exp.report.table import caption, fmt_over, fmt_vs_best, table_cells, table_columns
from fsdp_exp.report.write import csv_rows
from fsdp_exp.sweep import interleave_repeats

WARMUP = 2


def crafted(
    sharding: str, repeat: int, steps: list[float], peak_mib: float = 8.0, job: int = 0, rows: bool = True
) -> Run:
    """A completed run as run.json and metrics.jsonl describe it: ``steps`` are its per-step tokens/s after
    the warm-up (the summary's median is theirs, as the trainer computes it)."""
    warmup_rows = [{"step": s, "perf/tokens_per_s": 1.0} for s in range(1, WARMUP + 1)]  # slow: left out
    measured = [{"step": WARMUP + 1 + i, "perf/tokens_per_s": v} for i, v in enumerate(steps)]
    config = {
        "model": {"dim": 64},
        "trainer": {
            "steps": WARMUP + len(steps),
            "warmup_steps": WARMUP,
            "seed": 0,
            "repeat": repeat,
            "nproc_per_node": "auto",
        },
        "logger": {"wandb": {"mode": "offline"}},
    }
    record = {
        "status": "completed",
        "overrides": [f"sharding={sharding}", f"trainer.repeat={repeat}"],
        "choices": {"sharding": sharding},
        "config": config,
        "applied": {"strategy": sharding},
        "topology": {"world_size": 2},
        "env": {"device_type": "cpu", "torch_version": "2.13.0"},
        "summary": {
            "summary/tokens_per_s_median": statistics.median(steps),
            "summary/steps_measured": len(steps),
            "summary/tracked_peak_gib_max": peak_mib / 1024,
        },
    }
    return Run(
        path=f"/sweep/{job}_sharding={sharding},trainer.repeat={repeat}",
        record=record,
        rows=warmup_rows + measured if rows else [],
    )


def sweep(medians: dict[str, list[float]], peaks: dict[str, float] | None = None) -> list[Run]:
    """Runs in interleaved job order (every configuration's repeat 0, then repeat 1, ...), each run's
    steps spread around its median."""
    runs, job = [], 0
    for repeat in range(max(map(len, medians.values()))):
        for sharding, values in medians.items():
            if repeat < len(values):
                m = values[repeat]
                runs.append(crafted(sharding, repeat, [m * 0.98, m, m * 1.02], (peaks or {}).get(sharding, 8.0), job))
                job += 1
    return runs


# ------------------------------------------------------------------------------------ the statistics
def test_the_bootstrap_interval_is_deterministic_and_holds_the_median():
    values = [980.0, 1010.0, 1000.0, 1130.0, 940.0, 1005.0]
    low, high = bootstrap_median(values)
    assert (low, high) == bootstrap_median(values)  # fixed seed: the same report from the same records
    assert low <= statistics.median(values) <= high
    assert min(values) <= low and high <= max(values)
    assert bootstrap_median([5.0]) is None and bootstrap_median([]) is None
    # Spread out the same values tenfold around their median and the interval widens tenfold.
    centre = statistics.median(values)
    wide = bootstrap_median([centre + 10 * (v - centre) for v in values])
    assert wide[1] - wide[0] == pytest.approx(10 * (high - low))


def test_overlap_of_closed_intervals():
    a, b = estimate([1.0, 2.0]), estimate([2.0, 3.0])
    assert overlap(a, b) is True  # touching at 2.0 counts
    assert overlap(estimate([1.0, 1.1]), estimate([2.0, 2.1])) is False
    assert overlap(a, estimate([5.0])) is None  # one value, no steps: no interval, no verdict


# ------------------------------------------------------------------------------------ repeats and ties
def test_repeats_of_one_configuration_become_one_row_with_an_interval_over_them():
    runs = sweep({"full": [1000, 1100, 1200], "grad_op": [1050, 1150, 1250]})
    report = build_report(runs)
    assert [r.label for r in report.ranked] == ["sharding=grad_op", "sharding=full"]
    for r, values in ((report.ranked[0], [1050, 1150, 1250]), (report.ranked[1], [1000, 1100, 1200])):
        assert r.repeat_count == 3 and r.interval_over == "repeats"
        assert r.tokens_per_s == statistics.median(values)
        assert (r.ci_low, r.ci_high) == bootstrap_median(values)
        assert [run.repeat for run in r.repeats] == [0, 1, 2]
        assert [run.tokens_per_s for run in r.repeats] == values
        assert {run.repeat_of for run in r.repeats} == {r.label}
        assert r.steps_measured == 9 and r.tokens_per_s_p10 is None  # p10/p90 belong to single runs
    # Repeats are not duplicates, and each repeat ran once.
    assert report.duplicates == [] and len(report.completed) == 6
    assert len({configuration_key(run) for run in runs}) == 2 and len({settings_key(run) for run in runs}) == 6


def test_configurations_whose_intervals_overlap_are_reported_tied():
    report = build_report(sweep({"full": [1000, 1100, 1200], "grad_op": [1050, 1150, 1250]}))
    best, second = report.ranked
    assert best.tied_with_best is None and second.tied_with_best is True
    assert second.ci_high >= best.ci_low
    columns = table_columns(report)
    cells = dict(zip(columns, table_cells(report, second)))
    assert cells["vs #1"] == "tied" and cells["interval over"] == "3 repeats"
    assert cells["95% interval"] == "1,000 – 1,200"
    assert dict(zip(columns, table_cells(report, best)))["vs #1"] == "best"
    (csv_best, csv_second) = [r for r in csv_rows(report) if r["kind"] == "ranked"]
    assert csv_second["tied_with_best"] is True and csv_second["ci_low"] == second.ci_low
    assert json.loads(json.dumps(report.as_dict()))["ranked"][1]["tied_with_best"] is True


def test_well_separated_configurations_are_ranked_not_tied():
    report = build_report(sweep({"full": [1000, 1010, 1020], "grad_op": [2000, 2010, 2020], "ddp": [3000, 3030, 2990]}))
    assert [r.label for r in report.ranked] == ["sharding=ddp", "sharding=grad_op", "sharding=full"]
    assert [r.rank for r in report.ranked] == [1, 2, 3]
    assert [r.tied_with_best for r in report.ranked] == [None, False, False]
    assert [fmt_vs_best(r) for r in report.ranked] == ["best", "below", "below"]
    assert all(r.ci_high < report.ranked[0].ci_low for r in report.ranked[1:])


def test_one_repeat_falls_back_to_the_steps_interval_and_says_so():
    steps = [900.0, 1000.0, 1100.0, 1050.0, 950.0, 1020.0]
    report = build_report([crafted("full", 0, steps)])
    (r,) = report.ranked
    assert r.repeat_count == 1 and r.interval_over == "steps"
    assert (r.ci_low, r.ci_high) == bootstrap_median(steps)  # the measured steps only, not the warm-up
    assert fmt_over(r) == "6 steps, 1 run"
    assert "over the steps of a configuration measured once" in caption(report)
    assert "within-run jitter only" in report.as_dict()["interval"]["over"]["steps"]
    assert [c for c in csv_rows(report) if c["kind"] == "ranked"][0]["interval_over"] == "steps"
    assert [c["kind"] for c in csv_rows(report)] == ["ranked"]  # a configuration measured once is its run


def test_a_single_run_without_its_steps_has_no_interval_and_says_why():
    report = build_report(
        [crafted("full", 0, [900.0, 1000.0, 1100.0], rows=False), crafted("grad_op", 0, [800.0, 850.0, 900.0], job=1)]
    )
    full, grad_op = report.ranked
    assert full.ci_low is None and full.interval_over is None
    assert "metrics.jsonl has 0 of the 3 measured steps" in full.interval_note
    assert fmt_over(full) == "none (1 run)"
    assert grad_op.tied_with_best is None  # #1 has no interval: no verdict, not a guess
    assert fmt_vs_best(grad_op) == "n/a"


def test_a_run_repeated_with_the_same_repeat_index_is_a_duplicate():
    first, again = crafted("full", 0, [1000, 1010, 1020]), crafted("full", 0, [1500, 1510, 1520], job=1)
    other = crafted("full", 1, [1100, 1110, 1120], job=2)
    report = build_report([first, again, other])
    (r,) = report.ranked
    assert r.repeat_count == 2 and [run.repeat for run in r.repeats] == [0, 1]
    assert [d.duplicate_of for d in report.duplicates] == [r.repeats[0].label]
    assert r.tokens_per_s == statistics.median([1010, 1110])  # the duplicate is counted once


def test_the_pareto_front_uses_medians_and_marks_ties():
    # ddp: fastest, biggest. full: smallest, slow. grad_op: between on memory, slower than ddp but within
    # ddp's interval; no_shard: as big as ddp and clearly slower.
    medians = {
        "ddp": [3000, 3300, 3600],
        "grad_op": [2900, 3200, 3500],
        "full": [1000, 1010, 1020],
        "no_shard": [2000, 2010, 2020],
    }
    peaks = {"ddp": 10.0, "grad_op": 10.0, "full": 8.0, "no_shard": 10.0}
    report = build_report(sweep(medians, peaks))
    marks = {r.label.split("=")[1]: (r.pareto, r.pareto_tied) for r in report.ranked}
    assert marks["ddp"] == (True, False) and marks["full"] == (True, False)
    assert marks["grad_op"] == (False, True)  # beaten only by ddp, within ddp's interval
    assert marks["no_shard"] == (False, False)  # beaten by ddp and grad_op, both clearly
    cells = {r.label: table_cells(report, r)[0] for r in report.ranked}
    assert cells == {"sharding=ddp": "1*", "sharding=grad_op": "2~", "sharding=no_shard": "3", "sharding=full": "4*"}


def test_the_figure_draws_the_tables_intervals():
    repeated = sweep({"full": [1000, 1100, 1200], "grad_op": [1050, 1150, 1250]}, {"full": 8.0, "grad_op": 9.0})
    once = crafted("ddp", 0, [400.0, 500.0, 600.0, 550.0], peak_mib=10.0, job=9)  # an interval over its steps
    report = build_report(repeated + [once])
    fig, shown = plot_report(report)
    drawn = sorted(plotted_intervals(fig))
    table = sorted((r.peak_gib * 1024, r.ci_low, r.ci_high) for r in report.ranked)
    assert len(drawn) == len(table) == 3
    for bar, expected in zip(drawn, table):
        assert bar == pytest.approx(expected)
    configurations = [p for p in shown["points"] if p["kind"] == "configuration"]
    assert {p["label"]: tuple(p["interval"]) for p in configurations} == {
        r.label: (r.ci_low, r.ci_high) for r in report.ranked
    }
    assert sum(p["kind"] == "repeat" for p in shown["points"]) == 6  # the single ddp run is its marker


# ------------------------------------------------------------------------------------ identity and order
def test_w_and_b_job_type_is_the_reports_configuration_id():
    """The W&B sink gets the run's config with applied, topology and env beside it; the report reads the same
    from run.json. Both name the configuration alike, and the repeat does not change the name."""
    runs = [crafted("full", 0, [1.0, 2.0]), crafted("full", 1, [1.0, 2.0]), crafted("grad_op", 0, [1.0, 2.0])]
    logged = [
        {
            **run.config,
            "applied": run.applied,
            "topology": run.topology,
            "env": run.env,
            "choices": run.choices,
            "overrides": run.overrides,
        }
        for run in runs
    ]
    job_types = [configuration_job_type(config) for config in logged]
    assert job_types[0] == job_types[1] != job_types[2]
    assert job_types[0].startswith("cfg-") and len(job_types[0]) <= 64  # W&B's limit on a job type
    report = build_report(runs)
    assert {r.label: r.config_id for r in report.ranked} == {
        "sharding=full": job_types[0],
        "sharding=grad_op": job_types[2],
    }
    assert configuration_id({"trainer": {}}, None, {}, {}) is None  # no applied settings yet: no job type


def test_repeats_interleave_in_the_order_listed():
    jobs = [[f"sharding={s}", f"trainer.repeat={r}", "trainer.steps=3"] for s in ("full", "grad_op") for r in (2, 0, 1)]
    assert [(j[0], j[1]) for j in interleave_repeats(jobs)] == [
        ("sharding=full", "trainer.repeat=2"),
        ("sharding=grad_op", "trainer.repeat=2"),
        ("sharding=full", "trainer.repeat=0"),
        ("sharding=grad_op", "trainer.repeat=0"),
        ("sharding=full", "trainer.repeat=1"),
        ("sharding=grad_op", "trainer.repeat=1"),
    ]
    plain = [["sharding=full", "precision=fp32"], ["sharding=full", "precision=bf16"]]
    assert interleave_repeats(plain) == plain  # no repeats: Hydra's order


def test_the_sweeper_runs_a_presets_repeats_interleaved():
    """What the multirun launches for experiment=sharding_repeats: the sweeper's own split of its params."""
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import fsdp_exp.config  # noqa: F401 - registers the schema
    from hydra_plugins.fsdp_exp_sweeper import InterleavedSweeper

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=sharding_repeats"], return_hydra_config=True)
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.fsdp_exp_sweeper.InterleavedSweeper"
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    (jobs,) = InterleavedSweeper.split_arguments(OverridesParser.create().parse_overrides(params), None)
    assert [job[1] for job in jobs] == [f"trainer.repeat={r}" for r in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    assert [job[0] for job in jobs[:3]] == ["sharding=full", "sharding=grad_op", "sharding=ddp"]
    batches = InterleavedSweeper.split_arguments(OverridesParser.create().parse_overrides(params), 4)
    assert [len(b) for b in batches] == [4, 4, 1] and sum(batches, []) == jobs


def test_the_caption_says_which_flops_convention_mfu_counts_and_warns_when_runs_differ():
    same = build_report(sweep({"full": [1000, 1010], "ddp": [2000, 2010]}))
    assert "MFU counts FLOPs by the fsdp_exp convention" in caption(same)
    mixed = sweep({"full": [1000, 1010], "ddp": [2000, 2010]})
    for run in mixed[::2]:  # sharding=full's repeats (the sweep interleaves them with DDP's)
        run.record["env"]["flops_convention"] = "megatron"
    assert "different conventions here (fsdp_exp, megatron" in caption(build_report(mixed))


def test_intervals_at_the_same_memory_stand_side_by_side_and_the_bars_fill_their_row():
    """Two configurations at one peak: each interval drawn apart (report.json keeps the measured peak), and the
    one option panel below spans the figure's width, no empty slots beside it."""
    same = sweep({"full": [1000, 1100, 1200], "grad_op": [1050, 1150, 1250]}, {"full": 8.0, "grad_op": 8.0})
    report = build_report(same)
    fig, shown = plot_report(report)
    drawn = sorted(plotted_intervals(fig))
    assert len(drawn) == 2 and drawn[0][0] < drawn[1][0]  # apart on the memory axis
    configurations = [p for p in shown["points"] if p["kind"] == "configuration"]
    assert {p["peak"] for p in configurations} == {8.0}  # the measured figure is unchanged
    assert sorted(p["drawn_at"] for p in configurations) == pytest.approx([x for x, _, _ in drawn])
    scatter = next(a for a in fig.axes if a.get_gid() == "scatter")
    (panel,) = [a for a in fig.axes if a is not scatter]
    assert panel.get_position().width > 0.9 * scatter.get_position().width
    assert shown["bars"]["sharding"] and all("median" in b for b in shown["bars"]["sharding"])
