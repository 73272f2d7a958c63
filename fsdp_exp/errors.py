"""How fsdp_exp refuses and fails: one error for a configuration that cannot run, one for a run whose
rank failed, and the exit codes both map to. A leaf: it imports nothing of fsdp_exp.
"""

from __future__ import annotations

import difflib
from typing import Iterable, NoReturn, Optional

EXIT_RUN_FAILED = 1  # a rank failed (raised, was killed, ran out of memory)
EXIT_BAD_CONFIG = 2  # the configuration cannot run; nothing was started


class ConfigError(ValueError):
    """A configuration that cannot run. The message names the override that fixes it."""


def fail(problem: str, fix: str) -> NoReturn:
    """Refuse a configuration: what is wrong, then the override that fixes it (every check uses this)."""
    raise ConfigError(f"{problem}\n  fix: {fix}")


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
