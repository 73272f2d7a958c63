"""The run context: what the launcher settles about a run before any rank starts, as one typed object.

The launcher composes the config, validates it (the topology), asks the planner (the prediction) and
knows how the run was asked for (the labels: overrides, Hydra's choices, the sweep). Each rank gets
all of it as one ``RunContext``: pickled to a rank the launcher spawns, handed over in-process where
every rank is its own launcher (torchrun, a SLURM step). Nothing is computed twice, turned back into a
dict or read through ``.get``; run.json records it once, when the launcher writes it.

Also here, because the launcher's checks and the trainer's step metrics both need it: which steps are
sampled for a closer look (``sampled_steps``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdp_exp.config.schema import RunConfig, TrainerConfig
from fsdp_exp.config.topology import Topology


@dataclass(frozen=True)
class Sweep:
    """The sweep (a Hydra multirun) a run is one job of."""

    dir: str
    name: str  # the sweep folder's name: the runs' shared W&B group
    job: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Labels:
    """How the run was asked for: the command line's overrides, Hydra's option per config group, the sweep."""

    overrides: tuple[str, ...] = ()
    choices: dict[str, str] = field(default_factory=dict)
    sweep: Optional[Sweep] = None

    def as_record(self) -> dict:
        """The fields of run.json (and of a failure's W&B run) that these labels fill."""
        fields = {"overrides": list(self.overrides), "choices": dict(self.choices)}
        if self.sweep is not None:
            fields["sweep"] = self.sweep.as_dict()
        return fields


@dataclass(frozen=True)
class Prediction:
    """The memory planner's prediction for this run (``fsdp_exp.plan.plan_for_run``), made once by the launcher."""

    record: dict  # run.json["plan"]: the whole plan, or why there is none
    row: dict  # mem/predicted_peak_gib and mem/predicted_model_states_gib, in every logged row
    phases: dict  # mem/predicted_<phase>_peak_gib, beside the sampled step's breakdown


@dataclass(frozen=True)
class RunContext:
    """Everything a rank is handed. ``config`` and ``topology`` are final: a rank reads them, never changes them."""

    config: RunConfig
    topology: Topology
    run_dir: Path
    labels: Labels
    prediction: Prediction
    # trainer.loss_chunks as asked, as settled in ``config`` and why (run.json applied.loss_chunks;
    # ``fsdp_exp.plan.loss_chunks``)
    loss_chunks: dict = field(default_factory=dict)

    def in_folder(self, run_dir: Path) -> RunContext:
        """The same run in another folder (under torchrun every rank may compose its own; rank 0's wins)."""
        return dataclasses.replace(self, run_dir=Path(run_dir))


@dataclass(frozen=True)
class SampledSteps:
    """The steps (0-based) measured more closely than the others, all warm-up steps; None where there is none."""

    memory: Optional[int]  # under torch's memory tracker (trainer.track_memory)
    snapshot: Optional[int]  # with the CUDA allocator's history (trainer.memory_snapshot; CUDA only)

    @property
    def memory_sampled(self) -> Optional[int]:
        """The one step whose memory is sampled: the tracked one, else the snapshot's."""
        return self.memory if self.memory is not None else self.snapshot


def sampled_steps(t: TrainerConfig, tracks_memory: bool, device_type: str) -> SampledSteps:
    """Which warm-up step is tracked and which is snapshot. ``tracks_memory``: the backend's parameters can be
    followed by torch's memory trackers (``Backend.tracks_memory``); no breakdown otherwise. The snapshot is
    taken on the tracked step, or on the last warm-up step when nothing is tracked. ``device_type``: where the
    run trains; a snapshot is of the CUDA allocator only (preflight refuses one on a CPU)."""
    memory = None
    if t.track_memory and t.warmup_steps > 0 and tracks_memory:
        memory = t.track_memory_step if t.track_memory_step is not None else t.warmup_steps - 1
    snapshot = None
    if t.memory_snapshot and device_type == "cuda":
        snapshot = memory if memory is not None else t.warmup_steps - 1
    return SampledSteps(memory=memory, snapshot=snapshot)


def check_trainer(t: TrainerConfig, device_type: str, tracks_memory: bool) -> None:
    """Preflight's checks of the trainer group alone (``tracks_memory``: the backend's torch tracker can sample
    a step); what spans groups is preflight's table."""
    from fsdp_exp.config.schema import LOSS_CHUNKS_AUTO, fixed_loss_chunks
    from fsdp_exp.errors import fail

    for name, value in (
        ("trainer.steps", t.steps),
        ("trainer.seq_len", t.seq_len),
        ("trainer.global_batch_size", t.global_batch_size),
        ("trainer.log_every", t.log_every),
    ):
        if value < 1:
            fail(f"{name}={value} must be at least 1.", f"pass a positive {name}")
    if t.repeat < 0:
        fail(
            f"trainer.repeat={t.repeat} is negative; it numbers the repetitions of a configuration from 0.",
            "pass trainer.repeat=0 (or trainer.repeat=0,1,2 in a multirun to measure each configuration 3 times)",
        )
    if not 0 <= t.warmup_steps < t.steps:
        fail(
            f"trainer.warmup_steps={t.warmup_steps} leaves no step for the summary of {t.steps} steps.",
            f"pass trainer.warmup_steps={max(0, t.steps // 5)} or raise trainer.steps",
        )
    if t.track_memory and t.track_memory_step is not None and not 0 <= t.track_memory_step < t.warmup_steps:
        fail(
            f"trainer.track_memory_step={t.track_memory_step} is not a warm-up step (0 to "
            f"{t.warmup_steps - 1}); the tracked step is slow and must stay out of the summary.",
            f"pass trainer.warmup_steps={t.track_memory_step + 1} or more, or trainer.track_memory_step=null",
        )
    sampled = sampled_steps(t, tracks_memory, device_type).memory_sampled  # the trainer's rule
    for step in t.profile_steps:
        if not 0 <= step < t.steps:
            fail(
                f"trainer.profile_steps has {step}, not a step of this run (0 to {t.steps - 1}).",
                f"pass trainer.profile_steps=[{min(t.warmup_steps, t.steps - 1)}]",
            )
        if step == sampled:
            fail(
                f"trainer.profile_steps has {step}, the memory-sampled step: the memory tracker's per-op "
                "instrumentation (or the allocator's history) would be in the trace and in its times.",
                f"pass trainer.profile_steps=[{t.warmup_steps if t.warmup_steps < t.steps else step}] "
                "or trainer.track_memory_step=<another warm-up step>",
            )
    if t.memory_snapshot and device_type != "cuda":
        fail(
            "trainer.memory_snapshot=true records the CUDA allocator's history; this run is on the CPU.",
            "pass trainer.memory_snapshot=false (the CPU breakdown is mem/tracked_*)",
        )
    if t.memory_snapshot and t.warmup_steps == 0:
        fail(
            "trainer.memory_snapshot=true samples a warm-up step; trainer.warmup_steps=0 has none.",
            "pass trainer.warmup_steps=2",
        )
    if t.grad_clip < 0:
        fail(f"trainer.grad_clip={t.grad_clip} is negative.", "pass trainer.grad_clip=1.0 (0 disables clipping)")
    if not t.collective_timeout_s > 0:
        fail(
            f"trainer.collective_timeout_s={t.collective_timeout_s} must be positive.",
            "pass trainer.collective_timeout_s=600 (seconds a collective waits for a peer)",
        )
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        fail(f"trainer.peak_tflops={t.peak_tflops} must be positive.", "pass trainer.peak_tflops=null to look it up")
    chunks = fixed_loss_chunks(t.loss_chunks)
    if chunks is None and str(t.loss_chunks).strip() != LOSS_CHUNKS_AUTO:
        fail(
            f"trainer.loss_chunks={t.loss_chunks!r} is neither auto nor a number.",
            "pass trainer.loss_chunks=auto (the planner decides), or a number of slices such as 8 (1 takes the loss "
            "on all the logits at once)",
        )
    if chunks is not None and chunks < 1:
        fail(
            f"trainer.loss_chunks={t.loss_chunks} must be at least 1.",
            "pass trainer.loss_chunks=8 (1 takes the loss on all the logits at once), or auto",
        )
