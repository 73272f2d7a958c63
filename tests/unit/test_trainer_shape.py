"""The trainer trains: its loop, the step and the checkpoint calls fit in one reading, and what a step
measures lives in the step metrics (fsdp_exp.metrics.step), not in the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

from fsdp_exp.metrics.schema import ALL_METRICS

TRAINER = Path(__file__).resolve().parents[2] / "fsdp_exp" / "trainer.py"


def test_the_trainer_stays_under_350_lines():
    lines = len(TRAINER.read_text().splitlines())
    assert lines < 350, f"fsdp_exp/trainer.py has {lines} lines: move what is not the loop or the step out"


def test_the_trainer_names_no_metric_and_the_step_metrics_name_the_per_step_ones():
    """A metric's name in a string is where its value is made; the trainer makes none of them."""
    prefixes = tuple({name.split("/")[0] + "/" for name in ALL_METRICS if "/" in name})
    named = [
        node.value
        for node in ast.walk(ast.parse(TRAINER.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(prefixes)
    ]
    assert not named, f"fsdp_exp/trainer.py names metrics {named}: they belong in fsdp_exp/metrics/step.py"
    step = (TRAINER.parent / "metrics" / "step.py").read_text()
    assert '"perf/tokens_per_s"' in step and '"perf/mfu"' in step
