"""The report (python -m fsdp_exp.report) and the analysis notebook, on a real sweep.

The sweep is made once per module with real runs, as a user makes one:
- ``python -m fsdp_exp -m prefetch=default,deep``: jobs 0 and 1. On llama_tiny's 2 blocks, prefetching two
  blocks ahead gathers exactly what prefetching one does, so both hand FSDP2 the same prefetch lists:
  a real duplicate whose configs differ (prefetch.forward 1 vs 2).
- ``sharding=grad_op`` into ``2_sharding=grad_op``: another setting, so that the ranking has two runs.
- ``debug=fail_rank`` into ``3_failed``: rank 1 raises at step 2; the run exits 1 and records the error.

A second sweep measures two configurations twice each (``sharding=full,grad_op trainer.repeat=0,1``, W&B
offline): the jobs' order, the report's grouping of repeats with their intervals and tie marks, the
figure's error bars, and the W&B job type the repeats share.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fsdp_exp.report import (
    build_report,
    load_runs,
    plot_report,
    plotted_intervals,
    plotted_point_count,
    png_bytes,
    settings_key,
)
from fsdp_exp.report.table import readable
from fsdp_exp.report.intervals import bootstrap_median
from fsdp_exp.report.__main__ import main as report_main

from conftest import BASE_ENV, QUIET, REPO

FAST = ["trainer.steps=4", "trainer.warmup_steps=1", "logger.wandb.mode=disabled", *QUIET]
NOTEBOOK = REPO / "notebooks" / "sweep_analysis.ipynb"


def _env(home: Path) -> dict:
    # The module's fixture runs before the per-test environment fixture, so it isolates itself.
    return {
        **os.environ,
        **BASE_ENV,
        "WANDB_CONFIG_DIR": str(home / "wandb_config"),
        "WANDB_CACHE_DIR": str(home / "wandb_cache"),
        "WANDB_DATA_DIR": str(home / "wandb_data"),
        "HF_HOME": str(home / "hf"),
    }


def _fsdp_exp(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_exp", *args, *FAST], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    sweep_dir, env = root / "sweep", _env(root / "home")
    multirun = _fsdp_exp(["-m", "prefetch=default,deep", f"hydra.sweep.dir={sweep_dir}"], env, root)
    assert multirun.returncode == 0, multirun.stderr[-3000:]
    # The two single runs side by side (a tiny run leaves a core idle through its start-up and gloo waits),
    # after the multirun: its end-of-sweep check counts every run in its folder that started since it did.
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Quoted: an unquoted '=' inside an override's value is a Hydra grammar error.
        single = pool.submit(
            _fsdp_exp, ["sharding=grad_op", f"hydra.run.dir='{sweep_dir}/2_sharding=grad_op'"], env, root
        )
        failed = pool.submit(_fsdp_exp, ["debug=fail_rank", f"hydra.run.dir={sweep_dir}/3_failed"], env, root)
        single, failed = single.result(), failed.result()
    assert single.returncode == 0, single.stderr[-3000:]
    assert failed.returncode == 1, failed.stderr[-3000:]
    return sweep_dir


@pytest.fixture(scope="module")
def cli(sweep) -> subprocess.CompletedProcess:
    """``python -m fsdp_exp.report <sweep>`` as a user runs it: files land in the sweep folder."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.report", str(sweep)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **BASE_ENV, "COLUMNS": "220"},  # every column (piped, 100 drops some: DROP_ORDER)
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _records(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob("*/run.json"))}


def _folder(sweep: Path, prefix: str) -> str:
    return next(name for name in _records(sweep) if name.startswith(prefix))


def _report_json(sweep: Path) -> dict:
    return json.loads((sweep / "report.json").read_text())


