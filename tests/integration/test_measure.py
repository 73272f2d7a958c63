"""Measurement you can trust: MFU / HFU arithmetic, the CPU's measured peak and its cache, the
profiled step's communication times read back from its trace, the per-phase memory breakdown, and
honest summary statistics. Runs are real (gloo ranks, FSDP2 / DDP, torch.profiler); the interval
arithmetic is also checked on hand-written traces, where the answer is known exactly."""

from __future__ import annotations

import json
import math

import pytest

from fsdp_exp.config import ConfigError
from fsdp_exp.preflight import validate
from fsdp_exp.metrics.comm import comm_from_trace
from fsdp_exp.metrics.flops import counted_flops_per_token, mfu, recompute_flops_per_token
from fsdp_exp.metrics.schema import PHASES
from fsdp_exp.metrics.tracker import BREAKDOWN
from fsdp_exp.models import count_params, flops_per_token
from fsdp_exp.parallel import ac
from fsdp_exp.tune.work import work

from conftest import TINY_MODEL, read_metrics, run_config, run_experiment

SMALL = [
    *TINY_MODEL,
    "model.multiple_of=32",
    "trainer.seq_len=32",
    "trainer.global_batch_size=8",
    "checkpoint.on_signal=false",
    "trainer.digest_shards=false",
]

# The SMALL model by hand: dim 64, 4 query heads and 2 key/value heads of 16, SwiGLU width
# 32 * ceil(int(2 * 4 * 64 / 3) / 32) = 192, vocab 256, 2 layers, sequences of 32.
D, KV, FFN, VOCAB, LAYERS, SEQ = 64, 32, 192, 256, 2, 32
BLOCK_MATMULS = D * D + D * KV + D * KV + D * D + D * FFN + D * FFN + FFN * D  # wq wk wv wo w1 w3 w2
NORMS = 2 * LAYERS * D + D  # two RMSNorm weights per block and the final one: parameters, not matmuls
N = LAYERS * BLOCK_MATMULS + NORMS + VOCAB * D  # without the input embedding, with the output projection


def test_flops_per_token_and_recompute_by_hand():
    """6N + 12LdS from the parameter count, and what ac=full recomputes: every block's forward
    (2 FLOPs per weight per token, and 4dS for attention's two products) except w2, which
    non-reentrant checkpointing never recomputes (it stops once w2's saved inputs are back)."""
    cfg = run_config([*SMALL, "ac=full"])
    assert count_params(cfg.model, exclude_embeddings=True) == N
    assert flops_per_token(cfg.model, SEQ) == 6 * N + 12 * LAYERS * D * SEQ
    # torch's FlopCounterMode counts matmuls and attention only: 6N + 12LdS minus the norm weights.
    assert counted_flops_per_token(cfg, SEQ) == 6 * (N - NORMS) + 12 * LAYERS * D * SEQ
    per_block = 2 * (BLOCK_MATMULS - FFN * D) + 4 * D * SEQ
    assert recompute_flops_per_token(cfg, SEQ, ac.apply) == LAYERS * per_block
    # ac=selective checkpoints every 2nd block (block 0 of 2). Op-level AC: every_other_matmul (ac=selective_op)
    # saves the 1st, 3rd, 5th and 7th matmul (wq, wv, w1, w2) and attention, so it recomputes wk, wo and w3;
    # every_matmul recomputes no matmul. The planner's step-time model counts the same (tune/work.py).
    assert recompute_flops_per_token(run_config([*SMALL, "ac=selective"]), SEQ, ac.apply) == per_block
    # On the meta device SDPA runs as math (batched matmuls, which the policy does not save), so the counter
    # also sees attention's two products recomputed; a real kernel's outputs are saved.
    unsaved = 2 * (D * KV + D * D + D * FFN)
    selective_op = run_config([*SMALL, "ac=selective_op"])
    assert work(selective_op).recompute_flops_per_token(selective_op) == LAYERS * unsaved
    assert recompute_flops_per_token(selective_op, SEQ, ac.apply) == LAYERS * (unsaved + 4 * D * SEQ)
    assert recompute_flops_per_token(run_config([*SMALL, "ac=selective_op", "ac.ops=every_matmul"]), SEQ, ac.apply) == 0
    assert recompute_flops_per_token(run_config(SMALL), SEQ, ac.apply) == 0


