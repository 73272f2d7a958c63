"""Rank 0's W&B run, written by a process of its own (``WandbProcess``), so that W&B's work is not rank 0's.

Opening a W&B run costs 1-2 CPU seconds (importing wandb, its service, a first row with a null in it
importing pandas); in rank 0, or a thread of it, that time holds rank 0 while every other rank waits for
it at the next collective. A child process does it on another core instead: rank 0 hands it the calls a
``WandbSink`` takes, pickled through its standard input, and goes on; the child makes them, in order,
with a ``WandbSink`` of its own, and ``close`` waits until it has finished the run. A launcher that forks
its ranks starts the child ahead, so that W&B is imported while the launcher prepares. The run id is
chosen before W&B opens, so run.json and the checkpoints name it at once. W&B failing, to open the run
too, is W&B stopping: the run goes on without it (``error``, recorded in run.json). The child dies with
its parent and ignores the stop signals a scheduler or a terminal sends the whole job: the ranks decide
when the run ends.

    python -m fsdp_exp.record.wandb_process    # the child; started by WandbProcess only"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from fsdp_exp.record.values import json_safe
from fsdp_exp.record.wandb_sink import WandbSink, new_run_id

# The logger.wandb settings the child needs (as plain values: it does not import fsdp_exp's config).
WANDB_SETTINGS = ("project", "entity", "group", "name", "tags", "mode")
# What the job's stop signals mean for the ranks, not for W&B: the ranks save, stop and close it.
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")


class WandbProcess:
    """A ``WandbSink`` (same arguments and calls) whose W&B work runs in a child process."""

    def __init__(
        self,
        wandb_cfg,
        run_dir: Path,
        config: dict,
        overrides: list[str],
        choices: dict[str, str],
        run_id: Optional[str] = None,
    ):
        self.run_id = run_id or new_run_id()
        self.error: Optional[str] = None  # set when W&B stopped working during the run
        self._opened: Optional[bool] = None  # what the child answered once it tried to open the run
        settings = {name: getattr(wandb_cfg, name) for name in WANDB_SETTINGS}
        self._child = _take_ahead() or _start_child()
        sink_args = (settings, str(run_dir), _builtins(config), list(overrides), dict(choices), run_id, self.run_id)
        self._send("open", *sink_args)

    # --------------------------------------------------------------------------- WandbSink's calls
    def log(self, metrics: dict) -> None:
        self._check_opened(wait=False)  # says so at once if W&B could not open the run
        self._send("log", _builtins(metrics))

    def summary(self, summary: dict) -> None:
        self._send("summary", _builtins(summary))

    def log_files(self, files: list[Path], run_dir: Path) -> None:
        self._send("log_files", [Path(p) for p in files], Path(run_dir))

    def close(self, exit_code: int = 0) -> None:
        """Finish the W&B run and wait until the child has written everything handed to it."""
        self._check_opened(wait=True)
        self._send("close", exit_code)
        try:
            self._child.stdin.close()
        except OSError:
            pass
        answer = self._answer()
        self._child.wait()
        if answer is None:
            self._stopped("close: the W&B process ended before it finished the run")
        elif answer[1] and self.error is None:
            self.error = answer[1]  # the child's WandbSink stopped using W&B (it said so on stderr)

    # ------------------------------------------------------------------------------------- the pipe
    def _send(self, call: str, *args) -> None:
        if self.error is not None:
            return
        try:
            pickle.dump((call, args), self._child.stdin)
            self._child.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # the child is gone: it failed to open, or was killed
            self._check_opened(wait=True)
            self._stopped(f"{call}: the W&B process ended")

    def _answer(self) -> Optional[tuple]:
        """The child's next message, or None when it has ended."""
        try:
            return pickle.load(self._child.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            return None

    def _check_opened(self, wait: bool) -> None:
        """Read the child's answer to opening the run, once (``wait``: until it comes). A run W&B could not
        open is W&B stopping at the start: the run goes on without it, as after any other W&B failure."""
        if self._opened is not None or self.error is not None:
            return
        if not wait and not select.select([self._child.stdout], [], [], 0)[0]:
            return  # not answered yet: rank 0 goes on, its rows wait in the pipe
        answer = self._answer()
        self._opened = answer is not None and answer[0] == "opened"
        if answer is None:
            self._stopped("open: the W&B process ended")
        elif not self._opened:
            self._stopped(f"open: {answer[1]}")

    def _stopped(self, error: str) -> None:
        """As WandbSink does when W&B stops working: say so once, go on without it."""
        if self.error is not None:
            return
        self.error = error
        print(
            f"fsdp_exp: W&B stopped working ({error}); the run goes on without it, its metrics stay in metrics.jsonl",
            file=sys.stderr,
        )


def _builtins(value):
    """``value`` (json_safe) in Python's own types: what the child unpickles must not import a module (the
    run's env holds torch.__version__, a str subclass whose unpickling imports torch: 1-2 s)."""
    value = json_safe(value)
    if isinstance(value, dict):
        return {_builtins(k): _builtins(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_builtins(v) for v in value]
    for kind in (bool, int, float, str):  # bool first: it is an int
        if isinstance(value, kind):
            return kind(value)
    return value


# -------------------------------------------------------------------------- a child started ahead
# A launcher that will fork its ranks starts rank 0's child as soon as it has the config (``start_ahead``):
# the child imports W&B and starts its service on the core the launcher leaves idle while it validates,
# plans and imports the trainer. Every forked rank inherits it; rank 0 takes it, the others let it go.
_ahead: Optional[subprocess.Popen] = None


def _start_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def start_ahead() -> None:
    """Start rank 0's child now, in the launcher (before it forks the ranks). One no rank took is killed
    when the launcher exits (a refused config)."""
    global _ahead
    _ahead = _start_child()
    atexit.unregister(discard_ahead)  # once, however many jobs of a sweep started one
    atexit.register(discard_ahead)


def started_ahead() -> bool:
    return _ahead is not None


def _take_ahead() -> Optional[subprocess.Popen]:
    global _ahead
    child, _ahead = _ahead, None
    return child


def let_go_ahead() -> Optional[subprocess.Popen]:
    """This process will not write to the child started ahead: close its ends of the child's pipes, so
    that the child sees the end of its input when rank 0 closes or dies. Returns it (for ``reap``)."""
    child = _take_ahead()
    if child is not None:
        child.stdin.close()
        child.stdout.close()
    return child


def discard_ahead() -> None:
    """No forked rank 0 will use the child started ahead (the config was refused, the ranks are spawned)."""
    child = let_go_ahead()
    if child is not None:
        child.kill()
        child.wait()


def reap(child: Optional[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """The launcher, after its ranks ended: wait for the child it started ahead (it ends once rank 0 closed
    or died), or kill it."""
    if child is None:
        return
    try:
        child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# --------------------------------------------------------------------------------------- the child
def main() -> int:
    from fsdp_exp.env import die_with_parent

    die_with_parent()
    os.nice(10)  # W&B's work yields the cores to the launcher's and the ranks' (its service inherits this)
    for name in IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _warm_up()
    # The answers go through a copy of stdout; anything W&B prints itself goes to stderr.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    calls = sys.stdin.buffer

    def answer(*message) -> None:
        pickle.dump(message, answers)
        answers.flush()

    try:
        _, (settings, run_dir, config, overrides, choices, run_id, new_id) = pickle.load(calls)
    except (EOFError, pickle.UnpicklingError):
        # Its parent ended before handing it a run: a launcher that refused the config, a rank 0 that failed
        # while building (the run's own error says why). There is no W&B run to leave: end without a word.
        return 0
    try:
        sink = WandbSink(SimpleNamespace(**settings), Path(run_dir), config, overrides, choices, run_id, new_id)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the run
        answer("failed", f"{type(exc).__name__}: {exc}")
        return 1
    answer("opened", sink.run_id)
    while True:
        try:
            call, args = pickle.load(calls)
        except (EOFError, pickle.UnpicklingError):  # rank 0 ended without closing (it failed, maybe mid-call):
            # leave the run as a killed one would
            os._exit(1)
        if call == "close":
            sink.close(*args)
            answer("closed", sink.error)
            # The run is finished and written: leave without W&B's exit handlers, as the ranks leave (W&B's
            # service ends by itself once this process is gone).
            sys.stderr.flush()
            os._exit(0)
        getattr(sink, call)(*args)


def _warm_up() -> None:
    """Before the run's settings come: what opening the run and its first rows would import or start."""
    import importlib

    import wandb

    wandb.setup()  # W&B's service process
    # wandb.init imports W&B Launch's input staging, and the first row with a null imports pandas (W&B
    # looks for a DataFrame); neither is needed to open the run, both are needed soon after.
    for name in ("wandb.sdk.launch.inputs.internal", "pandas"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


if __name__ == "__main__":
    sys.exit(main())
