"""One rank's run: build the sharded model, train it, write the record.

The flow, each stage handing the next what it needs: process group -> mesh -> model on meta ->
parallelize -> to_empty + init -> optimizer -> data -> resume -> step loop -> summary.

Each step the loop trains (``train_step``), asks the stop guard whether the ranks agree to stop
(fsdp_exp.guard), hands the step to the step metrics (fsdp_exp.metrics.step: every number of its row)
and lets the checkpointer save when due. What is written goes through the recorder
(fsdp_exp.record.recorder: run.json, metrics.jsonl, W&B, the console).

``run_worker`` is the entry point of every rank, however it was started (fsdp_exp's local spawner,
torchrun, SLURM), and receives the launcher's ``RunContext`` (config, topology, run folder, labels, plan).
"""

from __future__ import annotations

import faulthandler
import hashlib
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_exp.checkpoint.layout import checkpoint_root
from fsdp_exp.checkpoint.manager import Checkpointer
from fsdp_exp.checkpoint.rng import RngState
from fsdp_exp.checkpoint.signals import handle_stop_signals
from fsdp_exp.checkpoint.states import sharded_state
from fsdp_exp.config import plain
from fsdp_exp.config.schema import settled_loss_chunks
from fsdp_exp.context import RunContext
from fsdp_exp.data import build_data
from fsdp_exp.debug.faults import inject_step_fault
from fsdp_exp.debug.init_check import check_identical_init
from fsdp_exp.dist import RankInfo, broadcast_object, init_distributed, reduce_over_ranks
from fsdp_exp.env import default_threads
from fsdp_exp.guard import StopGuard
from fsdp_exp.metrics.step import StepMetrics
from fsdp_exp.models.moe import reset_routing_counts, update_expert_bias
from fsdp_exp.models import build_meta, canonical_name, matrix_parameter_names
from fsdp_exp.models.attention_mask import packed_inputs
from fsdp_exp.models.loss import mean_cross_entropy
from fsdp_exp.optim import build_scheduler
from fsdp_exp.parallel import ac, float8, parallelize
from fsdp_exp.parallel.mesh import build_mesh
from fsdp_exp.record.recorder import Recorder


def run_worker(context: RunContext) -> None:
    """Entry point of one rank: the launcher's ``RunContext`` (``fsdp_exp.context``), typed and final."""
    # A rank killed by a fatal signal (abort, segfault) still says where it was.
    faulthandler.enable()
    cfg, topology = context.config, context.topology
    # From now on checkpoint.signals (none with on_signal=false) ask every rank to save and stop cleanly;
    # any other signal a launcher handled until now acts as the system defines again.
    handle_stop_signals(list(cfg.checkpoint.signals) if cfg.checkpoint.on_signal else [])
    threads = cfg.trainer.threads_per_rank or default_threads(topology.nproc_per_node)
    torch.set_num_threads(threads)
    info = init_distributed(topology, timeout_s=cfg.trainer.collective_timeout_s)
    # Under torchrun every rank composed its own config and may have picked its own time-stamped
    # output folder: rank 0's choice wins.
    context = context.in_folder(broadcast_object(str(context.run_dir)))
    Trainer(context, info).fit()
    # Tear down together: a rank that destroys its gloo group while a peer is still finishing
    # (rank 0 closes the sinks) can abort at exit.
    dist.barrier()
    dist.destroy_process_group()


