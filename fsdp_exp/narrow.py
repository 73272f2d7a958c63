"""Console output that fits the terminal: a width to print at, a table that drops its least needed columns, in
a stated order, until it fits (tune's ranking, the report's ranking), and lines of prose and commands broken at
that width (tune's and the planner's lines below their tables). The data behind them stays whole: tune.json,
the report's CSV and HTML hold every column."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from typing import Callable, Iterable, Optional

from rich.cells import cell_len

PIPED_WIDTH = 100  # a log or a pager: what a reader's window shows, not rich's 80 nor a width no terminal has


def terminal_width() -> Optional[int]:
    """None (rich detects it) on a terminal or where ``COLUMNS`` says; piped without ``COLUMNS``, ``PIPED_WIDTH``."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH


def fit_columns(build: Callable[[list[str]], object], columns: list[str], drop_order: Iterable[str], width: int):
    """``build(columns)`` with the columns of ``drop_order`` left out, first to last, until the table's narrowest
    rendering (wrapping columns at their ``min_width``) fits ``width``; what is left when none remains to drop."""
    from rich.console import Console

    console = Console(width=width, file=open(os.devnull, "w"))
    columns = list(columns)
    table = build(columns)
    for column in drop_order:
        if _fits(console, table, width):
            break
        if column in columns:
            columns.remove(column)
            table = build(columns)
    return table


def _fits(console, table, width: int) -> bool:
    """Whether ``table`` printed at ``width`` shows every word of every cell whole: rich's measurement says what
    the narrowest layout could be, not the one it picks (it shrinks columns in proportion and crops what is left
    over at the edge, a word folded or cut), so the table is laid out and read back."""
    console.begin_capture()
    console.print(table)
    shown = set(console.end_capture().split())
    for column in table.columns:
        for cell in column.cells:
            if not set(str(cell).split()) <= shown:
                return False
    return True


# A command, alone or after a short label ("  measure them: python -m ..."): printed whole, broken between its
# arguments with shell continuations as the docs print commands, so that it pastes into a shell as one command.
COMMAND = re.compile(r"^(?P<label>(?:[a-z][\w ]{0,40}:\s+)?)(?P<command>python3? -m \S.*)$")
ARGUMENT = re.compile(r"""(?:[^\s'"]+|'[^']*'|"[^"]*")+""")  # one shell word, its quotes kept
CONTINUATION = "    "  # a command's later lines, under its first (the docs' indentation)
HANGING = "  "  # a paragraph's later lines, under its first


def console_lines(text: str, width: int) -> list[str]:
    """``text`` (one or more lines) as lines of at most ``width`` columns: a command broken between its arguments
    with `` \\`` continuations, prose wrapped between words with its later lines indented under the first. A
    single word wider than ``width`` (a long path) stays whole on its own line: cut, it would no longer work."""
    out: list[str] = []
    for line in text.split("\n"):
        indent = line[: len(line) - len(line.lstrip())]
        body = line.strip()
        command = COMMAND.match(body)
        if cell_len(line) <= width:
            out.append(line)
        elif command:
            out += _command_lines(indent + command["label"], ARGUMENT.findall(command["command"]), indent, width)
        else:
            out += textwrap.wrap(
                body,
                width,
                initial_indent=indent,
                subsequent_indent=indent + HANGING,
                break_long_words=False,
                break_on_hyphens=False,
            )
    return out


def _command_lines(start: str, words: list[str], indent: str, width: int) -> list[str]:
    lines, current = [], start + words[0]
    for i, word in enumerate(words[1:], start=2):
        room = width - (0 if i == len(words) else 2)  # every line but the last ends in " \\"
        if cell_len(current) + 1 + cell_len(word) <= room:
            current += " " + word
        else:
            lines.append(current + " \\")
            current = indent + CONTINUATION + word
    return lines + [current]
