"""How fsdp_exp refuses and fails: one error for a configuration that cannot run, one for a run whose
rank failed, and the exit codes both map to. A leaf: it imports nothing of fsdp_exp.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
from typing import Iterable, Iterator, NoReturn, Optional

EXIT_RUN_FAILED = 1  # a rank failed (raised, was killed, ran out of memory)
EXIT_BAD_CONFIG = 2  # the configuration cannot run; nothing was started


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the override that fixes it."""


def fail(problem: str, fix: str) -> NoReturn:
    """Refuse a configuration: what is wrong, then the override that fixes it (every check uses this)."""
    raise ConfigError(f"{problem}\n  fix: {fix}")


# The refusals a plan or a search passes over (``planning``): set while the planner or tune weighs a layout.
_PLANNING: contextvars.ContextVar[Optional[list[str]]] = contextvars.ContextVar("planning", default=None)


def not_built(problem: str, fix: str) -> None:
    """Refuse a product of parallelisms that torch runs but fsdp_exp's runtime does not build yet. A run is
    refused as by ``fail``; a plan or a search (inside ``planning``) goes on, and the problem is noted."""
    noted = _PLANNING.get()
    if noted is None:
        fail(problem, fix)
    noted.append(problem)


@contextlib.contextmanager
def planning() -> Iterator[list[str]]:
    """Inside: ``not_built`` refusals are noted in the yielded list instead of raised (the planner's, tune's and
    the fit search's view: they weigh layouts the runtime has not built yet)."""
    noted: list[str] = []
    token = _PLANNING.set(noted)
    try:
        yield noted
    finally:
        _PLANNING.reset(token)


def closest(word: object, choices: Iterable[str]) -> Optional[str]:
    """The choice most like ``word`` (difflib's ratio at least 0.6), or None: what a refusal offers instead."""
    found = difflib.get_close_matches(str(word), list(choices), n=1)
    return found[0] if found else None


def did_you_mean(near: Optional[str], shown: str = "{}", before: str = "", after: str = "") -> str:
    """``before`` + "did you mean <``shown`` with ``near``>?" + ``after``, or "" where nothing was close
    (``near`` is ``closest(...)``): every refusal of an unknown name says it in these words."""
    return f"{before}did you mean {shown.replace('{}', near)}?{after}" if near is not None else ""


class RunFailed(RuntimeError):
    """A rank failed. ``rank`` and ``summary`` say which and why; the record holds the details."""

    def __init__(self, rank: Optional[int], summary: str):
        super().__init__(f"rank {rank} failed: {summary}" if rank is not None else summary)
        self.rank, self.summary = rank, summary
