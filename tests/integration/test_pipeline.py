"""Pipeline parallel (fsdp_exp/parallel/pipeline.py) trains like one process: real gloo ranks cut a tiny
Llama into stages, run torch's schedules over micro-batches, and after 5 steps the losses and every
parameter match tests/reference.py's single-process run of the same model, data and seed.

Every case runs inside one spawned group of 4 ranks (a spawn costs seconds here; see ROUNDS).
Tolerance, fp32: the stages compute the same operations on the same values as the single process, but
the loss is a mean of micro-batch means and the gradients a sum of micro-batch parts (and over dp, a
reduce-scatter), so they differ by float rounding only (measured: see docs/pipeline.md); 1e-5 relative on
the loss is the issue's bar, and 1e-5 absolute on the parameters (AdamW moves each by at most ~lr = 3e-4
a step) leaves room for the rounding only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_exp.env import rank_env

from conftest import QUIET, TINY_BATCH, TINY_MODEL, run_cli, run_config
from reference import reference_run

# Every test here shares the spawned group's fixture (~20 s on 2 idle cores, 30 s under load).
pytestmark = pytest.mark.slow

STEPS = 5
# 4 blocks, so that 2 ranks can hold 2 stages each (interleaved 1F1B).
# grad_clip 0.5: below the gradient norm (~0.92 here), so the clipping by the norm over all stages acts.
OVERRIDES = [*QUIET, *TINY_MODEL, "model.n_layers=4", *TINY_BATCH, f"trainer.steps={STEPS}", "trainer.grad_clip=0.5"]
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

# case -> the PipelineSettings fields. 8 sequences a step: 4 micro-batches of 2 on pp=2 alone.
PP2 = {
    "gpipe": dict(pp=2, schedule="gpipe", microbatches=4),
    "1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "interleaved_1f1b": dict(pp=2, schedule="interleaved_1f1b", microbatches=4, stages_per_rank=2),
    "looped_bfs": dict(pp=2, schedule="looped_bfs", microbatches=4, stages_per_rank=2),
    "zbv_zero_bubble": dict(pp=2, schedule="zbv_zero_bubble", microbatches=4, stages_per_rank=2),
    "dualpipev": dict(pp=2, schedule="dualpipev", microbatches=4, stages_per_rank=2),
}
PP2_DP2 = {"1f1b_fsdp2_dp2": dict(pp=2, schedule="1f1b", microbatches=2)}  # 4 sequences per dp rank
PP2_TP2 = {"1f1b_tp2": dict(pp=2, schedule="1f1b", microbatches=4)}
BF16 = {"1f1b_fsdp2_dp2_bf16": dict(pp=2, schedule="1f1b", microbatches=2)}
# ac=selective (every 2nd block) in stages of blocks [0] and [1, 2, 3]: the full model's blocks 0 and 2 are
# recomputed (counting a stage's own blocks would pick block 1 and 3 instead).
AC = {"1f1b_fsdp2_dp2_ac_selective": dict(pp=2, schedule="1f1b", microbatches=2, split=(1,))}
# The stage's dp ranks replicated (sharding=ddp: torch's replicate) or as HSDP (2 replicas x 1 shard): the same
# micro-batches and the same averaged gradients as 1f1b_fsdp2_dp2.
REPLICATED = {
    "1f1b_ddp_dp2": dict(pp=2, schedule="1f1b", microbatches=2),
    "1f1b_hsdp_dp2": dict(pp=2, schedule="1f1b", microbatches=2),
}
CASES = {**PP2, **PP2_DP2, **PP2_TP2, **BF16, **AC, **REPLICATED}
# The overrides a case's run adds to OVERRIDES (its config: the TP plan and loss parallel, the precision, AC).
CASE_OVERRIDES = {
    "1f1b_tp2": ["parallel.tp=2"],
    "1f1b_fsdp2_dp2_bf16": ["precision=bf16"],
    "1f1b_fsdp2_dp2_ac_selective": ["ac=selective"],
    "1f1b_ddp_dp2": ["sharding=ddp"],
    "1f1b_hsdp_dp2": ["sharding=hybrid", "sharding.replicate_size=2"],
}
# One spawned group of 4 ranks runs every case: a (replica, pp, dp, tp) mesh whose two replicas are two
# independent 2-rank pipelines (each round, replica 0 trains one case while replica 1 trains another),
# then pipelines over all four: pp=2 x dp=2, pp=2 x tp=2 (the pp, dp, tp mesh), pp=2 x dp=2 in bf16.
ROUNDS = [
    ((2, 2, 1, 1), ("gpipe", "1f1b")),
    ((2, 2, 1, 1), ("interleaved_1f1b", "looped_bfs")),
    ((2, 2, 1, 1), ("zbv_zero_bubble", "dualpipev")),
    ((1, 2, 2, 1), ("1f1b_fsdp2_dp2",)),
    ((1, 2, 1, 2), ("1f1b_tp2",)),
    ((1, 2, 2, 1), ("1f1b_fsdp2_dp2_bf16",)),
    ((1, 2, 2, 1), ("1f1b_fsdp2_dp2_ac_selective",)),
    ((1, 2, 2, 1), ("1f1b_ddp_dp2",)),
    ((1, 2, 2, 1), ("1f1b_hsdp_dp2",)),
]
NPROCS = 4
# bf16 compute (fp32 master parameters and gradient reduction), against the fp32 single process: the
# tolerance test_backends.py holds every backend's bf16 run to.
BF16_LOSS_RTOL = 1e-2


def _global_batches(cfg, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The reference's batches: the whole global batch of every step, from a one-rank topology."""
    from fsdp_exp.data import build_data
    from fsdp_exp.preflight import validate

    one = run_config([*OVERRIDES, "trainer.nproc_per_node=1"])
    data = build_data(one, validate(one, cuda_devices=0), dp_rank=0, device=torch.device("cpu"))
    return [(b.inputs, b.targets) for step in range(steps) for b in data.micro_batches(step)]


