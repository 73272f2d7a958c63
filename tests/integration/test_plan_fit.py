"""The planner finds a fit (issue 35): Llama-3 8B in the default fp32 on 8 H100 at sequence 8192 needs ~800 GiB a
rank; the plan prints the cheapest combination of memory options that fits as one command, and the planner run on
that command says it fits. No process group: the planner builds the model on the meta device."""

from __future__ import annotations

import pytest

from fsdp_exp.plan.cli import main

pytestmark = pytest.mark.slow

ISSUE = [
    "model=llama3_8b",
    "trainer.nproc_per_node=8",
    "trainer.seq_len=8192",
    "trainer.global_batch_size=16",
    "plan.device=h100_80gb",
]


def test_a_plan_that_does_not_fit_prints_a_combination_that_fits_and_planning_it_says_so(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one command a line, for the test to read back
    assert main(ISSUE) == 0
    out = capsys.readouterr().out
    assert "does not fit on h100_80gb" in out
    # the header says what was planned: not the tiny defaults
    assert "model=llama3_8b" in out and "sequence 8192, global batch 16" in out and "8 ranks" in out
    # rows say what they hold; the headroom has the table's digits
    assert "temporaries" in out and "-721.750" not in out
    fit = next(line for line in out.splitlines() if line.startswith("fits with "))
    assert len(fit.split(":")[0].split()) >= 4  # more than one change: no single memory option fits this one
    check = next(line for line in out.splitlines() if line.strip().startswith("check it: "))
    command = check.split("check it: ", 1)[1].split()
    assert command[:3] == ["python", "-m", "fsdp_exp.plan"]
    assert main(command[3:]) == 0
    again = capsys.readouterr().out
    assert "fits on h100_80gb" in again and "does not fit" not in again and "fits with " not in again
