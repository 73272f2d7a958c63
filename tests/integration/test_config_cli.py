"""Bad input on the command line fails fast and clearly: exit code, the fix named, no traceback, nothing
spawned (a real `python -m fsdp_exp` per case, so it lives in the integration tier). The same refusals
asked in-process (no subprocess) are in tests/unit/test_config.py, test_backend_interface.py and
test_deepspeed_refusals.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_exp.parallel.deepspeed import installed

from conftest import leftover_processes, run_cli


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model=llama8b"], "model"),
        (["trainer.stepz=3"], "stepz"),
        (["trainer.steps=many"], "trainer.steps"),
        (["trainer.global_batch_size=5"], "trainer.global_batch_size=6"),
        (["sharding=hybrid", "trainer.nproc_per_node=4", "sharding.shard_size=3"], "sharding.shard_size"),
        (["precision=fp16", "precision.loss_scaler=none"], "precision.loss_scaler=dynamic"),
        (["optim.lr=-0.1"], "optim.lr"),
        # the model family's own check (models/llama_spec.py): 9 of 4 experts is refused, not met by torch's topk in a rank
        (
            ["model=moe_tiny", "model.experts_top_k=9"],
            "model.experts_top_k=9 routes each token to that many experts, and the model has 4",
        ),
    ],
    ids=[
        "unknown-option",
        "unknown-key",
        "wrong-type",
        "batch",
        "hybrid-mesh",
        "fp16-no-scaler",
        "negative-lr",
        "moe-top-k",
    ],
)
def test_bad_input_on_the_command_line(tmp_path: Path, overrides, needle):
    result = run_cli(overrides, tmp_path / "run")
    assert result.returncode == 2, result.stderr  # bad input (fsdp_exp.errors.EXIT_BAD_CONFIG)
    assert needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 20, result.stderr  # a paragraph (Hydra lists options), not a wall
    assert result.seconds < 10, f"took {result.seconds:.1f}s"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was spawned
    assert leftover_processes(tmp_path / "run") == []


def test_an_unknown_backend_is_refused_with_the_closest_name(tmp_path):
    result = run_cli(["sharding.backend=fsdp3"], tmp_path / "run", timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "sharding.backend='fsdp3' is not one of fsdp2, fsdp1, ddp, deepspeed" in output
    assert "did you mean sharding.backend=fsdp2?" in output


@pytest.mark.skipif(
    not installed(),
    reason="DeepSpeed is not installed (pip install 'fsdp_exp[deepspeed]'; the "
    "README's test command and CI install it)",
)
def test_a_deepspeed_refusal_exits_2_before_any_rank_starts(tmp_path):
    result = run_cli(["sharding=zero2", "prefetch=deep"], tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "prefetch=deep with sharding=grad_op" in result.stderr and "fix:" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert leftover_processes(tmp_path / "run") == []
