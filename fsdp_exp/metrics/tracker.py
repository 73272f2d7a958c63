"""Memory breakdown of one sampled step, phase by phase, from torch's own memory trackers.

The backend picks the tracker (``Backend.memory_tracker``): FSDP2's ``FSDPMemTracker`` tells sharded
from unsharded parameters and gradients and the collectives' buffers; other backends get the generic
``MemTracker``, and a backend whose parameters torch cannot follow says so (``Backend.tracks_memory``).
The tracker instruments every op, so the tracked step is slow: the trainer samples one warm-up step,
which the summary leaves out. The training step names its phase (``StepMemory.phase``): ``forward``,
``backward``, ``optimizer``; each phase's peak is the largest total seen while it ran, with the
breakdown at that moment, and the step's peak is the largest of the three. Where each phase starts
and ends: the docs page design.md ("Metrics").
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn

from fsdp_exp.metrics.schema import PHASES


class TrackerSource(Protocol):
    """What the step's memory accounting asks of the backend (``fsdp_exp.parallel.backend.Backend``, which
    stands above metrics and so is not imported here): the torch tracker that follows its parameters."""

    def memory_tracker(self, model: nn.Module, optimizer: torch.optim.Optimizer): ...


# Torch's reference types -> fsdp_exp's kinds (the metric names say these).
KINDS = {
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "Parameter": "params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Gradient": "grads",
    "OptState": "optim_state",
    "Optstate": "optim_state",
    "Activation": "activations",
    "Temp": "temp",
    "Buffer": "buffers",
    "Inputs": "inputs",
    "Other": "other",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
}
# Kinds that are also a part of one of the kinds above (not added to the total again).
PARTS = {
    "Unsharded Param": "unsharded_params",
    "Unsharded Grad": "unsharded_grads",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
}
BREAKDOWN = (
    "params",
    "unsharded_params",
    "grads",
    "unsharded_grads",
    "optim_state",
    "activations",
    "temp",
    "comm_buffers",
    "all_gather",
    "reduce_scatter",
    "buffers",
    "inputs",
    "other",
    "model_states",
    "total",
)


def kinds_of(per_ref: dict) -> dict[str, int]:
    """One device's tracker snapshot ({reference type: bytes, "Total": bytes}) -> bytes by kind."""
    out = dict.fromkeys(BREAKDOWN, 0)
    for ref, nbytes in per_ref.items():
        name = getattr(ref, "value", ref)
        if name == "Total":
            out["total"] = nbytes
            continue
        out[KINDS.get(name, "other")] += nbytes
        if name in PARTS:
            out[PARTS[name]] += nbytes
    out["model_states"] = out["params"] + out["grads"] + out["optim_state"]
    if not out["total"]:
        parts = set(PARTS.values()) | {"model_states", "total"}
        out["total"] = sum(v for k, v in out.items() if k not in parts)
    return out


class StepMemory:
    """A context manager around one training step: torch's memory tracker, and the peak of each phase.

    ``phase(name)`` marks where the step is (``PHASES``); the first ``forward`` of a later
    micro-batch resets the tracker's per-module statistics, which otherwise refuse a second forward
    of the root module (the running peak is kept: torch documents ``reset_mod_stats`` for this)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, backend: TrackerSource, device: torch.device
    ):
        self.tracker = backend.memory_tracker(model, optimizer)
        self.device = device
        self.current: Optional[str] = None
        self.forwards = 0
        self.peaks: dict[str, dict] = {}  # phase -> its device's snapshot at the phase's peak

    def __enter__(self) -> "StepMemory":
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._close()
        finally:
            self.tracker.__exit__(*exc)

    def phase(self, name: str) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
        self._close()
        if name == "forward":
            if self.forwards:
                self.tracker.reset_mod_stats()
            self.forwards += 1
        self.current = name

    def _device_snapshot(self, snapshot: dict) -> dict:
        return snapshot.get(self.device) or snapshot.get(torch.device(self.device.type)) or {}

    def _close(self) -> None:
        """End the current phase: keep its peak if it beats the same phase of an earlier micro-batch,
        and start the next phase's peak from what is alive now."""
        if self.current is None:
            return
        snap = self._device_snapshot(self.tracker.get_tracker_snapshot("peak"))
        best = self.peaks.get(self.current)
        if best is None or snap.get("Total", 0) > best.get("Total", 0):
            self.peaks[self.current] = snap
        _restart_peak(self.tracker)
        self.current = None

    def breakdown(self) -> dict[str, dict[str, int]]:
        """{"step" and each phase: {kind: bytes}} at each one's peak."""
        out = {name: kinds_of(self.peaks.get(name, {})) for name in PHASES}
        out["step"] = max(out.values(), key=lambda kinds: kinds["total"])
        return out


def _restart_peak(tracker) -> None:
    """Make the tracker's running peak start again from its current state.

    torch's trackers keep one peak from ``__enter__`` on and have no public call to restart it;
    ``__enter__`` initializes exactly these two attributes from the current snapshot, and that is
    what is repeated here at each phase boundary (``_update_peak_stats`` then raises them op by op)."""
    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem_snap = current
    tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
