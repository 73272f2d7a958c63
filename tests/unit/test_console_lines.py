"""tune's console prose at the terminal's width (fsdp_exp.narrow.console_lines): prose wrapped between words,
commands broken between their arguments with shell continuations, whatever line a reason adds."""

from __future__ import annotations

import re
import shlex

from fsdp_exp.narrow import console_lines


def test_a_labelled_command_breaks_between_arguments_and_reads_back_as_the_same_command():
    command = "python -m fsdp_exp -m +tune_candidate=c1,c2 'hydra.sweep.dir=/a folder/sweep' " + " ".join(
        f"trainer.key{i}=value{i}" for i in range(12)
    )
    lines = console_lines(f"  measure them: {command}", 60)
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert lines[0].startswith("  measure them: python -m fsdp_exp")
    assert shlex.split(re.sub(r" \\\n\s+", " ", "\n".join(lines)).partition(": ")[2]) == shlex.split(command)


def test_prose_wraps_under_its_first_line_and_a_word_wider_than_the_terminal_stays_whole():
    path = "/very/long/" + "x" * 70 + "/tune.json"
    text = "  why: " + " ".join(["word"] * 30) + f" and {path} too"
    lines = console_lines(text, 50)
    assert lines[0].startswith("  why: ") and all(line.startswith("    ") for line in lines[1:])
    assert all(len(line) <= 50 or line.strip() == path for line in lines)
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())
    assert console_lines("short\n  python -m fsdp_exp a=1", 50) == ["short", "  python -m fsdp_exp a=1"]
