"""Pipeline-parallel runs measured per stage (issue #26): the peak memory of each pp rank, and how the
step's time splits into the stage's own compute and waiting on its neighbours.

- **Memory**: ``StageMemTracker`` is torch's ``MemTracker`` without its per-module statistics, which
  refuse a root module called more than once a step (every micro-batch calls each stage), and without its
  module tracker's backward hooks, which the zero-bubble schedules' split backward refuses. It still
  counts every live storage on this rank by kind: the parameters, gradients and optimizer states it
  was handed at the start, then every allocation and free of the sampled step (through its
  TorchDispatchMode and the storage ``resize_`` that FSDP2 uses), and keeps the peak. Each pp rank holds
  only its stages, so a rank's peak is its stages' peak. Under activation checkpointing the blocks' forwards
  recomputed in backward are activations (as torch's own tracker books them), not backward temporaries.
- **Time**: ``StageObserver`` wraps each ``PipelineStage``'s ``forward_one_chunk`` /
  ``backward_one_chunk`` / ``backward_weight_one_chunk`` (the stage's compute) and, while the schedule
  steps, torch's ``schedules._wait_batch_p2p`` (every wait on a send or a receive of a neighbour). Per
  step: ``compute_s`` + ``p2p_wait_s`` <= ``schedule_s`` (the schedule's ``step``; the rest is posting
  the sends, Python, the deferred gradient reduction); the measured bubble is 1 - compute_s / schedule_s.
  The same observer tells the memory tracker which phase a chunk is (forward / backward), so the sampled
  step's breakdown is split by phase as for the other layouts.

``PipelineMetrics`` turns both into the rows' ``pp/*``, ``comm/p2p_wait_s`` and ``mem/pp_*`` values and the
summary's per pp rank figures (fsdp_exp/metrics/schema.py names them).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker

from fsdp_exp.dist import gather_over_ranks


class _ForwardModTracker(ModTracker):
    """torch's ``ModTracker`` without its backward bookkeeping: it hooks every module's inputs and outputs
    (``register_multi_grad_hook``) to know which module a backward is in, which the split backward of the
    zero-bubble schedules (``autograd.grad`` on a stage's inputs first) refuses. ``is_bw`` reads autograd's
    current graph task, so it holds without them; the stage tracker needs no more."""

    def _fw_pre_hook(self, mod, input) -> None:
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output) -> None:
        if self._user_post_fw_hook is not None:  # the stage tracker's: the end of a forward recomputed in backward
            self._user_post_fw_hook(mod, input, output)


class StageMemTracker(MemTracker):
    """torch's ``MemTracker`` counting memory by kind, without the per-module statistics: a module's
    forward only (re)registers its parameters, buffers and gradient hooks, so a stage may run any number
    of micro-batches in any order (the module statistics torch keeps would refuse the second forward of a
    root, and resetting them between micro-batches breaks their backward hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _ForwardModTracker()

    def _pre_fw_hook(self, module, inputs) -> None:
        # FSDP2 swaps in the unsharded parameters just before the module's forward: counted as parameters
        self._track_module_params_and_buffers(module, install_grad_hooks=True)
        # A forward inside backward is activation checkpointing recomputing a block: what it allocates until that
        # outermost module's forward ends is activations, as torch's MemTracker books it (``_in_ac``), not the
        # backward's temporaries.
        if self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod, self._in_ac = weakref.ref(module), True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod, self._in_ac = None, False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


def stage_memory_tracker(model: torch.nn.Module, optimizer, receive_buffers: list = ()) -> StageMemTracker:
    """The tracker of one sampled step of a pipeline rank: its stages' parameters, gradients and optimizer
    states counted from the start, and the stages' receive buffers (``StageObserver.receive_buffers``: kind
    ``other``)."""
    tracker = StageMemTracker()
    tracker.track_external(model, optimizer, *receive_buffers)
    return tracker


@dataclass
class StepTimes:
    """One schedule step of this rank, in seconds."""

    compute_s: float = 0.0  # inside the stages' forward/backward chunks
    p2p_wait_s: float = 0.0  # waiting on a neighbour's send or receive
    schedule_s: float = 0.0  # the schedule's whole step
    p2p_waits: int = 0  # how many waits torch's schedule made through the timed _wait_batch_p2p

    @property
    def bubble(self) -> float:
        """The measured idle fraction of the schedule's step: everything but the stage's own compute."""
        return min(1.0, max(0.0, 1.0 - self.compute_s / self.schedule_s)) if self.schedule_s > 0 else 0.0


@dataclass
class StageObserver:
    """Installed by the pipeline engine on its schedule and ``PipelineStage`` objects (``observe``): each
    schedule step's times are ``last``. ``phase``, when set (the sampled step's memory tracker), is told
    ``forward`` / ``backward`` before each chunk."""

    pp_rank: int
    stages_of: dict[int, list[int]]  # pp rank -> its stage indices (every rank's, for the summary)
    predicted_bubble: Optional[float] = None  # the schedule's (parallel/pipeline.py's bubble_fraction)
    last: StepTimes = field(default_factory=StepTimes)
    phase: Optional[Callable[[str], None]] = None
    _depth: int = 0  # a chunk inside a chunk counts once
    _stages: list = field(default_factory=list)  # the observed PipelineStages
    steps_done: int = 0  # schedule steps finished: torch allocates the receive buffers during the first

    def observe(self, schedule, pipeline_stages: list) -> "StageObserver":
        """Time every ``schedule.step`` (``timing``) and every chunk of compute of ``pipeline_stages``."""
        step = schedule.step

        @functools.wraps(step)
        def timed_step(*args, **kwargs):
            with self.timing():
                result = step(*args, **kwargs)
            self.steps_done += 1
            return result

        schedule.step = timed_step
        self._stages = list(pipeline_stages)
        for stage in pipeline_stages:
            for name, phase in (
                ("forward_one_chunk", "forward"),
                ("backward_one_chunk", "backward"),
                ("backward_weight_one_chunk", "backward"),
            ):
                setattr(stage, name, self._timed(getattr(stage, name), phase))
        return self

    def receive_buffers(self) -> list[torch.Tensor]:
        """The tensors torch's stages receive into, one per micro-batch for the activations coming in (but on the
        first stage) and for the gradients coming back (but on the last), allocated at the first step and kept:
        made before a tracked step, so handed to its tracker (``stage_memory_tracker``). Read from torch's private
        ``args_recv_info`` / ``grad_recv_info`` and their ``_RecvInfo.buffer``: a stage that receives and shows no
        buffer there after a step (torch renamed or moved them) raises, rather than the tracker under-counting in
        silence. Before the first step (a tracked step 0, trainer.warmup_steps=1) the buffers do not exist yet: the
        tracker then sees them allocated inside the step."""
        buffers = []
        for stage in self._stages:
            for name, receives in (("args_recv_info", not stage.is_first), ("grad_recv_info", not stage.is_last)):
                infos = [info for per_chunk in _torch_private(stage, name).values() for info in per_chunk]
                found = [_torch_private(info, "buffer") for info in infos]
                found = [b for b in found if b is not None]  # a root input (the first stage's) has none
                if receives and not found and self.steps_done:
                    raise RuntimeError(
                        f"pipeline stage {stage.stage_index} receives from a neighbour, but torch's PipelineStage."
                        f"{name} holds no receive buffer after a step: torch {torch.__version__} keeps them elsewhere; "
                        "fsdp_exp/metrics/pipeline.py (StageObserver.receive_buffers) must follow it"
                    )
                buffers += found
        return buffers

    def _timed(self, chunk: Callable, phase: str) -> Callable:
        def timed(*args, **kwargs):
            if self.phase is not None and self._depth == 0:
                self.phase(phase)
            self._depth += 1
            started = time.perf_counter()
            try:
                return chunk(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.last.compute_s += time.perf_counter() - started

        return timed

    @contextlib.contextmanager
    def timing(self):
        """Around one ``schedule.step``: ``last`` becomes this step's times. torch's schedules wait on every
        P2P operation through the module's ``_wait_batch_p2p``, replaced for the step by a timed one."""
        from torch.distributed.pipelining import schedules

        original = schedules._wait_batch_p2p
        times = self.last = StepTimes()

        def timed_wait(work):
            started = time.perf_counter()
            try:
                return original(work)
            finally:
                times.p2p_wait_s += time.perf_counter() - started
                times.p2p_waits += 1

        schedules._wait_batch_p2p = timed_wait
        started = time.perf_counter()
        try:
            yield times
        finally:
            times.schedule_s = time.perf_counter() - started
            schedules._wait_batch_p2p = original
        if times.p2p_waits == 0:  # every stage of a pipeline of 2 or more waits on a neighbour each step
            raise RuntimeError(
                f"torch's pipeline schedule stepped without waiting through schedules._wait_batch_p2p: torch "
                f"{torch.__version__} waits on its P2P work elsewhere, and comm/p2p_wait_s would read 0; "
                "fsdp_exp/metrics/pipeline.py (StageObserver.timing) must follow it"
            )


def _torch_private(owner, name: str):
    """A private attribute of torch's pipelining that the stage tracker reads; its absence (torch renamed it) is
    an error naming what to change, never a default that would count nothing."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise RuntimeError(
            f"torch {torch.__version__}'s {type(owner).__name__} has no {name}: fsdp_exp/metrics/pipeline.py reads it "
            "to count the stages' receive buffers and must follow torch's new name"
        ) from None


class PipelineMetrics:
    """The per-stage figures of a pipeline run's rows and summary. Every method with a collective is called
    by all ranks (as ``StepMetrics``' own)."""

    TIMES = ("compute_s", "p2p_wait_s", "schedule_s", "bubble")

    def __init__(self, observer: StageObserver, device: torch.device):
        self.observer, self.device = observer, device
        self.predicted_bubble = observer.predicted_bubble
        self.ranks_times: list[torch.Tensor] = []  # per measured step: rank x TIMES
        self.memory: Optional[dict] = None  # the sampled step's per pp rank peaks

    @contextlib.contextmanager
    def phases(self, phase: Callable[[str], None]):
        """The sampled step's chunks tell the memory tracker their phase."""
        self.observer.phase = phase
        try:
            yield
        finally:
            self.observer.phase = None

    def row(self, measured: bool) -> dict:
        """The last step's times over ranks (one all-gather): ``pp/bubble`` (mean over ranks), its max, the
        slowest rank's compute, schedule and P2P wait. ``measured``: kept for the summary's per-rank medians."""
        t = self.observer.last
        ranks = gather_over_ranks([t.compute_s, t.p2p_wait_s, t.schedule_s, t.bubble], self.device)
        if measured:
            self.ranks_times.append(ranks)
        hi = ranks.max(dim=0).values.tolist()
        return {
            "pp/bubble": ranks[:, 3].mean().item(),
            "pp/bubble_max": hi[3],
            "pp/bubble_predicted": self.predicted_bubble,
            "pp/compute_s_max": hi[0],
            "pp/schedule_time_s_max": hi[2],
            "comm/p2p_wait_s": hi[1],
        }

    def memory_peaks(self, totals_gib: list[float]) -> tuple[dict, dict]:
        """``totals_gib``: every rank's tracked peak (rank order). Returns the sampled row's entries and
        run.json's ``memory_breakdown["pipeline"]``: the peak of each pp rank (max over its dp ranks), the
        largest and the pp rank and stages that hold it."""
        pp_of_rank = gather_over_ranks([float(self.observer.pp_rank)], self.device)[:, 0].long().tolist()
        per_pp: dict[int, float] = {}
        for pp_rank, total in zip(pp_of_rank, totals_gib):
            per_pp[pp_rank] = max(per_pp.get(pp_rank, 0.0), total)
        peaks = [per_pp[r] for r in sorted(per_pp)]
        worst = max(range(len(peaks)), key=lambda r: peaks[r])  # the first of equal peaks
        self.memory = {
            "unit": "GiB",
            "pp_rank_of_rank": pp_of_rank,
            "stages_of_pp_rank": [self.observer.stages_of[r] for r in sorted(per_pp)],
            "peak_gib_per_pp_rank": peaks,
            "peak_gib_max": peaks[worst],
            "peak_pp_rank": worst,
            "peak_stages": self.observer.stages_of[worst],
        }
        return {"mem/pp_peak_pp_rank": worst, "mem/pp_peak_gib_min": min(peaks)}, self.memory

    def summary(self) -> dict:
        """The summary's per-stage entries: the sampled step's peaks per pp rank and which holds the largest;
        each rank's median times over the measured steps."""
        out: dict = {"summary/pp_bubble_predicted": self.predicted_bubble}
        if self.memory:
            m = self.memory
            out.update(
                {
                    "summary/pp_peak_gib_per_pp_rank": [shown(v) for v in m["peak_gib_per_pp_rank"]],
                    "summary/pp_peak_pp_rank": m["peak_pp_rank"],
                    "summary/pp_peak_stages": ",".join(str(s) for s in m["peak_stages"]),
                }
            )
        if self.ranks_times:  # each rank's median over the measured steps, rank order
            steps = torch.stack(self.ranks_times)  # step x rank x TIMES
            for j, key in enumerate(
                (
                    "pp_compute_s_per_rank",
                    "comm_p2p_wait_s_per_rank",
                    "pp_schedule_time_s_per_rank",
                    "pp_bubble_per_rank",
                )
            ):
                out[f"summary/{key}"] = [shown(statistics.median(rank)) for rank in steps[:, :, j].T.tolist()]
        return out


def shown(value: float) -> float:
    """4 significant digits: the summary's per-rank lists stay readable in the console's summary table, and
    run-to-run noise is far larger (run.json["memory_breakdown"] keeps the exact peaks)."""
    return float(f"{value:.4g}")