def test_mfu_and_hfu_arithmetic_by_hand():
    """8 ranks at 1000 tokens/s each on a 100-TFLOPS device, 6N + 12LdS = 6e9 FLOPs per token,
    recompute 1.5e9: 6 TFLOPS per rank is 6% MFU, 7.5 TFLOPS 7.5% HFU."""
    per_rank = 8000 / 8
    assert mfu(6e9 * per_rank / 1e12, 100.0) == pytest.approx(0.06)
    assert mfu((6e9 + 1.5e9) * per_rank / 1e12, 100.0) == pytest.approx(0.075)
    assert mfu(6.0, None) is None


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The CPU peak cache in a folder of this test's own (ranks inherit the environment)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fsdp_exp" / "cpu_peak.json"


@pytest.mark.slow
def test_profiled_fsdp2_run_comm_mfu_hfu_and_summary(tmp_path, cache_home):
    """One real 2-rank FSDP2 run with ac=full, step 4 profiled: its traces give non-zero all-gather
    and reduce-scatter times, the row's comm/* are the ranks' maxima of what the trace files give,
    MFU and HFU follow from the measured CPU peak, and the summary leaves the profiled step out."""
    run = tmp_path / "run"
    overrides = [
        *SMALL,
        "ac=full",
        "trainer.steps=6",
        "trainer.warmup_steps=2",
        "trainer.profile_steps=[3]",
        "logger.wandb.mode=offline",
        "trainer.flops_convention=torchtitan",
    ]
    run_experiment(overrides, run)
    record = json.loads((run / "run.json").read_text())
    rows = read_metrics(run)
    assert record["status"] == "completed"
    # MFU counts by the named convention, and says which (torchtitan's: the input embedding left out of 6N)
    from fsdp_exp.metrics.flops import convention_flops_per_token

    assert record["env"]["flops_convention"] == "torchtitan"
    assert record["env"]["flops_per_token"] == convention_flops_per_token(
        "torchtitan", run_config(overrides).model, SEQ
    )

    # Communication, recomputed from the artifacts.
    traces = [run / "traces" / f"rank{r}_step4.json" for r in (0, 1)]
    assert record["artifacts"] == [str(p.relative_to(run)) for p in traces]
    per_rank = [comm_from_trace(json.loads(p.read_text())) for p in traces]
    for comm in per_rank:
        assert comm["device"] == "cpu"
        assert comm["all_gather_s"] > 0 and comm["reduce_scatter_s"] > 0
        # 2 blocks + root gathered in forward, 2 blocks again in backward (the root stays gathered
        # from the loss on); one reduce-scatter per unit; the grad norm's all-reduce.
        assert comm["collectives"] == {
            "all_gather": 5,
            "reduce_scatter": 3,
            "all_reduce": 1,
            "all_to_all": 0,
            "other": 0,
        }
        kinds = sum(comm[f"{k}_s"] for k in ("all_gather", "reduce_scatter", "all_reduce", "other"))
        assert max(comm["all_gather_s"], comm["reduce_scatter_s"]) <= comm["total_s"] <= kinds + 1e-9
        assert 0 <= comm["exposed_s"] <= comm["total_s"] < comm["step_s"]
    (row,) = [r for r in rows if "comm/total_s" in r]
    assert row["step"] == 4
    for name in ("all_gather_s", "reduce_scatter_s", "all_reduce_s", "total_s", "exposed_s", "step_s"):
        assert row[f"comm/{name}"] == pytest.approx(max(c[name] for c in per_rank)), name
    assert [entry["step"] for entry in record["comm"]] == [4] and len(record["comm"][0]["per_rank"]) == 2

    # The peak: measured on this CPU now (the cache is this test's), cached only if no rank was starved.
    env = record["env"]
    measurement = env["peak_tflops_measurement"]
    assert env["peak_tflops"] == measurement["tflops"] > 0 and "measured now" in env["peak_tflops_source"]
    assert measurement["threads_per_rank"] >= 1 and measurement["ranks_per_node"] == 2
    cached = cache_home.exists() and measurement["key"] in json.loads(cache_home.read_text())
    assert cached == (measurement["min_core_share"] >= 0.9 * measurement["fair_core_share"])
    # MFU and HFU from the logged throughput, the FLOPs and the peak.
    rc = env["recompute_flops_per_token"]
    assert rc == LAYERS * (2 * (BLOCK_MATMULS - FFN * D) + 4 * D * SEQ)
    assert env["hardware_flops_per_token"] == env["flops_per_token"] + rc
    for r in rows:
        assert r["perf/mfu"] == pytest.approx(r["perf/tflops_per_rank"] / env["peak_tflops"])
        assert r["perf/hfu"] == pytest.approx(r["perf/mfu"] * (env["flops_per_token"] + rc) / env["flops_per_token"])

    # The summary: medians over the post-warm-up steps without the profiled one, and says so.
    summary = record["summary"]
    measured = [r for r in rows if r["step"] > 2 and r["step"] != 4]
    assert summary["summary/steps_measured"] == len(measured) == 3
    times = sorted(r["perf/step_time_s"] for r in measured)
    assert summary["summary/step_time_s_median"] == times[1]
    assert summary["summary/step_time_s_p90"] == times[2]
    assert summary["summary/hfu_median"] > summary["summary/mfu_median"] > 0
    assert summary["summary/peak_tflops_source"] == env["peak_tflops_source"]
    assert summary["summary/comm_exposed_s_median"] == row["comm/exposed_s"]

    # The memory-tracked step (the last warm-up step) broke its peak down by phase, per rank.
    breakdown = record["memory_breakdown"]
    assert breakdown["step"] == 2 and set(breakdown["phases"]) == set(PHASES)
    tracked = next(r for r in rows if "mem/tracked_total_gib_max" in r)
    for rank in range(2):
        phase_totals = [breakdown["phases"][p]["per_rank"][rank]["total"] for p in PHASES]
        whole = breakdown["per_rank"][rank]
        assert whole["total"] == max(phase_totals)
        for p in PHASES:
            kinds = breakdown["phases"][p]["per_rank"][rank]
            parts = sum(
                kinds[k]
                for k in (
                    "params",
                    "grads",
                    "optim_state",
                    "activations",
                    "temp",
                    "comm_buffers",
                    "buffers",
                    "inputs",
                    "other",
                )
            )
            assert parts == pytest.approx(kinds["total"], rel=1e-9), p
            assert tracked[f"mem/tracked_{p}_total_gib_max"] >= kinds["total"]
    forward, backward = breakdown["phases"]["forward"]["max"], breakdown["phases"]["backward"]["max"]
    assert forward["unsharded_params"] > 0 and forward["all_gather"] > 0 and forward["grads"] == 0
    assert backward["reduce_scatter"] > 0 and backward["temp"] > 0
    assert set(BREAKDOWN) <= set(forward)


