"""A stop signal that reaches a SLURM task while it is still starting (importing torch, unpickling its
job) must not kill it: the task's Python starts with the stop signals blocked (fsdp_exp/slurm.py
``task_python``), and the signal reaches the handlers once they are installed."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys

from fsdp_exp.slurm import STOP_SIGNALS, task_python

# A task that is signalled before any handler exists, then installs fsdp_exp's.
EARLY_SIGNAL = ("import os, signal, sys; os.kill(os.getpid(), signal.{name}); "
                "from fsdp_exp.checkpoint.signals import install_signal_handlers, signal_requested; "
                f"install_signal_handlers({STOP_SIGNALS!r}); print(signal_requested())")


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


def test_a_held_signal_acts_as_the_default_once_the_run_stands_down():
    """checkpoint.on_signal=false: the run restores the defaults, and a signal that came meanwhile acts."""
    code = ("import os, signal; os.kill(os.getpid(), signal.SIGTERM); "
            "from fsdp_exp.checkpoint.signals import install_signal_handlers, stand_down; "
            f"install_signal_handlers({STOP_SIGNALS!r}); stand_down({STOP_SIGNALS!r}); print('survived')")
    result = _run([*shlex.split(task_python()), "-c", code])
    assert result.returncode == -signal.SIGTERM, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "survived" not in result.stdout