class Trainer:
    def __init__(self, context: RunContext, info: RankInfo):
        cfg, topology, run_dir = context.config, context.topology, context.run_dir
        self.context, self.cfg, self.topology, self.info, self.run_dir = context, cfg, topology, info, run_dir
        self.device = info.device
        torch.manual_seed(cfg.trainer.seed)

        # Build: meta model -> parallelize (TP, AC, compile, shard) -> this rank's shards, seeded init.
        self.mesh = build_mesh(topology)
        float8.check_rank_device(cfg, self.device)  # float8 on a GPU without FP8 tensor cores: refused before the build
        setup_start = time.perf_counter()  # perf/setup_time_s: build, shard, materialize, wrap, optimizer
        meta_model = build_meta(cfg.model)
        decay_names = matrix_parameter_names(meta_model)
        # The backend, bound to this run, also does its part of the step (sync, autocast, clipping, scaler).
        self.parallel = parallelize(meta_model, cfg, self.mesh, self.device)
        self.model, self.applied, self.backend = self.parallel.model, self.parallel.applied, self.parallel.backend
        self.optimizer = self.parallel.build_optimizer(decay_names)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.steps)
        setup_s = time.perf_counter() - setup_start
        # fp16: a loss scaler that agrees over ranks on skipped steps (sharded for FSDP).
        self.scaler = self.parallel.grad_scaler() if cfg.precision.loss_scaler == "dynamic" else None
        self.data = build_data(cfg, topology, dp_rank=topology.dp_rank(info.rank), device=self.device)
        # the output projection and loss per slice of the sequence (auto settled by the launcher: run_context)
        self.loss_chunks = settled_loss_chunks(cfg.trainer.loss_chunks)
        self.applied["loss_chunks"] = context.loss_chunks or {"trainer.loss_chunks": cfg.trainer.loss_chunks}

        # Diagnostics, then resume: everything a checkpoint restores exists now (``fsdp_exp.checkpoint``).
        self.init_check = (
            check_identical_init(self.backend, self.model, cfg.trainer.seed, info.world_size)
            if cfg.debug.check_identical_init
            else None
        )
        self.recorder = Recorder(run_dir, info.is_main)  # rank 0 writes; the other ranks' writes are no-ops
        self.checkpointer = Checkpointer(
            root=checkpoint_root(cfg.checkpoint.dir, run_dir),
            info=info,
            topology=topology,
            config=plain(cfg),
            sharded=sharded_state(self.model, self.optimizer, self.backend),
            replicated={"scheduler": self.scheduler, "scaler": self.scaler, "data": self.data},
            per_rank={"rng": RngState(self.device)},
            settings=cfg.checkpoint,
            faults=cfg.debug,
            total_steps=cfg.trainer.steps,
            on_saved=self.recorder.checkpoint_saved,
        )
        self.start_step = self.checkpointer.resume()
        self.guard = StopGuard(cfg.checkpoint, info.rank, cfg.trainer.steps)  # signal stop, NaN/inf stop

        kept = self.recorder.open_sinks(cfg, keep_through_step=self.checkpointer.metrics_keep_through)
        self.metrics = StepMetrics(
            cfg,
            topology,
            info,
            run_dir,
            model=self.model,
            optimizer=self.optimizer,
            backend=self.backend,
            data=self.data,
            recorder=self.recorder,
            apply_ac=ac.apply,
            predicted=context.prediction.row,
            predicted_phases=context.prediction.phases,
            history=kept,
            setup_s=setup_s,
            start_step=self.start_step,
        )

    def _start_record(self) -> None:
        """The ranks are up: run.json says running, with the environment; W&B opens (rank 0)."""
        self.checkpointer.wandb_run_id = self.recorder.start(  # the W&B run its checkpoints name from now on
            self.cfg,
            self.topology,
            self.info,
            applied=self.applied,
            labels=self.context.labels,
            facts=self.metrics.facts(),
            resumed_from=self.checkpointer.resumed,
            init_check=self.init_check,
            wandb_run_id=self.checkpointer.wandb_run_id,
        )  # a resumed run continues its W&B run

    # ------------------------------------------------------------------------------------- loop
    def fit(self) -> None:
        self._start_record()
        try:
            stopped = self._train()  # the signal that stopped the run after a checkpoint, or None
            if stopped is None:
                self._export()
        except BaseException as exc:
            self.recorder.close(status="failed", error=f"{type(exc).__name__}: {exc}")
            raise
        if stopped:
            self.recorder.interrupted(stopped, self.checkpointer.last_saved)
            self.recorder.close(status="interrupted")
            return
        summary = self.metrics.summary()
        if self.cfg.trainer.digest_shards:
            self.recorder.shard_digests(self._shard_digests())
        self.recorder.close(status="completed", summary=summary)

    def _train(self) -> Optional[str]:
        """The step loop, from the resumed step on; returns the stop signal after which it saved and
        stopped, or None when every step ran."""
        stopped = None
        step_fn = self.pipeline_step if self.parallel.owns_step else self.train_step
        for step in range(self.start_step, self.cfg.trainer.steps):
            started = time.perf_counter()  # the step's time: from here until its row is gathered
            inject_step_fault(self.cfg.debug, step, self.info.rank, self.model)  # debug.fail_at_step etc.
            # a mixture of experts' loads: per step; its aux gradient scaled as fp16's scaler scales the loss
            scale = self.backend.loss_scale(self.model, self.scaler)
            reset_routing_counts(self.model, self.topology.grad_accum_steps, scale)
            loss, grad_norm, lr = self.metrics.run(step, step_fn, started)  # tracked or profiled if sampled
            # DeepSeek-V3's loss-free balancing: the biases move after the step, by the load over every rank.
            update_expert_bias(self.model, getattr(self.cfg.model, "expert_bias_rate", 0.0), dist.all_reduce)
            done = step + 1  # steps completed: the row's, the checkpoint's step
            flags = self.guard.poll(done, loss, saves=self.checkpointer.saves_at(done))  # a signal? NaN/inf?
            self.metrics.log(done, started, loss, grad_norm, lr, self.evaluate)  # on logged steps only
            self.guard.check_finite(flags, self.checkpointer.latest)  # NaN/inf: stop, saving nothing
            stopped = self.guard.stop_signal(done, flags)
            if stopped:
                self.checkpointer.save(done, f"signal:{stopped}")
                self.checkpointer.wait()
                break
            self.checkpointer.save_if_due(done)  # checkpoint.every, and the final step
        self.guard.finish()
        self.checkpointer.finish()
        return stopped

    def _export(self) -> None:
        """checkpoint.export: the trained model in a standard format (``fsdp_exp.export``)."""
        if self.cfg.checkpoint.export == "none":
            return
        from fsdp_exp.export import export_dir, export_model

        exported = export_model(
            self.model,
            self.cfg.model,
            self.cfg.checkpoint.export,
            export_dir(self.cfg.checkpoint.export_dir, self.run_dir),
            self.info.is_main,
            consolidate=self.backend.full_state_dict,
        )
        self.recorder.exported(exported)

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
            inputs, targets = self.parallel.sequence_shard(batch.inputs, batch.targets)  # parallel.cp: this rank's
            packed = self.parallel.packed_shard(self._packed(batch))
            # Reduced into the sharded gradient every micro-batch, or only after the last one
            # (trainer.grad_sync, resolved by the backend); otherwise accumulated locally.
            with self.parallel.gradient_sync(last=i == accum - 1):
                with self.parallel.loss_parallel():
                    with self.parallel.autocast():
                        loss = mean_cross_entropy(self.model, inputs, targets, self.loss_chunks, **packed) / accum
                    if phase:
                        phase("backward")
                    self.parallel.backward(loss, self.scaler)
            loss_sum += loss.detach()
            if phase and i < accum - 1:
                phase("forward")
        if phase:
            phase("optimizer")
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.parallel.optimizer_step(
            self.optimizer, self.scaler, self.cfg.trainer.grad_clip or float("inf")
        )
        self.scheduler.step()
        return loss_sum, grad_norm.item(), lr

    def pipeline_step(self, step: int, phase=None) -> tuple[torch.Tensor, float, float]:
        """``train_step`` under parallel.pp > 1: the engine's schedule runs forward and backward over the
        micro-batches of this dp rank's batch (one batch a step), then its optimizer step clips over every
        stage (parallel/pipeline.py). The loss is the global batch's mean, the same on every rank."""
        if phase:
            phase("forward")
        (batch,) = self.data.micro_batches(step)
        engine, lr = self.parallel.engine, self.scheduler.get_last_lr()[0]
        loss = engine.step(batch.inputs, batch.targets, **self._packed(batch))
        if phase:
            phase("optimizer")
        grad_norm = engine.optimizer_step(self.cfg.trainer.grad_clip)
        self.scheduler.step()
        return torch.tensor(loss, device=self.device), grad_norm, lr

    def _packed(self, batch) -> dict:
        """The batch's documents / per-token positions for the model (model.attention_mask, data.positions)."""
        return packed_inputs(
            batch.documents, getattr(self.cfg.model, "attention_mask", "causal"), self.cfg.data.positions
        )

    def evaluate(self) -> float:
        """Mean cross-entropy per token on ``data.val_batches`` global batches of the validation data
        (the same blocks every time), over all ranks."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = 0
        with torch.no_grad():
            for batch in self.data.val_micro_batches():
                inputs, targets = self.parallel.sequence_shard(batch.inputs, batch.targets)
                packed = self.parallel.packed_shard(self._packed(batch))
                with self.parallel.loss_parallel(), self.parallel.autocast():
                    mean = mean_cross_entropy(self.model, inputs, targets, self.loss_chunks, **packed)
                total += mean.double() * targets.numel()
                tokens += targets.numel()
        _, mean = reduce_over_ranks([total.item() / max(tokens, 1)], self.device)  # equal tokens per rank
        return mean[0]

    def _shard_digests(self) -> list[str]:
        """A hash of each rank's parameter shards, gathered to every rank (trainer.digest_shards). Ranks
        that hold the same shard (replicas in HSDP, DDP, no_shard) must show the same digest."""
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
