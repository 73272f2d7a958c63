"""Fault injection (the ``debug`` group), to exercise what a failing rank does to a run and its
checkpoints: a rank that raises or is killed at the start of a step, a rank whose parameters turn NaN,
a rank that dies inside a save after writing its shards."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from fsdp_exp.models.moe import moe_layers


class InjectedFailure(RuntimeError):
    """Raised on purpose by debug.fail_at_step, to exercise failure handling."""


def inject_step_fault(debug, step: int, rank: int, model: torch.nn.Module) -> None:
    """At the start of step ``step`` (0-based) on rank ``debug.fail_rank``: ``debug.nan_at_step`` turns
    a parameter NaN; ``debug.fail_at_step`` (with ``fail_during=step``) raises or sends ``fail_signal``.
    Every rank first sleeps ``debug.step_sleep_s``."""
    d = debug
    if d.step_sleep_s:
        time.sleep(d.step_sleep_s)
    if d.nan_at_step == step and rank == d.fail_rank:
        # A real NaN: through this rank's forward, its gradients, the reduction and the loss.
        with torch.no_grad():
            for param in model.parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.numel():
                    local.fill_(float("nan"))
                    break
    if d.favour_expert is not None:
        favour_expert(model, d.favour_expert)
    if d.fail_at_step is not None and step == d.fail_at_step and rank == d.fail_rank and d.fail_during == "step":
        if d.fail_signal:  # SIGKILL ends the rank here; a handled signal (SIGTERM) asks for a save and stop
            os.kill(os.getpid(), getattr(signal, d.fail_signal))
            return
        raise InjectedFailure(f"debug.fail_at_step={d.fail_at_step} on rank {d.fail_rank}")


@torch.no_grad()
def favour_expert(model: torch.nn.Module, expert: int) -> None:
    """Every MoE layer's router picks ``expert`` first for every token: its bias is set 1e4 above the others'
    (scores are in [0, 1]), every rank alike. The mixing weights are the scores', as the bias never enters them."""
    for layer in moe_layers(model):
        bias = layer.router.expert_bias
        if not 0 <= expert < bias.numel():
            raise ValueError(f"debug.favour_expert={expert}: the model has {bias.numel()} experts")
        bias.zero_()
        bias[expert] = 1e4


def storage_writer(path: Path, step: int, rank: int, debug):
    """The torch.distributed.checkpoint writer of checkpoint ``step``: a FileSystemWriter, or on
    ``debug.fail_during=save`` (at ``debug.fail_at_step``, rank ``debug.fail_rank``) one that fails."""
    from torch.distributed.checkpoint import FileSystemWriter

    d = debug
    if d.fail_during == "save" and d.fail_at_step == step and rank == d.fail_rank:
        return _failing_writer(path, d.fail_signal)
    return FileSystemWriter(path)


def _failing_writer(path: Path, fail_signal: Optional[str]):
    """A FileSystemWriter that writes this rank's shards, then fails (raises, or sends the rank
    ``fail_signal``) before the checkpoint is complete."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Failing(FileSystemWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            if fail_signal:
                os.kill(os.getpid(), getattr(signal, fail_signal))
                time.sleep(60)  # a catchable signal still ends the rank here
            raise RuntimeError(f"debug.fail_during=save: injected failure while saving {path}")

    return Failing(path)