@pytest.mark.slow
def test_ddp_profile_finds_the_all_reduces(tmp_path, cache_home):
    """DDP reduces gradients with all-reduces (one bucket here), no all-gather or reduce-scatter."""
    run = tmp_path / "run"
    run_experiment(
        [
            *SMALL,
            "sharding=ddp",
            "trainer.steps=4",
            "trainer.warmup_steps=1",
            "trainer.profile_steps=[2]",
            "trainer.peak_tflops=1.0",
            "logger.wandb.mode=disabled",
        ],
        run,
    )
    record = json.loads((run / "run.json").read_text())
    assert record["env"]["peak_tflops_source"] == "trainer.peak_tflops" and not cache_home.exists()
    for r in (0, 1):
        comm = comm_from_trace(json.loads((run / "traces" / f"rank{r}_step3.json").read_text()))
        assert comm["all_reduce_s"] > 0 and comm["collectives"]["all_reduce"] >= 1
        assert comm["all_gather_s"] == 0 and comm["reduce_scatter_s"] == 0


def _trace(events):
    return {
        "traceEvents": [
            {
                "ph": "X",
                "pid": 1,
                "tid": 1,
                "name": "fsdp_exp/step",
                "cat": "user_annotation",
                "ts": 0.0,
                "dur": 1000.0,
            },
            *({"ph": "X", "pid": 1, **e} for e in events),
        ]
    }


