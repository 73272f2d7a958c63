"""The memory planner (fsdp_exp/plan.py): exact model-state arithmetic, the CLI, and its predictions
against torch's memory tracker on real runs: the whole step's peak, and the peak of each phase
(forward, backward, optimizer) with the model states alive at it.

The measured matrix is a pairwise covering of sharding {full, grad_op, no_shard, ddp} x precision
{fp32, bf16} x ac {none, full} x world {1, 2, 4}: every pair of values appears in some run (12 runs),
plus uneven shards over 3 ranks and FSDP1 (model states only; torch's tracker cannot hook FSDP1).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fsdp_exp.preflight import validate

from conftest import TINY_BATCH, TINY_MODEL, REPO, read_metrics, run_config, run_experiment

GIB = 2**30
TINY = [
    *TINY_MODEL,
    *TINY_BATCH,
    "trainer.steps=3",
    "trainer.warmup_steps=2",
    "logger.wandb.mode=disabled",
    "checkpoint.on_signal=false",
    "trainer.digest_shards=false",
    "trainer.peak_tflops=1.0",
]  # MFU is not under test here: skip measuring this CPU's peak

# (sharding, precision, ac, world): each pair of factor values is covered at least once.
MATRIX = [
    ("full", "fp32", "none", 1),
    ("grad_op", "bf16", "full", 1),
    ("no_shard", "bf16", "none", 1),
    ("ddp", "fp32", "full", 1),
    ("full", "bf16", "full", 2),
    ("grad_op", "fp32", "none", 2),
    ("no_shard", "fp32", "full", 2),
    ("ddp", "bf16", "none", 2),
    ("full", "fp32", "full", 4),
    ("grad_op", "bf16", "none", 4),
    ("no_shard", "bf16", "full", 4),
    ("ddp", "fp32", "none", 4),
]
MODEL_STATES_TOLERANCE = 0.03
PEAK_TOLERANCE = 0.10
# The optimizer phase is never the step's peak here, and its measured total depends on timing: on one
# rank gloo's copy of the root unit's last reduce-scatter is sometimes still alive when the optimizer
# starts (seen: -11.6% at 4 ranks, where that buffer is large next to the tiny model's states). Its
# deterministic part, the model states, is held to MODEL_STATES_TOLERANCE below.
OPTIMIZER_PHASE_TOLERANCE = 0.15
STAGES = ("forward", "backward", "optimizer")


def _plan(overrides, **kwargs):
    from fsdp_exp.plan import plan

    cfg = run_config(overrides)
    return plan(cfg, validate(cfg, cuda_devices=0), **kwargs)


def _run_and_compare(overrides, run_dir, tracked=True):
    run_experiment(overrides, run_dir)
    rows = read_metrics(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    predicted = _plan(overrides)
    # The run logged the planner's prediction in every row, and the whole plan in run.json.
    assert all(r["mem/predicted_model_states_gib"] == rows[0]["mem/predicted_model_states_gib"] for r in rows)
    assert record["plan"]["peak"]["total"] == predicted.peak["total"]
    at_rest = rows[-1]["mem/model_states_gib_max"] * GIB
    got = rows[-1]["mem/predicted_model_states_gib"] * GIB
    assert got == predicted.model_states["total"]
    assert abs(got / at_rest - 1) < MODEL_STATES_TOLERANCE, (got, at_rest)
    if not tracked:
        return None
    row = next(r for r in rows if "mem/tracked_total_gib_max" in r)
    measured, peak = row["mem/tracked_total_gib_max"] * GIB, row["mem/predicted_peak_gib"] * GIB
    error = peak / measured - 1
    assert abs(error) < PEAK_TOLERANCE, (
        f"predicted peak {peak:.0f} B ({predicted.peak['phase']}) vs tracked {measured:.0f} B: {error:+.1%}"
    )
    # The whole step's peak is its largest phase's, on both sides.
    assert row["mem/tracked_total_gib_max"] == max(row[f"mem/tracked_{s}_total_gib_max"] for s in STAGES)
    assert predicted.peak["total"] == max(p["total"] for p in predicted.stage_peaks.values())
    errors = {"step": error}
    for stage in STAGES:
        planned = predicted.stage_peaks[stage]
        assert row[f"mem/predicted_{stage}_peak_gib"] * GIB == planned["total"]
        measured = row[f"mem/tracked_{stage}_total_gib_max"] * GIB
        errors[stage] = planned["total"] / measured - 1
        tolerance = OPTIMIZER_PHASE_TOLERANCE if stage == "optimizer" else PEAK_TOLERANCE
        assert abs(errors[stage]) < tolerance, (
            f"{stage}: predicted {planned['total']} B ({planned['phase']}) "
            f"vs tracked {measured:.0f} B: {errors[stage]:+.1%}"
        )
    # In the optimizer phase nothing is gathered: the model states the tracker sees are the states at
    # rest, plus the optimizer's own temporaries (its tensors count as optimizer state while it steps)
    # when the phase's largest total falls inside the step. It may fall just before it instead (gradient
    # clipping's temporaries, a few KB more or less of other tensors decide, per rank and per run), so
    # the states seen lie between the two, within the tolerance.
    planned = predicted.stage_peaks["optimizer"]
    states = row["mem/tracked_optimizer_model_states_gib_max"] * GIB
    resting = planned["params"] + planned["grads"] + planned["optimizer"]
    stepping = resting + planned["temporaries"]
    nearest = min(max(states, resting), stepping)
    errors["optimizer model states"] = nearest / states - 1
    assert abs(errors["optimizer model states"]) < MODEL_STATES_TOLERANCE, (resting, stepping, states)
    record_phases = record["memory_breakdown"]["phases"]
    assert set(record_phases) == set(STAGES)
    assert len(record_phases["backward"]["per_rank"]) == record["topology"]["world_size"]
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("sharding,precision,ac,world", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_planner_matches_the_tracker(tmp_path, sharding, precision, ac, world):
    overrides = [*TINY, f"sharding={sharding}", f"precision={precision}", f"ac={ac}", f"trainer.nproc_per_node={world}"]
    errors = _run_and_compare(overrides, tmp_path / "run")
    print(
        f"planner vs tracker, {sharding}-{precision}-{ac}-world{world}: "
        + ", ".join(f"{k} {v:+.2%}" for k, v in errors.items())
    )


FLOAT8_TOLERANCE = 0.05


def test_planner_matches_the_tracker_for_a_float8_run_within_5_percent(tmp_path):
    """precision=float8 (torchao) on 2 ranks: the converted matmuls' float8 casts of their operands are in the
    planned peak (without them the step's peak was 7.7% under the tracker's)."""
    pytest.importorskip("torchao", reason='float8 training needs torchao: pip install "fsdp_exp[float8]"')
    errors = _run_and_compare(
        [*TINY, "sharding=full", "precision=float8", "trainer.nproc_per_node=2"], tmp_path / "run"
    )
    print("planner vs tracker, full-float8-none-world2: " + ", ".join(f"{k} {v:+.2%}" for k, v in errors.items()))
    assert abs(errors["step"]) < FLOAT8_TOLERANCE, errors


@pytest.mark.slow
def test_bf16_storage_trains_bf16_shards_and_the_planner_follows_within_5_percent(tmp_path):
    """precision.storage_dtype=bf16 on 2 ranks: the model is cast before sharding, so the run's sharded parameters
    (and their gradients and AdamW moments) are bf16, and the planner, which counted fp32 states whatever the run
    stored before the option, is within 5% of the tracker."""
    overrides = [*TINY, "sharding=full", "precision=bf16", "precision.storage_dtype=bf16", "trainer.nproc_per_node=2"]
    errors = _run_and_compare(overrides, tmp_path / "run")
    print("planner vs tracker, full-bf16 storage-none-world2: " + ", ".join(f"{k} {v:+.2%}" for k, v in errors.items()))
    assert abs(errors["step"]) < FLOAT8_TOLERANCE, errors
    rows = read_metrics(tmp_path / "run")
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses  # three steps, none diverged
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    units = [unit for unit in record["applied"]["inspected"] if "sharded_dtypes" in unit]  # FSDP2's, read back
    assert units and all(unit["sharded_dtypes"] == ["bfloat16"] for unit in units), units


@pytest.mark.slow
def test_uneven_shards_and_fsdp1_model_states(tmp_path):
    """dim 72, vocab 250 over 3 ranks: torch.chunk gives rank 0 the ceil rows (FSDP2) and FSDP1 pads
    each flat unit; the planner reports the largest rank."""
    uneven = [*TINY, "model.dim=72", "model.vocab_size=250", "trainer.nproc_per_node=3", "trainer.global_batch_size=6"]
    _run_and_compare(uneven, tmp_path / "fsdp2")
    _run_and_compare([*uneven, "sharding.backend=fsdp1"], tmp_path / "fsdp1", tracked=False)


ACCUMULATING = [
    *TINY,
    "model.dim=256",
    "trainer.seq_len=8",
    "trainer.micro_batch_size=1",  # 4 micro-batches
    "trainer.nproc_per_node=2",
]  # parameters (1.6 M) dominate the activations of 8 tokens


@pytest.mark.slow
def test_accumulation_reduces_into_the_gradient_shard_by_default_and_the_planner_follows_both(tmp_path):
    """2 ranks, 4 micro-batches: by default (trainer.grad_sync=auto: every_micro_batch under FSDP2) the
    tracked forward holds the gradient shard and no unsharded gradient; under last_micro_batch the whole
    unsharded gradient. The planner predicts both forwards within 3%, and the losses are the same (fp32)."""
    GRAD_TOLERANCE = 0.03
    runs = {}
    for name, extra in (
        ("default", []),
        ("last", ["trainer.grad_sync=last_micro_batch"]),
        ("fsdp1", ["sharding.backend=fsdp1"]),
    ):
        overrides = [*ACCUMULATING, *extra]
        tracked = name != "fsdp1"  # torch's tracker cannot hook FSDP1
        errors = _run_and_compare(overrides, tmp_path / name, tracked=tracked)
        rows = read_metrics(tmp_path / name)
        record = json.loads((tmp_path / name / "run.json").read_text())
        runs[name] = {"rows": rows, "applied": record["applied"]["grad_sync"], "plan": _plan(overrides)}
        if tracked:
            # The forward phase, where the two policies differ, is held to 3%. The step's peak (backward
            # here) is held only to PEAK_TOLERANCE in _run_and_compare: torch's tracker counts one more
            # block of unsharded parameters there or not depending on when Python's cyclic GC runs
            # (gc.set_threshold(10, 2, 2) in every process: +2.2 MB, the step -5.5%; seen so in CI).
            assert abs(errors["forward"]) < GRAD_TOLERANCE, (name, errors)
    default, last = runs["default"], runs["last"]
    assert default["applied"] == {"trainer.grad_sync": "auto", "resolved": "every_micro_batch"}
    assert runs["fsdp1"]["applied"]["resolved"] == "every_micro_batch"
    assert last["applied"]["resolved"] == "last_micro_batch"
    shard = default["plan"].model_states["device"]["grads"]  # fp32, this rank's half
    forward = [next(r for r in run["rows"] if "mem/tracked_total_gib_max" in r) for run in (default, last)]
    assert forward[0]["mem/tracked_forward_grads_gib_max"] * GIB == pytest.approx(shard, rel=GRAD_TOLERANCE)
    assert forward[0]["mem/tracked_forward_unsharded_grads_gib_max"] == 0
    assert forward[1]["mem/tracked_forward_unsharded_grads_gib_max"] * GIB == pytest.approx(2 * shard, rel=0.01)
    for name in ("last", "fsdp1"):
        assert [r["train/loss"] for r in runs[name]["rows"]] == pytest.approx(
            [r["train/loss"] for r in default["rows"]], rel=1e-6, abs=0
        )


def test_llama7b_full_shard_is_the_zero3_figure():
    """bf16 compute, fp32 master parameters, fp32 gradients, AdamW's two fp32 moments: 16 bytes per
    parameter, divided over 8 ranks (ZeRO-3)."""
    result = _plan(["model=llama7b", "precision=bf16", "trainer.nproc_per_node=8", "sharding=full"])
    p = result.num_params
    assert 6.7e9 < p < 6.8e9
    per_rank = result.per_rank_bytes
    states = per_rank["params"] + per_rank["grads"] + per_rank["optimizer"]
    assert abs(states / (16 * p / 8) - 1) < MODEL_STATES_TOLERANCE
    assert per_rank["params"] == 4 * p / 8 and per_rank["optimizer"] == 8 * p / 8  # every dim divides by 8
    # Less sharding, more memory; the unsharded bf16 copies appear only during compute (at the peak).
    grad_op = _plan(["model=llama7b", "precision=bf16", "trainer.nproc_per_node=8", "sharding=grad_op"])
    ddp = _plan(["model=llama7b", "precision=bf16", "trainer.nproc_per_node=8", "sharding=ddp"])
    assert result.peak["total"] < grad_op.peak["total"] < ddp.peak["total"]
    assert ddp.model_states["total"] == 16 * p
    assert grad_op.peak["unsharded"] > 0.9 * 2 * p  # (nearly) every parameter is gathered in bf16
    assert result.peak["unsharded"] < 0.1 * 2 * p  # full: the root and a block or two


def test_offload_moves_model_states_to_the_host_and_hybrid_shards_within_the_group():
    from fsdp_exp.plan import plan

    cfg = run_config(["model=llama7b", "precision=bf16", "trainer.nproc_per_node=8", "offload=params"])
    result = plan(cfg, validate(cfg, cuda_devices=8), device_kind="cuda")
    assert result.model_states["device"]["total"] == 0
    host = result.model_states["host"]["total"]
    assert host == result.model_states["total"] == pytest.approx(16 * result.num_params / 8)
    assert result.per_rank_bytes["total"] > result.peak["unsharded"] > 0  # compute still gathers on the device
    hybrid = _plan(["model=llama7b", "trainer.nproc_per_node=8", "sharding=hybrid", "sharding.shard_size=2"])
    assert hybrid.model_states["total"] == pytest.approx(16 * hybrid.num_params / 2, rel=1e-3)


def test_planner_options_never_reach_the_run_config():
    from fsdp_exp.plan import PlanOptionError, split_argv

    options, overrides = split_argv(["sharding=grad_op", "plan.format=json", "plan.device=h100_80gb"])
    assert options == {"format": "json", "device": "h100_80gb"} and overrides == ["sharding=grad_op"]
    with pytest.raises(PlanOptionError, match="plan.format=table|json"):
        split_argv(["plan.fromat=json"])


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "fsdp_exp.plan", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_cli_json_for_llama7b_on_h100():
    proc = _cli(
        "model=llama7b",
        "precision=bf16",
        "trainer.nproc_per_node=8",
        "trainer.seq_len=4096",
        "trainer.global_batch_size=8",
        "plan.format=json",
        "plan.device=h100_80gb",
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert set(plan["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    p = plan["num_params"]
    states = sum(plan["per_rank_bytes"][k] for k in ("params", "grads", "optimizer"))
    assert abs(states / (16 * p / 8) - 1) < MODEL_STATES_TOLERANCE
    assert plan["device_kind"] == "cuda" and plan["margin_bytes"] > 0
    assert plan["per_rank_bytes"]["total"] == plan["peak"]["total"] + plan["margin_bytes"]
    assert plan["device"]["name"] == "h100_80gb" and plan["device"]["fits"] is True
    # What each memory option would change, asked of the planner again: the default loss (trainer.loss_chunks=auto:
    # one chunk here, the logits a sliver of the peak, which is at the loss's backward) taken in 8 slices saves
    # under the rule's 10% and moves the peak off the loss; full checkpointing saves.
    options = {o["change"]: o for o in plan["options"]}
    sliced = options["trainer.loss_chunks=8"]
    assert plan["peak"]["phase"] == "loss backward" and "trainer.loss_chunks=auto -> 1" in plan["assumptions"][-1]
    assert 0 < sliced["saves_bytes"] < 0.1 * plan["peak"]["total"] and sliced["peak_phase"] != "loss backward"
    assert sliced["total_bytes"] == plan["per_rank_bytes"]["total"] - sliced["saves_bytes"]
    assert options["ac=full"]["saves_bytes"] > 0


def test_cli_table_says_llama70b_does_not_fit_an_l4():
    proc = _cli("model=llama70b", "precision=bf16", "plan.device=l4_24gb")
    assert proc.returncode == 0, proc.stderr
    assert "Memory plan per rank" in proc.stdout and "activations" in proc.stdout
    assert "does not fit on l4_24gb" in " ".join(proc.stdout.split())


def test_cli_refuses_an_unknown_device_and_a_bad_config():
    proc = _cli("plan.device=tpu_v9")
    assert proc.returncode == 2
    assert "plan.device='tpu_v9' is not a known device" in proc.stderr and "h100_80gb" in proc.stderr
    proc = _cli("trainer.global_batch_size=3")
    assert proc.returncode == 2 and "trainer.global_batch_size" in proc.stderr


# A vocabulary of 8192 next to a width of 64: the loss is most of the step's peak.
LOSS_HEAVY = [*TINY, "model.vocab_size=8192", "trainer.seq_len=64", "trainer.nproc_per_node=2"]
LOSS_TOLERANCE = 0.03


def _tracked_and_planned(overrides, run_dir):
    """(tracked GiB by stage and for the step, the plan, the run's losses) of one run; the step and its
    forward and backward stages within LOSS_TOLERANCE of the planner."""
    record = run_experiment(overrides, run_dir)
    assert record["status"] == "completed"
    rows = read_metrics(run_dir)
    row = next(r for r in rows if "mem/tracked_total_gib_max" in r)
    planned = _plan(overrides)
    tracked = {stage: row[f"mem/tracked_{stage}_total_gib_max"] * GIB for stage in ("forward", "backward")}
    tracked["step"] = row["mem/tracked_total_gib_max"] * GIB
    predicted = {
        **{stage: planned.stage_peaks[stage]["total"] for stage in ("forward", "backward")},
        "step": planned.peak["total"],
    }
    for key, value in tracked.items():
        assert abs(predicted[key] / value - 1) < LOSS_TOLERANCE, (key, predicted[key], value, planned.peak["phase"])
    return tracked, planned, [r["train/loss"] for r in rows], record


@pytest.mark.slow
def test_the_chunked_loss_lowers_the_tracked_peak_by_what_the_planner_says(tmp_path):
    """All the logits at once (trainer.loss_chunks=1) and in 8 slices of the sequence, FSDP2 on 1 rank:
    each run's tracked peak within 3% of the planner's, the loss's backward the peak of the first; the
    saving tracked is the saving planned (within 3% of the first peak); the losses are the same (fp32)."""
    one_rank = [*LOSS_HEAVY, "trainer.nproc_per_node=1"]
    whole, whole_plan, whole_losses, _ = _tracked_and_planned([*one_rank, "trainer.loss_chunks=1"], tmp_path / "whole")
    sliced, sliced_plan, sliced_losses, _ = _tracked_and_planned(one_rank, tmp_path / "sliced")
    assert whole_plan.peak["phase"] == "loss backward"
    saved, planned = whole["step"] - sliced["step"], whole_plan.peak["total"] - sliced_plan.peak["total"]
    assert saved > 0.3 * whole["step"], (saved, whole["step"])
    assert abs(planned - saved) < LOSS_TOLERANCE * whole["step"], (planned, saved)
    print(
        f"chunked loss: tracked peak {whole['step'] / 2**20:.2f} -> {sliced['step'] / 2**20:.2f} MiB, planned "
        f"{whole_plan.peak['total'] / 2**20:.2f} -> {sliced_plan.peak['total'] / 2**20:.2f} MiB"
    )
    for a, b in zip(sliced_losses, whole_losses):
        assert abs(a / b - 1) < 1e-5, (sliced_losses, whole_losses)


@pytest.mark.slow
def test_loss_parallel_keeps_the_logits_sharded_with_the_reference_losses(tmp_path):
    """parallel.tp=2 on 2 ranks with the default loss parallel (and chunked loss): the output projection
    hands the loss vocabulary-sharded logits; the losses are the single-process reference's (what tensor
    parallel without it gives, test_backends), the tracked peak within 3% of the planner's, which is below
    what the planner says of gathered logits."""
    from reference import reference_losses

    overrides = [*LOSS_HEAVY, "parallel.tp=2"]
    _, planned, losses, record = _tracked_and_planned(overrides, tmp_path / "run")
    assert record["applied"]["tp"]["loss_parallel"] is True
    expected = reference_losses(run_config(overrides), len(losses))
    for step, (a, b) in enumerate(zip(losses, expected), 1):
        assert abs(a / b - 1) < 1e-5, f"step {step}: {a} vs single process {b}"
    gathered = _plan([*overrides, "parallel.loss_parallel=false"])
    assert planned.peak["total"] < gathered.peak["total"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the planner over ~300 published rows: about a minute on 2 idle cores, 15+ at load 30
def test_the_fit_checks_band_is_derived_from_the_published_record():
    """The launcher's fit check and tune judge memory by one band (``fsdp_exp.fit_check.PLANNER_BAND``); here it is
    read again from the record: every calibration run that ran, planned as the planner counts it now, and every run
    published as out of memory. No process group: the planner on the meta device."""
    import importlib.util

    from fsdp_exp.fit_check import PLANNER_BAND, band_from

    spec = importlib.util.spec_from_file_location("published_benchmark", REPO / "benchmarks" / "published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.load("calibration")
    bench.predict_all(rows, memory=True, speed=False)
    ran = [r.need_gib / r.device_gib - 1 for r in rows if r.published_tokens and r.need_gib]
    oom = [r.need_gib / r.device_gib - 1 for r in rows if r.published_oom and r.need_gib]
    derived = band_from(ran, oom, PLANNER_BAND.source)
    assert (PLANNER_BAND.over, PLANNER_BAND.ran) == (derived.over, derived.ran), derived
    assert PLANNER_BAND.oom_least == pytest.approx(derived.oom_least, abs=0.0005), derived
    assert all(
        band_verdict != "refused" for band_verdict in (r.verdict for r in rows if r.published_tokens and r.need_gib)
    )
    assert all(r.verdict == "refused" for r in rows if r.published_oom and r.need_gib)
