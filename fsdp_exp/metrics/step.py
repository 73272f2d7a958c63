"""What a run measures, step by step: ``StepMetrics``, which the training loop calls once per step.

It owns the per-step row (loss, lr, grad norm, step time, tokens/s, TFLOPS, MFU/HFU, data wait,
memory; fsdp_exp.metrics.schema names every field), the steps measured more closely (the sampled
step's memory breakdown under torch's tracker, the CUDA allocator snapshot, the profiled steps'
collectives), the FLOPs and peak it divides by, the rows kept for the summary, and the summary.
Rows and facts go to a recorder (fsdp_exp.record.Recorder: metrics.jsonl, W&B, the console, run.json).
Every method with a collective is called by all ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fsdp_exp.context import sampled_steps
from fsdp_exp.data import attention_span
from fsdp_exp.dist import gather_over_ranks, reduce_over_ranks
from fsdp_exp.metrics import memory
from fsdp_exp.metrics.device_peak import device_peak
from fsdp_exp.config.schema import settled_loss_chunks
from fsdp_exp.metrics.flops import convention_flops_per_token, mfu, recompute_flops_per_token
from fsdp_exp.metrics.summary import summarize
from fsdp_exp.metrics.schema import MOE_METRICS, PHASES
from fsdp_exp.metrics.tracker import BREAKDOWN, StepMemory
from fsdp_exp.models.moe import routing_counts, routing_row
from fsdp_exp.units import GIB

# One optimizer step, told where it is by ``phase`` on measured steps: (loss tensor, grad norm, lr).
StepFn = Callable[..., tuple[torch.Tensor, float, float]]


class StepMetrics:
    """Args:
    cfg, topology, info: the run's config, topology and this rank.
    run_dir: the run's folder (traces/ and memory/ of the measured steps).
    model, optimizer, backend: what the memory tracker and the model-state counter look at.
    data: the step data (its ``last_wait_s``: the time the step waited for its batch).
    recorder: where rows and facts go (``log``, ``memory_breakdown``, ``comm``; rank 0 writes).
    apply_ac: applies the run's activation checkpointing to a model (fsdp_exp.parallel.ac.apply,
        handed in: metrics stand below parallel), to count what it recomputes (perf/hfu).
    predicted, predicted_phases: the planner's figures, beside the measured ones in the rows.
    history: the rows a resumed run keeps from before its checkpoint.
    setup_s: this rank's set-up time (perf/setup_time_s is the slowest rank's).
    start_step: the first step this process trains (its time is perf/first_step_time_s).
    """

    def __init__(
        self,
        cfg,
        topology,
        info,
        run_dir: Path,
        *,
        model,
        optimizer,
        backend,
        data,
        recorder,
        apply_ac: Callable,
        predicted: dict,
        predicted_phases: dict,
        history: list[dict],
        setup_s: float,
        start_step: int,
    ):
        self.cfg, self.topology, self.info, self.run_dir = cfg, topology, info, run_dir
        self.device = info.device
        self.model, self.optimizer, self.backend, self.data, self.recorder = model, optimizer, backend, data, recorder
        self.predicted, self.predicted_phases = predicted, predicted_phases
        self.history, self.start_step = history, start_step
        self.state_bytes = backend.model_state_counter(model, optimizer)  # mem/params_gib_* etc., as laid out
        t = cfg.trainer
        self.tokens_per_step = t.global_batch_size * t.seq_len
        # MFU's numerator under the run's named convention (trainer.flops_convention; recorded in run.json env),
        # attention priced at the span of the run's mask: block_causal counts each document's own attention
        self.attention_span, self.attention_span_source = attention_span(cfg)
        self.flops_per_token = convention_flops_per_token(t.flops_convention, cfg.model, self.attention_span)
        # HFU's numerator: the model FLOPs plus what activation checkpointing recomputes (torch's
        # FlopCounterMode on the meta model). A model the counter cannot run on the meta device gets no
        # HFU (null, and the reason in run.json env), not a failed run.
        self.recompute_error = None
        try:
            self.recompute_flops_per_token: Optional[float] = recompute_flops_per_token(
                cfg, t.seq_len, apply_ac, settled_loss_chunks(t.loss_chunks)
            )
        except Exception as exc:  # noqa: BLE001 - a measurement aside must not stop training
            self.recompute_flops_per_token, self.recompute_error = None, f"{type(exc).__name__}: {exc}"
        self.peak = device_peak(cfg, self.device, topology.nproc_per_node, info.world_size, info.is_main)
        self.pending: dict = {}  # metrics of a measured step, added to the next logged row
        self.pending["perf/setup_time_s"] = reduce_over_ranks([setup_s], self.device)[0][0]  # slowest rank
        # The memory tracker's step and the CUDA allocator history's (the rule preflight checks against).
        sampled = sampled_steps(t, backend.tracks_memory, self.device.type)
        self.track_step, self.snapshot_step = sampled.memory, sampled.snapshot
        self.profile_steps = set(t.profile_steps)  # torch.profiler traces and comm/* (fsdp_exp.metrics.comm)
        self.comm_record: list[dict] = []
        # A pipeline run's per-stage figures: its engine's observer times every step (fsdp_exp.metrics.pipeline).
        observer = getattr(backend, "stage_observer", None)
        self.pipeline = None
        if observer:  # imported here: torch's memory tracker it builds on costs 0.6 s to import
            from fsdp_exp.metrics.pipeline import PipelineMetrics

            self.pipeline = PipelineMetrics(observer, self.device)

    def facts(self) -> dict:
        """What the rows are divided by, for run.json's env: FLOPs per token and the device's peaks."""
        p = self.peak
        return {
            "flops_per_token": self.flops_per_token,
            "flops_convention": self.cfg.trainer.flops_convention,
            # attention's FLOPs counted at this sequence length (fsdp_exp.data.attention_span)
            "attention_mask": getattr(self.cfg.model, "attention_mask", "causal"),
            "positions": self.cfg.data.positions,
            "attention_span": self.attention_span,
            "attention_span_source": self.attention_span_source,
            "recompute_flops_per_token": self.recompute_flops_per_token,
            "hardware_flops_per_token": None
            if self.recompute_flops_per_token is None
            else self.flops_per_token + self.recompute_flops_per_token,
            "recompute_flops_error": self.recompute_error,
            "peak_tflops": p.tflops,
            "peak_tflops_source": p.source,
            "peak_tflops_measurement": p.measurement,
            "peak_tflops_fp8": p.fp8_tflops,
            "peak_tflops_fp8_source": p.fp8_source,
        }

    # ------------------------------------------------------------------------------- each step
    def run(self, step: int, train_step: StepFn, started: float) -> tuple[torch.Tensor, float, float]:
        """``train_step(step[, phase])`` (step 0-based, begun at ``started``), under the memory tracker
        or the profiler on the steps sampled for them."""
        if step in (self.track_step, self.snapshot_step):
            result = self._sampled(step, train_step)
        elif step in self.profile_steps:
            result = self._profiled(step, train_step)
        else:
            result = train_step(step)
        if step == self.start_step:  # where lazy buffers are allocated: in the next logged row
            self.pending["perf/first_step_time_s"] = time.perf_counter() - started
        return result

    def log(
        self, step: int, started: float, loss: torch.Tensor, grad_norm: float, lr: float, evaluate: Callable[[], float]
    ) -> None:
        """After step ``step`` (1-based), on a logged step (every ``trainer.log_every``, the last, an
        evaluation's): combine its numbers over ranks and hand the row to the recorder.

        The step time runs from ``started`` to after the all-reduce over ranks, so that what measuring
        costs is inside the reported throughput, not hidden between steps. An evaluation (``evaluate()``:
        the validation loss, every ``trainer.eval_every``) runs after that, outside every step's time, and
        joins the row with its perplexity."""
        t = self.cfg.trainer
        evaluating = t.eval_every > 0 and step % t.eval_every == 0
        if not (step % t.log_every == 0 or step == t.steps or evaluating):
            return
        local = {**self.state_bytes(), **memory.host_bytes()}
        counts = {}
        if self.device.type == "cuda":
            local.update(memory.cuda_bytes(self.device))
            counts = memory.cuda_counts(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # peaks are per log interval
        values = [loss.item(), self.data.last_wait_s] + [float(v) for v in [*local.values(), *counts.values()]]
        hi, mean = reduce_over_ranks(values, self.device)  # every rank has equally many tokens
        measured = step > t.warmup_steps and step - 1 not in self.profile_steps
        stages = self.pipeline.row(measured) if self.pipeline else {}  # pp/*, comm/p2p_wait_s
        step_time = time.perf_counter() - started

        tokens_per_s = self.tokens_per_step / step_time
        per_rank = tokens_per_s / self.info.world_size
        tflops = self.flops_per_token * per_rank / 1e12
        hw_tflops = (
            None
            if self.recompute_flops_per_token is None
            else (self.flops_per_token + self.recompute_flops_per_token) * per_rank / 1e12
        )
        row = {
            "step": step,
            "train/loss": mean[0],
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_rank": per_rank,
            "perf/tflops_per_rank": tflops,
            "perf/mfu": mfu(tflops, self.peak.tflops),
            "perf/hfu": None if hw_tflops is None else mfu(hw_tflops, self.peak.tflops),
            "perf/mfu_fp8": mfu(tflops, self.peak.fp8_tflops),
            "perf/data_time_s": hi[1],  # the slowest rank's wait holds every rank back
        }
        for key, h, m in zip([*local, *counts], hi[2:], mean[2:]):
            if key in counts:
                row[f"mem/{key}_max"] = int(h)
            else:
                row[f"mem/{key}_gib_max"], row[f"mem/{key}_gib_mean"] = h / GIB, m / GIB
        if evaluating:
            val_loss = evaluate()
            row.update({"val/loss": val_loss, "val/perplexity": math.exp(min(val_loss, 700.0))})
        row.update(stages)
        row.update(self._routing())
        row.update(self.predicted)
        row.update(self.pending)
        self.pending = {}
        self.history.append(row)
        if self.info.is_main:
            self.recorder.log(row)

    def _routing(self) -> dict:
        """A mixture of experts' ``moe/*`` metrics of this step: the loads summed over ranks (one all-reduce);
        null for a dense model (every row has every metric)."""
        counts = routing_counts(self.model)
        if counts is None:
            return dict.fromkeys(MOE_METRICS)
        counts = counts.to(self.device)
        dist.all_reduce(counts)
        return routing_row(self.model, counts.cpu(), self.info.world_size)

    def summary(self) -> dict:
        summary = summarize(self.history, self.cfg.trainer.warmup_steps, self.peak, self.device.type == "cuda")
        return {**summary, **self.pipeline.summary()} if self.pipeline else summary

    # ---------------------------------------------------------------------- the measured steps
    def _sampled(self, step: int, train_step: StepFn) -> tuple[torch.Tensor, float, float]:
        """A training step under torch's memory tracker (its peak breakdown, whole and by phase, joins
        the step's metrics) and, on CUDA with trainer.memory_snapshot, the allocator's history."""
        snapshot = step == self.snapshot_step
        if snapshot:
            # Alloc/free events with their stack traces from here to the dump; at most this many are kept
            # (torch documents several KB per entry), enough for a step of a large model.
            torch.cuda.memory._record_memory_history(enabled="all", max_entries=200_000)
        try:
            if step != self.track_step:
                return train_step(step)
            with StepMemory(self.model, self.optimizer, self.backend, self.device) as mem:
                with self.pipeline.phases(mem.phase) if self.pipeline else contextlib.nullcontext():
                    result = train_step(step, mem.phase)
            self._breakdown(step, mem.breakdown())
            return result
        finally:
            if snapshot:
                path = self.run_dir / "memory" / f"rank{self.info.rank}_step{step + 1}.pickle"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(path))
                torch.cuda.memory._record_memory_history(enabled=None)  # stop recording

    def _breakdown(self, step: int, breakdown: dict[str, dict[str, int]]) -> None:
        """Every rank's breakdown to every rank (one all-gather): max and mean in the step's row, all of
        it in run.json["memory_breakdown"]."""
        parts = ("step", *PHASES)
        ranks = gather_over_ranks([float(breakdown[p][k]) for p in parts for k in BREAKDOWN], self.device)
        ranks = ranks.view(self.info.world_size, len(parts), len(BREAKDOWN)) / GIB  # rank x part x kind
        hi, mean = ranks.max(dim=0).values, ranks.mean(dim=0)
        self.pending.update(self.predicted_phases)
        stages = None  # a pipeline run: each pp rank's peak, the largest and who holds it
        if self.pipeline:
            entries, stages = self.pipeline.memory_peaks(ranks[:, 0, BREAKDOWN.index("total")].tolist())
            self.pending.update(entries)
        for j, kind in enumerate(BREAKDOWN):
            self.pending[f"mem/tracked_{kind}_gib_max"] = hi[0, j].item()
            self.pending[f"mem/tracked_{kind}_gib_mean"] = mean[0, j].item()
            for i, phase in enumerate(PHASES, start=1):
                self.pending[f"mem/tracked_{phase}_{kind}_gib_max"] = hi[i, j].item()
        if self.info.is_main:

            def table(values, i):
                return {kind: values[i, j].item() for j, kind in enumerate(BREAKDOWN)}

            self.recorder.memory_breakdown(
                {
                    "step": step + 1,
                    "unit": "GiB",
                    **{f"{kind}_gib_max": hi[0, j].item() for j, kind in enumerate(BREAKDOWN)},
                    **{f"{kind}_gib_mean": mean[0, j].item() for j, kind in enumerate(BREAKDOWN)},
                    "per_rank": [table(r, 0) for r in ranks],
                    "phases": {
                        phase: {"max": table(hi, i), "mean": table(mean, i), "per_rank": [table(r, i) for r in ranks]}
                        for i, phase in enumerate(PHASES, start=1)
                    },
                    **({"pipeline": stages} if stages else {}),
                }
            )

    def _profiled(self, step: int, train_step: StepFn) -> tuple[torch.Tensor, float, float]:
        """A training step under torch.profiler: its chrome trace in traces/, its collectives' times
        (comm/*, max over ranks) in the step's row, every rank's in run.json["comm"]."""
        from fsdp_exp.metrics.comm import COMM_KINDS, profiled

        path = self.run_dir / "traces" / f"rank{self.info.rank}_step{step + 1}.json"
        result, comm = profiled(lambda phase: train_step(step, phase), self.device, path)
        names = [f"{k}_s" for k in COMM_KINDS] + [f"exposed_{k}_s" for k in COMM_KINDS]
        names += ["total_s", "exposed_s", "compute_s", "step_s"]
        ranks = gather_over_ranks([comm[n] for n in names] + [comm["exposed_s"] / comm["step_s"]], self.device)
        names.append("exposed_fraction")
        for j, name in enumerate(names):
            self.pending[f"comm/{name}"] = ranks[:, j].max().item()
        if self.info.is_main:
            self.comm_record.append(
                {
                    "step": step + 1,
                    "unit": "s",
                    "device": comm["device"],
                    "traces": f"traces/rank<N>_step{step + 1}.json",
                    "per_rank": [dict(zip(names, r.tolist())) for r in ranks],
                    "collectives_rank0": comm["collectives"],
                }
            )
            self.recorder.comm(self.comm_record)
        return result
