"""Memory breakdown of one sampled step, from torch's own memory trackers.

FSDP2 models go through ``FSDPMemTracker`` (it tells sharded from unsharded parameters and
gradients, and the all-gather / reduce-scatter buffers); FSDP1 and DDP through the generic
``MemTracker``. Both count every tensor the step allocates, by what it is, on CPU and CUDA alike.
The tracker instruments each op, so the tracked step is slow: the trainer samples it inside the
warm-up steps, which the summary leaves out.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# Torch's reference types -> fsdp_exp's kinds (the metric names say these).
KINDS = {
    "Sharded Param": "params", "Unsharded Param": "params", "Parameter": "params",
    "Sharded Grad": "grads", "Unsharded Grad": "grads", "Gradient": "grads",
    "OptState": "optim_state", "Optstate": "optim_state",
    "Activation": "activations", "Temp": "temp", "Buffer": "buffers", "Inputs": "inputs", "Other": "other",
    "All Gather": "comm_buffers", "Reduce Scatter": "comm_buffers",
}
BREAKDOWN = ("params", "unsharded_params", "grads", "optim_state", "activations", "temp", "comm_buffers",
             "buffers", "inputs", "other", "model_states", "total")


def tracked(model: nn.Module, optimizer: torch.optim.Optimizer, backend: str, device: torch.device,
            run: Callable[[Callable[[], None]], object]) -> tuple[object, dict[str, int]]:
    """Run ``run(between_micro_batches)`` under a memory tracker; return its result and the peak
    breakdown in bytes. ``run`` calls ``between_micro_batches()`` after each micro-batch but the last:
    the tracker counts one forward per module unless its per-module stats are reset (the peak stays)."""
    if backend == "fsdp2":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        result = run(tracker.reset_mod_stats)
    snapshot = tracker.get_tracker_snapshot("peak")
    per_kind = snapshot.get(device) or snapshot.get(torch.device(device.type)) or {}
    out = dict.fromkeys(BREAKDOWN, 0)
    for ref, nbytes in per_kind.items():
        name = getattr(ref, "value", ref)
        if name == "Total":
            out["total"] = nbytes
            continue
        out[KINDS.get(name, "other")] += nbytes
        if name == "Unsharded Param":
            out["unsharded_params"] += nbytes
    out["model_states"] = out["params"] + out["grads"] + out["optim_state"]
    if not out["total"]:
        out["total"] = sum(v for k, v in out.items() if k not in ("unsharded_params", "model_states", "total"))
    return result, out
