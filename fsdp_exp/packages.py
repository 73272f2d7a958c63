"""Optional packages: a run needs them on the machine it runs on; a plan for another machine does not.

``python -m fsdp_exp.tune ... plan.device=h100_80gb`` weighs candidates for a GPU that is not this machine:
their FLOPs and memory come from the config and the model's shapes, so a package that only running needs
(torchao for float8, say) need not be installed on the laptop that plans. Inside ``planning_elsewhere()`` a
check that would refuse a missing package notes it instead, and the planner says so in its output; everywhere
else (a run, a plan for this machine) the refusal stands, naming the install command.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

from fsdp_exp.errors import fail

# module -> (what needs it, the install command), while planning for another machine; None otherwise
_NOTED: ContextVar[Optional[dict[str, tuple[str, str]]]] = ContextVar("fsdp_exp_missing_packages", default=None)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, needed_by: str, problem: str, fix: str) -> None:
    """Refuse ``needed_by`` where ``module`` is not installed (``problem``, ``fix``), unless planning for another
    machine, where the missing package is noted and the check passes."""
    if installed(module):
        return
    noted = _NOTED.get()
    if noted is None:
        fail(problem, fix)
    noted.setdefault(module, (needed_by, fix))


@contextmanager
def planning_elsewhere() -> Iterator[dict[str, tuple[str, str]]]:
    """While planning for another machine: yields module -> (what needs it, install command) of the packages a
    check found missing here and let pass."""
    noted: dict[str, tuple[str, str]] = {}
    token = _NOTED.set(noted)
    try:
        yield noted
    finally:
        _NOTED.reset(token)
