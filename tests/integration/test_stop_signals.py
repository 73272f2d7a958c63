"""A stop signal that reaches a SLURM task while it is still starting (importing torch, unpickling its
job) must not kill it: the task's Python starts with the stop signals blocked (fsdp_exp/slurm.py
``task_python``), and the signal reaches the handlers once they are installed. The run then keeps only
the handlers its config asks for (checkpoint.signals, none with checkpoint.on_signal=false)."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys

from fsdp_exp.slurm import STOP_SIGNALS, task_python

# A task that is signalled before any handler exists, then installs fsdp_exp's.
EARLY_SIGNAL = (
    "import os, signal, sys; os.kill(os.getpid(), signal.{name}); "
    "from fsdp_exp.checkpoint.signals import handle_stop_signals, signal_requested; "
    f"handle_stop_signals({STOP_SIGNALS!r}); print(signal_requested())"
)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_signal_that_comes_before_the_handlers_waits_for_them():
    for name in STOP_SIGNALS:
        code = EARLY_SIGNAL.format(name=name)
        held = _run([*shlex.split(task_python()), "-c", code])
        assert held.returncode == 0, held.stderr[-2000:]
        assert held.stdout.strip() == name
    # The same task started as a plain Python is killed by the signal's default action.
    plain = _run([sys.executable, "-c", EARLY_SIGNAL.format(name="SIGUSR1")])
    assert plain.returncode == -signal.SIGUSR1, (plain.returncode, plain.stderr[-2000:])


def test_the_run_keeps_only_the_handlers_its_config_asks_for():
    """The launcher handles both; a run with checkpoint.signals=[SIGTERM] gives SIGUSR1 its default back
    (it kills), and checkpoint.on_signal=false gives both back: a signal that came meanwhile acts then."""
    setup = (
        "import os, signal; from fsdp_exp.checkpoint.signals import handle_stop_signals, signal_requested; "
        f"handle_stop_signals({STOP_SIGNALS!r}); "
    )
    only_sigterm = _run(
        [
            sys.executable,
            "-c",
            setup + "handle_stop_signals(['SIGTERM']); "
            "os.kill(os.getpid(), signal.SIGTERM); print(signal_requested(), flush=True); "
            "os.kill(os.getpid(), signal.SIGUSR1); print('survived')",
        ]
    )
    assert only_sigterm.returncode == -signal.SIGUSR1, (only_sigterm.returncode, only_sigterm.stderr[-2000:])
    assert only_sigterm.stdout.split() == ["SIGTERM"]
    came_early = _run(
        [
            *shlex.split(task_python()),
            "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGTERM); "
            + setup
            + "handle_stop_signals([]); print('survived')",
        ]
    )
    assert came_early.returncode == -signal.SIGTERM, (came_early.returncode, came_early.stderr[-2000:])
    assert "survived" not in came_early.stdout
