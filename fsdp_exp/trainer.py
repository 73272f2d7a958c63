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
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_exp import __version__
from fsdp_exp.checkpoint.faults import inject_step_fault
from fsdp_exp.checkpoint.init_check import check_identical_init
from fsdp_exp.checkpoint.layout import checkpoint_root
from fsdp_exp.checkpoint.manager import Checkpointer
from fsdp_exp.checkpoint.rng import RngState
from fsdp_exp.checkpoint.signals import handle_stop_signals
from fsdp_exp.checkpoint.states import sharded_state
from fsdp_exp.config import RunConfig, Topology, plain, to_run_config
from fsdp_exp.data import build_data
from fsdp_exp.env import default_threads, placement
from fsdp_exp.dist import (RankInfo, broadcast_object, build_mesh, gather_over_ranks, init_distributed,
                           reduce_over_ranks)
from fsdp_exp.metrics import memory
from fsdp_exp.metrics.flops import convention_flops_per_token, lookup_peak_tflops, mfu, recompute_flops_per_token
from fsdp_exp.metrics.peak import measured_peak
from fsdp_exp.metrics.tracker import BREAKDOWN, PHASES, StepMemory
from fsdp_exp.models import (build_meta, canonical_name, count_params, matrix_parameter_names,
                             spec_for)
from fsdp_exp.models.loss import mean_cross_entropy
from fsdp_exp.optim import build_scheduler
from fsdp_exp.parallel import ac, parallelize
from fsdp_exp.record import ConsoleSink, JsonlSink, RunRecord, WandbSink

GIB = memory.GIB


