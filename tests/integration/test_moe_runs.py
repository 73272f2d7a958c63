"""A mixture of experts trained for real (moe_tiny on 2 gloo ranks, FSDP2): its routing metrics in every row,
every balancing option on at once, and refusals of what does not compose with experts."""

from __future__ import annotations

import pytest

from conftest import TINY_BATCH, read_metrics, run_cli, run_experiment

STEPS = 3
MOE = ["model=moe_tiny", *TINY_BATCH, f"trainer.steps={STEPS}", "trainer.warmup_steps=1", "logger.wandb.mode=disabled"]


@pytest.mark.slow
def test_a_routed_run_logs_its_expert_load_aux_loss_and_dropped_tokens_each_step(tmp_path):
    overrides = [*MOE, "model.aux_loss_coef=0.01", "model.expert_bias_rate=0.01", "model.capacity_factor=1.0"]
    run_experiment(overrides, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    copies = 8 * 32 * 2  # the global batch's tokens x top-2, in each of the 2 layers
    for r in rows:
        # The loads are the assignment before dropping (what the balancing reads): every routed copy, per layer
        # over both ranks; the dropped ones are a part of them.
        assert r["moe/tokens_per_expert_mean"] * 4 == copies
        assert r["moe/dropped_tokens"] > 0 and r["moe/dropped_fraction"] == r["moe/dropped_tokens"] / (2 * copies)
        assert 1 <= r["moe/load_imbalance_mean"] <= r["moe/load_imbalance_max"]
        # capacity 1.0 per rank (4 x 32 tokens x 2 / 4 experts = 64 a rank): an expert over it lost copies
        assert r["moe/tokens_per_expert_max"] > 8 * 32 * 2 / 4 or r["moe/dropped_tokens"] == 0
        # 2 layers, each coef x (1 when balanced) x k: near 2 x 0.01 x 2
        assert 0.03 < r["moe/aux_loss"] < 0.06
        assert r["train/grad_norm"] < 10  # dropped copies' rows stay out of the gradients


def test_tensor_parallel_experts_are_refused_before_any_rank_starts(tmp_path):
    """MoE under TP is refused with the fix (expert parallel); pipeline stages take MoE since issue #40
    (tests/integration/test_layouts.py runs PP2 x EP2)."""
    result = run_cli(["model=moe_tiny", "trainer.nproc_per_node=4", "parallel.tp=2"], tmp_path)
    assert result.returncode == 2 and "parallel.ep" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_a_forced_imbalanced_router_shows_in_metrics_run_json_the_summary_and_the_report(tmp_path):
    """Every token's first pick on expert 0 (debug.favour_expert: the router's bias far above its scores), under
    expert parallel on 4 ranks as issue #43 ran it: moe_tiny's 4 experts, top-2, so expert 0 gets every token once
    and the other three share the second picks: max/mean = 1 / (2 / 4) = 2.0 in each layer, every step."""
    import json

    from fsdp_exp.report.__main__ import main as report

    run_dir = tmp_path / "run"
    result = run_cli(
        [*MOE, "trainer.nproc_per_node=4", "parallel.ep=2", "debug.favour_expert=0"], run_dir, timeout=400, quiet=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir)
    for r in rows:
        assert r["moe/load_imbalance_max"] == pytest.approx(2.0) and r["moe/load_imbalance_per_layer"] == [2.0, 2.0]
        assert r["moe/load_imbalance_worst_layer"] == 0 and r["moe/dropped_tokens"] == 0
    summary = json.loads((run_dir / "run.json").read_text())["summary"]
    assert summary["summary/moe_load_imbalance_median"] == pytest.approx(2.0)
    assert summary["summary/moe_load_imbalance_per_layer"] == [2.0, 2.0]
    assert summary["summary/moe_dropped_fraction_max"] == 0
    assert "moe_load_imbalance_median" in result.stdout  # the console's summary table names it
    assert report([str(run_dir), "--out", str(tmp_path / "report")]) == 0
    ranked = json.loads((tmp_path / "report" / "report.json").read_text())["ranked"]
    assert ranked[0]["expert_imbalance"] == pytest.approx(2.0)
    assert "expert load" in (tmp_path / "report" / "report.html").read_text()
