"""The step-time model under precision=float8 (torchao): converted matmuls at the device's FP8 peak, the casts by
their bytes, float8 all-gathers at 1 byte a converted weight element, a GPU without FP8 tensor cores refused by
name; and tune searching float8 only where the device has FP8 tensor cores. No process group: the planner and the
step-time model on the meta device, GPU devices from the table."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_exp.errors import ConfigError
from fsdp_exp.models import spec_for
from fsdp_exp.parallel.float8 import planned_matmuls
from fsdp_exp.plan.devices import DEVICES
from fsdp_exp.preflight import validate
from fsdp_exp.tune.options import split_argv
from fsdp_exp.tune.perf import step_costs, timing
from fsdp_exp.tune.step_time import predict
from fsdp_exp.tune.search import weigh

from conftest import run_config

pytest.importorskip("torchao")

# torchtitan's float8 benchmark: docs/performance.md (commit eaea6f6, torch/torchao of 2024-12-23), Table 1, Llama 3.1
# 8B on 8 H100, FSDP, local batch 2 (global 16), sequence 8192, selective AC: FSDP + torch.compile 6,667 tokens/s per
# GPU, + Float8 (tensorwise, float8 all-gather) 8,532, x1.28 (the "+28%").
LLAMA3_8B_ON_8 = [
    "model=llama3_8b",
    "sharding=full",
    "ac=selective_op",
    "compile=true",
    "trainer.nproc_per_node=8",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=2",
    "trainer.seq_len=8192",
    "trainer.device=cuda",
]
BF16 = ["precision=bf16"]
FLOAT8 = ["precision=float8"]
FLOAT8_ALL_GATHER = FLOAT8 + ["precision.float8_all_gather=true"]


def _costs(extra: list[str]):
    cfg = run_config(LLAMA3_8B_ON_8 + extra)
    topology = validate(cfg, cuda_devices=8)
    return cfg, topology, step_costs(cfg, topology)


def _tokens_per_s(extra: list[str], device: str) -> float:
    cfg, topology, _ = _costs(extra)
    return predict(cfg, topology, DEVICES[device].perf).tokens_per_s


@pytest.mark.parametrize("device", ["h100_80gb", "h100_96gb_500w"])
def test_float8_speeds_llama3_8b_on_eight_h100s_up_within_the_band_torchtitan_published(device):
    ratio = _tokens_per_s(FLOAT8_ALL_GATHER, device) / _tokens_per_s(BF16, device)
    assert 1.1 < ratio < 1.5, ratio  # published x1.28 (above)


def test_a_float8_prediction_gives_mfu_against_both_peaks():
    cfg, topology, _ = _costs(FLOAT8)
    predicted = predict(cfg, topology, DEVICES["h100_80gb"].perf)
    assert predicted.mfu_fp8 == pytest.approx(predicted.mfu * 989.0 / 1979.0)  # H100 SXM: bf16 and FP8 peaks
    bf16, bf16_topology, _ = _costs(BF16)
    assert predict(bf16, bf16_topology, DEVICES["h100_80gb"].perf).mfu_fp8 is None


def test_the_converted_matmuls_leave_the_bf16_ones_and_the_output_projection_stays_bf16():
    _, _, bf16 = _costs(BF16)
    _, _, f8 = _costs(FLOAT8)
    total = sum(g[3] for g in bf16.gemms)
    assert sum(g[3] for g in f8.gemms) + sum(g[3] for g in f8.float8.gemms) == pytest.approx(total)
    assert [g[1:3] for g in f8.gemms] == [(4096.0, 128256.0)]  # torchao's filter keeps the output projection
    assert f8.float8.cast_bytes_forward > 0 and f8.float8.cast_bytes_backward > 0


def test_float8_all_gather_moves_each_converted_weight_in_one_byte():
    _, _, bf16 = _costs(BF16)
    cfg, _, f8 = _costs(FLOAT8)
    _, _, f8ag = _costs(FLOAT8_ALL_GATHER)
    inventory = spec_for(cfg.model).inventory(cfg.model)
    converted = sum(k * n for block in planned_matmuls(cfg, inventory.blocks) for k, n in block)
    parameters = sum(p.numel for p in inventory.params)
    assert converted / parameters == pytest.approx(0.87, abs=0.01)  # all but the embedding and output projection
    gathered = [{t.purpose: t.bytes for t in c.traffic} for c in (bf16, f8, f8ag)]
    assert gathered[1] == gathered[0]  # without float8 all-gather the weights travel in bf16
    for purpose in ("forward all-gather", "backward re-gather"):  # 2 bytes a parameter, 1 a converted one
        expected = gathered[0][purpose] * (2 * parameters - converted) / (2 * parameters)
        assert gathered[2][purpose] == pytest.approx(expected, rel=1e-9), purpose
    assert gathered[2]["gradient reduce-scatter"] == gathered[0]["gradient reduce-scatter"]
    assert f8ag.float8.optimizer_bytes == pytest.approx(4 * converted / 8)  # the scales' amax over each fp32 shard


def test_the_casts_cost_their_bytes_so_eager_float8_is_slower_than_compiled():
    h100 = DEVICES["h100_80gb"].perf
    _, _, f8 = _costs(FLOAT8)
    free_casts = dataclasses.replace(
        f8, float8=dataclasses.replace(f8.float8, cast_bytes_forward=0.0, cast_bytes_backward=0.0)
    )
    assert timing(free_casts, h100).step_time_s < timing(f8, h100).step_time_s
    eager = _tokens_per_s(FLOAT8 + ["compile=false"], "h100_80gb")
    assert eager < _tokens_per_s(FLOAT8, "h100_80gb")


def test_a_gpu_without_fp8_tensor_cores_refuses_float8_by_name_and_its_emulation_has_no_fp8_term():
    a100 = DEVICES["a100_80gb"].perf
    assert "fp8" not in a100.peak_tflops and a100.fp8_efficiency == 0.0
    cfg, topology, _ = _costs(FLOAT8)
    with pytest.raises(ValueError, match="no FP8 tensor cores") as refused:
        predict(cfg, topology, a100)
    assert "precision=bf16" in str(refused.value) and "precision.float8_emulate=true" in str(refused.value)
    # Emulated, the converted matmuls run at the bf16 rate: without the casts the step is bf16's to the last bit.
    _, _, emulated = _costs(FLOAT8 + ["precision.float8_emulate=true"])
    no_casts = dataclasses.replace(
        emulated, float8=dataclasses.replace(emulated.float8, cast_bytes_forward=0.0, cast_bytes_backward=0.0)
    )
    _, _, bf16 = _costs(BF16)
    assert timing(no_casts, a100).step_time_s == pytest.approx(timing(bf16, a100).step_time_s, rel=1e-12)
    assert timing(emulated, a100).tokens_per_s < timing(bf16, a100).tokens_per_s


# ------------------------------------------------------------------------------------------------ tune
TINY = [
    "model=llama_tiny",
    "trainer.nproc_per_node=8",
    "trainer.global_batch_size=8",
    "trainer.seq_len=256",
    "tune.space.backend=[fsdp2]",
    "tune.space.sharding=[full]",
    "tune.space.ac=[none]",
    "tune.space.offload=[none]",
    "tune.space.prefetch=[default]",
    "tune.space.micro_batch_size=[1]",
    "tune.space.pp=[1]",  # one candidate per precision (the keys below)
]


def _precisions(argv: list[str]):
    opts, overrides = split_argv(TINY + argv)
    tuning = weigh(overrides, opts)
    return tuning, {
        (w.candidate.cfg.precision.float8_recipe, w.candidate.cfg.precision.float8_all_gather): w
        for w in tuning.candidates
    }


def test_tune_searches_float8_where_the_device_has_fp8_tensor_cores_and_leaves_it_out_elsewhere():
    h100, on_h100 = _precisions(["plan.device=h100_80gb"])
    assert {"float8", "float8_all_gather"} <= set(h100.space.values["precision"])
    assert on_h100[("tensorwise", False)].prediction and on_h100[("tensorwise", True)].prediction  # both timed
    a100, on_a100 = _precisions(["plan.device=a100_80gb"])
    assert {"float8", "float8_all_gather"}.isdisjoint(a100.space.values["precision"])
    assert all(recipe is None for recipe, _ in on_a100)
    assert any(
        "float8,float8_all_gather left out: a100_80gb has no FP8 tensor cores" in note for note in a100.space.notes
    )
    # Fixed by the run, it is weighed and not timed: tune refuses with the reason and the override that fixes it.
    with pytest.raises(ConfigError, match="no FP8 tensor cores") as refused:
        _precisions(["plan.device=a100_80gb", "precision=float8"])
    assert "fix: pass precision=bf16, or precision.float8_emulate=true" in str(refused.value)


# A 70B model on 64 GPUs as FSDP 8 x TP 8, the shape of torchtitan's float8 tables: tensor parallel 8 within a node.
TP8 = ["model=llama70b", "trainer.nproc_per_node=8", "trainer.nnodes=8", "parallel.tp=8", "trainer.device=cuda"]
TP8_BATCH = ["trainer.global_batch_size=8", "trainer.seq_len=4096"]


def _tp_costs(extra: list[str]):
    cfg = run_config([*TP8, *TP8_BATCH, *extra])
    topology = validate(cfg, cuda_devices=8)
    return cfg, topology, {t.purpose: t for t in step_costs(cfg, topology).traffic}


def test_under_tensor_parallel_a_rank_casts_its_own_share_of_each_converted_linear():
    cfg = run_config([*TP8, *TP8_BATCH, *FLOAT8])
    blocks = spec_for(cfg.model).inventory(cfg.model).blocks
    whole, shared = planned_matmuls(cfg, blocks)[0], planned_matmuls(cfg, blocks, tp=8)[0]
    # wq, wk, wv, w1, w3 colwise (output features split), wo and w2 rowwise (input features split)
    assert [k * n for k, n in shared] == [k * n // 8 for k, n in whole]
    assert [k for k, _ in shared] == [k if i not in (3, 6) else k // 8 for i, (k, _) in enumerate(whole)]


def test_float8_styles_gather_the_sequence_in_one_byte_under_sequence_parallel():
    sp = ["parallel.sequence_parallel=true"]
    _, _, bf16 = _tp_costs([*BF16, *sp])
    _, _, tensorwise = _tp_costs([*FLOAT8, *sp])
    _, _, rowwise = _tp_costs([*FLOAT8, "precision.float8_recipe=rowwise", *sp])
    _, _, no_sp = _tp_costs(FLOAT8)
    for phase in ("forward", "backward"):
        gather, scatter = f"tensor-parallel all-gather ({phase})", f"tensor-parallel reduce-scatter ({phase})"
        assert bf16[gather].bytes == bf16[scatter].bytes == rowwise[gather].bytes  # bf16, 2 bytes an element
        assert tensorwise[gather].bytes == bf16[gather].bytes / 2 and tensorwise[scatter].bytes == bf16[scatter].bytes
        # without sequence parallel the stream is all-reduced in bf16 (torchao's styles cast no gathered input)
        assert no_sp[f"tensor-parallel all-reduce ({phase})"].bytes == bf16[gather].bytes


def test_the_planner_refuses_float8_on_a_gpu_without_fp8_tensor_cores_as_tune_does():
    from fsdp_exp.plan.cli import plan_from_argv

    with pytest.raises(ConfigError, match="a100_80gb has no FP8 tensor cores") as refused:
        plan_from_argv(["precision=float8", "plan.device=a100_80gb", "trainer.nproc_per_node=8"])
    assert "fix: pass precision=bf16, or precision.float8_emulate=true" in str(refused.value)
    # what it lets through is the same rule's, asked by GPU name below


@pytest.mark.parametrize(
    "name,overrides,refused",
    [
        ("NVIDIA A100-SXM4-80GB", ["precision=float8"], True),
        ("NVIDIA A100 80GB PCIe", ["precision=float8"], True),
        ("NVIDIA A100-SXM4-80GB", ["precision=float8", "precision.float8_emulate=true"], False),
        ("NVIDIA A100-SXM4-80GB", ["precision=bf16"], False),
        ("NVIDIA H100 80GB HBM3", ["precision=float8"], False),
        ("NVIDIA H200", ["precision=float8"], False),
        ("NVIDIA GeForce GTX 9999", ["precision=float8"], False),  # no table knows it: torchao says what it can do
    ],
)
def test_a_rank_refuses_float8_on_a_gpu_cuda_names_without_fp8_tensor_cores(name, overrides, refused):
    from fsdp_exp.parallel.float8 import check_gpu_name

    cfg = run_config(overrides)
    if not refused:
        check_gpu_name(cfg, name)
        return
    with pytest.raises(ConfigError, match=f"{name} has no FP8 tensor cores") as error:
        check_gpu_name(cfg, name)
    assert "fix: pass precision=bf16, or precision.float8_emulate=true" in str(error.value)
