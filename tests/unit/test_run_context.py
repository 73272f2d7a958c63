"""The run context the launcher hands every rank: made once from the composed config, typed, and cheap to
make (no process group: the launcher's part only)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from fsdp_exp.config import RunConfig, Topology
from fsdp_exp.context import Labels, RunContext, Sweep
from fsdp_exp.launch import prepare, run_context
from tests.conftest import run_config

REPO = Path(__file__).resolve().parents[2]


def test_a_spawned_rank_gets_the_launchers_context_typed_and_whole(tmp_path):
    cfg = run_config([])
    labels = Labels(overrides=("precision=fp32",), choices={"model": "llama_tiny"}, sweep=Sweep("s", "s", 3))
    context = run_context(cfg, prepare(cfg), tmp_path, labels)
    back = pickle.loads(pickle.dumps(context))  # what torch.multiprocessing's spawn does with it
    assert isinstance(back, RunContext) and isinstance(back.config, RunConfig) and isinstance(back.topology, Topology)
    assert back == context
    # The planner's prediction is in it, the same figures a rank logs beside its measurements.
    assert back.prediction.row["mem/predicted_peak_gib"] > 0
    assert back.prediction.record["peak"]["total"] / 2**30 == back.prediction.row["mem/predicted_peak_gib"]
    assert labels.as_record() == {
        "overrides": ["precision=fp32"],
        "choices": {"model": "llama_tiny"},
        "sweep": {"dir": "s", "name": "s", "job": 3},
    }


def test_a_topology_read_back_from_run_json_is_the_one_written():
    topology = prepare(run_config(["sharding=hybrid", "trainer.nproc_per_node=4", "sharding.shard_size=2"]))
    assert Topology.from_dict(json.loads(json.dumps(topology.as_dict()))) == topology
