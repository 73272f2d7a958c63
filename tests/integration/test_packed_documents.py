"""Packed documents that never see each other (model.attention_mask=block_causal, data.positions=document):
on real gloo ranks, fp32, a batch of packed blocks of three documents each gives the same per-token losses
and the same gradients as the documents run one by one through a single unsharded process, under FSDP2
(shard 2), context parallel 2 (all_to_all), tensor parallel 2, pipeline parallel 2 (1F1B, 2 micro-batches),
and on 4 ranks FSDP2 2 x CP 2 and PP 2 x FSDP2 2. With ``causal`` (the four 2-rank layouts) the losses of
every document after a block's first differ: the mask is what keeps the documents apart.

Every case runs inside one spawned group of 4 ranks, round by round (tests/integration/test_context_parallel.py's
harness: two 2-rank cases side by side on a ("replica", ...) mesh). Tolerance 1e-5 (absolute on the per-token
losses, relative and absolute on the gradients): the same fp32 operations summed in another order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fsdp_exp.env import rank_env

from conftest import QUIET, TINY_MODEL, run_config

pytestmark = pytest.mark.slow

SEQ, ROWS, NPROCS, TOL = 32, 4, 4, 1e-5
# Three documents per block, of other lengths in every row (inputs: SEQ positions).
LENGTHS = [(9, 14, 9), (5, 20, 7), (16, 8, 8), (1, 30, 1)]
OVERRIDES = [
    *QUIET,
    *TINY_MODEL,
    f"trainer.seq_len={SEQ}",
    f"trainer.global_batch_size={ROWS}",
    "trainer.steps=2",
    "trainer.warmup_steps=1",
    "data.positions=document",
    "parallel.loss_parallel=false",
    "trainer.loss_chunks=1",
]
BLOCK = ["model.attention_mask=block_causal"]
CASES = {
    "fsdp2": BLOCK,
    "cp2": [*BLOCK, "parallel.cp=2", "parallel.cp_method=all_to_all"],
    "tp2": [*BLOCK, "parallel.tp=2"],
    "pp2": [*BLOCK, "parallel.pp=2"],
    "shard2_cp2": [*BLOCK, "parallel.cp=2", "parallel.cp_method=all_to_all"],
    "pp2_dp2": [*BLOCK, "parallel.pp=2"],
}
CAUSAL = {f"{name}_causal": ["model.attention_mask=causal", *over[1:]] for name, over in CASES.items()}
CASES.update({name: CAUSAL[name] for name in ("fsdp2_causal", "cp2_causal", "tp2_causal", "pp2_causal")})
# (ranks per case, the cases trained side by side: the same mesh, block-causal beside causal)
ROUNDS = [
    (2, ("fsdp2", "fsdp2_causal")),
    (2, ("cp2", "cp2_causal")),
    (2, ("tp2", "tp2_causal")),
    (2, ("pp2", "pp2_causal")),
    (4, ("shard2_cp2",)),
    (4, ("pp2_dp2",)),
]


def _batch():
    """(inputs, targets, documents) of ROWS packed blocks: seeded tokens, LENGTHS' documents."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=gen)
    documents = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(row)) for row in LENGTHS])
    return tokens[:, :-1], tokens[:, 1:], documents.to(torch.int32)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _rank(rank: int, world: int, port: int, cases: dict, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_exp.config import Topology, to_run_config

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for ranks, names in ROUNDS:
        config, topology = cases[names[0]]
        topology = Topology.from_dict(topology)
        shape, dims = topology.mesh_shape, topology.mesh_dim_names
        if ranks == world:
            name, mesh = names[0], init_device_mesh("cpu", shape, mesh_dim_names=dims)
        else:
            both = init_device_mesh("cpu", (world // ranks, *shape), mesh_dim_names=("replica", *dims))
            name, mesh = names[both["replica"].get_local_rank()], both[dims]
        config, topology = cases[name]
        _run_case(to_run_config(config), Topology.from_dict(topology), name, mesh, Path(out))
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as fsdp_exp's launcher does: no gloo teardown at interpreter exit


def _run_case(cfg, topology, name: str, mesh, out: Path) -> None:
    """One forward and backward of the packed batch through the trainer's calls (train_step, or pipeline_step's
    engine): this rank's per-token losses (with the rows and positions they belong to) and every gradient."""
    import torch.distributed as dist

    from fsdp_exp.models import build_meta, canonical_name
    from fsdp_exp.models.attention_mask import packed_inputs
    from fsdp_exp.parallel import parallelize

    par = parallelize(build_meta(cfg.model), cfg, mesh, torch.device("cpu"))
    rank = dist.get_rank() % topology.world_size
    dp, dp_rank = topology.dp_size, topology.dp_rank(rank)
    inputs, targets, documents = _batch()
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    packed = packed_inputs(documents[rows], cfg.model.attention_mask, cfg.data.positions)
    result: dict = {"rows": [rows.start, rows.stop]}
    if par.owns_step:  # pipeline: the engine's schedule over its micro-batches
        engine = par.engine
        result["mean_loss"] = engine.step(inputs[rows], targets[rows], **packed)
        params = [(n, p) for stage in engine.stages for n, p in stage.named_parameters()]
        grads = {canonical_name(n): _full(p.grad) for n, p in params}
        # the per-token losses: the same schedule again, its last stage handing back the logits
        for stage in engine.stages:
            stage.zero_grad(set_to_none=True)
        logits = engine.schedule.step(
            *((inputs[rows],) if engine.has_first else ()),
            target=targets[rows] if engine.has_last else None,
            losses=[] if engine.has_last else None,
            return_outputs=True,
            **packed,
        )
        if engine.has_last:
            per_token = F.cross_entropy(logits.float().flatten(0, 1), targets[rows].flatten(), reduction="none")
            result.update(positions=list(range(SEQ)), losses=per_token.view(-1, SEQ).tolist())
    else:
        x, y = par.sequence_shard(inputs[rows], targets[rows])
        local = par.packed_shard(packed)
        with par.gradient_sync(last=True):
            per_token = F.cross_entropy(
                par.model(x, **local).float().flatten(0, 1), y.flatten(), reduction="none"
            ).view(x.shape)
            par.backward(per_token.mean(), None)
        positions = par.context.positions.tolist() if par.context is not None else list(range(SEQ))
        result.update(positions=positions, losses=per_token.detach().tolist())
        grads = {canonical_name(n): _full(p.grad) for n, p in par.model.named_parameters()}
    (out / f"{name}-{rank}.json").write_text(json.dumps(result))
    torch.save(grads, out / f"{name}-grads-{rank}.pt")


def _spawn(out: Path) -> dict:
    import torch.multiprocessing as mp

    from fsdp_exp.config import plain
    from fsdp_exp.launch import free_port
    from fsdp_exp.preflight import validate

    cases = {}
    for ranks, names in ROUNDS:
        for name in names:
            cfg = run_config([*OVERRIDES, *CASES[name], f"trainer.nproc_per_node={ranks}"])
            cases[name] = (plain(cfg), validate(cfg, cuda_devices=0).as_dict())
    mp.start_processes(_rank, args=(NPROCS, free_port(), cases, str(out)), nprocs=NPROCS, start_method="spawn")
    results = {}
    for name in CASES:
        losses = torch.full((ROWS, SEQ), float("nan"))
        means, grads = [], {}
        for path in sorted(out.glob(f"{name}-[0-9]*.json")):
            r = json.loads(path.read_text())
            if "mean_loss" in r:
                means.append(r["mean_loss"])
            if "losses" in r:
                losses[slice(*r["rows"])][:, r["positions"]] = torch.tensor(r["losses"])
            grads.update(torch.load(path.with_name(path.name.replace("-", "-grads-", 1).replace(".json", ".pt"))))
        results[name] = {"losses": losses, "grads": grads, "mean_losses": means}
    return results


def _one_by_one() -> tuple[torch.Tensor, dict]:
    """Each document alone through one unsharded fp32 process (positions from 0, the causal mask): the
    per-token losses, and the gradients of their mean over the whole batch."""
    from fsdp_exp.models import build_meta, init_weights

    cfg = run_config([*OVERRIDES, *BLOCK])
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, cfg.trainer.seed, torch.device("cpu"))
    inputs, targets, _ = _batch()
    losses = torch.zeros(ROWS, SEQ)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            end = start + length
            logits = model(inputs[row : row + 1, start:end])
            losses[row, start:end] = F.cross_entropy(logits.float()[0], targets[row, start:end], reduction="none")
            start = end
    losses.mean().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return _one_by_one()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("packed_documents"))


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("_causal")])
def test_a_packed_block_trains_like_its_documents_one_by_one(runs, reference, case):
    losses, grads = reference
    run = runs[case]
    assert not run["losses"].isnan().any(), f"{case}: a token's loss was not written"
    torch.testing.assert_close(run["losses"], losses, rtol=0, atol=TOL)
    for mean in run["mean_losses"]:  # the pipeline's own loss: the batch's mean, on every rank
        assert mean == pytest.approx(losses.mean().item(), abs=TOL)
    assert set(run["grads"]) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(run["grads"][name], grad, rtol=TOL, atol=TOL, msg=f"{case}: {name}")


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("_causal")])
def test_with_the_causal_mask_the_documents_see_each_other(runs, reference, case):
    losses, _ = reference
    first_documents = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    for row, lengths in enumerate(LENGTHS):
        first_documents[row, : lengths[0]] = True
    later = runs[case]["losses"][~first_documents] - losses[~first_documents]
    # a block's first document sees nothing before it either way; every later one sees its predecessors
    torch.testing.assert_close(runs[case]["losses"][first_documents], losses[first_documents], rtol=0, atol=TOL)
    assert later.abs().max() > 1e-2
