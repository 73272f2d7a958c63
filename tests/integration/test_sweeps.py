"""Sweeps: Hydra multiruns whose failing jobs are recorded while the sweep goes on, bad sweep input refused
before any job, W&B grouping, and every shipped sweep definition composing into runnable configs."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import yaml
from hydra import compose, initialize_config_module

import fsdp_exp.config  # noqa: F401 - registers the config schema with Hydra
from conftest import QUIET, REPO, read_metrics

TINY = ["trainer.steps=4", "trainer.warmup_steps=1", "checkpoint.on_signal=false"]


def run_sweep(args: list[str], sweep_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fsdp_exp", "-m", *args, *QUIET, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def job_records(sweep_dir: Path) -> dict[str, dict]:
    """{job folder name: run.json} for every job folder of a sweep."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/run.json"))}


def wandb_run(run_dir: Path) -> tuple[dict, dict]:
    """(the run record: name, group, tags; the summary and state) of a job's offline W&B run. A run whose
    rank failed has two folders with one id: rank 0's, then the launcher's note of the failure."""
    wandb_bin = Path(sys.executable).with_name("wandb")
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len({f.name.rsplit("-", 1)[1] for f in folders}) == 1, folders
    folder = folders[-1]
    inspected = json.loads(
        subprocess.run(
            [str(wandb_bin), "leet", "inspect", "--summary", "--json", str(folder)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (log,) = folder.glob("*.wandb")
    lines = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--json", str(log)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    run = next(r["run"] for r in map(json.loads, lines) if r["type"] == "run")
    return run, inspected


# The multiruns of the two slow tests below: {key: (the test that reads it, its arguments besides TINY)}.
SLOW_SWEEPS = {
    "cannot_run": (
        "test_a_job_that_cannot_run_is_recorded_and_the_sweep_goes_on",
        ["sharding=full,grad_op,no_shard,ddp", "offload=params"],
    ),
    "crashed_rank": (
        "test_a_crashed_rank_fails_its_job_not_the_sweep",
        ["debug.fail_at_step=null,2", "debug.fail_rank=1"],
    ),
}


@pytest.fixture(scope="module")
def slow_sweeps(request, tmp_path_factory):
    """``sweep(key) -> (sweep dir, finished multirun)`` for SLOW_SWEEPS. The first call starts the multiruns of
    every such test this session runs, together (under that test's isolated environment): one keeps about
    1.3 of this machine's 2 cores busy (rank start-ups, gloo and W&B waits), so both end in ~30 s, not ~45."""
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    pool = ThreadPoolExecutor(max_workers=len(SLOW_SWEEPS))
    started = {}

    def sweep(key: str) -> tuple[Path, subprocess.CompletedProcess]:
        if not started:
            for name, (test, args) in SLOW_SWEEPS.items():
                if test in selected or name == key:
                    sweep_dir = tmp_path_factory.mktemp(name) / "sweep"
                    started[name] = sweep_dir, pool.submit(run_sweep, [*args, *TINY], sweep_dir)
        sweep_dir, finished = started[key]
        return sweep_dir, finished.result()

    yield sweep
    pool.shutdown()


@pytest.mark.slow
def test_a_job_that_cannot_run_is_recorded_and_the_sweep_goes_on(slow_sweeps):
    """4 jobs, one a combination that cannot run (DDP cannot offload): 3 complete, 1 failed with its reason
    in run.json and in W&B; the multirun exits 1 at the end naming the failed job."""
    sweep_dir, proc = slow_sweeps("cannot_run")
    assert proc.returncode == 1, proc.stderr[-3000:]
    records = job_records(sweep_dir)
    assert len(records) == 4
    status = {name.split("_", 1)[0]: r["status"] for name, r in records.items()}
    assert status == {"0": "completed", "1": "completed", "2": "completed", "3": "failed"}
    ((failed_name, failed),) = [(n, r) for n, r in records.items() if r["status"] == "failed"]
    assert "sharding=ddp" in failed_name and failed["choices"]["sharding"] == "ddp"
    assert failed["error"]["rank"] is None and "offload=params cannot be honoured" in failed["error"]["message"]
    # announced before the first job, and named again at the end
    assert "1 combination(s) of this sweep cannot run" in proc.stderr
    assert proc.stderr.index("cannot run") < proc.stderr.index("1 of 4 jobs failed")
    assert f"1 of 4 jobs failed: {failed_name}" in proc.stderr
    for name, record in records.items():
        assert record["sweep"]["name"] == "sweep" and record["sweep"]["dir"] == str(sweep_dir)
        if record["status"] == "completed":
            assert [row["step"] for row in read_metrics(sweep_dir / name)] == [1, 2, 3, 4]

    # The report ranks the 3 completed runs by throughput and lists the failed one with its error.
    report = subprocess.run(
        [sys.executable, "-m", "fsdp_exp.report", str(sweep_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr[-2000:]
    ranked = json.loads((sweep_dir / "report.json").read_text())
    ranked_rows = [r for r in ranked["ranked"]]
    assert sorted(r["label"] for r in ranked_rows) == ["sharding=full", "sharding=grad_op", "sharding=no_shard"]
    speeds = [r["tokens_per_s"] for r in ranked_rows]
    assert speeds == sorted(speeds, reverse=True)
    (listed,) = ranked["not_ranked"]
    assert listed["label"] == "sharding=ddp" and "offload=params cannot be honoured" in listed["error"]
    assert (sweep_dir / "report.png").stat().st_size > 10_000

    # W&B: one group per sweep (its name), tags from the choices, a name from the overrides; the failed
    # job has a failed W&B run carrying the same error.
    for name, record in records.items():
        run, inspected = wandb_run(sweep_dir / name)
        assert run["run_group"] == "sweep"
        assert f"sharding:{record['choices']['sharding']}" in run["tags"] and "offload:params" in run["tags"]
        assert run["display_name"].startswith(f"sharding={record['choices']['sharding']},offload=params")
        if record["status"] == "failed":
            assert inspected["state"] == "failed"
            assert inspected["summary"]["status"] == "failed"
            assert "offload=params cannot be honoured" in inspected["summary"]["error"]["message"]
        else:
            assert inspected["state"] == "finished"


@pytest.mark.slow
def test_a_crashed_rank_fails_its_job_not_the_sweep(slow_sweeps):
    """Rank 1 of the second job raises at step 2: that job is failed with rank 1 named (run.json and W&B),
    the other completes, and the multirun exits 1."""
    sweep_dir, proc = slow_sweeps("crashed_rank")
    assert proc.returncode == 1, proc.stderr[-3000:]
    records = list(job_records(sweep_dir).items())
    assert [r["status"] for _, r in records] == ["completed", "failed"]
    name, failed = records[1]
    assert failed["error"]["rank"] == 1 and "InjectedFailure" in failed["error"]["message"]
    _, inspected = wandb_run(sweep_dir / name)
    assert inspected["state"] == "failed" and inspected["summary"]["error"]["rank"] == 1
    assert f"1 of 2 jobs failed: {name}" in proc.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["sharding=full,grad_opp"], "sharding=grad_opp: no such option; did you mean sharding=grad_op?"),
        (["sharding=[]"], "sharding=[] selects no option of the group; pick one of: ddp, fsdp1, full"),
        (["precision=fp32,bf16,fp32"], "precision: fp32 listed twice"),
        (["trainer.steps=choice()"], "empty choice is not legal"),  # Hydra's own refusal, also before any job
        (
            ["trainer.stepz=3,4"],
            "trainer.stepz is not a setting of fsdp_exp (did you mean trainer.steps?)",
        ),  # ours, before Hydra's
    ],
)
def test_bad_sweep_input_fails_before_any_job(tmp_path, args, says):
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep([*args, *TINY], sweep_dir, timeout=120)
    assert proc.returncode != 0
    assert says in proc.stderr, proc.stderr[-2000:]
    assert not list(sweep_dir.glob("*/run.json")) and not list(sweep_dir.glob("0_*"))


def test_our_own_refusals_exit_2_with_a_short_message(tmp_path):
    proc = run_sweep(["sharding=full,nonexistent", *TINY], tmp_path / "sweep", timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3 and lines[0] == "fsdp_exp: invalid sweep, nothing was started:"


# ------------------------------------------------------------------------------- sweep definitions
def _validate(overrides: list[str]) -> None:
    """Compose as a job would and run fsdp_exp's own checks (raises ConfigError if it cannot run)."""
    from fsdp_exp.config import to_run_config
    from fsdp_exp.launch import prepare

    prepare(to_run_config(compose(config_name="config", overrides=overrides)))


# A spawned validator starts in about 3 s (Python, Hydra, torch), some 15 compositions' worth: below this many
# jobs one process is as quick.
SHARE_FROM = 40


def _validate_all(jobs: list[list[str]]) -> None:
    """``_validate`` every job (inside an initialized Hydra). Many jobs: every other one in a spawned process
    meanwhile, since composing is CPU-bound (~0.2 s a job) and this machine has two cores. A job refused
    there is validated again here, so the test fails with the very ConfigError (or Hydra's error)."""
    if len(jobs) < SHARE_FROM:
        for job in jobs:
            _validate(job)
        return
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # leaving the block ends the other process
        theirs = pool.apply_async(_first_refused, (jobs[1::2],))
        for job in jobs[0::2]:
            _validate(job)
        refused = theirs.get()
    if refused is not None:
        job, trace = refused
        _validate(job)
        pytest.fail(f"{job} was refused in the spawned validator but passes here:\n{trace}")


def _first_refused(jobs: list[list[str]]) -> Optional[tuple[list[str], str]]:
    """In the spawned validator: the first job ``_validate`` refuses, with its traceback; None if none."""
    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        for job in jobs:
            try:
                _validate(job)
            except Exception:  # noqa: BLE001 - any refusal or crash: the parent raises it again itself
                return job, traceback.format_exc()
    return None


def _product(params: dict[str, list]) -> list[list[str]]:
    keys = list(params)
    return [[f"{k}={v}" for k, v in zip(keys, values)] for values in itertools.product(*params.values())]


PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_combination_of_every_preset_is_a_valid_config(preset):
    from fsdp_exp.sweep import _combinations

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True)
        params = {k: str(v) for k, v in cfg.hydra.sweeper.params.items()}
        jobs = _combinations([f"{k}={v}" for k, v in params.items()])
        expected = 1
        for value in params.values():
            expected *= len(value.split(","))
        assert len(jobs) == expected > 1
        for job in jobs:
            _validate([f"experiment={preset}", *job])


WANDB_SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))


def _sweep_choices(spec: dict) -> dict[str, list]:
    """{parameter: the values a W&B sweep definition gives it} (a distribution: its ends)."""
    choices = {}
    for key, param in spec["parameters"].items():
        if "values" in param:
            choices[key] = param["values"]
        elif "value" in param:
            choices[key] = [param["value"]]
        else:  # a distribution: its ends
            choices[key] = [param["min"], param["max"]]
    return choices


def _wandb_sweep_param(path: Path):
    """A sweep of hundreds of combinations takes over 20 s to validate on 2 cores (bayes_throughput.yaml's
    243 took 26 s in CI): slow."""
    jobs = len(_product(_sweep_choices(yaml.safe_load(path.read_text()))))
    return pytest.param(path, id=path.name, marks=[pytest.mark.slow] if jobs > 100 else [])


@pytest.mark.parametrize("path", [_wandb_sweep_param(p) for p in WANDB_SWEEPS])
def test_every_combination_of_every_wandb_sweep_is_a_valid_config(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["method"] in ("grid", "bayes", "random")
    assert spec["command"][2:5] == ["-m", "fsdp_exp", "${args_no_hyphens}"]
    assert spec["metric"]["name"].startswith("summary/")
    fixed = [arg for arg in spec["command"][5:]]
    choices = _sweep_choices(spec)
    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        _validate_all([[*job, *fixed] for job in _product(choices)])


def test_the_summary_metric_the_sweeps_optimize_is_in_the_schema():
    from fsdp_exp.metrics.schema import SUMMARY_METRICS

    names = {m.name for m in SUMMARY_METRICS}
    for path in WANDB_SWEEPS:
        assert yaml.safe_load(path.read_text())["metric"]["name"] in names


def test_a_preset_sweep_names_its_jobs_by_what_varies(tmp_path):
    """`experiment=zero_stages` expands to 4 jobs; the pre-check sees the DDP one as runnable (no refusal)."""
    from fsdp_exp.sweep import invalid_combinations

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        assert invalid_combinations(["sharding=full,grad_op,no_shard,ddp"]) == []
        refused = invalid_combinations(["sharding=full,ddp", "offload=params"])
    assert [label for label, _ in refused] == ["sharding=ddp"]
    assert "offload=params cannot be honoured" in refused[0][1]


def test_repeats_are_not_duplicates_but_a_repeat_listed_twice_is():
    """`trainer.repeat=0,1` measures each configuration twice and passes the duplicate-value check; a repeat
    index listed twice would run identical jobs and is refused, with the list that measures N times. A
    negative repeat is refused before any rank starts."""
    from fsdp_exp.config import ConfigError
    from fsdp_exp.sweep import invalid_combinations, sweep_problems

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        assert sweep_problems(["sharding=full,grad_op", "trainer.repeat=0,1,2"]) == []
        (problem,) = sweep_problems(["sharding=full,grad_op", "trainer.repeat=0,1,1"])
        assert problem.startswith("trainer.repeat: 1 listed twice")
        assert "to measure each configuration 3 times: trainer.repeat=0,1,2" in problem
        refused = invalid_combinations(["sharding=full", "trainer.repeat=0,-1"])
        with pytest.raises(ConfigError, match="pass trainer.repeat=0"):
            _validate(["trainer.repeat=-1"])
    assert [label for label, _ in refused] == ["trainer.repeat=-1"]
    assert "trainer.repeat=-1 is negative" in refused[0][1]