# ------------------------------------------------------------------------------------ ranking and table
@pytest.mark.slow
def test_table_ranks_completed_runs_by_tokens_per_s(sweep, cli):
    report = _report_json(sweep)
    ranked = report["ranked"]
    values = [r["tokens_per_s"] for r in ranked]
    assert values == sorted(values, reverse=True) and len(values) == 2
    assert [r["rank"] for r in ranked] == [1, 2]
    assert {r["label"] for r in ranked} == {"prefetch=default", "sharding=grad_op"}
    # The numbers are the runs' own medians over their measured steps.
    records = _records(sweep)
    for row in ranked:
        record = records[Path(row["path"]).name]
        assert row["tokens_per_s"] == record["summary"]["summary/tokens_per_s_median"]
        assert row["final_loss"] == record["summary"]["summary/final_loss"]
        rows = [json.loads(line) for line in (Path(row["path"]) / "metrics.jsonl").read_text().splitlines()]
        assert row["peak_source"] == "tracked"  # CPU, FSDP2: torch's tracker on the sampled step
        assert row["peak_gib"] == next(r["mem/tracked_total_gib_max"] for r in rows if "mem/tracked_total_gib_max" in r)
        assert row["predicted_peak_gib"] == rows[-1]["mem/predicted_peak_gib"]
    assert report["common_overrides"] == ["trainer.steps=4", "trainer.warmup_steps=1"]
    # The printed table shows the same runs in the same order, with the columns the brief names.
    out = cli.stdout
    for column in ("tokens/s", "MFU", "peak / rank", "peak from", "predicted peak", "final loss", "status"):
        assert column in out
    positions = [out.index(f" {readable(r['label'])} ") for r in ranked]  # the console spaces its overrides
    assert positions == sorted(positions)
    assert f"{ranked[0]['tokens_per_s']:,.0f}" in out
    assert "wrote report.png, report.html, report.json, report.csv" in out
    # The CSV holds every run, ranked first, in rank order.
    lines = (sweep / "report.csv").read_text().splitlines()
    assert lines[0].startswith("kind,rank,label,status,tokens_per_s")
    assert [line.split(",")[2] for line in lines[1:3]] == [r["label"] for r in ranked]
    assert len(lines) == 1 + 4


@pytest.mark.slow
def test_pareto_front_and_option_means(sweep, cli):
    report = _report_json(sweep)
    ranked = report["ranked"]
    fastest, smallest = ranked[0], min(ranked, key=lambda r: r["peak_gib"])
    assert fastest["pareto"] and smallest["pareto"]  # nothing is faster than #1, nothing smaller than the smallest
    # Median tokens/s per option (the ranking's statistic), over the completed runs (the duplicate is a
    # measurement of its own option).
    records = [r for r in _records(sweep).values() if r["status"] == "completed"]
    means = {key: {o["option"]: o["median"] for o in options} for key, options in report["option_means"].items()}
    assert set(means) == {"prefetch", "sharding"}
    for group, options in means.items():
        for option, mean in options.items():
            expected = statistics.median(
                r["summary"]["summary/tokens_per_s_median"] for r in records if r["choices"][group] == option
            )
            assert mean == pytest.approx(expected)


