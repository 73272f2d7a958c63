"""Console tables that fit the terminal: a width to print at, and a table that drops its least needed columns, in
a stated order, until it fits (tune's ranking, the report's ranking). The data behind them stays whole: tune.json,
the report's CSV and HTML hold every column."""

from __future__ import annotations

import os
import sys
from typing import Callable, Iterable, Optional

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
