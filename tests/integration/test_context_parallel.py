"""Context parallel (fsdp_exp/parallel/context.py, all_to_all attention) trains like one process: real gloo
ranks split every sequence of a tiny Llama (grouped-query: 4 heads, 2 key/value heads) over cp ranks, FSDP2
shards the weights over shard x cp, and after 5 steps the losses, the first step's gradients and every
parameter match tests/reference.py's single unsharded process on the same data and seed.

Every case runs inside one spawned group of 4 ranks, round by round (a spawn costs seconds here): each
round's mesh is ("replica", *the case's own mesh as preflight lays it out), so two 2-rank cases train side by
side. Tolerances, fp32: the same operations on the same values, summed in another order (the all-to-alls
move values without arithmetic; FSDP2's reduce-scatter sums over shard x cp), so float rounding only:
1e-5 relative on the loss and the gradients, 1e-5 absolute on the parameters (as test_pipeline.py). bf16
compute against the fp32 process: 1e-2 on the loss (test_backends.py's bar for every backend's bf16), and
float8's linears the same. Compiled blocks (compile=true) are held to fp32's bars.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_exp.env import rank_env

from conftest import QUIET, TINY_BATCH, TINY_MODEL, run_config
from reference import reference_run

pytestmark = pytest.mark.slow

STEPS = 5
# grad_clip 0.5: below the gradient norm (~0.8 here), so clipping by the norm over every shard acts.
OVERRIDES = [*QUIET, *TINY_MODEL, *TINY_BATCH, f"trainer.steps={STEPS}", "trainer.grad_clip=0.5"]
NPROCS = 4
LOSS_RTOL, GRAD_RTOL, PARAM_ATOL, BF16_LOSS_RTOL = 1e-5, 1e-5, 1e-5, 1e-2

# case -> its overrides on top of OVERRIDES (trainer.nproc_per_node comes from its round).
CASES = {
    "cp2": ["parallel.cp=2"],
    "cp2_bf16": ["parallel.cp=2", "precision=bf16"],
    "cp2_ac_full": ["parallel.cp=2", "ac=full"],
    # The loss in chunks of a sequence shard (the model's own forward takes it: fsdp_exp.models.loss).
    "cp2_loss_chunks": ["parallel.cp=2", "trainer.loss_chunks=4"],
    # 4 heads over 4 CP ranks: one query head each, the 2 key/value heads repeated up to 4 first.
    "cp4": ["parallel.cp=4"],
    "shard2_cp2": ["parallel.cp=2"],  # FSDP2 over shard 2 x cp 2, two batch shards
    "hybrid_cp2": ["parallel.cp=2", "sharding=hybrid", "sharding.replicate_size=2", "sharding.shard_size=1"],
    # 2 local heads after TP, cp 2 of them; 1 local key/value head, repeated.
    "tp2_cp2": ["parallel.cp=2", "parallel.tp=2"],
    # Each block compiled with the exchange inside it (funcol's all-to-all traces); torchao's float8 linears
    # (emulated on a CPU) around the unchanged attention.
    "cp2_compile": ["parallel.cp=2", "compile=true"],
    "cp2_float8": ["parallel.cp=2", "precision=float8"],
}
# (ranks per case, the cases trained side by side)
ROUNDS = [
    (2, ("cp2", "cp2_bf16")),
    (2, ("cp2_ac_full", "cp2_loss_chunks")),
    (4, ("cp4",)),
    (4, ("shard2_cp2",)),
    (4, ("hybrid_cp2",)),
    (4, ("tp2_cp2",)),
    (2, ("cp2_compile", "cp2_float8")),
]
# float8's matmuls round their operands to 8 bits: against the fp32 process, bf16's bar.
FLOAT8_LOSS_RTOL = 1e-2


def _case_config(name: str, ranks: int):
    return run_config([*OVERRIDES, *CASES[name], f"trainer.nproc_per_node={ranks}"])


def _global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The reference's batches: the whole global batch of every step, from a one-rank topology."""
    from fsdp_exp.data import build_data
    from fsdp_exp.preflight import validate

    one = run_config([*OVERRIDES, "trainer.nproc_per_node=1"])
    data = build_data(one, validate(one, cuda_devices=0), dp_rank=0, device=torch.device("cpu"))
    return [(b.inputs, b.targets) for step in range(steps) for b in data.micro_batches(step)]