def test_exposed_communication_on_a_known_cpu_timeline():
    """Times in microseconds. The training thread (tid 1) computes over [0, 300] and [500, 900]; an
    all-gather runs on a gloo thread over [200, 600], a reduce-scatter (gloo runs it as an all-reduce)
    over [550, 950]. Comm in flight: [200, 950] = 750 us; not under compute: [300, 500] and
    [900, 950] = 250 us."""
    trace = _trace(
        [
            {"tid": 1, "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 300},
            {"tid": 1, "cat": "cpu_op", "name": "c10d::_allgather_base_", "ts": 150, "dur": 10},
            {"tid": 7, "cat": "user_annotation", "name": "gloo:all_gather", "ts": 200, "dur": 400},
            {"tid": 1, "cat": "cpu_op", "name": "aten::mm", "ts": 500, "dur": 400},
            {"tid": 1, "cat": "cpu_op", "name": "c10d::_reduce_scatter_base_", "ts": 540, "dur": 5},
            {"tid": 8, "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 550, "dur": 400},
        ]
    )
    comm = comm_from_trace(trace)
    assert comm["all_gather_s"] == pytest.approx(400e-6) and comm["reduce_scatter_s"] == pytest.approx(400e-6)
    assert comm["all_reduce_s"] == 0 and comm["total_s"] == pytest.approx(750e-6)
    assert comm["exposed_s"] == pytest.approx(250e-6) and comm["compute_s"] == pytest.approx(700e-6)
    # by kind (issue #43 item 11: the report's exposed collectives by kind): the all-gather waits [300, 500], the
    # reduce-scatter [900, 950]
    assert comm["exposed_all_gather_s"] == pytest.approx(200e-6)
    assert comm["exposed_reduce_scatter_s"] == pytest.approx(50e-6) and comm["exposed_all_reduce_s"] == 0


def test_exposed_communication_on_a_known_cuda_timeline():
    """NCCL kernels are the collectives, every other kernel is compute, on whichever stream."""
    trace = _trace(
        [
            {
                "tid": 7,
                "cat": "kernel",
                "name": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                "ts": 100,
                "dur": 200,
            },
            {"tid": 7, "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ts": 700, "dur": 200},
            {"tid": 9, "cat": "kernel", "name": "ampere_sgemm_128x64_tn", "ts": 0, "dur": 250},
            {"tid": 9, "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 750, "dur": 100},
        ]
    )
    comm = comm_from_trace(trace)
    assert comm["device"] == "cuda"
    assert comm["all_gather_s"] == pytest.approx(200e-6) and comm["reduce_scatter_s"] == pytest.approx(200e-6)
    assert comm["exposed_s"] == pytest.approx((50 + 100) * 1e-6)  # [250, 300] and [700, 750] + [850, 900]
    assert comm["exposed_all_gather_s"] == pytest.approx(50e-6)
    assert comm["exposed_reduce_scatter_s"] == pytest.approx(100e-6)


def test_sampling_options_are_checked_before_any_rank_starts():
    cfg = run_config([*SMALL, "trainer.profile_steps=[1]"])  # the default tracked step: warm-up 2 - 1
    with pytest.raises(ConfigError, match="memory-sampled step"):
        validate(cfg, cuda_devices=0)
    with pytest.raises(ConfigError, match="not a step of this run"):
        validate(run_config([*SMALL, "trainer.profile_steps=[10]"]), cuda_devices=0)
    with pytest.raises(ConfigError, match="CUDA allocator"):
        validate(run_config([*SMALL, "trainer.memory_snapshot=true"]), cuda_devices=0)
    validate(run_config([*SMALL, "trainer.profile_steps=[1]", "trainer.track_memory=false"]), cuda_devices=0)


def test_cpu_matmul_peak_is_measured_on_the_threads_a_rank_gets():
    """A short real measurement in this process: positive, the size grew until a matmul took
    >= 20 ms (or hit the cap), and the rate over all batches lies within the batches' rates."""
    import torch

    from fsdp_exp.metrics.flops import measure_matmul_tflops

    result = measure_matmul_tflops("fp32", seconds=0.3, batches=3)
    assert result["threads"] == torch.get_num_threads()
    assert min(result["batches_tflops"]) * 0.99 <= result["tflops"] <= max(result["batches_tflops"]) * 1.01
    assert result["tflops"] > 0
    assert result["n"] >= 512 and math.log2(result["n"]).is_integer()
    assert 0 < result["core_share"] <= 1.05


def test_per_step_model_state_bytes_equal_the_plain_count(tmp_path):
    """The cached per-step count (sizes read once) against reading every tensor's local shard, on a
    real FSDP2 model (one gloo rank in this process) before and after an optimizer step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_exp.metrics.memory import ModelStateBytes, model_state_bytes
    from fsdp_exp.models import build_meta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_meta(run_config(SMALL).model)
        for block in model.layers.values():
            fully_shard(block, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p.to_local(), std=0.02)
        model.init_buffers(torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters())
        count = ModelStateBytes(model, optimizer)
        assert count() == model_state_bytes(model, optimizer)
        model(torch.randint(0, VOCAB, (2, SEQ))).float().mean().backward()
        optimizer.step()
        after = count()
        assert after == model_state_bytes(model, optimizer)
        assert after["grads"] == after["params"] and after["optim_state"] == 2 * after["params"]
    finally:
        dist.destroy_process_group()
