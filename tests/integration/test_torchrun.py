"""torchrun multi-node: two torchrun processes on localhost act as two nodes of 2 ranks each; the job is
one run (one record, one W&B run) and trains exactly like the same world size launched by fsdp_exp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI_NODE_TRAINING, QUIET, REPO, read_metrics
from fsdp_exp.launch import free_port

ARGS = [*MULTI_NODE_TRAINING, "checkpoint.on_signal=false"]


def _torchrun_node(node_rank: int, port: int, run_dir: Path, log: Path) -> subprocess.Popen:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "fsdp-exp-test",
        "-m",
        "fsdp_exp",
        *ARGS,
        *QUIET,
        f"hydra.run.dir={run_dir}",
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


@pytest.mark.slow
def test_two_torchrun_nodes_make_one_run(tmp_path, four_local_ranks):
    run_dir = tmp_path / "run"
    port = free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [_torchrun_node(n, port, run_dir, logs[n]) for n in (0, 1)]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)

    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed"
    topo = record["topology"]
    assert (topo["world_size"], topo["nnodes"], topo["nproc_per_node"]) == (4, 2, 2)
    assert len(record["shard_digests"]) == 4
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: rank 0, once
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1

    # The same job launched by fsdp_exp itself on 4 local ranks (conftest's FOUR_LOCAL_RANKS) trains identically.
    assert [r["train/loss"] for r in rows] == pytest.approx(four_local_ranks, rel=1e-6)


@pytest.mark.slow
def test_a_failing_rank_under_torchrun_is_named_in_the_record(tmp_path):
    """No fsdp_exp launcher watches torchrun's ranks: the rank that raised records the failure itself,
    and rank 0 (which only saw its peer vanish) names that rank too. Without hydra.run.dir, every rank
    picks the same folder (named by torchrun's run id, not each rank's clock)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fsdp_exp",
        *ARGS,
        "debug=fail_rank",
        "logger.wandb.mode=disabled",
        *QUIET,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode != 0
    (run_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    assert run_dir.name.startswith("torchrun-")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed"
    assert record["error"]["rank"] == 1 and "InjectedFailure" in record["error"]["message"], record["error"]
    assert (run_dir / "errors" / "rank1.txt").exists()