# ------------------------------------------------------------------------------------ plots and HTML
@pytest.mark.slow
def test_png_plots_one_point_per_completed_run(sweep, cli):
    png = (sweep / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 30_000
    completed = [r for r in _records(sweep).values() if r["status"] == "completed"]
    assert len(completed) == 3
    fig, shown = plot_report(build_report(load_runs([sweep])))
    assert plotted_point_count(fig) == len(shown["points"]) == len(completed)
    assert {p["label"] for p in shown["points"]} == {"prefetch=default", "prefetch=deep", "sharding=grad_op"}
    assert set(shown["bars"]) == {"prefetch", "sharding"}
    assert shown["front"]


class _Tables(HTMLParser):
    """Cell texts of each <table id=...> and the <img> sources of a page."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self.links, self._table, self._row = {}, [], [], None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._row.append("")
        elif tag == "img":
            self.images.append(attrs.get("src", ""))
        elif tag in ("link", "script") and (attrs.get("href") or attrs.get("src")):
            self.links.append(attrs.get("href") or attrs.get("src"))

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = self._row = None

    def handle_data(self, data):
        if self._row:
            self._row[-1] += data


@pytest.mark.slow
def test_html_is_self_contained_and_shows_the_same_rows(sweep, cli):
    page = (sweep / "report.html").read_text()
    parsed = _Tables()
    parsed.feed(page)
    assert parsed.links == []  # no external stylesheet or script
    # the ranking's figure, then where each configuration's time and memory went (its peaks by phase are tracked)
    assert len(parsed.images) == 2 and all(i.startswith("data:image/png;base64,") for i in parsed.images)
    assert base64.b64decode(parsed.images[0].split(",", 1)[1]) == (sweep / "report.png").read_bytes()
    assert base64.b64decode(parsed.images[1].split(",", 1)[1]) == (sweep / "report_breakdown.png").read_bytes()
    report = _report_json(sweep)
    header, *rows = parsed.tables["ranked"]
    assert header[:3] == ["#", "run", "tokens/s"]
    assert [row[1] for row in rows] == [r["label"] for r in report["ranked"]]
    assert [row[2] for row in rows] == [f"{r['tokens_per_s']:,.0f}" for r in report["ranked"]]
    # The page's embedded data: the same rows, and the points the figure drew.
    start = page.index('<script type="application/json" id="report-data">')
    embedded = json.loads(page[page.index(">", start) + 1 : page.index("</script>", start)])
    assert embedded["ranked"] == report["ranked"] and embedded["not_ranked"] == report["not_ranked"]
    _, shown = plot_report(build_report(load_runs([sweep])))
    assert sorted(r["label"] for r in embedded["ranked"] + embedded["duplicates"]) == sorted(
        p["label"] for p in shown["points"]
    )
    assert [row[0] for row in parsed.tables["duplicates"][1:]] == ["prefetch=deep"]
    assert parsed.tables["not-ranked"][1][:2] == ["debug=fail_rank", "failed"]


# ------------------------------------------------------------------------------------ duplicates, failures
@pytest.mark.slow
def test_runs_with_the_same_applied_settings_are_counted_once(sweep, cli):
    records = _records(sweep)
    default, deep = records[_folder(sweep, "0_")], records[_folder(sweep, "1_")]
    # Different configs, the same call: what makes this a duplicate is "applied", not the config.
    assert default["config"]["prefetch"] != deep["config"]["prefetch"]
    assert default["applied"] == deep["applied"]
    runs = {Path(r.path).name[:2]: r for r in load_runs([sweep])}
    assert settings_key(runs["0_"]) == settings_key(runs["1_"]) != settings_key(runs["2_"])

    report = _report_json(sweep)
    assert [(d["label"], d["duplicate_of"]) for d in report["duplicates"]] == [("prefetch=deep", "prefetch=default")]
    counted = next(r for r in report["ranked"] if r["label"] == "prefetch=default")
    assert counted["duplicates"] == ["prefetch=deep"]
    assert "prefetch=deep" not in [r["label"] for r in report["ranked"]]
    assert "Same applied settings as a ranked run" in cli.stdout and "(+1 same)" in cli.stdout


@pytest.mark.slow
def test_failed_run_is_listed_with_its_error(sweep, cli):
    record = _records(sweep)["3_failed"]
    assert record["status"] == "failed" and record["error"]["rank"] == 1
    (row,) = _report_json(sweep)["not_ranked"]
    assert row["label"] == "debug=fail_rank" and row["status"] == "failed"
    assert row["error"] == f"rank 1: {record['error']['message']}"
    assert "InjectedFailure" in row["error"]
    not_ranked = cli.stdout[cli.stdout.index("Not ranked") :]
    assert "debug=fail_rank" in not_ranked and "InjectedFailure" in not_ranked


# ------------------------------------------------------------------------------------ options, exit codes
@pytest.mark.slow
def test_metric_option_and_out_dir(sweep, tmp_path, capsys):
    assert report_main([str(sweep), "--metric", "tokens_per_s_per_rank", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    values = [r["tokens_per_s_per_rank"] for r in report["ranked"]]
    assert report["metric"] == "tokens_per_s_per_rank" and values == sorted(values, reverse=True)
    assert "tokens/s/rank" in capsys.readouterr().out
    # By MFU: ranked where the run knew its device's peak; where it did not, the fix is named.
    report = build_report(load_runs([sweep]), metric="mfu")
    values = [r.mfu for r in report.ranked]
    assert values == sorted(values, reverse=True)
    assert all("trainer.peak_tflops" in r.error for r in report.not_ranked if r.status == "completed")


def test_a_path_without_runs_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "no runs under" in capsys.readouterr().err
    assert report_main([str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert not list((tmp_path / "empty").iterdir())  # nothing written for nothing found


# ------------------------------------------------------------------------------------ damaged records
@pytest.mark.slow
def test_damaged_runs_are_listed_not_fatal(sweep, tmp_path):
    """Copies of the real grad_op run, each damaged as a crash or a partial copy would leave it."""
    source = sweep / _folder(sweep, "2_")
    damaged = tmp_path / "damaged"

    def copy(name: str) -> Path:
        target = damaged / name
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("report.*"))
        return target

    truncated = copy("0_truncated_metrics")  # a crash mid-write: the last line cut short
    lines = (truncated / "metrics.jsonl").read_text().splitlines()
    (truncated / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    no_record = copy("1_no_run_json")
    (no_record / "run.json").unlink()
    corrupt = copy("2_corrupt_run_json")
    (corrupt / "run.json").write_text((corrupt / "run.json").read_text()[:200])
    partial = copy("3_missing_fields")
    record = json.loads((partial / "run.json").read_text())
    for key in ("summary", "applied", "plan", "memory_breakdown"):
        del record[key]
    (partial / "run.json").write_text(json.dumps(record))

    runs = {Path(r.path).name: r for r in load_runs([damaged])}
    assert len(runs) == 4
    assert len(runs["0_truncated_metrics"].rows) == len(lines) - 1
    assert "skipped 1 unreadable line" in runs["0_truncated_metrics"].problems[0]
    report = build_report(list(runs.values()))
    # The truncated log does not matter to the ranking: the summary is in run.json.
    assert [Path(r.path).name for r in report.ranked] == ["0_truncated_metrics"]
    reasons = {Path(r.path).name: r.error for r in report.not_ranked}
    assert "run.json missing" in reasons["1_no_run_json"]
    assert "run.json unreadable" in reasons["2_corrupt_run_json"]
    assert "run.json has no 'summary'" in reasons["3_missing_fields"]
    # A folder name labels a run that has no overrides to show.
    assert {r.label for r in report.not_ranked} >= {"1_no_run_json", "2_corrupt_run_json"}
    fig, shown = plot_report(report)
    assert plotted_point_count(fig) == 1


# ------------------------------------------------------------------------------------ the notebook
@pytest.mark.slow
def test_notebook_executes_on_the_sweep(sweep, monkeypatch, tmp_path):
    import nbclient
    import nbformat
    from ipykernel.kernelspec import write_kernel_spec

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("FSDP_EXP_SWEEP", str(sweep))  # the kernel inherits this process's environment
    # The notebook's kernel "python3", pinned to this interpreter (where fsdp_exp is installed): a
    # JUPYTER_PATH spec wins over a user-level "python3" that may point at another Python. No
    # `ipykernel install` step: the spec is written here, from ipykernel itself.
    write_kernel_spec(tmp_path / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(sweep)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "4 runs from" in text and "2 ranked, 1 duplicates, 1 not ranked" in text
    assert "3 completed runs plotted" in text
    assert "4 runs with logged steps" in text  # the failed run's rows up to its failure included
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # the breakdown's figure the fourth
    assert "peak by phase (tracked / planned)" in text


# ------------------------------------------------------------------------------------ repeats
REPEATS = [
    "sharding=full,grad_op",
    "trainer.repeat=0,1",
    "trainer.steps=4",
    "trainer.warmup_steps=1",
    "trainer.profile_steps=[3]",  # the last step profiled (comm/*): where the time goes; steps 2 and 3 measured
    "logger.wandb.mode=offline",
    *QUIET,
]
# Set DOCS_IMAGES=1 to write the report's breakdown figure of this sweep into docs/images/ (docs/reports.md shows it)
DOCS_IMAGE = REPO / "docs" / "images" / "report_breakdown.png"


def _probe_this_cpu(env: dict) -> None:
    """The step-time model's figures of this CPU for the sweep's layout, cached where the runs read them (a run
    records its predicted parts from a cached probe only: fsdp_exp.tune.step_time.run_prediction)."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from conftest import compose_config\n"
        "from fsdp_exp.config import to_run_config\n"
        "from fsdp_exp.config.topology import resolve_nproc\n"
        "from fsdp_exp.env import default_threads\n"
        "from fsdp_exp.tune.probe import block_shape, cpu_probe\n"
        "cfg = to_run_config(compose_config(['trainer.steps=4']))\n"
        "n = resolve_nproc(cfg.trainer.nproc_per_node, 0)\n"
        "cpu_probe(n, cfg.trainer.threads_per_rank or default_threads(n), block_shape(cfg))\n"
    )
    probe = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]


