"""One rank's run: build the sharded model, train it, measure every step, write the record.

The flow, each stage handing the next what it needs:
  process group -> mesh -> model on meta -> parallelize -> to_empty + init -> optimizer -> data
  -> step loop (metrics) -> summary.

``run_worker`` is the entry point of every rank, however it was started (fsdp_exp's local spawner,
torchrun, SLURM); it receives plain data only: the resolved config, the topology and the run meta.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import platform
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_exp import __version__
from fsdp_exp.checkpoint import Checkpointer, check_identical_init, install_signal_handlers
from fsdp_exp.config import RunConfig, Topology, plain, to_run_config
from fsdp_exp.data import build_data
from fsdp_exp.dist import RankInfo, broadcast_object, build_mesh, init_distributed, reduce_over_ranks
from fsdp_exp.metrics import memory
from fsdp_exp.metrics.flops import lookup_peak_tflops, mfu
from fsdp_exp.metrics.tracker import tracked
from fsdp_exp.models import build_meta, canonical_name, count_params, flops_per_token, matrix_parameter_names
from fsdp_exp.optim import build_optimizer, build_scheduler
from fsdp_exp.parallel import parallelize
from fsdp_exp.sinks import ConsoleSink, JsonlSink, RunRecord, WandbSink

GIB = memory.GIB


class InjectedFailure(RuntimeError):
    """Raised on purpose by debug.fail_at_step, to exercise failure handling."""


def run_worker(payload: dict) -> None:
    """Entry point of one rank. ``payload``: {"config", "topology", "run_dir", "meta"} as plain data."""
    # A rank killed by a fatal signal (abort, segfault) still says where it was.
    faulthandler.enable()
    cfg = to_run_config(payload["config"])
    if cfg.checkpoint.on_signal:  # from now on SIGTERM / SIGUSR1 ask every rank to save and stop cleanly
        install_signal_handlers(list(cfg.checkpoint.signals))
    topology = Topology(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["topology"].items()})
    threads = cfg.trainer.threads_per_rank or max(1, (os.cpu_count() or 1) // topology.nproc_per_node)
    torch.set_num_threads(threads)
    info = init_distributed(topology)
    # Under torchrun every rank composed its own config and may have picked its own time-stamped
    # output folder: rank 0's choice wins.
    run_dir = Path(broadcast_object(payload["run_dir"]))
    Trainer(cfg, topology, info, run_dir, payload.get("meta", {})).fit()
    # Tear down together: a rank that destroys its gloo group while a peer is still finishing
    # (rank 0 closes the sinks) can abort at exit.
    dist.barrier()
    dist.destroy_process_group()


class Trainer:
    def __init__(self, cfg: RunConfig, topology: Topology, info: RankInfo, run_dir: Path, meta: dict):
        self.cfg, self.topology, self.info, self.run_dir, self.meta = cfg, topology, info, run_dir, meta
        self.device = info.device
        torch.manual_seed(cfg.trainer.seed)

        # Build: meta model -> parallelize (TP, AC, compile, shard) -> this rank's shards, seeded init.
        self.mesh = build_mesh(topology)
        meta_model = build_meta(cfg.model)
        decay_names = matrix_parameter_names(meta_model)
        parallel = parallelize(meta_model, cfg, self.mesh, self.device)
        self.model, self.applied, self.runtime = parallel.model, parallel.applied, parallel.runtime

        self.optimizer = build_optimizer(self.model, cfg.optim, decay_names)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.steps)
        # fp16: a loss scaler that agrees over ranks on skipped steps (sharded for FSDP).
        self.scaler = self.runtime.grad_scaler(self.device) if cfg.precision.loss_scaler == "dynamic" else None
        self.data = build_data(cfg, topology, dp_rank=info.rank // topology.tp_size, device=self.device)
        # Diagnostics, then resume: everything a checkpoint restores exists now (fsdp_exp/checkpoint.py).
        self.init_check = check_identical_init(self.model, cfg, info) if cfg.debug.check_identical_init else None
        self.checkpointer = Checkpointer(self)
        self.start_step = self.checkpointer.resume()

        self.tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.trainer.seq_len)
        self.peak_tflops, self.peak_source = self._peak_tflops()
        from fsdp_exp.plan import plan_for_run

        # The memory planner's prediction (fsdp_exp/plan.py): run.json["plan"], and mem/predicted_* in
        # every row beside the measurements.
        self.plan, self.predicted = plan_for_run(cfg, topology)
        self.history: list[dict] = []
        self.pending_metrics: dict = {}  # metrics of a sampled step, added to its logged row
        t = cfg.trainer
        # torch's MemTracker cannot hook FSDP1's parameters (views into flat parameters): no breakdown there.
        trackable = t.track_memory and t.warmup_steps > 0 and cfg.sharding.backend != "fsdp1"
        self.track_step = (t.track_memory_step if t.track_memory_step is not None else t.warmup_steps - 1) \
            if trackable else None
        self.sinks_open = False
        if info.is_main:
            self._open_sinks()

    # ----------------------------------------------------------------------------------- set-up
    def _peak_tflops(self) -> tuple[Optional[float], str]:
        if self.cfg.trainer.peak_tflops is not None:
            return self.cfg.trainer.peak_tflops, "trainer.peak_tflops"
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            peak = lookup_peak_tflops(name, self.cfg.precision.param_dtype)
            return peak, f"table: {name} {self.cfg.precision.param_dtype}" if peak else f"unknown device {name}"
        return None, "unknown (CPU: pass trainer.peak_tflops)"

    def _environment(self) -> dict:
        names = [None] * self.info.world_size
        dist.all_gather_object(names, f"{socket.gethostname()}:{self._device_name()}")
        return {
            "fsdp_exp_version": __version__,
            "git_commit": _git_commit(),
            "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda,
            "python_version": platform.python_version(),
            "hostname": socket.gethostname(),
            "world_size": self.info.world_size,
            "device_type": self.device.type,
            "devices": names,
            "threads_per_rank": torch.get_num_threads(),
            "num_params": count_params(self.cfg.model),
            "flops_per_token": self.flops_per_token,
            "peak_tflops": self.peak_tflops,
            "peak_tflops_source": self.peak_source,
        }

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return platform.processor() or platform.machine()

    def _open_sinks(self) -> None:
        cfg = self.cfg
        self.record = RunRecord(self.run_dir)
        # A resumed run keeps the rows through its checkpoint's step (later ones are trained again) and
        # summarizes them with its own.
        self.jsonl = JsonlSink(self.run_dir, keep_through_step=self.checkpointer.metrics_keep_through)
        self.history = list(self.jsonl.kept)
        self.console = ConsoleSink(cfg.trainer.steps, cfg.logger.progress, cfg.logger.summary_table)
        self.wandb = None
        self.sinks_open = True

    def _start_record(self) -> None:
        env = self._environment()  # a collective: every rank calls it
        if not self.info.is_main:
            return
        config = plain(self.cfg)
        if self.cfg.logger.wandb.mode != "disabled":
            self.wandb = WandbSink(self.cfg.logger.wandb, self.run_dir,
                                   {**config, "applied": self.applied, "topology": self.topology.as_dict(),
                                    "env": env, "choices": self.meta.get("choices", {})},
                                   self.meta.get("overrides", []), self.meta.get("choices", {}),
                                   run_id=self.checkpointer.wandb_run_id)  # a resumed run continues its W&B run
        extra = {"resumed_from": self.checkpointer.resumed, "error": None, "interrupted": None} \
            if self.checkpointer.resumed else {}
        if self.init_check is not None:
            extra["init_check"] = self.init_check
        if extra:
            self.record.update(**extra)
        self.record.update(status="running", config=config, choices=self.meta.get("choices", {}),
                           overrides=self.meta.get("overrides", []), topology=self.topology.as_dict(),
                           applied=self.applied, env=env,
                           wandb={"mode": self.cfg.logger.wandb.mode,
                                  "run_id": self.wandb.run_id if self.wandb else None})
        self.record.update(plan=self.plan)

    # ------------------------------------------------------------------------------------- loop
    def fit(self) -> None:
        self._start_record()
        stopped = None  # the signal that stopped the run after a checkpoint
        try:
            for step in range(self.start_step, self.cfg.trainer.steps):
                start = time.perf_counter()
                self._check_injected_failure(step)
                if step == self.track_step:
                    loss, grad_norm, lr = self._tracked_step(step)
                else:
                    loss, grad_norm, lr = self.train_step(step)
                flags = self.checkpointer.poll(step + 1, loss)  # ranks agree: a signal? a NaN/inf loss?
                evaluate = self.cfg.trainer.eval_every > 0 and (step + 1) % self.cfg.trainer.eval_every == 0
                if (step + 1) % self.cfg.trainer.log_every == 0 or step + 1 == self.cfg.trainer.steps or evaluate:
                    self._log(step + 1, start, loss, grad_norm, lr, evaluate)
                stopped = self.checkpointer.after_step(step + 1, flags)  # periodic save; NaN stop; signal save
                if stopped:
                    break
            self.checkpointer.finish()
            if stopped is None and self.cfg.checkpoint.export != "none":
                from fsdp_exp.export import export_model

                exported = export_model(self)
                if self.info.is_main:
                    self.record.update(export=exported)
        except BaseException as exc:
            if self.info.is_main and self.sinks_open:
                self._close_sinks(status="failed", error=f"rank 0: {type(exc).__name__}: {exc}")
            raise
        if stopped:
            if self.info.is_main:
                self.record.update(interrupted={"signal": stopped, "checkpoint": self.checkpointer.last_saved})
                self._close_sinks(status="interrupted")
            return
        summary = self._summary()
        digests = self._shard_digests() if self.cfg.trainer.digest_shards else None
        if self.info.is_main:
            if digests is not None:
                self.record.update(shard_digests=digests)
            self._close_sinks(status="completed", summary=summary)

    def _tracked_step(self, step: int) -> tuple[torch.Tensor, float, float]:
        """A training step under torch's memory tracker; its peak breakdown joins the step's metrics."""
        result, breakdown = tracked(self.model, self.optimizer, self.cfg.sharding.backend, self.device,
                                    lambda between: self.train_step(step, between))
        hi, mean = reduce_over_ranks([float(v) for v in breakdown.values()], self.device)
        self.pending_metrics = {}
        for kind, h, m in zip(breakdown, hi, mean):
            self.pending_metrics[f"mem/tracked_{kind}_gib_max"] = h / GIB
            self.pending_metrics[f"mem/tracked_{kind}_gib_mean"] = m / GIB
        if self.info.is_main:
            self.record.update(memory_breakdown={"step": step + 1, "unit": "GiB", **{
                k.removeprefix("mem/tracked_"): v for k, v in self.pending_metrics.items()}})
        return result

    def _shard_digests(self) -> list[str]:
        """A hash of each rank's parameter shards, gathered to every rank. Ranks that hold the same
        shard (replicas in HSDP, DDP, no_shard) must show the same digest."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters(), key=lambda item: canonical_name(item[0])):
            local = param.to_local() if isinstance(param, DTensor) else param
            digest.update(canonical_name(name).encode())
            digest.update(local.detach().float().cpu().contiguous().numpy().tobytes())
        digests = [None] * self.info.world_size
        dist.all_gather_object(digests, digest.hexdigest()[:16])
        return digests

    def train_step(self, step: int, between_micro_batches=None) -> tuple[torch.Tensor, float, float]:
        """One optimizer step; returns this rank's loss (a tensor), the global grad norm and the lr."""
        self.optimizer.zero_grad(set_to_none=True)
        accum = self.topology.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.data.micro_batches(step)):
            # Reduce gradients only after the last micro-batch; the others accumulate locally.
            with self.runtime.gradient_sync(self.model, i == accum - 1):
                with self.runtime.autocast():
                    logits = self.model(batch.inputs)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten()) / accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
            if between_micro_batches is not None and i < accum - 1:
                between_micro_batches()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.trainer.grad_clip or float("inf")
        grad_norm = self.runtime.clip_grad_norm(self.model, max_norm)
        lr = self.scheduler.get_last_lr()[0]
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return loss_sum, grad_norm.item(), lr

    def _check_injected_failure(self, step: int) -> None:
        d = self.cfg.debug
        if d.nan_at_step == step and self.info.rank == d.fail_rank:
            # A real NaN: through this rank's forward, its gradients, the reduction and the loss.
            with torch.no_grad():
                for param in self.model.parameters():
                    local = param.to_local() if isinstance(param, DTensor) else param
                    if local.numel():
                        local.fill_(float("nan"))
                        break
        if d.fail_at_step is not None and step == d.fail_at_step and self.info.rank == d.fail_rank \
                and d.fail_during == "step":
            if d.fail_signal:  # SIGKILL ends the rank here; a handled signal (SIGTERM) asks for a save and stop
                os.kill(os.getpid(), getattr(signal, d.fail_signal))
                return
            raise InjectedFailure(f"debug.fail_at_step={d.fail_at_step} on rank {d.fail_rank}")

    def evaluate(self) -> dict:
        """Mean cross-entropy per token on ``data.val_batches`` global batches of the validation data
        (the same blocks every time), over all ranks; and its perplexity."""
        import math

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        with torch.no_grad():
            for batch in self.data.val_micro_batches():
                with self.runtime.autocast():
                    logits = self.model(batch.inputs)
                total += F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
                tokens += batch.targets.numel()
        _, mean = reduce_over_ranks([total.item() / max(tokens, 1)], self.device)  # equal tokens per rank
        return {"val/loss": mean[0], "val/perplexity": math.exp(min(mean[0], 700.0))}

    # ---------------------------------------------------------------------------------- metrics
    def _log(self, step: int, start: float, loss: torch.Tensor, grad_norm: float, lr: float,
             evaluate: bool = False) -> None:
        """Combine this step's numbers over ranks and hand them to the sinks.

        The step time runs from the step's start to after the metric all-reduces, so that what
        measuring costs is inside the reported throughput, not hidden between steps. An evaluation
        (``evaluate``) runs after that, outside every step's time, and joins the same row.
        """
        local = {**memory.model_state_bytes(self.model, self.optimizer), **memory.host_bytes()}
        counts = {}
        if self.device.type == "cuda":
            local.update(memory.cuda_bytes(self.device))
            counts = memory.cuda_counts(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # peaks are per log interval
        values = [loss.item(), self.data.last_wait_s] + [float(v) for v in [*local.values(), *counts.values()]]
        hi, mean = reduce_over_ranks(values, self.device)  # every rank has equally many tokens
        step_time = time.perf_counter() - start

        tokens_per_s = self.tokens_per_step / step_time
        per_rank = tokens_per_s / self.info.world_size
        tflops = self.flops_per_token * per_rank / 1e12
        metrics = {
            "step": step,
            "train/loss": mean[0],
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_rank": per_rank,
            "perf/tflops_per_rank": tflops,
            "perf/mfu": mfu(tflops, self.peak_tflops),
            "perf/data_time_s": hi[1],  # the slowest rank's wait holds every rank back
        }
        for key, h, m in zip([*local, *counts], hi[2:], mean[2:]):
            if key in counts:
                metrics[f"mem/{key}_max"] = int(h)
            else:
                metrics[f"mem/{key}_gib_max"], metrics[f"mem/{key}_gib_mean"] = h / GIB, m / GIB
        if evaluate:
            metrics.update(self.evaluate())
        metrics.update(self.predicted)
        metrics.update(self.pending_metrics)
        self.pending_metrics = {}
        self.history.append(metrics)
        if self.info.is_main:
            self.jsonl.log(metrics)
            if self.wandb:
                self.wandb.log(metrics)
            self.console.log(metrics)

    def _summary(self) -> dict:
        measured = [h for h in self.history if h["step"] > self.cfg.trainer.warmup_steps]
        times = sorted(h["perf/step_time_s"] for h in measured)

        def median(key):
            values = [h[key] for h in measured if h[key] is not None]
            return statistics.median(values) if values else None

        def largest(key):
            values = [h[key] for h in self.history if key in h]
            return max(values) if values else None

        summary = {
            "summary/steps_measured": len(measured),
            "summary/step_time_s_median": median("perf/step_time_s"),
            "summary/step_time_s_p90": _percentile(times, 0.9),
            "summary/tokens_per_s_median": median("perf/tokens_per_s"),
            "summary/tokens_per_s_per_rank_median": median("perf/tokens_per_s_per_rank"),
            "summary/tflops_per_rank_median": median("perf/tflops_per_rank"),
            "summary/mfu_median": median("perf/mfu"),
            "summary/final_loss": self.history[-1]["train/loss"] if self.history else None,
            "summary/model_states_gib_max": largest("mem/model_states_gib_max"),
            "summary/host_peak_rss_gib_max": largest("mem/host_peak_rss_gib_max"),
        }
        if self.device.type == "cuda":
            summary["summary/peak_allocated_gib_max"] = largest("mem/peak_allocated_gib_max")
            summary["summary/peak_reserved_gib_max"] = largest("mem/peak_reserved_gib_max")
        return summary

    def _close_sinks(self, status: str, summary: Optional[dict] = None, error: Optional[str] = None) -> None:
        self.sinks_open = False
        fields = {"status": status}
        if summary is not None:
            fields["summary"] = summary
        if error is not None:
            fields["error"] = error
        self.record.update(**fields)
        self.jsonl.close()
        if self.wandb:
            if summary:
                self.wandb.summary(summary)
            self.wandb.close(exit_code=0 if status in ("completed", "interrupted") else 1)
        if summary is not None:
            self.console.summary(summary, title=f"fsdp_exp run: {self.run_dir}")
        else:
            self.console.close()


def _percentile(sorted_values: list[float], q: float) -> Optional[float]:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
