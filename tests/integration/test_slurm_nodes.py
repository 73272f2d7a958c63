"""Sweeps on several nodes, on a real 2-node SLURM cluster on this machine (.ci/slurm/up --nodes 2: node1
and node2, each in a network namespace of its own, with its own address and hostname):

- a job of 2 nodes x 2 tasks is one run of world size 4 whose ranks meet on the first node's address,
  name their hosts in run.json, and train exactly as 4 ranks on one machine;
- a node whose ranks all die (SIGKILL) ends its job within seconds, naming the node and its ranks,
  with nothing left running on either node, and the sweep goes on to its verdict;
- a job that SLURM stops (``scontrol requeue``; the time-limit signal) saves, comes back by itself,
  resumes in the same folder and completes with the losses of an uninterrupted run, bit for bit;
- the real time limit requeues a job through submitit until hydra.launcher.max_num_timeout, and then
  the record says why it was not requeued again;
- a job held in the queue is reported while it waits, with SLURM's reason;
- a job larger than its partition, or with a time-limit signal due while its ranks are still starting, is
  refused before anything is submitted;
- torchrun across the two hosts (one torchrun per node, started by one ``srun``) is one run too.

The sweeps and the torchrun job start together at the beginning of the module and run side by side on
the cluster; the long jobs sleep through most steps (debug.step_sleep_s), so they cost little CPU.

torchrun starts inside the cluster's nodes through ``srun -N2 --ntasks-per-node=1``: each task runs in
its node's namespaces as slurmd set them up (network, hostname, and the /etc/hosts that resolves
node1/node2, which gloo needs to find its own address); a hand-made ``nsenter`` + ``unshare --uts``
would have to rebuild all of that.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from conftest import MARKER, MULTI_NODE_TRAINING, QUIET, REPO, leftover_processes, read_metrics, run_cli
from fsdp_exp.launch import free_port
from slurm_cluster import Sweep, cluster, job_env

TRAINING = MULTI_NODE_TRAINING  # the 2-node jobs' and their 4-local-rank reference's (conftest's four_local_ranks)
SHORT = [*TRAINING, "hydra.launcher.timeout_min=5"]
TWO_BY_TWO = ["trainer.nnodes=2", "trainer.nproc_per_node=2"]
# Long enough to act on mid-job, cheap while it lasts: most of a step is a sleep.
SLOW = ["debug.step_sleep_s=0.4", "trainer.warmup_steps=1", "hydra.launcher.timeout_min=5"]
RESUMED = ["trainer.nnodes=2", "trainer.nproc_per_node=1", "trainer.steps=16", "trainer.repeat=0,1", *SLOW]


@pytest.fixture(scope="module")
def two_nodes():
    with cluster(2) as env:
        yield env


@pytest.fixture(scope="module")
def sweeps(two_nodes, tmp_path_factory):
    """The sweeps of this file, submitted together; what the tests do to their jobs mid-run starts at
    once too, in threads (``acted``: {name: a future of what was done}), so that no job ends before a
    test gets to it."""
    base = tmp_path_factory.mktemp("slurm_nodes")
    env = job_env(two_nodes, base)
    started = {
        # trainer.repeat changes nothing in a run: two jobs that must train alike.
        "two_by_two": Sweep([*TWO_BY_TWO, "trainer.repeat=0,1", *SHORT], base / "two_by_two", env),
        "dead_node": Sweep(
            [*TWO_BY_TWO, "trainer.steps=1000", "trainer.collective_timeout_s=30", "checkpoint.on_signal=false", *SLOW],
            base / "dead_node",
            env,
        ),
        # node2's ranks are frozen (SIGSTOP): no connection closes, so only the collective timeout ends it.
        "stuck_node": Sweep(
            [*TWO_BY_TWO, "trainer.steps=1000", "trainer.collective_timeout_s=15", "checkpoint.on_signal=false", *SLOW],
            base / "stuck_node",
            env,
        ),
        "resumed": Sweep(RESUMED, base / "resumed", env),
        # Held in the queue (sbatch --hold) until the test releases it: the sweep must say that it waits.
        "held": Sweep([*SHORT, "+hydra.launcher.additional_parameters.hold=true"], base / "held", env),
        # The real time limit: SIGUSR1 is due 60 s before the job's 2 minutes are up, so 30-60 s after it
        # starts (SLURM looks at time limits every 30 s or so and signals at the first look within
        # signal_delay_s + 30 s of the end; measured here: a 120 s / 50 s job got it 47 and 68 s after it
        # started), while the ranks may still be importing (up to ~19 s and more under this file's load):
        # the signal waits, blocked, until their handlers are in place. The job never finishes, so
        # it is requeued once (max_num_timeout=1), then stops.
        "time_limit": Sweep(
            [
                "trainer.nproc_per_node=2",
                "trainer.steps=100000",
                "debug.step_sleep_s=0.4",
                "trainer.warmup_steps=1",
                "hydra.launcher.timeout_min=2",
                "hydra.launcher.signal_delay_s=60",
                "hydra.launcher.max_num_timeout=1",
            ],
            base / "time_limit",
            env,
        ),
    }
    started["torchrun"] = _start_torchrun_on_two_nodes(two_nodes, base / "torchrun")
    slurm_env = {**os.environ, **started["resumed"].env}
    with ThreadPoolExecutor(max_workers=5) as pool:
        acted = {
            "node2_killed": pool.submit(_signal_node2_ranks, started["dead_node"], signal.SIGKILL),
            "node2_stopped": pool.submit(_signal_node2_ranks, started["stuck_node"], signal.SIGSTOP),
            # SIGTERM, then SLURM requeues the job itself
            "requeued": pool.submit(_when_at_step, started["resumed"], 0, 3, ["scontrol", "requeue"], slurm_env),
            # the signal SLURM sends before the time limit: fsdp_exp requeues the job through submitit
            "usr1": pool.submit(_when_at_step, started["resumed"], 1, 3, ["scancel", "--signal=USR1"], slurm_env),
            "released": pool.submit(_release_after, started["held"], HELD_S, slurm_env),
        }
        yield started, acted
        for name, sweep in started.items():
            if name == "torchrun":
                sweep.kill()
                subprocess.run(["scancel", f"--name={TORCHRUN_JOB}"], capture_output=True, timeout=30, env=slurm_env)
            else:
                sweep.stop()


@pytest.fixture(scope="module")
def four_local(sweeps, request) -> list[float]:
    """conftest's four_local_ranks (the 4-local-rank reference losses), trained while the sweeps run: named
    as a test's argument, a session fixture would be set up before the module's sweeps, not beside them."""
    return request.getfixturevalue("four_local_ranks")


TORCHRUN_JOB = f"fsdp_exp_torchrun_nodes_{os.getpid()}"


def _start_torchrun_on_two_nodes(cluster_env: dict, run_dir: Path) -> subprocess.Popen:
    """One torchrun per node (node rank = the task's SLURM_NODEID), 2 ranks each, meeting on node1's
    address; static rendezvous, so node rank i holds ranks 2i and 2i+1."""
    env = {**os.environ, **cluster_env, "OMP_NUM_THREADS": "1", MARKER: str(run_dir)}
    out = subprocess.run(
        ["scontrol", "show", "node", "--oneliner", "node1"], capture_output=True, text=True, timeout=30, env=env
    )
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    assert out.returncode == 0 and fields.get("NodeAddr"), f"scontrol show node node1: {out.stdout}{out.stderr}"
    torchrun = Path(sys.executable).with_name("torchrun")
    # Any port: node1's network namespace has its own, where only slurmd and the jobs' ranks listen.
    node_cmd = (
        f"exec {torchrun} --nnodes 2 --nproc-per-node 2 --node-rank $SLURM_NODEID "
        f"--master-addr {fields['NodeAddr']} --master-port {free_port()} -m fsdp_exp "
        f"{' '.join([*TRAINING, *QUIET, 'logger.wandb.mode=disabled'])} hydra.run.dir={run_dir}"
    )
    # srun passes its environment (the marker too) to the tasks: leftover_processes finds them on any node.
    cmd = [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--nodelist=node1,node2",
        f"--job-name={TORCHRUN_JOB}",
        "--kill-on-bad-exit=1",
        "--time=5",
        "--label",
        "bash",
        "-c",
        node_cmd,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    proc.run_dir, proc.master = run_dir, fields["NodeAddr"]  # type: ignore[attr-defined]
    return proc


def _when_at_step(sweep: Sweep, number: int, step: int, command: list[str], env: dict) -> str:
    """Run ``command <job id>`` once job ``number`` of ``sweep`` reached ``step``; its job id."""
    _wait_for_step(sweep, number, step)
    job_id = _job_ids(sweep)[number]
    done = subprocess.run([*command, job_id], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(command)} {job_id}: {done.stderr}"
    return job_id


HELD_S = 20  # well past the 10 s after which the sweep reports a job held in the queue (QUEUED_NOTE_S)


def _release_after(sweep: Sweep, seconds: float, env: dict) -> str:
    """``scontrol release`` the sweep's job ``seconds`` after it was submitted; its job id."""
    deadline = time.monotonic() + 120
    while not (ids := _job_ids(sweep)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ids, f"the sweep {sweep.dir.name} submitted nothing in 120 s"
    time.sleep(seconds)
    done = subprocess.run(["scontrol", "release", ids[0]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"scontrol release {ids[0]}: {done.stderr}"
    return ids[0]


def _signal_node2_ranks(sweep: Sweep, signum: int) -> float:
    """Send ``signum`` to every rank process of the sweep's job on node2 once it reached step 2; when
    (monotonic)."""
    _wait_for_step(sweep, 0, 2)
    victims = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get(MARKER) == str(sweep.dir) and env.get("SLURMD_NODENAME") == "node2" and "SLURM_PROCID" in env:
            victims.append((int(env["SLURM_PROCID"]), proc))
    assert sorted(rank for rank, _ in victims) == [2, 3], victims
    for _, proc in victims:
        proc.send_signal(signum)
    return time.monotonic()


def _job_ids(sweep: Sweep) -> dict[int, str]:
    """{job number: its SLURM job id} (jobs of one size are one array: <array>_<number in it>)."""
    ids: dict[int, str] = {}
    if not (sweep.dir / ".submitit").is_dir():  # nothing submitted yet
        return ids
    for folder in (sweep.dir / ".submitit").iterdir():
        if folder.is_dir() and (folder / f"{folder.name}_submitted.pkl").exists():
            ids[int(folder.name.split("_")[1]) if "_" in folder.name else 0] = folder.name
    return ids


def _wait_for_step(sweep: Sweep, number: int, step: int, timeout: float = 180) -> Path:
    """Job ``number``'s folder, once its metrics reached ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in sweep.dir.glob(f"{number}_*"):
            if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= step:
                return run_dir
        assert sweep.proc.poll() is None, (
            f"the sweep {sweep.dir.name} ended (exit {sweep.proc.returncode}) before job {number} reached step {step}"
        )
        time.sleep(0.5)
    raise AssertionError(f"job {number} of {sweep.dir.name} did not reach step {step} in {timeout} s")


def _no_leftovers(sweep_dir: Path, within: float = 15.0) -> list[str]:
    deadline = time.monotonic() + within
    while (left := leftover_processes(sweep_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _losses(run_dir: Path) -> list[float]:
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1)), "every step once, in order"
    return [row["train/loss"] for row in rows]


def _local_losses(overrides: list[str], run_dir: Path) -> list[float]:
    """The same training on this machine's ranks, launched by fsdp_exp itself."""
    result = run_cli([*overrides, "logger.wandb.mode=disabled"], run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(run_dir)


@pytest.mark.slow
def test_a_two_node_job_is_one_run_on_two_hosts_that_trains_like_four_local_ranks(sweeps, four_local):
    sweep = sweeps[0]["two_by_two"]
    code, stderr = sweep.wait()
    assert code == 0, stderr[-3000:]
    jobs = sweep.jobs()
    assert sorted(jobs) == [0, 1], stderr[-3000:]
    for run_dir, record in jobs.values():
        assert record["status"] == "completed", record.get("error")
        topology = record["topology"]
        assert (topology["world_size"], topology["nnodes"], topology["nproc_per_node"]) == (4, 2, 2)
        ranks = record["env"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
        assert [r["host"] for r in ranks] == ["node1", "node1", "node2", "node2"], ranks
        addresses = [r["address"] for r in ranks]
        assert addresses[0] == addresses[1] != addresses[2] == addresses[3], ranks
        assert all(a.startswith("198.18.") for a in addresses), ranks  # the cluster's own network
        assert record["slurm"]["nodes"] == "node[1-2]" and record["slurm"]["restarts"] == 0
        # One record, one W&B run, every step once (written by rank 0 only).
        assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
        assert _losses(run_dir) == pytest.approx(four_local, rel=1e-6)
    (script,) = {p.read_text() for p in (sweep.dir / ".submitit").glob("*/*_submission.sh")}
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_a_lost_node_ends_its_job_fast_naming_the_node_and_its_ranks(sweeps):
    """Every rank process on node2 is killed (SIGKILL) mid-job: the ranks on node1 see their peers
    vanish, the job fails within seconds (well before trainer.collective_timeout_s), the record names
    node2 and its ranks, nothing of the job survives on either node, and the sweep reports it."""
    started, acted = sweeps
    sweep = started["dead_node"]
    killed = acted["node2_killed"].result(timeout=240)
    code, stderr = sweep.wait(timeout=120)
    ended = time.monotonic() - killed
    assert code == 1, stderr[-3000:]
    assert ended < 60, f"the sweep took {ended:.0f} s after the kill"
    record = sweep.jobs()[0][1]
    assert record["status"] == "failed", record
    message = record["error"]["message"]
    assert "node node2 lost: ranks [2, 3]" in message, message
    assert "1 of 1 jobs failed" in stderr, stderr[-3000:]
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_a_node_that_stops_answering_ends_its_job_after_the_collective_timeout(sweeps):
    """node2's ranks are frozen (SIGSTOP: alive, their connections open, as on a node that hangs or drops
    off the network): the ranks on node1 give up after trainer.collective_timeout_s (15 s), the record
    names node2, and the sweep cancels the frozen tasks (srun would wait for them until the time limit),
    so nothing of the job is left and the sweep ends."""
    started, acted = sweeps
    sweep = started["stuck_node"]
    stopped = acted["node2_stopped"].result(timeout=240)
    code, stderr = sweep.wait(timeout=180)
    ended = time.monotonic() - stopped
    assert code == 1, stderr[-3000:]
    # 15 s timeout + 5 s for the peers' errors + 20 s before stuck tasks are cancelled + the cancel itself
    assert ended < 90, f"the sweep took {ended:.0f} s after node2 stopped answering"
    record = sweep.jobs()[0][1]
    assert record["status"] == "failed", record
    message = record["error"]["message"]
    assert "node node2 lost: ranks [2, 3]" in message and "Timed out" in message, message
    assert "other tasks still run" in sweep.stdout and "cancelling the job" in sweep.stdout, sweep.stdout[-3000:]
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_a_sweep_says_when_its_job_waits_in_the_queue_and_why(sweeps):
    started, acted = sweeps
    sweep = started["held"]
    job_id = acted["released"].result(timeout=240)
    code, stderr = sweep.wait()
    assert code == 0, stderr[-3000:]
    assert re.search(rf"SLURM job {job_id} has waited 1\d s in the queue \(reason: JobHeldUser\)", sweep.stdout), (
        sweep.stdout[-3000:]
    )
    assert f"SLURM job {job_id} is running" in sweep.stdout
    ((_, record),) = sweep.jobs().values()
    assert record["status"] == "completed", record.get("error")


@pytest.mark.slow
def test_a_job_that_slurm_stops_comes_back_and_completes_bit_identical(sweeps, tmp_path):
    """Job 0 is requeued by ``scontrol requeue`` (SIGTERM: SLURM requeues it itself), job 1 gets SIGUSR1, the
    signal SLURM sends before the time limit (fsdp_exp requeues it through submitit). Both save, come
    back by themselves in the same folder, resume and complete: the losses of an uninterrupted run, bit
    for bit; the record counts the restart; the sweep counts both completed."""
    started, acted = sweeps
    sweep = started["resumed"]
    local = _local_losses(
        ["trainer.nproc_per_node=2", "trainer.steps=16", "trainer.warmup_steps=1"], tmp_path / "local"
    )
    acted["requeued"].result(timeout=240)
    acted["usr1"].result(timeout=240)
    code, stderr = sweep.wait(timeout=240)
    assert code == 0, stderr[-3000:]
    jobs = sweep.jobs()
    for number, (signal_name, requeued) in enumerate((("SIGTERM", None), ("SIGUSR1", True))):
        run_dir, record = jobs[number]
        assert record["status"] == "completed", record.get("error")
        slurm = record["slurm"]
        assert slurm["restarts"] == 1, slurm
        (stop,) = slurm["stops"]
        assert (stop["signal"], stop["requeued"]) == (signal_name, requeued), stop
        assert stop["saved_step"] >= 3
        assert record["resumed_from"]["step"] == stop["saved_step"]
        assert _losses(run_dir) == local  # bit for bit
    # The sweep said what happened while it waited.
    for job_id in (acted["requeued"].result(), acted["usr1"].result()):
        assert f"SLURM job {job_id} was requeued" in sweep.stdout, sweep.stdout[-3000:]
        assert f"SLURM job {job_id} is running again" in sweep.stdout, sweep.stdout[-3000:]
    assert _no_leftovers(sweep.dir) == []


@pytest.mark.slow
def test_the_time_limit_requeues_a_job_until_max_num_timeout(sweeps):
    sweep = sweeps[0]["time_limit"]
    code, stderr = sweep.wait(timeout=330)
    assert code == 0, stderr[-3000:]
    ((run_dir, record),) = sweep.jobs().values()
    assert record["status"] == "interrupted", record.get("error")
    slurm = record["slurm"]
    assert slurm["restarts"] == 1, slurm
    assert [(s["signal"], s["reason"], s["requeued"]) for s in slurm["stops"]] == [("SIGUSR1", "time limit", True)], (
        slurm
    )
    assert "hydra.launcher.max_num_timeout=1" in slurm["not_requeued"], slurm
    # The second start resumed from the first one's checkpoint and went further.
    assert record["resumed_from"]["step"] == slurm["stops"][0]["saved_step"]
    assert record["interrupted"]["checkpoint"]["step"] > slurm["stops"][0]["saved_step"]
    assert _no_leftovers(sweep.dir) == []


def test_sweeps_that_could_never_run_are_refused_before_submission(two_nodes, tmp_path):
    """A job larger than its partition would wait in the queue forever; a time-limit signal due before the
    ranks can handle it would kill them. Both are refused (exit 2) naming the fix; nothing is submitted."""
    env = {**os.environ, **job_env(two_nodes, tmp_path)}
    for name, overrides, said in (
        (
            "too_large",
            ["trainer.nnodes=1,3"],
            ["trainer.nnodes=3", "the default partition has 2 node(s)", "pass trainer.nnodes=2 or less"],
        ),
        (
            "early_signal",
            ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=90"],
            ["would come 30 s after a job starts", "hydra.launcher.signal_delay_s=60"],
        ),
    ):
        cmd = [
            sys.executable,
            "-m",
            "fsdp_exp",
            "-m",
            "hydra/launcher=slurm",
            *overrides,
            *QUIET,
            f"hydra.sweep.dir={tmp_path / name}",
        ]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "nothing was submitted" in result.stderr, result.stderr[-3000:]
        for words in said:
            assert words in result.stderr, result.stderr[-3000:]
        assert not (tmp_path / name / ".submitit").exists()


@pytest.mark.slow
def test_torchrun_on_two_hosts_is_one_run_that_trains_like_four_local_ranks(sweeps, four_local):
    proc = sweeps[0]["torchrun"]
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the 2-node torchrun job did not end in 240 s; the end of its output:\n{output[-4000:]}")
    assert proc.returncode == 0, f"srun ... torchrun exited {proc.returncode}:\n{output[-4000:]}"
    record = json.loads((proc.run_dir / "run.json").read_text())
    assert record["status"] == "completed", record.get("error")
    topology = record["topology"]
    assert (topology["world_size"], topology["nnodes"], topology["nproc_per_node"]) == (4, 2, 2), topology
    ranks = record["env"]["ranks"]
    assert [r["host"] for r in ranks] == ["node1", "node1", "node2", "node2"], ranks
    addresses = [r["address"] for r in ranks]
    assert addresses[0] == addresses[1] == proc.master != addresses[2] == addresses[3], ranks
    assert _losses(proc.run_dir) == pytest.approx(four_local, rel=1e-6)  # one writer, every step once
    assert _no_leftovers(proc.run_dir) == []
