"""Sweeps on SLURM, on a real single-node cluster on localhost (.ci/slurm/up): ``hydra/launcher=slurm``
submits one SLURM job per combination, each rank is one SLURM task, and a rank that fails ends its job
at once and is named in the record while the sweep goes on.

The cluster is the one .ci/run stands up (tests/integration/slurm_cluster.py says how a developer's run
gets one); multi-node jobs are tested in test_slurm_nodes.py.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from conftest import leftover_processes, read_metrics
from slurm_cluster import Sweep, cluster, job_env

TINY = ["trainer.steps=4", "trainer.warmup_steps=1", "hydra.launcher.timeout_min=5"]
# The rank that fails (debug=fail_rank: rank 1 raises at step 2) and the job sizes of that sweep: each
# job's tasks come from its own trainer.nproc_per_node.
FAILING = [
    "debug=fail_rank",
    "trainer.nproc_per_node=2,3",
    "trainer.global_batch_size=12",
    "trainer.steps=6",
    "hydra.launcher.timeout_min=5",
]
# Rank 1 killed by SIGKILL at step 2: no Python error, no result of its task.
KILLED = ["debug=fail_rank", "debug.fail_signal=SIGKILL", "trainer.steps=6", "hydra.launcher.timeout_min=5"]


@pytest.fixture(scope="module")
def cluster_env():
    with cluster(1) as env:
        yield env


@pytest.fixture(scope="module")
def sweeps(cluster_env, tmp_path_factory):
    """The three sweeps of this file, submitted together: the cluster runs their jobs side by side."""
    base = tmp_path_factory.mktemp("slurm")
    env = job_env(cluster_env, base)
    started = {
        "ok": Sweep(["sharding=full,grad_op", *TINY], base / "ok", env),
        # A MASTER_PORT left in the submitting shell reaches the jobs (sbatch exports the environment)
        # and must not decide their rendezvous.
        "failing": Sweep(FAILING, base / "failing", {**env, "MASTER_PORT": "29500"}),
        "killed": Sweep(KILLED, base / "killed", env),
    }
    yield started
    for sweep in started.values():
        sweep.stop()


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
    slurm_jobs = sweep.slurm_jobs()
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
    slurm_jobs = sweep.slurm_jobs()
    assert len(slurm_jobs) == 2
    deadline = time.monotonic() + 30
    while True:
        squeue = subprocess.run(
            ["squeue", "-h", "-t", "all", "-o", "%i|%T|%M", "-j", ",".join(slurm_jobs)],
            capture_output=True,
            text=True,
            env=sweep.env,
            check=True,
        )
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
