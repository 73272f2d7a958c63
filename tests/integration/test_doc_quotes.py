"""Every command output the docs quote is what the command prints today.

A page marks a quoted output with the command that printed it, then the output as a ``text`` block:

    <!-- checked: python -m fsdp_exp.plan model=qwen3_moe_30b_a3b trainer.nproc_per_node=8 -->
    ```text
    ...the lines the command printed...
    ```

Each marked block is checked line by line (whitespace folded) against a fresh run of the command, in this
process and without a process group: the planner and tune weigh on the meta device. A change that moves a
quoted figure fails here, and the page is updated with the new output. docs/choosing.md's blocks, named
rather than spelt out, are test_choosing_doc's.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"<!-- checked: (python -m (fsdp_exp\.\w+) [^>]*?) -->\s*```text\n(.*?)```", re.S)
CHECKABLE = ("fsdp_exp.plan", "fsdp_exp.tune")  # their mains run in-process, on the meta device
RULES = " ─━│┃┏┓┗┛┳┻┡┩╇├┤┼└┘┴┬┌┐"  # box drawing: a quoted table's rules (a page quotes it at a width that fits)


def quotes() -> list[tuple[str, str, str, list[str]]]:
    """(page, module, arguments, quoted lines) of every marked block under docs/."""
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for command, module, lines in MARKED.findall(page.read_text()):
            args = command.split(None, 3)[3] if len(command.split(None, 3)) > 3 else ""
            found.append((page.name, module, args, [line for line in lines.splitlines() if line.strip()]))
    return found


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_marked_quote_names_a_command_this_test_can_run():
    for page, module, args, lines in quotes():
        assert module in CHECKABLE, f"docs/{page} marks a quote of {module}, which only {CHECKABLE} can check"
        assert lines, f"docs/{page} marks an empty quote of python -m {module} {args}"


@pytest.mark.slow  # each quote reruns its planner or tune search: seconds to a minute on 2 busy cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page,module,args,lines", [pytest.param(*q, id=f"{q[0]}-{i}") for i, q in enumerate(quotes())])
def test_a_quoted_output_is_what_its_command_prints_today(page, module, args, lines, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # a line of output a line, as the pages quote it
    argv = shlex.split(args.replace("\\\n", " "))
    if module == "fsdp_exp.tune":
        argv.append(f"tune.out={tmp_path}")
    main = importlib.import_module(module + ".cli").main
    capsys.readouterr()
    main(argv)  # a refusal quoted on purpose exits 2: the lines below decide
    printed = _flat(capsys.readouterr().out)
    for line in lines:
        if not line.strip(RULES):
            continue  # a table's rule: its length is the terminal's, no figure in it
        assert _flat(line) in printed, f"docs/{page} quotes a line `python -m {module}` no longer prints:\n{line}"
