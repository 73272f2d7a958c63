"""The local SLURM clusters of the SLURM tests (.ci/slurm/up): one node on 127.0.0.1, or two nodes in
network namespaces of their own. CI stands them up before the tests (.ci/run); a developer's run starts
them through the same script when SLURM is installed, and stops what it started. Without SLURM the tests
skip, unless FSDP_EXP_REQUIRE_SLURM=1 (CI), which turns that into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from conftest import MARKER, QUIET, REPO

SCRIPTS = REPO / ".ci" / "slurm"
REQUIRED = os.environ.get("FSDP_EXP_REQUIRE_SLURM") == "1"


@contextmanager
def cluster(nodes: int) -> Iterator[dict]:
    """What a process needs to reach the cluster of ``nodes`` nodes: SLURM_CONF, FSDP_EXP_SLURM_DIR, and
    PATH with the sacct stand-in. Stops the cluster afterwards if this call started it."""
    if shutil.which("slurmctld") is None:
        reason = (
            "SLURM is not installed: apt-get install -y --no-install-recommends slurmctld slurmd "
            "slurm-client munge (as root), or .ci/slurm/up --install"
        )
        if REQUIRED:
            pytest.fail(f"FSDP_EXP_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    # Each node count has its own default folder; a folder exported by an earlier `eval "$(.ci/slurm/up)"`
    # in the caller's shell would make both counts share one.
    env = {k: v for k, v in os.environ.items() if k != "FSDP_EXP_SLURM_DIR"}
    up = subprocess.run(
        [str(SCRIPTS / "up"), "--nodes", str(nodes)], capture_output=True, text=True, timeout=300, env=env
    )
    if up.returncode != 0:
        pytest.fail(f".ci/slurm/up --nodes {nodes} could not stand up the cluster (exit {up.returncode}):\n{up.stderr}")
    exported = dict(
        line.split("#")[0].strip().removeprefix("export ").split("=", 1)
        for line in up.stdout.splitlines()
        if line.startswith("export ")
    )
    cluster_env = {
        "SLURM_CONF": exported["SLURM_CONF"],
        "FSDP_EXP_SLURM_DIR": exported["FSDP_EXP_SLURM_DIR"],
        "PATH": f"{SCRIPTS / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        yield cluster_env
    finally:
        if exported.get("FSDP_EXP_SLURM_STARTED") == "1":
            subprocess.run(
                [str(SCRIPTS / "down"), "--nodes", str(nodes)],
                capture_output=True,
                timeout=120,
                env={**env, "FSDP_EXP_SLURM_DIR": exported["FSDP_EXP_SLURM_DIR"]},
            )


def job_env(cluster_env: dict, base: Path) -> dict:
    """The environment of a test's sweeps (and so of their jobs: sbatch exports it): the cluster's, quiet,
    offline, and away from the user's caches, like every test (conftest's BASE_ENV)."""
    return {
        **cluster_env,
        "WANDB_SILENT": "true",
        "OMP_NUM_THREADS": "1",
        "HYDRA_FULL_ERROR": "0",
        "WANDB_MODE": "offline",
        "WANDB_CACHE_DIR": str(base / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(base / "wandb_config"),
        "WANDB_DATA_DIR": str(base / "wandb_data"),
        "HF_HOME": str(base / "hf"),
    }


class Sweep:
    """``python -m fsdp_exp -m hydra/launcher=slurm ...`` running in the background."""

    def __init__(self, args: list[str], sweep_dir: Path, env: dict):
        self.dir = sweep_dir
        cmd = [
            sys.executable,
            "-m",
            "fsdp_exp",
            "-m",
            "hydra/launcher=slurm",
            *args,
            *QUIET,
            f"hydra.sweep.dir={sweep_dir}",
        ]
        # The marker travels with the jobs' environment (sbatch exports it), so their processes can be found.
        self.env = {**os.environ, **env, MARKER: str(sweep_dir)}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env
        )

    def wait(self, timeout: float = 240) -> tuple[int, str]:
        """(exit code, stderr) of the sweep; a sweep still running after ``timeout`` fails the test. Its
        stdout (Hydra's log: what was submitted, jobs queued, requeued, running) is then ``self.stdout``."""
        try:
            self.stdout, stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, stderr = self.proc.communicate()
            pytest.fail(f"the sweep did not end in {timeout} s:\n{self.stdout[-2000:]}\n{stderr[-3000:]}")
        return self.proc.returncode, stderr

    def jobs(self) -> dict[int, tuple[Path, dict]]:
        """{job number: (its folder, its run.json)}."""
        return {
            int(p.parent.name.split("_", 1)[0]): (p.parent, json.loads(p.read_text()))
            for p in self.dir.glob("*/run.json")
        }

    def slurm_jobs(self) -> dict[str, list[Path]]:
        """{SLURM job id (array element): its tasks' logs} from submitit's folder of the sweep."""
        return {
            folder.name: sorted(folder.glob("*_log.out"))
            for folder in (self.dir / ".submitit").iterdir()
            if folder.is_dir() and list(folder.glob("*_log.out"))
        }

    def stop(self) -> None:
        """Kill the sweep if it still runs, and cancel its jobs: a failed test leaves nothing queued."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        submitted = self.dir / ".submitit"
        ids = [p.name for p in submitted.iterdir() if p.is_dir()] if submitted.is_dir() else []
        if ids:
            subprocess.run(["scancel", *ids], env=self.env, capture_output=True, timeout=60)
