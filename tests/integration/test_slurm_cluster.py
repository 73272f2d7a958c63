"""The local cluster scripts themselves (.ci/slurm/up and down): a second 2-node cluster stands up beside
the one the other SLURM tests use, without touching it (its own addresses, namespaces, links and port,
derived from its folder), runs a job across its two nodes, and ``down`` removes exactly what its ``up``
made: daemons, namespaces, links, and nothing of the other cluster.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil
import pytest

from slurm_cluster import SCRIPTS, cluster


def _key(folder: Path) -> int:
    out = subprocess.run(["cksum"], input=str(folder), capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) % 200 + 20


def _links(folder) -> list[tuple[str, str]]:
    path = folder / "run" / "links"
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def _exists(kind: str, name: str) -> bool:
    if kind == "netns":
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        return any(line.split()[0] == name for line in listed.splitlines() if line.strip())
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def _daemons(conf: str) -> list[str]:
    return [
        " ".join(p.info["cmdline"])
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"]
        and p.info["cmdline"][0].split("/")[-1] in ("slurmctld", "slurmd")
        and conf in p.info["cmdline"]
    ]


@pytest.mark.slow
def test_a_second_cluster_stands_up_beside_the_first_and_down_removes_only_its_own(tmp_path):
    with cluster(2) as first:
        first_links = _links(Path(first["FSDP_EXP_SLURM_DIR"]))
        assert first_links, "the 2-node cluster records the links it made"
        # Names come from a checksum of the folder (.ci/slurm/names): pick one whose key differs from the
        # first cluster's, as a user would (up refuses a clash, naming the fix).
        folder = next(
            tmp_path / f"second{i}"
            for i in range(20)
            if _key(tmp_path / f"second{i}") != _key(Path(first["FSDP_EXP_SLURM_DIR"]))
        )
        env = {**os.environ, "FSDP_EXP_SLURM_DIR": str(folder)}
        up = subprocess.run([str(SCRIPTS / "up"), "--nodes", "2"], capture_output=True, text=True, env=env, timeout=180)
        try:
            assert up.returncode == 0, up.stderr
            exported = dict(
                line.split("#")[0].strip().removeprefix("export ").split("=", 1)
                for line in up.stdout.splitlines()
                if line.startswith("export ")
            )
            second_env = {**env, "SLURM_CONF": exported["SLURM_CONF"]}
            ours = _links(folder)
            assert {kind for kind, _ in ours} == {"link", "netns"} and not set(ours) & set(first_links), ours
            hosts = subprocess.run(
                ["srun", "-N2", "--ntasks-per-node=1", "--time=1", "hostname"],
                capture_output=True,
                text=True,
                env=second_env,
                timeout=60,
            )
            assert hosts.returncode == 0 and sorted(hosts.stdout.split()) == ["node1", "node2"], hosts.stderr
            assert _daemons(exported["SLURM_CONF"])
        finally:
            down = subprocess.run([str(SCRIPTS / "down")], capture_output=True, text=True, env=env, timeout=120)
        assert down.returncode == 0, down.stderr
        assert not [(kind, name) for kind, name in ours if _exists(kind, name)]
        assert _daemons(str(folder / "slurm.conf")) == []
        # The first cluster is untouched and still takes jobs.
        assert all(_exists(kind, name) for kind, name in first_links)
        still = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=1", "--time=1", "hostname"],
            capture_output=True,
            text=True,
            env={**os.environ, **first},
            timeout=60,
        )
        assert still.returncode == 0 and sorted(still.stdout.split()) == ["node1", "node2"], still.stderr


@pytest.mark.slow
def test_standing_up_a_cluster_in_its_default_folder_leaves_the_others_running():
    """`up --nodes 3` (its default folder, no FSDP_EXP_SLURM_DIR) clears what a half-started 3-node cluster
    left before starting; the 1-node cluster running beside it in its own default folder keeps running."""
    with cluster(1) as single:
        assert _daemons(single["SLURM_CONF"])
        env = {k: v for k, v in os.environ.items() if k != "FSDP_EXP_SLURM_DIR"}
        up = subprocess.run([str(SCRIPTS / "up"), "--nodes", "3"], capture_output=True, text=True, env=env, timeout=180)
        try:
            assert up.returncode == 0, up.stderr
            assert len(_daemons(single["SLURM_CONF"])) == 2, "up --nodes 3 stopped the 1-node cluster"
        finally:
            down = subprocess.run(
                [str(SCRIPTS / "down"), "--nodes", "3"], capture_output=True, text=True, env=env, timeout=120
            )
        assert down.returncode == 0, down.stderr
        assert len(_daemons(single["SLURM_CONF"])) == 2, "down --nodes 3 stopped the 1-node cluster"
        idle = subprocess.run(
            ["srun", "--time=1", "hostname"], capture_output=True, text=True, env={**os.environ, **single}, timeout=60
        )
        assert idle.returncode == 0, idle.stderr
