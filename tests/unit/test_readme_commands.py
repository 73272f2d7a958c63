"""The README's quick start: its test commands say how long they take, and its tools install from an extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
DURATION = re.compile(r"~\s?\d+(?:\.\d+)?\s?(?:s|min)\b")


def quick_start_block() -> str:
    """The first bash block of the README: the commands a new user runs first."""
    return FENCE.findall((REPO / "README.md").read_text())[0]


def test_every_test_command_of_the_quick_start_says_how_long_it_runs_and_the_quick_tier_is_beside_the_suite():
    lines = [line for line in quick_start_block().splitlines() if "pytest" in line]
    suite = [line for line in lines if re.search(r"python -m pytest\s*(#|$|&&)", line)]
    quick = [line for line in lines if "python -m pytest tests/unit" in line]
    assert suite, "the quick start names no command that runs the whole suite"
    assert quick, "the quick start does not give the quick tier's command (python -m pytest tests/unit)"
    for line in suite + quick:
        assert DURATION.search(line.partition("#")[2]), f"this test command does not say how long it runs: {line!r}"


def test_the_notebooks_extra_installs_jupyter_lab_and_nbclient_and_the_readme_and_reports_page_name_it():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ]", requirement)[0].lower() for requirement in extras.get("notebooks", [])}
    assert {"jupyterlab", "nbclient"} <= names, f"the notebooks extra holds {sorted(names)}"
    assert '".[notebooks]"' in quick_start_block()
    reports = (REPO / "docs" / "reports.md").read_text()
    assert "jupyter lab" in reports and ".[notebooks]" in reports
