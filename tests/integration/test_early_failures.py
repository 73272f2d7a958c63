"""A run that fails before rank 0's first row says why in its own words, and nothing else: no Python
traceback from the launcher, a rank or rank 0's W&B writer (which a failing parent used to leave with
"EOFError: Ran out of input"). One real ``python -m fsdp_exp`` per stage where a run can stop, from
Hydra's composition to the first step, W&B on (offline) so that its writer is started ahead."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TINY_BATCH, TINY_MODEL, leftover_processes, run_cli

TINY = [*TINY_MODEL, *TINY_BATCH, "trainer.steps=2", "trainer.warmup_steps=1", "logger.wandb.mode=offline"]


def _stages(tmp_path) -> dict[str, tuple[list[str], int, str]]:
    """stage: (overrides, exit status, the words of the real message)."""
    short = tmp_path / "short.txt"
    short.write_text("Too short for a batch.\n")
    broken = tmp_path / "broken" / "step_2"  # complete by its files, unreadable by a rank: no format in it
    broken.mkdir(parents=True)
    (broken / "fsdp_exp_checkpoint.json").write_text("{}")
    (broken / ".metadata").write_bytes(b"")
    return {
        # Hydra's composition: one path for a key that holds a list
        "composition": (["data=text", "data.files=/some/train.txt"], 2, "fix: pass data.files=[/some/train.txt]"),
        # typing the composed config
        "typing": ([*TINY, "optim.lr=nan"], 2, "optim.lr=nan is not a finite number"),
        # preflight's own checks
        "preflight": ([*TINY, "trainer.global_batch_size=5"], 2, "trainer.global_batch_size=6"),
        # the launcher's late checks: the resume folder, the fit check, packing the data
        "resume folder": ([*TINY, "checkpoint.resume=/nonexistent/ckpt"], 2, "checkpoint.resume=/nonexistent/ckpt: no"),
        "fit check": (["model=llama7b", "sharding=full"], 2, "does not fit"),
        "data": (
            [*TINY, "data=text", f"data.files=[{short}]", f"data.cache_dir={tmp_path / 'cache'}"],
            2,
            "fewer than one global batch",
        ),
        # the ranks: every rank raises while building (the resume reads the checkpoint), before W&B opens
        "building": ([*TINY, f"checkpoint.resume={broken}"], 1, "has format None"),
        # a rank raises at the first step, once rank 0's W&B run is open
        "first step": ([*TINY, "debug.fail_at_step=0", "debug.fail_rank=1"], 1, "debug.fail_at_step=0 on rank 1"),
    }


@pytest.mark.slow
def test_a_run_that_fails_before_its_first_row_prints_its_reason_and_no_traceback(tmp_path):
    stages = _stages(tmp_path)
    with ThreadPoolExecutor(max_workers=3) as pool:  # independent start-ups of Python and torch
        results = {
            name: pool.submit(run_cli, overrides, tmp_path / name.replace(" ", "_"))
            for name, (overrides, _, _) in stages.items()
        }
        results = {name: future.result() for name, future in results.items()}
    for name, (_, status, words) in stages.items():
        result = results[name]
        output = result.stdout + result.stderr
        assert result.returncode == status, f"{name}: {output[-3000:]}"
        assert words in output, f"{name}: {output[-3000:]}"
        assert "Traceback" not in output, f"{name}: {output[-3000:]}"
        metrics = result.run_dir / "metrics.jsonl"
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        assert rows == [], f"{name}: {rows}"
        assert leftover_processes(result.run_dir) == [], name
        if status == 1:  # the ranks started: the run record says failed, with the same words
            record = json.loads((result.run_dir / "run.json").read_text())
            assert record["status"] == "failed" and words in record["error"]["message"], record.get("error")
