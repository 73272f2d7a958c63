"""Sweeps on SLURM, on a real single-node cluster on localhost (.ci/slurm/up): ``hydra/launcher=slurm``
submits one SLURM job per combination, each rank is one SLURM task, and a rank that fails ends its job
at once and is named in the record while the sweep goes on.

The cluster is the one .ci/run stands up; a developer's run starts it through the same script (and stops
it afterwards) when SLURM is installed. Without SLURM the tests skip, unless FSDP_EXP_REQUIRE_SLURM=1
(CI), which turns that into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MARKER, QUIET, REPO, leftover_processes, read_metrics

SCRIPTS = REPO / ".ci" / "slurm"
REQUIRED = os.environ.get("FSDP_EXP_REQUIRE_SLURM") == "1"
TINY = ["trainer.steps=4", "trainer.warmup_steps=1", "hydra.launcher.timeout_min=5"]
# The rank that fails (debug=fail_rank: rank 1 raises at step 2) and the job sizes of that sweep: each
# job's tasks come from its own trainer.nproc_per_node.
FAILING = ["debug=fail_rank", "trainer.nproc_per_node=2,3", "trainer.global_batch_size=12", "trainer.steps=6",
           "hydra.launcher.timeout_min=5"]
# Rank 1 killed by SIGKILL at step 2: no Python error, no result of its task.
KILLED = ["debug=fail_rank", "debug.fail_signal=SIGKILL", "trainer.steps=6", "hydra.launcher.timeout_min=5"]


@pytest.fixture(scope="module")
def cluster_env():
    """What a process needs to reach the localhost cluster: SLURM_CONF, and PATH with the sacct stand-in."""
    if shutil.which("slurmctld") is None:
        reason = ("SLURM is not installed: apt-get install -y --no-install-recommends slurmctld slurmd "
                  "slurm-client munge (as root), or .ci/slurm/up --install")
        if REQUIRED:
            pytest.fail(f"FSDP_EXP_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    up = subprocess.run([str(SCRIPTS / "up")], capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        pytest.fail(f".ci/slurm/up could not stand up the localhost cluster (exit {up.returncode}):\n{up.stderr}")
    exported = dict(line.split("#")[0].strip().removeprefix("export ").split("=", 1)
                    for line in up.stdout.splitlines() if line.startswith("export "))
    env = {"SLURM_CONF": exported["SLURM_CONF"], "PATH": f"{SCRIPTS / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    yield env
    if exported.get("FSDP_EXP_SLURM_STARTED") == "1":
        subprocess.run([str(SCRIPTS / "down")], capture_output=True, timeout=120)


class Sweep:
    """``python -m fsdp_exp -m hydra/launcher=slurm ...`` running in the background."""

    def __init__(self, args: list[str], sweep_dir: Path, env: dict):
        self.dir = sweep_dir
        cmd = [sys.executable, "-m", "fsdp_exp", "-m", "hydra/launcher=slurm", *args, *QUIET,
               f"hydra.sweep.dir={sweep_dir}"]
        # The marker travels with the jobs' environment (sbatch exports it), so their processes can be found.
        self.env = {**os.environ, **env, MARKER: str(sweep_dir)}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env)

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        """(exit code, stderr) of the sweep; a sweep still running after ``timeout`` fails the test."""
        try:
            _, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, stderr = self.proc.communicate()
            pytest.fail(f"the sweep did not end in {timeout} s:\n{stderr[-3000:]}")
        return self.proc.returncode, stderr

    def jobs(self) -> dict[int, tuple[Path, dict]]:
        """{job number: (its folder, its run.json)}."""
        return {int(p.parent.name.split("_", 1)[0]): (p.parent, json.loads(p.read_text()))
                for p in self.dir.glob("*/run.json")}


@pytest.fixture(scope="module")
def sweeps(cluster_env, tmp_path_factory):
    """The three sweeps of this file, submitted together: the cluster runs their jobs side by side."""
    base = tmp_path_factory.mktemp("slurm")
    # Quiet, offline, and away from the user's caches, like every test (conftest's BASE_ENV): the jobs
    # inherit this environment.
    env = {**cluster_env, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
           "WANDB_MODE": "offline", "WANDB_CACHE_DIR": str(base / "wandb_cache"),
           "WANDB_CONFIG_DIR": str(base / "wandb_config"), "WANDB_DATA_DIR": str(base / "wandb_data"),
           "HF_HOME": str(base / "hf")}
    started = {
        "ok": Sweep(["sharding=full,grad_op", *TINY], base / "ok", env),
        # A MASTER_PORT left in the submitting shell reaches the jobs (sbatch exports the environment)
        # and must not decide their rendezvous.
        "failing": Sweep(FAILING, base / "failing", {**env, "MASTER_PORT": "29500"}),
        "killed": Sweep(KILLED, base / "killed", env),
    }
    yield started
    for sweep in started.values():
        if sweep.proc.poll() is None:
            sweep.proc.kill()


def _slurm_jobs(sweep_dir: Path) -> dict[str, list[Path]]:
    """{SLURM job id (array element): its tasks' logs} from submitit's folder of the sweep."""
    return {folder.name: sorted(folder.glob("*_log.out")) for folder in (sweep_dir / ".submitit").iterdir()
            if folder.is_dir() and list(folder.glob("*_log.out"))}


def _no_leftovers(sweep_dir: Path, within: float = 15.0) -> list[str]:
    """The sweep's processes still alive once the tasks had ``within`` seconds to exit after their results."""
    deadline = time.monotonic() + within
    while (left := leftover_processes(sweep_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_sweep_runs_one_slurm_job_per_combination_with_one_task_per_rank(sweeps):
    sweep = sweeps["ok"]
    code, stderr = sweep.wait()
    assert code == 0, stderr[-3000:]
    jobs = sweep.jobs()
    assert sorted(jobs) == [0, 1], stderr[-3000:]
    strategies = set()
    for _, (run_dir, record) in sorted(jobs.items()):
        assert record["status"] == "completed", record.get("error")
        strategies.add(record["choices"]["sharding"])
        topology = record["topology"]
        assert (topology["world_size"], topology["nproc_per_node"], topology["nnodes"]) == (2, 2, 1)
        assert record["env"]["world_size"] == 2 and len(record["env"]["devices"]) == 2
        assert len(record["shard_digests"]) == 2
        assert record["sweep"]["dir"] == str(sweep.dir)
        assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4]  # written once, by rank 0
        assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert strategies == {"full", "grad_op"}

    # Two SLURM jobs (one array), each of 2 tasks, and every task one rank of its job's world.
    slurm_jobs = _slurm_jobs(sweep.dir)
    assert len(slurm_jobs) == 2, slurm_jobs
    for job_id, logs in slurm_jobs.items():
        assert [log.name for log in logs] == [f"{job_id}_0_log.out", f"{job_id}_1_log.out"]
        for task, log in enumerate(logs):
            assert f"global_rank={task}(2)" in log.read_text()
    (script,) = {p.read_text() for p in (sweep.dir / ".submitit").glob("*/*_submission.sh")}
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --nodes=1" in script
    assert "#SBATCH --signal=USR1@120" in script and "gpus" not in script
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_a_failing_rank_ends_its_job_fast_and_is_named(sweeps):
    """debug=fail_rank: rank 1 raises at step 2. Its job ends at once (not at the collective timeout),
    run.json names rank 1 and its error (rank 0 only saw its peer go), and the sweep reports it."""
    sweep = sweeps["failing"]
    code, stderr = sweep.wait()
    assert code == 1, stderr[-3000:]
    jobs = sweep.jobs()
    assert sorted(jobs) == [0, 1], stderr[-3000:]
    for number, world in ((0, 2), (1, 3)):  # each job as large as its own trainer.nproc_per_node
        run_dir, record = jobs[number]
        assert record["status"] == "failed"
        assert record["topology"]["world_size"] == world and len(record["env"]["devices"]) == world
        error = record["error"]
        assert error["rank"] == 1, error
        assert "InjectedFailure: debug.fail_at_step=2 on rank 1" in error["message"]
        assert "InjectedFailure" in (run_dir / "errors" / "rank1.txt").read_text()
        assert [row["step"] for row in read_metrics(run_dir)] == [1, 2]  # steps 1 and 2 were logged
    assert "2 of 2 jobs failed" in stderr

    # Both jobs ended within seconds of the failure (the collective timeout would be 600 s), as SLURM
    # records them. The launcher returns once every task has left its result; the tasks' processes
    # then take a moment to exit.
    slurm_jobs = _slurm_jobs(sweep.dir)
    assert len(slurm_jobs) == 2
    deadline = time.monotonic() + 30
    while True:
        squeue = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%M", "-j", ",".join(slurm_jobs)],
                                capture_output=True, text=True, env=sweep.env, check=True)
        states = [line.split("|") for line in squeue.stdout.split()]
        if all(state in ("COMPLETED", "FAILED") for _, state, _ in states) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(states) == 2
    for job_id, state, elapsed in states:
        assert state in ("COMPLETED", "FAILED"), (job_id, state, elapsed)
        minutes, seconds = map(int, elapsed.split(":")[-2:])
        assert minutes * 60 + seconds < 90, (job_id, state, elapsed)
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_and_the_sweep_ends(sweeps):
    """Rank 1 dies by SIGKILL (as by the OOM killer): it leaves neither an error nor a result. Rank 0 sees
    its peer vanish, names it, and the launcher does not wait for the missing result."""
    sweep = sweeps["killed"]
    code, stderr = sweep.wait()
    assert code == 1, stderr[-3000:]
    ((run_dir, record),) = sweep.jobs().values()
    assert record["status"] == "failed", stderr[-3000:]
    assert record["error"]["rank"] == 1, record["error"]
    assert "rank 1 left no error of its own" in record["error"]["message"]
    assert not (run_dir / "errors" / "rank1.txt").exists() and (run_dir / "errors" / "rank0.txt").exists()
    assert _no_leftovers(sweep.dir) == []
