"""The training loop's stop policy: ``StopGuard``.

After every step the ranks agree (the per-step flags of fsdp_exp.checkpoint.signals) on two things: did
a stop signal come (``checkpoint.on_signal``: save and stop), and was some rank's loss NaN/inf
(``checkpoint.nan_check``: stop with an error and save nothing, so the last good checkpoint stays the
newest). The loop acts on the answer; the checkpointer only saves when it is told to or when it is due.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from fsdp_exp.checkpoint.signals import Flags, StepFlags


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf: the run stops; the last good checkpoint stays on disk."""


class StopGuard:
    """One rank's side; every rank calls ``poll`` after every step and ``finish`` at the end."""

    def __init__(self, settings, rank: int, total_steps: int):
        self.flags = StepFlags(settings.on_signal, settings.nan_check, rank)
        self.total_steps = total_steps

    def poll(self, step: int, loss: torch.Tensor, saves: bool) -> Flags:
        """What all ranks agree on after step ``step`` (1-based): (the signal that asks to stop, the
        highest rank whose loss was NaN/inf, the step it was). At a step that ``saves``, and at the
        last, the current flags are agreed at once, so a NaN/inf state is never saved."""
        return self.flags.poll(step, loss, agree_now=saves or step == self.total_steps)

    def check_finite(self, flags: Flags, last_good: Callable[[], Optional[Path]]) -> None:
        """Raise NonFiniteLoss when a rank's loss was NaN/inf, naming ``last_good()`` (the newest
        complete checkpoint, once a save in flight has completed)."""
        _, bad_rank, bad_step = flags
        if bad_rank is None:
            return
        last = last_good()
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        raise NonFiniteLoss(
            f"train/loss is not finite (NaN or inf) at step {bad_step} (seen on rank {bad_rank}); "
            f"stopping without saving this state: {where}. Lower optim.lr, raise "
            "trainer.grad_clip or change precision, then resume from that checkpoint"
        )

    def stop_signal(self, step: int, flags: Flags) -> Optional[str]:
        """The signal that asks the run to save and stop after step ``step``; None to go on (also at
        the last step, which ends the run anyway)."""
        stop = flags[0]
        return stop if stop and step < self.total_steps else None

    def finish(self) -> None:
        self.flags.finish()
