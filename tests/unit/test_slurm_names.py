"""SLURM's names and words, read without a cluster: the first host of a node list (where a step's task 0
runs, so its rendezvous host), the partition check that refuses a job its partition can never hold, and
what the report says of a job that SLURM stopped and that was not requeued."""

from __future__ import annotations

import shutil

import pytest

from fsdp_exp.env import first_node, parse_first_node
from fsdp_exp.errors import ConfigError
from fsdp_exp.slurm import check_partition

# Node lists in SLURM's syntax and their first host, as `scontrol show hostnames` expands them.
NODE_LISTS = {
    "gpu[003-010,015],cpu01": "gpu003",  # ranges keep their zero padding
    "node1": "node1",
    "a-b[1,2]": "a-b1",  # a dash in the name is not a range
    "n[1-2],m3": "n1",
    "x[5]": "x5",
    "rack[1-2]-node[01-04]": "rack1-node01",  # several bracket groups in one name
    "cpu01,gpu[1-4]": "cpu01",
}


@pytest.mark.parametrize("nodelist, first", NODE_LISTS.items())
def test_parse_first_node(nodelist, first):
    assert parse_first_node(nodelist) == first


def test_first_node_without_scontrol_parses_the_list(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no scontrol
    assert shutil.which("scontrol") is None
    for nodelist in [*NODE_LISTS, ""]:
        assert first_node(nodelist) == parse_first_node(nodelist), nodelist


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not installed")
def test_first_node_agrees_with_scontrol(monkeypatch, tmp_path):
    """Where scontrol exists first_node asks it; the parser must give SLURM's own answer. Expanding a list
    needs only a readable slurm.conf, not a controller."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=names\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    for nodelist, first in NODE_LISTS.items():
        assert first_node(nodelist) == first, nodelist


SIZES = {"debug": 2, "": 2, "gpu": 4}  # as partition_sizes() gives them: the default (debug) also under ""


def test_a_job_its_partition_holds_passes():
    check_partition(None, 2, SIZES)
    check_partition("debug", 1, SIZES)
    check_partition("gpu", 4, SIZES)


def test_more_nodes_than_the_default_partition_has_is_refused():
    with pytest.raises(ConfigError) as err:
        check_partition(None, 3, SIZES)
    message = str(err.value)
    assert "trainer.nnodes=3" in message and "the default partition has 2 node(s)" in message, message
    assert "fix: pass trainer.nnodes=2 or less" in message and "hydra.launcher.partition=" in message, message


def test_more_nodes_than_a_named_partition_has_is_refused():
    with pytest.raises(ConfigError, match=r"gpu has 4 node\(s\)(.|\n)*fix: pass trainer.nnodes=4 or less"):
        check_partition("gpu", 5, SIZES)


def test_an_unknown_partition_names_the_known_ones():
    with pytest.raises(ConfigError) as err:
        check_partition("gpus", 1, SIZES)
    message = str(err.value)
    assert "hydra.launcher.partition=gpus" in message and "no such partition" in message, message
    assert "fix: pass hydra.launcher.partition=<one of: debug, gpu>" in message, message


def test_without_partition_sizes_nothing_is_checked():
    """SLURM could not be asked (no scontrol, no controller): sbatch judges the request itself."""
    check_partition(None, 64, {})
    check_partition("anything", 64, {})


def test_an_interrupted_run_that_was_not_requeued_says_why_in_the_report():
    from fsdp_exp.report.load import Run

    interrupted = {
        "status": "interrupted",
        "interrupted": {"signal": "SIGUSR1", "checkpoint": {"step": 179, "path": "/runs/0/checkpoints/step_179"}},
    }
    assert (
        Run("/runs/0", record=interrupted).error
        == "stopped by SIGUSR1 after step 179; checkpoint /runs/0/checkpoints/step_179"
    )
    stopped = {**interrupted, "slurm": {"restarts": 1, "not_requeued": "the job reached its time limit 2 time(s)"}}
    assert Run("/runs/0", record=stopped).error.endswith("; not requeued: the job reached its time limit 2 time(s)")


def test_a_ranks_rendezvous_environment_names_its_peers_and_its_place_on_its_node(monkeypatch):
    """The env:// block (fsdp_exp.env.rank_env): a local rank by default, a SLURM task's place on its node."""
    import os

    from fsdp_exp.env import export_slurm_rendezvous, rank_env

    assert rank_env(1, 2, 29400) == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    for name in [*rank_env(0, 0, 0), "TORCHELASTIC_RUN_ID"]:  # set, then unset: restored when the test ends
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    slurm |= {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_ID": "7"}
    slurm |= {"SLURM_STEP_NODELIST": "gpu[003-004]"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    export_slurm_rendezvous()
    assert {k: os.environ[k] for k in rank_env(0, 0, 0)} == rank_env(
        3, 4, 20028, master="gpu003", local_rank=1, local_world=2
    )