def run_worker(payload: dict) -> None:
    """Entry point of one rank. ``payload``: {"config", "topology", "run_dir", "meta"} as plain data."""
    # A rank killed by a fatal signal (abort, segfault) still says where it was.
    faulthandler.enable()
    cfg = to_run_config(payload["config"])
    # From now on checkpoint.signals (none with on_signal=false) ask every rank to save and stop cleanly;
    # any other signal a launcher handled until now acts as the system defines again.
    handle_stop_signals(list(cfg.checkpoint.signals) if cfg.checkpoint.on_signal else [])
    topology = Topology(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["topology"].items()})
    threads = cfg.trainer.threads_per_rank or default_threads(topology.nproc_per_node)
    torch.set_num_threads(threads)
    info = init_distributed(topology, timeout_s=cfg.trainer.collective_timeout_s)
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
        setup_start = time.perf_counter()  # perf/setup_time_s: build, shard, materialize, wrap, optimizer
        meta_model = build_meta(cfg.model)
        decay_names = matrix_parameter_names(meta_model)
        # The backend, bound to this run, also does its part of the step (sync, autocast, clipping, scaler).
        self.parallel = parallelize(meta_model, cfg, self.mesh, self.device)
        self.model, self.applied, self.backend = self.parallel.model, self.parallel.applied, self.parallel.backend

        self.optimizer = self.parallel.build_optimizer(decay_names)
        # mem/params_gib_* etc., per step, counted as the backend lays them out
        self.state_bytes = self.backend.model_state_counter(self.model, self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.steps)
        setup_s = time.perf_counter() - setup_start
        # fp16: a loss scaler that agrees over ranks on skipped steps (sharded for FSDP).
        self.scaler = self.parallel.grad_scaler() if cfg.precision.loss_scaler == "dynamic" else None
        self.data = build_data(cfg, topology, dp_rank=info.rank // topology.tp_size, device=self.device)
        # Diagnostics, then resume: everything a checkpoint restores exists now (fsdp_exp/checkpoint/).
        self.init_check = check_identical_init(self.backend, self.model, cfg.trainer.seed, info.world_size) \
            if cfg.debug.check_identical_init else None
        self.record = RunRecord(run_dir) if info.is_main else None  # run.json's writer (rank 0's part)
        self.checkpointer = Checkpointer(
            root=checkpoint_root(cfg.checkpoint.dir, run_dir), info=info, topology=topology, config=plain(cfg),
            sharded=sharded_state(self.model, self.optimizer, self.backend),
            replicated={"scheduler": self.scheduler, "scaler": self.scaler, "data": self.data},
            per_rank={"rng": RngState(self.device)}, settings=cfg.checkpoint, faults=cfg.debug,
            total_steps=cfg.trainer.steps, on_saved=self.record.checkpoint_saved if self.record else None)
        self.start_step = self.checkpointer.resume()

        self.tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        self.loss_chunks = cfg.trainer.loss_chunks  # the output projection and loss per slice of the sequence
        # MFU's numerator under the run's named convention (trainer.flops_convention; recorded in run.json env)
        self.flops_per_token = convention_flops_per_token(cfg.trainer.flops_convention, cfg.model, cfg.trainer.seq_len)
        # HFU's numerator: the model FLOPs plus what activation checkpointing recomputes (torch's
        # FlopCounterMode on the meta model; fsdp_exp/metrics/flops.py). A model the counter cannot run
        # on the meta device gets no HFU (null, and the reason in run.json env), not a failed run.
        self.recompute_error = None
        try:
            self.recompute_flops_per_token: Optional[float] = recompute_flops_per_token(cfg, cfg.trainer.seq_len, ac.apply)
        except Exception as exc:  # noqa: BLE001 - a measurement aside must not stop training
            self.recompute_flops_per_token, self.recompute_error = None, f"{type(exc).__name__}: {exc}"
        self.peak_tflops, self.peak_source, self.peak_measurement = self._peak_tflops()
        self.fp8_peak_tflops, self.fp8_peak_source = self._fp8_peak_tflops()
        from fsdp_exp.plan import plan_for_run

        # The memory planner's prediction (fsdp_exp/plan.py): run.json["plan"], the peak and model states
        # in every row beside the measurements, each phase's peak beside the sampled step's breakdown.
        self.plan, self.predicted, self.predicted_phases = plan_for_run(cfg, topology)
        self.history: list[dict] = []
        self.pending_metrics: dict = {}  # metrics of a sampled step, added to its logged row
        self.pending_metrics["perf/setup_time_s"] = reduce_over_ranks([setup_s], self.device)[0][0]  # slowest rank
        t = cfg.trainer
        # Not every backend's parameters can be followed by torch's memory trackers: no breakdown there.
        trackable = t.track_memory and t.warmup_steps > 0 and self.backend.tracks_memory
        self.track_step = (t.track_memory_step if t.track_memory_step is not None else t.warmup_steps - 1) \
            if trackable else None
        # CUDA allocator history on the same sampled step (the last warm-up step when nothing is tracked).
        self.snapshot_step = (self.track_step if self.track_step is not None else t.warmup_steps - 1) \
            if t.memory_snapshot and self.device.type == "cuda" else None
        self.profile_steps = set(t.profile_steps)  # torch.profiler traces and comm/* (fsdp_exp/metrics/comm.py)
        self.comm_record: list[dict] = []
        self.sinks_open = False
        if info.is_main:
            self._open_sinks()

    # ----------------------------------------------------------------------------------- set-up
    def _peak_tflops(self) -> tuple[Optional[float], str, Optional[dict]]:
        """(peak TFLOPS of one rank's device in the compute dtype, where it comes from, the CPU
        measurement it was taken from or None)."""
        dtype = self.cfg.precision.param_dtype
        if self.cfg.trainer.peak_tflops is not None:
            return self.cfg.trainer.peak_tflops, "trainer.peak_tflops", None
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            peak = lookup_peak_tflops(name, dtype)
            return peak, f"table: {name} {dtype}" if peak else f"unknown device {name}", None
        return self._measured_cpu_peak(dtype)

    def _fp8_peak_tflops(self) -> tuple[Optional[float], str]:
        """Under precision.float8_recipe, the device's FP8 peak: MFU's second denominator (perf/mfu_fp8),
        beside the compute dtype's (perf/mfu), since the converted matmuls run on the FP8 tensor cores."""
        if self.cfg.precision.float8_recipe is None:
            return None, "float8 off"
        if self.device.type != "cuda":
            return None, "a CPU has no FP8 matmul peak"
        name = torch.cuda.get_device_name(self.device)
        peak = lookup_peak_tflops(name, "fp8")
        return peak, f"table: {name} fp8" if peak else f"no FP8 peak known for {name}"

    def _measured_cpu_peak(self, dtype: str) -> tuple[Optional[float], str, Optional[dict]]:
        """This CPU's matmul peak per rank: from the cache, or measured now by every rank at once
        (fsdp_exp/metrics/flops.py) and cached by rank 0. Rank 0 decides for all (a rank reading the
        cache after rank 0 wrote it must not skip the measurement the others run)."""
        from fsdp_exp.metrics import flops

        key = flops.peak_key(torch.get_num_threads(), self.topology.nproc_per_node, dtype)
        entry = broadcast_object(flops.read_cached_peak(key) if self.info.is_main else None)
        if entry is None:
            dist.barrier()  # start together: each rank measures while its peers compute too
            local = flops.measure_matmul_tflops(dtype)
            hi, mean = reduce_over_ranks([local["tflops"], -local["core_share"]], self.device)
            entry = {"tflops": mean[0], "n": local["n"], "dtype": dtype, "threads_per_rank": local["threads"],
                     "ranks_per_node": self.topology.nproc_per_node, "ranks_measured": self.info.world_size,
                     "rank0_batches_tflops": local["batches_tflops"], "min_core_share": -hi[1],
                     "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            # What each rank can get when only this run computes: its threads, or its share of the cores
            # when the node's ranks ask for more threads than there are cores.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            fair = min(1.0, cores / (local["threads"] * self.topology.nproc_per_node))
            entry["fair_core_share"] = fair
            if -hi[1] >= flops.MIN_CORE_SHARE * fair:
                if self.info.is_main:
                    flops.write_cached_peak(key, entry)
                how = "measured now"
            else:  # other programs took cores: right for this run at best, never for later ones
                how = f"measured now, not cached: a rank got {-hi[1]:.0%} of its cores' time, {fair:.0%} expected"
        else:
            how = "cached"
        source = (f"CPU matmul peak per rank, {how}: {key}; {entry['n']}x{entry['n']} matmuls for 1 s, "
                  f"mean over {entry['ranks_measured']} ranks (cache: {flops.cache_path()})")
        return entry["tflops"], source, {"key": key, **entry}

    def _environment(self) -> dict:
        # Every rank's host, address and device: on a multi-node job, which ranks shared a node (and were
        # lost together when it failed: fsdp_exp/launch.py names them by this list).
        ranks: list = [None] * self.info.world_size
        dist.all_gather_object(ranks, {"rank": self.info.rank, **placement(), "device": self._device_name()})
        return {
            "fsdp_exp_version": __version__,
            "git_commit": _git_commit(),
            "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda,
            "python_version": platform.python_version(),
            "hostname": socket.gethostname(),
            "world_size": self.info.world_size,
            "device_type": self.device.type,
            "devices": [f"{r['host']}:{r['device']}" for r in ranks],
            "ranks": ranks,
            "threads_per_rank": torch.get_num_threads(),
            "num_params": count_params(self.cfg.model),
            "architecture": spec_for(self.cfg.model).architecture(self.cfg.model),  # e.g. MistralForCausalLM
            "flops_per_token": self.flops_per_token,
            "flops_convention": self.cfg.trainer.flops_convention,
            "recompute_flops_per_token": self.recompute_flops_per_token,
            "hardware_flops_per_token": None if self.recompute_flops_per_token is None
            else self.flops_per_token + self.recompute_flops_per_token,
            "recompute_flops_error": self.recompute_error,
            "peak_tflops": self.peak_tflops,
            "peak_tflops_source": self.peak_source,
            "peak_tflops_measurement": self.peak_measurement,
            "peak_tflops_fp8": self.fp8_peak_tflops,
            "peak_tflops_fp8_source": self.fp8_peak_source,
        }

    def _device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return platform.processor() or platform.machine()

    def _open_sinks(self) -> None:
        cfg = self.cfg
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
                                    "env": env, "choices": self.meta.get("choices", {}),
                                    "overrides": self.meta.get("overrides", [])},
                                   self.meta.get("overrides", []), self.meta.get("choices", {}),
                                   run_id=self.checkpointer.wandb_run_id)  # a resumed run continues its W&B run
        wandb_run_id = self.wandb.run_id if self.wandb else None
        self.checkpointer.wandb_run_id = wandb_run_id  # the run its checkpoints name from now on
        self.record.running(config=config, choices=self.meta.get("choices", {}),
                            overrides=self.meta.get("overrides", []), topology=self.topology.as_dict(),
                            applied=self.applied, env=env, wandb={"mode": self.cfg.logger.wandb.mode,
                                                                  "run_id": wandb_run_id},
                            plan=self.plan, resumed_from=self.checkpointer.resumed, init_check=self.init_check)

    # ------------------------------------------------------------------------------------- loop
    def fit(self) -> None:
        self._start_record()
        stopped = None  # the signal that stopped the run after a checkpoint
        try:
            for step in range(self.start_step, self.cfg.trainer.steps):
                start = time.perf_counter()
                inject_step_fault(self.cfg.debug, step, self.info.rank, self.model)  # debug.fail_at_step etc.
                if step in (self.track_step, self.snapshot_step):
                    loss, grad_norm, lr = self._sampled_step(step)
                elif step in self.profile_steps:
                    loss, grad_norm, lr = self._profiled_step(step)
                else:
                    loss, grad_norm, lr = self.train_step(step)
                if step == self.start_step:  # where lazy buffers are allocated: in the next logged row
                    self.pending_metrics["perf/first_step_time_s"] = time.perf_counter() - start
                flags = self.checkpointer.poll(step + 1, loss)  # ranks agree: a signal? a NaN/inf loss?
                evaluate = self.cfg.trainer.eval_every > 0 and (step + 1) % self.cfg.trainer.eval_every == 0
                if (step + 1) % self.cfg.trainer.log_every == 0 or step + 1 == self.cfg.trainer.steps or evaluate:
                    self._log(step + 1, start, loss, grad_norm, lr, evaluate)
                stopped = self.checkpointer.after_step(step + 1, flags)  # periodic save; NaN stop; signal save
                if stopped:
                    break
            self.checkpointer.finish()
            if stopped is None and self.cfg.checkpoint.export != "none":
                from fsdp_exp.export import export_dir, export_model

                exported = export_model(self.model, self.cfg.model, self.cfg.checkpoint.export,
                                        export_dir(self.cfg.checkpoint.export_dir, self.run_dir), self.info.is_main,
                                        consolidate=self.backend.full_state_dict)
                if self.info.is_main:
                    self.record.exported(exported)
        except BaseException as exc:
            if self.info.is_main and self.sinks_open:
                self._close_sinks(status="failed", error=f"{type(exc).__name__}: {exc}")
            raise
        if stopped:
            if self.info.is_main:
                self.record.interrupted(stopped, self.checkpointer.last_saved)
                self._close_sinks(status="interrupted")
            return
        summary = self._summary()
        digests = self._shard_digests() if self.cfg.trainer.digest_shards else None
        if self.info.is_main:
            if digests is not None:
                self.record.shard_digests(digests)
            self._close_sinks(status="completed", summary=summary)

    def _sampled_step(self, step: int) -> tuple[torch.Tensor, float, float]:
        """A training step under torch's memory tracker (its peak breakdown, whole and by phase, joins
        the step's metrics) and, on CUDA with trainer.memory_snapshot, the allocator's history."""
        snapshot = step == self.snapshot_step
        if snapshot:
            # Alloc/free events with their stack traces from here to the dump; at most this many are kept
            # (torch documents several KB per entry), enough for a step of a large model.
            torch.cuda.memory._record_memory_history(enabled="all", max_entries=200_000)
        try:
            if step != self.track_step:
                return self.train_step(step)
            with StepMemory(self.model, self.optimizer, self.backend, self.device) as mem:
                result = self.train_step(step, mem.phase)
            self._log_breakdown(step, mem.breakdown())
            return result
        finally:
            if snapshot:
                path = self.run_dir / "memory" / f"rank{self.info.rank}_step{step + 1}.pickle"
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(path))
                torch.cuda.memory._record_memory_history(enabled=None)  # stop recording

    def _log_breakdown(self, step: int, breakdown: dict[str, dict[str, int]]) -> None:
        """Every rank's breakdown to every rank (one all-gather): max and mean in the step's row, all of
        it in run.json["memory_breakdown"]."""
        parts = ("step", *PHASES)
        ranks = gather_over_ranks([float(breakdown[p][k]) for p in parts for k in BREAKDOWN], self.device)
        ranks = ranks.view(self.info.world_size, len(parts), len(BREAKDOWN)) / GIB  # rank x part x kind
        hi, mean = ranks.max(dim=0).values, ranks.mean(dim=0)
        self.pending_metrics.update(self.predicted_phases)
        for j, kind in enumerate(BREAKDOWN):
            self.pending_metrics[f"mem/tracked_{kind}_gib_max"] = hi[0, j].item()
            self.pending_metrics[f"mem/tracked_{kind}_gib_mean"] = mean[0, j].item()
            for i, phase in enumerate(PHASES, start=1):
                self.pending_metrics[f"mem/tracked_{phase}_{kind}_gib_max"] = hi[i, j].item()
        if self.info.is_main:
            def table(values, i):
                return {kind: values[i, j].item() for j, kind in enumerate(BREAKDOWN)}

            self.record.memory_breakdown({
                "step": step + 1, "unit": "GiB",
                **{f"{kind}_gib_max": hi[0, j].item() for j, kind in enumerate(BREAKDOWN)},
                **{f"{kind}_gib_mean": mean[0, j].item() for j, kind in enumerate(BREAKDOWN)},
                "per_rank": [table(r, 0) for r in ranks],
                "phases": {phase: {"max": table(hi, i), "mean": table(mean, i),
                                   "per_rank": [table(r, i) for r in ranks]}
                           for i, phase in enumerate(PHASES, start=1)},
            })

    def _profiled_step(self, step: int) -> tuple[torch.Tensor, float, float]:
        """A training step under torch.profiler: its chrome trace in traces/, its collectives' times
        (comm/*, max over ranks) in the step's row, every rank's in run.json["comm"]."""
        from fsdp_exp.metrics.comm import COMM_KINDS, profiled

        path = self.run_dir / "traces" / f"rank{self.info.rank}_step{step + 1}.json"
        result, comm = profiled(lambda phase: self.train_step(step, phase), self.device, path)
        names = [f"{k}_s" for k in COMM_KINDS] + ["total_s", "exposed_s", "compute_s", "step_s"]
        ranks = gather_over_ranks([comm[n] for n in names] + [comm["exposed_s"] / comm["step_s"]], self.device)
        names.append("exposed_fraction")
        for j, name in enumerate(names):
            self.pending_metrics[f"comm/{name}"] = ranks[:, j].max().item()
        if self.info.is_main:
            self.comm_record.append({"step": step + 1, "unit": "s", "device": comm["device"],
                                     "traces": f"traces/rank<N>_step{step + 1}.json",
                                     "per_rank": [dict(zip(names, r.tolist())) for r in ranks],
                                     "collectives_rank0": comm["collectives"]})
            self.record.comm(self.comm_record)
        return result

    def _shard_digests(self) -> list[str]:
        """A hash of each rank's parameter shards, gathered to every rank. Ranks that hold the same
        shard (replicas in HSDP, DDP, no_shard) must show the same digest."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters(), key=lambda item: canonical_name(item[0])):
            local = param.to_local() if isinstance(param, DTensor) else param
            while is_traceable_wrapper_subclass(local):  # a weight wrapper (torchao's float8 all-gather): its data
                local = getattr(local, local.__tensor_flatten__()[0][0])
            digest.update(canonical_name(name).encode())
            digest.update(local.detach().float().cpu().contiguous().numpy().tobytes())
        digests = [None] * self.info.world_size
        dist.all_gather_object(digests, digest.hexdigest()[:16])
        return digests

    def train_step(self, step: int, phase=None) -> tuple[torch.Tensor, float, float]:
        """One optimizer step; returns this rank's loss (a tensor), the global grad norm and the lr.

        ``phase(name)``, on sampled steps only, is told where the step is: ``forward`` (from here,
        and again at each later micro-batch), ``backward`` (before each ``backward()``), ``optimizer``
        (after the last one): the memory tracker's and the profiler's phases."""
        if phase:
            phase("forward")
        self.parallel.zero_grad(self.optimizer)
        accum = self.topology.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.data.micro_batches(step)):
            # Reduced into the sharded gradient every micro-batch, or only after the last one
            # (trainer.grad_sync, resolved by the backend); otherwise accumulated locally.
            with self.parallel.gradient_sync(last=i == accum - 1):
                with self.parallel.loss_parallel():
                    with self.parallel.autocast():
                        loss = mean_cross_entropy(self.model, batch.inputs, batch.targets, self.loss_chunks) / accum
                    if phase:
                        phase("backward")
                    self.parallel.backward(loss, self.scaler)
            loss_sum += loss.detach()
            if phase and i < accum - 1:
                phase("forward")
        if phase:
            phase("optimizer")
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.parallel.optimizer_step(self.optimizer, self.scaler, self.cfg.trainer.grad_clip or float("inf"))
        self.scheduler.step()
        return loss_sum, grad_norm.item(), lr

    def evaluate(self) -> dict:
        """Mean cross-entropy per token on ``data.val_batches`` global batches of the validation data
        (the same blocks every time), over all ranks; and its perplexity."""
        import math

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        with torch.no_grad():
            for batch in self.data.val_micro_batches():
                with self.parallel.loss_parallel(), self.parallel.autocast():
                    mean = mean_cross_entropy(self.model, batch.inputs, batch.targets, self.loss_chunks)
                total += mean.double() * batch.targets.numel()
                tokens += batch.targets.numel()
        _, mean = reduce_over_ranks([total.item() / max(tokens, 1)], self.device)  # equal tokens per rank
        return {"val/loss": mean[0], "val/perplexity": math.exp(min(mean[0], 700.0))}

    # ---------------------------------------------------------------------------------- metrics
    def _log(self, step: int, start: float, loss: torch.Tensor, grad_norm: float, lr: float,
             evaluate: bool = False) -> None:
        """Combine this step's numbers over ranks and hand them to the sinks.

        The step time runs from the step's start to after the metrics' all-gather over ranks, so that what
        measuring costs is inside the reported throughput, not hidden between steps. An evaluation
        (``evaluate``) runs after that, outside every step's time, and joins the same row.
        """
        local = {**self.state_bytes(), **memory.host_bytes()}
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
        hw_tflops = None if self.recompute_flops_per_token is None else \
            (self.flops_per_token + self.recompute_flops_per_token) * per_rank / 1e12
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
            "perf/hfu": None if hw_tflops is None else mfu(hw_tflops, self.peak_tflops),
            "perf/mfu_fp8": mfu(tflops, self.fp8_peak_tflops),
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
        # Post-warm-up steps, without the profiled ones (the profiler slows its step down).
        measured = [h for h in self.history if h["step"] > self.cfg.trainer.warmup_steps and "comm/total_s" not in h]
        times = sorted(h["perf/step_time_s"] for h in measured)
        speeds = sorted(h["perf/tokens_per_s"] for h in measured)  # the run's own spread, beside its median

        def median(key, rows=measured):
            values = [h[key] for h in rows if h.get(key) is not None]
            return statistics.median(values) if values else None

        def largest(key):
            values = [h[key] for h in self.history if h.get(key) is not None]
            return max(values) if values else None

        def last(key):
            values = [h[key] for h in self.history if h.get(key) is not None]
            return values[-1] if values else None

        profiled = [h for h in self.history if "comm/total_s" in h]
        tracked, predicted = largest("mem/tracked_total_gib_max"), last("mem/predicted_peak_gib")

        summary = {
            "summary/steps_measured": len(measured),
            "summary/step_time_s_median": median("perf/step_time_s"),
            "summary/step_time_s_p90": _percentile(times, 0.9),
            "summary/tokens_per_s_median": median("perf/tokens_per_s"),
            "summary/tokens_per_s_p10": _percentile(speeds, 0.1),
            "summary/tokens_per_s_p90": _percentile(speeds, 0.9),
            "summary/tokens_per_s_per_rank_median": median("perf/tokens_per_s_per_rank"),
            "summary/tflops_per_rank_median": median("perf/tflops_per_rank"),
            "summary/mfu_median": median("perf/mfu"),
            "summary/hfu_median": median("perf/hfu"),
            "summary/mfu_fp8_median": median("perf/mfu_fp8"),
            "summary/peak_tflops_fp8": self.fp8_peak_tflops,
            "summary/peak_tflops": self.peak_tflops,
            "summary/peak_tflops_source": self.peak_source,
            "summary/final_loss": self.history[-1]["train/loss"] if self.history else None,
            "summary/model_states_gib_max": largest("mem/model_states_gib_max"),
            "summary/host_peak_rss_gib_max": largest("mem/host_peak_rss_gib_max"),
            "summary/setup_time_s": last("perf/setup_time_s"),
            "summary/first_step_time_s": last("perf/first_step_time_s"),
        }
        if tracked:  # memory breakdown and communication: only when a step was sampled for them
            summary["summary/tracked_peak_gib_max"] = tracked
            summary["summary/planner_peak_error"] = predicted / tracked - 1 if predicted else None
        if profiled:
            summary["summary/comm_total_s_median"] = median("comm/total_s", profiled)
            summary["summary/comm_exposed_s_median"] = median("comm/exposed_s", profiled)
        if self.device.type == "cuda":
            summary["summary/peak_allocated_gib_max"] = largest("mem/peak_allocated_gib_max")
            summary["summary/peak_reserved_gib_max"] = largest("mem/peak_reserved_gib_max")
            summary["summary/peak_active_gib_max"] = largest("mem/peak_active_gib_max")
            summary["summary/alloc_retries_max"] = last("mem/alloc_retries_max")
            summary["summary/ooms_max"] = last("mem/ooms_max")
        # The peak the report ranks by, chosen once (fsdp_exp.metrics.peak), so that W&B shows the same.
        summary["summary/peak_gib"], summary["summary/peak_source"] = measured_peak(summary, last)
        return summary

    def _close_sinks(self, status: str, summary: Optional[dict] = None, error: Optional[str] = None) -> None:
        self.sinks_open = False
        files = sorted(p for folder in ("traces", "memory") for p in (self.run_dir / folder).glob("rank*_step*.*"))
        self.record.ended(status, summary=summary, error=error,
                          artifacts=[str(p.relative_to(self.run_dir)) for p in files])
        self.jsonl.close()
        if self.wandb:
            if files:
                self.wandb.log_files(files, self.run_dir)
            if summary:
                self.wandb.summary(summary)
            self.wandb.close(exit_code=0 if status in ("completed", "interrupted") else 1)
            if self.wandb.error:  # W&B stopped mid-run; the run went on (record.WandbSink._guarded)
                self.record.wandb_stopped(self.wandb.error)
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