def _rank(rank: int, world: int, port: int, cases: dict, batches: list, out: str) -> None:
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
        if ranks == world:  # the run's own mesh, as the trainer builds it (fsdp_exp/parallel/mesh.py)
            name, mesh = names[0], init_device_mesh("cpu", shape, mesh_dim_names=dims)
        else:
            both = init_device_mesh("cpu", (world // ranks, *shape), mesh_dim_names=("replica", *dims))
            name, mesh = names[both["replica"].get_local_rank()], both[dims]
        config, _ = cases[name]
        _train_case(to_run_config(config), topology, name, mesh, batches, Path(out))
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as fsdp_exp's launcher does: no gloo teardown at interpreter exit


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_case(cfg, topology, name: str, mesh, batches: list, out: Path) -> None:
    """The trainer's step (fsdp_exp/trainer.py: train_step), through the same Parallelized calls, on this
    case's mesh: this rank's batch rows (its dp index) and its positions of every sequence (its cp index)."""
    from fsdp_exp.models import build_meta, canonical_name, matrix_parameter_names
    from fsdp_exp.models.loss import mean_cross_entropy
    from fsdp_exp.optim import build_scheduler
    from fsdp_exp.parallel import parallelize
    from fsdp_exp.plan import loss_chunks_for

    chunks = loss_chunks_for(cfg, topology).chunks  # trainer.loss_chunks=auto, as the launcher settles it
    meta = build_meta(cfg.model)
    decay = matrix_parameter_names(meta)
    par = parallelize(meta, cfg, mesh, torch.device("cpu"))
    optimizer = par.build_optimizer(decay)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.steps)
    import torch.distributed as dist

    rank = dist.get_rank() % topology.world_size  # the replica dim is outermost: this case's own rank
    dp, dp_rank = topology.dp_size, topology.dp_rank(rank)
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(batches):
        rows = slice(dp_rank * inputs.shape[0] // dp, (dp_rank + 1) * inputs.shape[0] // dp)
        x, y = par.sequence_shard(inputs[rows], targets[rows])
        par.zero_grad(optimizer)
        with par.gradient_sync(last=True), par.loss_parallel():
            with par.autocast():
                loss = mean_cross_entropy(par.model, x, y, chunks)
            par.backward(loss, None)
        if step == 0:
            grads = {canonical_name(n): _full(p.grad) for n, p in par.model.named_parameters()}
        par.optimizer_step(optimizer, None, cfg.trainer.grad_clip)
        scheduler.step()
        losses.append(loss.item())
    params = {canonical_name(n): _full(p.detach()) for n, p in par.model.named_parameters()}
    (out / f"{name}-losses-{rank}.json").write_text(json.dumps(losses))
    if rank == 0:
        torch.save({"params": params, "grads": grads, "applied": par.applied.get("cp")}, out / f"{name}.pt")


def _train_all(out: Path) -> dict:
    import torch.multiprocessing as mp

    from fsdp_exp.config import plain
    from fsdp_exp.launch import free_port
    from fsdp_exp.preflight import validate

    cases = {}
    for ranks, names in ROUNDS:
        for name in names:
            cfg = _case_config(name, ranks)
            cases[name] = (plain(cfg), validate(cfg, cuda_devices=0).as_dict())
    with pytest.MonkeyPatch.context() as env:  # compile=true: inductor's cache shared by this session's tests
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(out.parent / "inductor-cache"))
        mp.start_processes(
            _rank,
            args=(NPROCS, free_port(), cases, _global_batches(STEPS), str(out)),
            nprocs=NPROCS,
            start_method="spawn",
        )
    results = {}
    for name in CASES:
        per_rank = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-losses-*.json"))]
        # Every rank's loss is the mean over its own tokens, equally many on each: their mean is the batch's.
        results[name] = {"losses": [sum(s) / len(s) for s in zip(*per_rank)], **torch.load(out / f"{name}.pt")}
    return results


def _first_step_gradients() -> dict[str, torch.Tensor]:
    """The single unsharded fp32 process's gradients of the first step (before clipping), tests/reference.py's way."""
    import torch.nn.functional as F

    from fsdp_exp.models import build_meta, init_weights

    cfg = run_config(OVERRIDES)
    torch.manual_seed(cfg.trainer.seed)
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, cfg.trainer.seed, torch.device("cpu"))
    inputs, targets = _global_batches(1)[0]
    F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    losses, model = reference_run(run_config(OVERRIDES), STEPS)
    return losses, model, _first_step_gradients()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train_all(tmp_path_factory.mktemp("context_parallel"))


def _assert_matches_reference(run: dict, reference, case: str, loss_rtol: float = LOSS_RTOL, exact: bool = True):
    expected_losses, model, expected_grads = reference
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], expected_losses), 1):
        assert abs(got - want) / abs(want) < loss_rtol, f"{case} step {step}: loss {got} vs single process {want}"
    if not exact:
        return
    assert sorted(run["grads"]) == sorted(expected_grads)
    for name, grad in run["grads"].items():
        gap = ((grad - expected_grads[name]).norm() / expected_grads[name].norm()).item()
        assert gap < GRAD_RTOL, f"{case}: {name}'s first gradient differs by {gap:.2e} (relative)"
    expected = dict(model.named_parameters())
    for name, value in run["params"].items():
        gap = (value - expected[name].detach()).abs().max().item()
        assert gap < PARAM_ATOL, f"{case}: {name} differs from the single process by {gap}"


@pytest.mark.parametrize(
    "case", ["cp2", "cp4", "shard2_cp2", "hybrid_cp2", "tp2_cp2", "cp2_ac_full", "cp2_loss_chunks", "cp2_compile"]
)
def test_a_sequence_split_over_context_parallel_ranks_trains_like_one_process(runs, reference, case):
    assert runs[case]["applied"]["method"] == "all_to_all"
    _assert_matches_reference(runs[case], reference, case)


def test_context_parallel_in_bf16_follows_the_fp32_process_within_bf16_rounding(runs, reference):
    _assert_matches_reference(runs["cp2_bf16"], reference, "cp2_bf16", loss_rtol=BF16_LOSS_RTOL, exact=False)


def test_every_attention_kernel_is_wrapped_and_each_rank_holds_a_head_and_a_tail_chunk(runs):
    assert runs["cp4"]["applied"]["attention_kernels"] == 2  # one per block of the tiny Llama
    assert runs["cp4"]["applied"]["cp"] == 4


def test_context_parallel_with_float8_linears_follows_the_fp32_process_within_their_rounding(runs, reference):
    assert runs["cp2_float8"]["applied"]["method"] == "all_to_all"
    _assert_matches_reference(runs["cp2_float8"], reference, "cp2_float8", loss_rtol=FLOAT8_LOSS_RTOL, exact=False)
