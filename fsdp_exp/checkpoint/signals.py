"""Stop signals, and the per-step agreement of all ranks on "stop" and "my loss is not finite".

``handle_stop_signals`` makes SIGTERM / SIGUSR1 (``checkpoint.signals``) only set a flag. Each
step every rank all-reduces two numbers (the signal, "my loss is not finite") without blocking and
reads the result one step later, so all ranks agree at the same step to save and stop, or to stop with
an error on a NaN/inf loss; at a step that saves (and at the last) the current step's flags are agreed
at once, so a non-finite state is never saved.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

_requested: dict[str, Optional[str]] = {"signal": None}


def _on_signal(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    if _requested["signal"] is None:
        _requested["signal"] = signal.Signals(signum).name


def handle_stop_signals(names: list[str]) -> None:
    """From now on exactly these signals only ask the run to save and stop (main thread only); any other
    that was handled here before acts as the system defines again (``_stand_down``). A launcher may have
    started this process with them blocked (``fsdp_exp.slurm``: SLURM can signal a task while it is still
    importing); one that came meanwhile is pending, and reaches the handler as they are unblocked."""
    _stand_down(sorted(_handled() - set(names)))
    signums = [getattr(signal, name) for name in names]
    for signum in signums:
        signal.signal(signum, _on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)


def _handled() -> set[str]:
    """The signals whose handler is ``_on_signal`` now."""
    return {
        s.name for s in signal.valid_signals() if isinstance(s, signal.Signals) and signal.getsignal(s) is _on_signal
    }


def _stand_down(names: list[str]) -> None:
    """These signals act as the system defines again: a launcher handled them from its first moment
    (``fsdp_exp.slurm``: SLURM can signal a job before its config is read), the run does not
    (checkpoint.on_signal=false, or not in checkpoint.signals). One that already came is delivered now,
    as it would have been."""
    signums = [getattr(signal, name) for name in names]
    for signum in signums:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)
    if _requested["signal"] in names:
        signal.raise_signal(getattr(signal, _requested["signal"]))


def signal_requested() -> Optional[str]:
    return _requested["signal"]


# (the signal that asks to stop, the highest rank whose loss was NaN/inf, the step it was)
Flags = tuple[Optional[str], Optional[int], Optional[int]]


class StepFlags:
    """One rank's side of the per-step agreement. Every rank calls ``poll`` at every step and
    ``finish`` at the end (both are collectives on a group of their own)."""

    def __init__(self, on_signal: bool, nan_check: bool, rank: int):
        self.on_signal, self.nan_check, self.rank = on_signal, nan_check, rank
        self.enabled = on_signal or nan_check
        self._inflight = None  # (work, flags, step) of the all-reduce in flight
        # The flags travel on a CPU group of their own: never queued behind (or between) the model's
        # collectives, and no device synchronization on CUDA.
        self._group = dist.new_group(backend="gloo") if self.enabled else None

    def poll(self, step: int, loss: torch.Tensor, agree_now: bool) -> Flags:
        """What all ranks agree on after step ``step``. Each step's flags are all-reduced without
        blocking and read one step later, so the collective hides behind the next step's compute;
        ``agree_now`` (a step that saves, or the last) agrees on the current flags at once. Nothing at
        all when checkpoint.on_signal and nan_check are off."""
        if not self.enabled:
            return None, None, None
        requested = signal_requested() if self.on_signal else None
        finite = not self.nan_check or bool(torch.isfinite(loss).all())
        flags = torch.tensor(
            [float(getattr(signal, requested)) if requested else 0.0, 0.0 if finite else self.rank + 1.0],
            dtype=torch.float64,
        )
        agreed: list[tuple[torch.Tensor, int]] = []
        if self._inflight is not None:
            work, buffer, at = self._inflight
            self._inflight = None
            work.wait()
            agreed.append((buffer, at))
        if agree_now:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            agreed.append((flags, step))
        else:
            self._inflight = (
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True),
                flags,
                step,
            )
        stop = bad_rank = bad_step = None
        for buffer, at in agreed:
            signum, bad = buffer.tolist()
            if signum and stop is None:
                stop = signal.Signals(int(signum)).name
            if bad and bad_step is None:
                bad_rank, bad_step = int(bad) - 1, at
        return stop, bad_rank, bad_step

    def finish(self) -> None:
        if self._inflight is not None:  # every rank started it: it completes
            self._inflight[0].wait()
            self._inflight = None
