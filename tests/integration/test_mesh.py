"""The run's mesh and its sub-meshes (fsdp_exp/parallel/mesh.py), built for real on 4 gloo ranks:
which ranks each parallelism's groups hold, and that a collective over each reaches exactly them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

NPROCS = 4

# name: (backend dp shape, dp names, pp, cp, tp, ep)
LAYOUTS = {
    "shard4_cp2": ((2,), ("shard",), 1, 2, 1, 2),
    "hsdp2x1_cp2": ((2, 1), ("replicate", "shard"), 1, 2, 1, 2),
    "shard2_tp2": ((2,), ("shard",), 1, 1, 2, 2),
    "pp2_dp1_cp2": ((1,), ("dp",), 2, 2, 1, 2),
    "shard4_ep4": ((4,), ("shard",), 1, 1, 1, 4),
}


def _members(mesh) -> list[int]:
    """The global ranks of this rank's group on a 1-D mesh, read back by an all-gather over it."""
    import torch
    import torch.distributed as dist

    group = mesh.get_group()
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return sorted(int(t) for t in out)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from fsdp_exp.config.layout import Layout
    from fsdp_exp.parallel import mesh as meshes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(NPROCS))
    dist.init_process_group("gloo")
    found = {}
    for name, (dp_shape, dp_names, pp, cp, tp, ep) in LAYOUTS.items():
        dims = tuple(zip(dp_names, dp_shape))
        replicate, dp = dict(dims).get("replicate", 1), math.prod(dp_shape)
        built = meshes.build_meshes(Layout(NPROCS, pp, replicate, dp // replicate, cp, tp, ep, dims), "cpu")
        names, dense, cp_group, ep_mesh, efsdp = (
            built.world.mesh_dim_names,
            built.dense_dp,
            built.cp,
            built.ep,
            built.efsdp,
        )
        found[name] = {
            "names": list(names),
            "dense_names": list(dense.mesh_dim_names),
            "dense": sorted(int(r) for r in dense.mesh.flatten()),
            "cp": _members(cp_group) if cp_group is not None else None,
            "ep": _members(ep_mesh),
            "efsdp": sorted(int(r) for r in efsdp.mesh.flatten()),
        }
    Path(out, f"{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    from fsdp_exp.launch import free_port

    out = tmp_path_factory.mktemp("mesh")
    mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=NPROCS, start_method="spawn")
    return {r: json.loads((out / f"{r}.json").read_text()) for r in range(NPROCS)}


def test_cp_sits_between_the_data_parallel_dims_and_tp_and_its_groups_are_consecutive_ranks(meshes):
    assert meshes[0]["shard4_cp2"]["names"] == ["shard", "cp"]
    assert meshes[0]["pp2_dp1_cp2"]["names"] == ["pp", "dp", "cp"]
    for rank in range(NPROCS):
        assert meshes[rank]["shard4_cp2"]["cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert meshes[rank]["pp2_dp1_cp2"]["cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]


def test_fsdp_shards_dense_weights_over_shard_times_cp(meshes):
    for rank in range(NPROCS):
        assert meshes[rank]["shard4_cp2"]["dense"] == [0, 1, 2, 3]
        assert meshes[rank]["shard4_cp2"]["dense_names"] == ["shard_cp"]
        assert meshes[rank]["hsdp2x1_cp2"]["dense_names"] == ["replicate", "shard_cp"]
        assert meshes[rank]["hsdp2x1_cp2"]["dense"] == [0, 1, 2, 3]
        # tensor parallel keeps its own dim: the dense data-parallel mesh holds this rank's tp peers' partners
        assert meshes[rank]["shard2_tp2"]["dense"] == [rank % 2, rank % 2 + 2]
        # a pipeline stage's data-parallel ranks with cp folded in: the two ranks of this pp stage
        assert meshes[rank]["pp2_dp1_cp2"]["dense"] == [rank // 2 * 2, rank // 2 * 2 + 1]


def test_expert_groups_are_borrowed_from_shard_times_cp_and_experts_shard_over_what_is_left(meshes):
    for rank in range(NPROCS):
        assert meshes[rank]["shard4_ep4"]["ep"] == [0, 1, 2, 3]
        assert meshes[rank]["shard4_ep4"]["efsdp"] == [rank]
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert meshes[rank]["shard4_cp2"]["ep"] == pair  # ep 2 of shard 2 x cp 2: the cp pair
        assert meshes[rank]["shard4_cp2"]["efsdp"] == [rank % 2, rank % 2 + 2]
        # under HSDP the experts are replicated over `replicate` and sharded over the rest
        assert meshes[rank]["hsdp2x1_cp2"]["ep"] == pair
        assert meshes[rank]["hsdp2x1_cp2"]["efsdp"] == [rank % 2, rank % 2 + 2]
        # with tp the ep group skips over tp peers: ranks with the same tp index
        assert meshes[rank]["shard2_tp2"]["ep"] == [rank % 2, rank % 2 + 2]