def settled(cfg):
    """``cfg`` with trainer.loss_chunks=auto settled as the launcher settles it (``fsdp_exp.launch.run_context``):
    the ranks here build the pipeline themselves."""
    from fsdp_exp.plan import loss_chunks_for
    from fsdp_exp.plan.loss_chunks import with_chunks
    from fsdp_exp.preflight import validate

    return with_chunks(cfg, loss_chunks_for(cfg, validate(cfg, cuda_devices=0)).chunks)


def _rank(rank: int, world: int, port: int, configs: dict, batches: list, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_exp.config import to_run_config

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    meshes: dict = {}
    for shape, names in ROUNDS:
        if shape not in meshes:
            meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replica", "pp", "dp", "tp"))
        mesh = meshes[shape]
        name = names[mesh["replica"].get_local_rank()]
        # The run's own mesh: (pp, dp), or (pp, dp, tp) under tensor parallel, as preflight lays it out.
        dims = ("pp", "dp", "tp") if shape[3] > 1 else ("pp", "dp")
        _train_case(to_run_config(configs[name]), name, mesh[dims], batches, Path(out), rank)
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as fsdp_exp's launcher does: no gloo teardown at interpreter exit


def _train_case(cfg, name: str, mesh, batches: list, out: Path, rank: int) -> None:
    """Train case ``name`` on the (pp, dp) or (pp, dp, tp) ``mesh``; write its parameters (each stage's first
    rank) and its losses (the mesh's first rank)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdp_exp.parallel.pipeline import PipelineSettings, build_pipeline

    engine = build_pipeline(cfg, PipelineSettings(**CASES[name]), mesh, torch.device("cpu"))
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    losses = []
    for inputs, targets in batches:
        rows = slice(dp_rank * inputs.shape[0] // dp, (dp_rank + 1) * inputs.shape[0] // dp)
        losses.append(engine.step(inputs[rows], targets[rows]))
        engine.optimizer_step(cfg.trainer.grad_clip)
    # Under the names DCP saves (an activation-checkpoint wrapper's dropped), gathered over dp and tp.
    params = {n: p.full_tensor() for stage in engine.stages for n, p in get_model_state_dict(stage).items()}
    first_of_stage = dp_rank == 0 and ("tp" not in mesh.mesh_dim_names or mesh["tp"].get_local_rank() == 0)
    if first_of_stage:
        checkpointed = {i: engine.applied["stages"][i].get("ac", {}).get("checkpointed") for i in engine.stage_indices}
        saved = {"params": params, "tp": _tensor_parallel_layout(engine), "checkpointed": checkpointed}
        torch.save(saved, out / f"{name}-params-{rank}.pt")
    if mesh["pp"].get_local_rank() == 0 and first_of_stage:
        (out / f"{name}.json").write_text(
            json.dumps(
                {
                    "losses": losses,
                    "stages": engine.stage_indices,
                    "stage_blocks": engine.applied["stage_blocks"],
                    "dp_layout": engine.applied["stages"][engine.stage_indices[0]]["dp_layout"],
                }
            )
        )


def _tensor_parallel_layout(engine) -> dict:
    """Per local stage: the root modules the TP plan was applied to, and the parameters sharded over a tp dim."""
    layout = {}
    for index, stage in zip(engine.stage_indices, engine.stages):
        applied = engine.applied["stages"][index].get("tp", {})
        on_tp = [n for n, p in stage.named_parameters() if "tp" in (p.device_mesh.mesh_dim_names or ())]
        layout[index] = {"root_plan": sorted(applied.get("root_plan", {})), "tp_params": on_tp}
    return layout


def _train_all(out: Path) -> dict:
    import torch.multiprocessing as mp

    from fsdp_exp.config import plain
    from fsdp_exp.launch import free_port

    batches = _global_batches(run_config(OVERRIDES), STEPS)
    # Each case's config is a pipeline run's on its pipeline's ranks (pp x dp x tp of its round's mesh): the
    # stages' recipe reads parallel.pp as a run's does (FSDP2 keeps stages unsharded, DDP replicates them).
    ranks = {name: shape[1] * shape[2] * shape[3] for shape, names in ROUNDS for name in names}
    configs = {
        name: plain(
            settled(
                run_config(
                    [
                        *OVERRIDES,
                        "parallel.pp=2",
                        f"trainer.nproc_per_node={ranks[name]}",
                        *CASE_OVERRIDES.get(name, []),
                    ]
                )
            )
        )
        for name in CASES
    }
    mp.start_processes(
        _rank, args=(NPROCS, free_port(), configs, batches, str(out)), nprocs=NPROCS, start_method="spawn"
    )
    results = {}
    for name in CASES:
        results[name] = json.loads((out / f"{name}.json").read_text())
        results[name]["params"], results[name]["tp"], results[name]["checkpointed"] = {}, {}, {}
        for path in out.glob(f"{name}-params-*.pt"):
            saved = torch.load(path)
            for key in ("params", "tp", "checkpointed"):
                results[name][key].update(saved[key])
    return results


@pytest.fixture(scope="module")
def reference():
    return reference_run(run_config(OVERRIDES), STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train_all(tmp_path_factory.mktemp("pipeline"))


def _assert_losses_match(run: dict, reference, case: str, rtol: float = LOSS_RTOL) -> None:
    expected_losses, _ = reference
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], expected_losses), 1):
        assert abs(got - want) / abs(want) < rtol, f"{case} step {step}: loss {got} vs single process {want}"


def _assert_matches_reference(run: dict, reference, case: str) -> None:
    _, model = reference
    _assert_losses_match(run, reference, case)
    expected = dict(model.named_parameters())
    assert sorted(run["params"]) == sorted(expected), f"{case}: the stages together hold every parameter once"
    for name, value in run["params"].items():
        gap = (value - expected[name].detach()).abs().max().item()
        assert gap < PARAM_ATOL, f"{case}: {name} differs from the single process by {gap}"


@pytest.mark.parametrize("case", sorted(PP2))
def test_two_pipeline_stages_train_like_one_process(runs, reference, case):
    _assert_matches_reference(runs[case], reference, case)


def test_interleaved_schedule_places_two_stages_on_each_rank(runs):
    assert runs["interleaved_1f1b"]["stages"] == [0, 2]  # pp rank 0, looped: stage s on rank s % pp
    assert runs["interleaved_1f1b"]["stage_blocks"] == [[0], [1], [2], [3]]
    assert runs["zbv_zero_bubble"]["stages"] == [0, 3]  # a V: pp rank 0 holds the first and the last stage


def test_two_stages_with_fsdp2_over_two_dp_ranks_train_like_one_process(runs, reference):
    _assert_matches_reference(runs["1f1b_fsdp2_dp2"], reference, "1f1b_fsdp2_dp2")


@pytest.mark.parametrize("case", sorted(REPLICATED))
def test_two_stages_replicated_over_two_dp_ranks_give_the_fsdp2_stages_losses_and_train_like_one_process(
    runs, reference, case
):
    fsdp2 = runs["1f1b_fsdp2_dp2"]["losses"]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(runs[case]["losses"], fsdp2)), (runs[case]["losses"], fsdp2)
    assert runs[case]["dp_layout"] == {"replicate": 2, "shard": 1}
    _assert_matches_reference(runs[case], reference, case)


def test_two_stages_with_tensor_parallel_over_two_ranks_inside_each_train_like_one_process(runs, reference):
    # parallel.tp=2 with its default loss parallel: the last stage's logits stay sharded over the vocabulary.
    run = runs["1f1b_tp2"]
    _assert_matches_reference(run, reference, "1f1b_tp2")
    # The plan reached each stage's modules and skipped the ends the stage does not run (nn.Identity).
    assert {i: layout["root_plan"] for i, layout in run["tp"].items()} == {0: ["tok_embeddings"], 1: ["output"]}
    assert "layers.0.attention.wq.weight" in run["tp"][0]["tp_params"]
    assert "output.weight" in run["tp"][1]["tp_params"] and "norm.weight" not in run["tp"][1]["tp_params"]


def test_two_stages_with_fsdp2_in_bf16_train_like_the_fp32_process_within_bf16_tolerance(runs, reference):
    run = runs["1f1b_fsdp2_dp2_bf16"]
    _assert_losses_match(run, reference, "1f1b_fsdp2_dp2_bf16", BF16_LOSS_RTOL)
    # And it did compute in bf16: its parameters left fp32's rounding (PARAM_ATOL) behind.
    _, model = reference
    expected = dict(model.named_parameters())
    assert max((v - expected[n].detach()).abs().max().item() for n, v in run["params"].items()) > PARAM_ATOL


def test_two_stages_with_selective_activation_checkpointing_recompute_the_full_models_blocks_and_train_like_one_process(
    runs, reference
):
    run = runs["1f1b_fsdp2_dp2_ac_selective"]
    assert run["checkpointed"] == {0: ["layers.0"], 1: ["layers.2"]}
    _assert_matches_reference(run, reference, "1f1b_fsdp2_dp2_ac_selective")


# The command line's pipeline run (fsdp_exp's launcher, trainer and preflight: parallel.pp*), checked against
# the same single-process reference: interleaved 1F1B, so each rank trains two stages under one optimizer.
CLI_PP = [
    "trainer.nproc_per_node=2",
    "parallel.pp=2",
    "parallel.pp_schedule=interleaved_1f1b",
    "parallel.pp_stages_per_rank=2",
    "parallel.pp_microbatches=4",
    "logger.wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The CLI pipeline run, saving each rank's stages at step 4 (and the last, 5) through DCP."""
    result = run_cli([*OVERRIDES, *CLI_PP, "checkpoint.every=4"], tmp_path_factory.mktemp("cli_pp") / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# The killed run's collective timeout: a rank whose peer died would wait this long in a P2P receive, so a
# job ended well before it was ended by the launcher noticing the dead rank, not by the wait running out.
KILLED_COLLECTIVE_TIMEOUT_S = 180


def test_a_killed_rank_ends_the_pipeline_run_naming_it_and_the_resume_trains_step_5_bit_identically(cli_run, tmp_path):
    """Rank 1 (the last stage of pp rank 1) is SIGKILLed at the start of step 5, after the step 4 checkpoint:
    the job exits 1 naming it; rerun in the same run directory, it resumes from step_4 and its step 5 is the
    uninterrupted run's, bit for bit."""
    run_dir = tmp_path / "run"
    killed = run_cli(
        [
            *OVERRIDES,
            *CLI_PP,
            "checkpoint.every=4",
            "debug.fail_at_step=4",  # 0-based: the fifth step
            "debug.fail_rank=1",
            "debug.fail_signal=SIGKILL",
            f"trainer.collective_timeout_s={KILLED_COLLECTIVE_TIMEOUT_S}",
        ],
        run_dir,
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert killed.seconds < KILLED_COLLECTIVE_TIMEOUT_S, f"took {killed.seconds:.0f} s"
    assert "rank 1" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert killed.record["status"] == "failed" and killed.record["error"]["rank"] == 1
    assert [row["step"] for row in killed.metrics] == [1, 2, 3, 4]

    resumed = run_cli([*OVERRIDES, *CLI_PP, "checkpoint.every=4"], run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.record["resumed_from"]["step"] == 4
    assert resumed.record["resumed_from"]["previous_attempt"]["error"]["rank"] == 1
    step_5 = [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in resumed.metrics if r["step"] == STEPS]
    assert step_5 == [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in cli_run.metrics if r["step"] == STEPS]


def test_the_command_line_pipeline_run_trains_like_one_process_and_records_its_cut(reference, cli_run):
    result = cli_run
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["train/loss"] for row in result.metrics]
    expected_losses, _ = reference
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, expected_losses), 1):
        assert abs(got - want) / abs(want) < LOSS_RTOL, f"step {step}: loss {got} vs single process {want}"
    pipeline = result.record["applied"]["pipeline"]
    assert (pipeline["schedule"], pipeline["n_microbatches"]) == ("ScheduleInterleaved1F1B", 4)
    assert pipeline["stage_blocks"] == [[0], [1], [2], [3]] and pipeline["local_stages"] == [0, 2]
    assert result.record["topology"]["mesh_dim_names"] == ["pp", "dp"]
    # Nothing ignored: the last stage takes the loss in the slices trainer.loss_chunks=auto (the default) settled
    # on before the ranks started (the planner's rule: one here, the logits barely matter to the worst rank's
    # peak), and the gradients are reduced after the last micro-batch, as recorded
    chosen = result.record["applied"]["loss_chunks"]
    assert chosen["trainer.loss_chunks"] == "auto" and chosen["why"].startswith("auto:")
    assert pipeline["loss_chunks"] == chosen["resolved"] == 1
    assert result.record["applied"]["grad_sync"] == {"trainer.grad_sync": "auto", "resolved": "last_micro_batch"}
