"""Communication of a profiled step: torch.profiler's trace, and the collectives' times read from it.

A profiled step (``trainer.profile_steps``) runs under ``torch.profiler.profile``; its chrome trace is
written to ``<run dir>/traces/rank<N>_step<S>.json``, with the step and its phases marked as named
ranges. ``comm_from_trace`` computes every number from that file alone, so anyone can recompute them
from the artifact. A collective is a NCCL kernel on CUDA, and on CPU the ``gloo:*`` range gloo's worker
thread records (its kind taken from the ``c10d::`` call that issued it: gloo runs a reduce-scatter as
an all-reduce). Per kind the time is the union of its intervals; ``exposed_s`` is the part of all
collectives' time during which no compute runs. What counts as compute on each device, and what the
figures cannot show on CPU: the docs page design.md ("Metrics"); the metrics: metrics.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other")
STEP_RANGE = "fsdp_exp/step"


def kind_of(name: str) -> str:
    """A collective's kind from a kernel, gloo range or c10d operator name."""
    flat = name.lower().replace("_", "")
    needles = (
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
        ("allreduce", "all_reduce"),
        ("alltoall", "all_to_all"),  # expert parallel's dispatch and combine, context parallel's exchange
    )
    for needle, kind in needles:
        if needle in flat:
            return kind
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _subtract(these: list[tuple[float, float]], minus: list[tuple[float, float]]) -> float:
    """Length of the union of ``these`` not covered by the union of ``minus`` (both merged, sorted)."""
    left, j = 0.0, 0
    for start, end in these:
        cursor = start
        while j < len(minus) and minus[j][1] <= cursor:
            j += 1
        k = j
        while k < len(minus) and minus[k][0] < end:
            if minus[k][0] > cursor:
                left += minus[k][0] - cursor
            cursor = max(cursor, minus[k][1])
            k += 1
        if cursor < end:
            left += end - cursor
    return left


def comm_from_trace(trace: dict) -> dict:
    """Collective times of one profiled step from its chrome trace (see the module docstring).
    Trace times are microseconds; the result is in seconds."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == STEP_RANGE]
    if not steps:
        raise ValueError(f"no {STEP_RANGE!r} range in the trace: not a profiled fsdp_exp step")
    step = steps[0]
    lo, hi = step["ts"], step["ts"] + step["dur"]
    main = (step.get("pid"), step.get("tid"))

    def clip(e) -> tuple[float, float]:  # the part inside the step (may be empty: end <= start)
        return max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])

    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    comm: dict[str, list[tuple[float, float]]] = {k: [] for k in COMM_KINDS}
    compute: list[tuple[float, float]] = []
    if any("nccl" in e["name"].lower() for e in kernels):
        device = "cuda"
        for e in kernels:
            if "nccl" in e["name"].lower():
                comm[kind_of(e["name"])].append(clip(e))
            else:
                compute.append(clip(e))
    else:
        device = "cpu"
        issued = sorted(
            (
                e
                for e in events
                if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::") and "wait" not in e["name"]
            ),
            key=lambda e: e["ts"],
        )
        claimed = [False] * len(issued)
        for e in sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["ts"]):
            kind = kind_of(e["name"])
            # The first unclaimed call issued before this range that gloo could run this way
            # (an all-reduce range may be a reduce-scatter).
            fits = {"all_reduce": ("all_reduce", "reduce_scatter")}.get(kind, (kind,))
            for i, op in enumerate(issued):
                if op["ts"] > e["ts"]:
                    break
                if not claimed[i] and kind_of(op["name"]) in fits:
                    claimed[i], kind = True, kind_of(op["name"])
                    break
            comm[kind].append(clip(e))
        for e in events:
            if (
                (e.get("pid"), e.get("tid")) == main
                and e.get("cat") == "cpu_op"
                and e["name"].startswith(("aten::", "fsdp::"))
            ):
                compute.append(clip(e))
    comm = {k: [iv for iv in v if iv[1] > iv[0]] for k, v in comm.items()}  # only what ran inside the step
    merged = {k: _union(v) for k, v in comm.items()}
    every = _union([iv for v in merged.values() for iv in v])
    busy = _union([iv for iv in compute if iv[1] > iv[0]])
    out = {f"{k}_s": _length(v) / 1e6 for k, v in merged.items()}
    # each kind's own exposed time (kinds in flight at once each count it: their sum may exceed exposed_s)
    out.update({f"exposed_{k}_s": _subtract(v, busy) / 1e6 for k, v in merged.items()})
    out.update(
        total_s=_length(every) / 1e6,
        exposed_s=_subtract(every, busy) / 1e6,
        compute_s=_length(busy) / 1e6,
        step_s=step["dur"] / 1e6,
        collectives={k: len(v) for k, v in comm.items()},
        device=device,
    )
    return out


class _Phases:
    """Marks the step's phases in the trace as consecutive ``fsdp_exp/<phase>`` ranges."""

    def __init__(self):
        self.open = None

    def __call__(self, name: str) -> None:
        self.close()
        self.open = torch.profiler.record_function(f"fsdp_exp/{name}")
        self.open.__enter__()

    def close(self) -> None:
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None


def profiled(
    run: Callable[[Callable[[str], None]], object], device: torch.device, trace_path: Path
) -> tuple[object, dict]:
    """``run(phase)`` under torch.profiler (CPU, and CUDA kernels on a GPU); writes the chrome trace
    to ``trace_path`` and returns run's result and ``comm_from_trace`` of that file."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    phases = _Phases()
    with profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP_RANGE):
            try:
                result = run(phases)
            finally:
                phases.close()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # every kernel of the step inside the range
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return result, comm_from_trace(json.loads(trace_path.read_text()))