@pytest.fixture(scope="module")
def repeated(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A real sweep of 2 configurations x 2 repeats, then ``python -m fsdp_exp.report`` on it."""
    root = tmp_path_factory.mktemp("repeats")
    sweep_dir, env = root / "sweep", _env(root / "home")
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg_cache")  # the session's, as conftest's
    _probe_this_cpu(env)
    multirun = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "-m", *REPEATS, f"hydra.sweep.dir={sweep_dir}"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert multirun.returncode == 0, multirun.stderr[-3000:]
    report = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.report", str(sweep_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "220"},  # every column (piped, 100 drops some: DROP_ORDER)
    )
    assert report.returncode == 0, report.stderr[-3000:]
    return sweep_dir, report


def _job_order(sweep: Path) -> list[tuple[str, int]]:
    """(sharding, repeat) of each job, in the order the jobs finished (the local launcher runs one at a time)."""
    paths = sorted(sweep.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    records = [json.loads(p.read_text()) for p in paths]
    assert [r["sweep"]["job"] for r in records] == list(range(len(records)))  # Hydra's job numbers, in run order
    return [(r["choices"]["sharding"], r["config"]["trainer"]["repeat"]) for r in records]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to run makes the repeated sweep: a probe of this CPU, 4 runs
def test_a_multirun_orders_repeats_interleaved(repeated):
    """Hydra's basic sweeper would run full/0, full/1, grad_op/0, grad_op/1; fsdp_exp's sweeper runs every
    configuration's repeat 0 first."""
    sweep, _ = repeated
    assert _job_order(sweep) == [("full", 0), ("grad_op", 0), ("full", 1), ("grad_op", 1)]
    # Each job keeps its overrides, and so its folder name.
    assert sorted(p.parent.name.split(",")[0] for p in sweep.glob("*/run.json")) == [
        "0_sharding=full",
        "1_sharding=grad_op",
        "2_sharding=full",
        "3_sharding=grad_op",
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to run makes the repeated sweep: a probe of this CPU, 4 runs
def test_the_report_groups_repeats_with_an_interval_over_them(repeated):
    sweep, cli = repeated
    report = _report_json(sweep)
    records = {Path(p.parent).name: json.loads(p.read_text()) for p in sweep.glob("*/run.json")}
    assert report["duplicates"] == [] and report["not_ranked"] == []
    assert {r["label"] for r in report["ranked"]} == {"sharding=full", "sharding=grad_op"}
    for row in report["ranked"]:
        runs = [records[Path(run["path"]).name] for run in row["repeats"]]
        assert [run["config"]["trainer"]["repeat"] for run in runs] == [0, 1]
        assert {run["choices"]["sharding"] for run in runs} == {row["label"].split("=")[1]}
        medians = [run["summary"]["summary/tokens_per_s_median"] for run in runs]
        assert row["repeat_count"] == 2 and row["interval_over"] == "repeats"
        assert row["tokens_per_s"] == statistics.median(medians)
        assert [row["ci_low"], row["ci_high"]] == list(bootstrap_median(medians))
        for run in runs:  # each run's own spread, beside its median
            s = run["summary"]
            assert s["summary/steps_measured"] == 2
            assert s["summary/tokens_per_s_p10"] <= s["summary/tokens_per_s_median"] <= s["summary/tokens_per_s_p90"]
    first, second = report["ranked"]
    assert first["tied_with_best"] is None and isinstance(second["tied_with_best"], bool)
    tied = second["ci_high"] >= first["ci_low"]
    assert second["tied_with_best"] == tied
    # The console: the ranked table with interval, what it resampled and the tie mark, then each repeat.
    out = cli.stdout
    for column in ("95% interval", "interval over", "vs #1"):
        assert column in out
    assert out.count("2 repeats") == 2 and ("tied" if tied else "below") in out
    assert "Runs of the configurations measured more than once" in out
    # The CSV: the 2 configurations, then their 4 runs; the HTML: the same intervals, and the runs.
    rows = list(csv.DictReader(io.StringIO((sweep / "report.csv").read_text())))
    assert [r["kind"] for r in rows] == ["ranked"] * 2 + ["repeat"] * 4
    assert [float(r["ci_low"]) for r in rows[:2]] == [r["ci_low"] for r in report["ranked"]]
    parsed = _Tables()
    parsed.feed((sweep / "report.html").read_text())
    header, *ranked = parsed.tables["ranked"]
    interval = header.index("95% interval")
    assert [r[interval] for r in ranked] == [f"{r['ci_low']:,.0f} – {r['ci_high']:,.0f}" for r in report["ranked"]]
    assert len(parsed.tables["repeats"]) == 1 + 4


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to run makes the repeated sweep: a probe of this CPU, 4 runs
def test_the_pngs_error_bars_match_the_table(repeated):
    sweep, _ = repeated
    report = _report_json(sweep)
    fig, shown = plot_report(build_report(load_runs([sweep])))
    assert png_bytes(fig) == (sweep / "report.png").read_bytes()  # the figure below is the PNG's
    drawn = [bound for interval in sorted((low, high) for _, low, high in plotted_intervals(fig)) for bound in interval]
    table = [bound for interval in sorted((r["ci_low"], r["ci_high"]) for r in report["ranked"]) for bound in interval]
    # to the last bits: the figure's data passes through matplotlib's float arrays
    assert drawn == pytest.approx(table, rel=1e-12)
    kinds = [p["kind"] for p in shown["points"]]
    assert kinds.count("configuration") == 2 and kinds.count("repeat") == 4
    assert plotted_point_count(fig) == 6


def _wandb_run(run_dir: Path) -> dict:
    """The run record (name, group, job type, tags) of a job's offline W&B run."""
    wandb_bin = Path(sys.executable).with_name("wandb")
    (log,) = (run_dir / "wandb").glob("offline-run-*/*.wandb")
    lines = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--json", str(log)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return next(r["run"] for r in map(json.loads, lines) if r["type"] == "run")


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to run makes the repeated sweep: a probe of this CPU, 4 runs
def test_repeats_share_a_wandb_job_type(repeated):
    """W&B groups runs by job type: the repeats of one configuration share one, the report's config_id."""
    sweep, _ = repeated
    report = _report_json(sweep)
    for row in report["ranked"]:
        runs = [_wandb_run(Path(run["path"])) for run in row["repeats"]]
        assert {run["job_type"] for run in runs} == {row["config_id"]}
        assert [f"repeat:{r}" in run["tags"] for r, run in enumerate(runs)] == [True, True]
        assert all(run["run_group"] == "sweep" for run in runs)
    assert report["ranked"][0]["config_id"] != report["ranked"][1]["config_id"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first to run makes the repeated sweep: a probe of this CPU, 4 runs
def test_the_report_says_where_each_configurations_time_and_memory_went_measured_against_predicted(repeated):
    """Issue #43 item 11: per configuration, the profiled step's compute and exposed collectives by kind beside the
    step-time model's parts (recorded by the run at its start), and the peak by phase tracked against planned: in
    report.json, the console, the HTML and report_breakdown.png."""
    from fsdp_exp.report.breakdown import TIME_PARTS
    from fsdp_exp.report.plots import plot_breakdown

    sweep, cli = repeated
    report = _report_json(sweep)
    for row in report["ranked"]:
        found = row["breakdown"]
        measured, predicted = found["time_s"]["measured"], found["time_s"]["predicted"]
        assert measured is not None and predicted is not None, found["time_notes"]
        assert set(measured) == set(predicted) == set(TIME_PARTS)
        assert measured["compute"] > 0 and predicted["compute"] > 0
        run = json.loads((Path(row["repeats"][0]["path"]) / "run.json").read_text())
        profiled = next(
            r for r in map(json.loads, (Path(row["repeats"][0]["path"]) / "metrics.jsonl").open()) if "comm/step_s" in r
        )
        # the measured parts are the profiled step's (one profiled step: its values), the rest what they leave
        assert measured["compute"] == profiled["comm/compute_s"]
        assert measured["exposed all-gather"] == profiled["comm/exposed_all_gather_s"]
        assert sum(measured.values()) == pytest.approx(
            max(profiled["comm/step_s"], sum(v for k, v in measured.items() if k != "other"))
        )
        assert predicted == pytest.approx(run["plan"]["step_time"]["parts"])
        # FSDP2 gathers parameters (all-gather) under either strategy: the model prices some of it exposed or not,
        # the run measured it; both name it
        assert "exposed all-gather" in predicted
        for phase in ("forward", "backward", "optimizer"):
            memory = found["memory_gib"][phase]
            assert memory["measured"] > 0 and memory["predicted"] > 0
    out = cli.stdout
    assert "Where each configuration's step went" in out and out.count("time (s, measured / predicted)") == 2
    assert "peak by phase (tracked / planned)" in out
    assert "Where the time and the memory went" in (sweep / "report.html").read_text()
    fig = plot_breakdown(build_report(load_runs([sweep])))
    assert png_bytes(fig) == (sweep / "report_breakdown.png").read_bytes()
    if os.environ.get("DOCS_IMAGES"):
        DOCS_IMAGE.parent.mkdir(exist_ok=True)
        shutil.copyfile(sweep / "report_breakdown.png", DOCS_IMAGE)
