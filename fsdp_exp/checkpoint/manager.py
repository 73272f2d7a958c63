"""Save and resume one rank's share of a run: the ``Checkpointer``.

It is handed what it saves, as ``Stateful`` objects (``state_dict()`` / ``load_state_dict()``), in three
kinds (``fsdp_exp.checkpoint.layout`` says where each lands): ``sharded``, one object whose state dict
torch.distributed.checkpoint writes, every rank its shards (the model and optimizer:
``fsdp_exp.checkpoint.states``); ``replicated``, name -> object, identical on every rank and written once
by rank 0 (LR schedule, grad scaler, the data position under ``"data"``); ``per_rank``, name -> object,
each rank its own (its RNGs: ``fsdp_exp.checkpoint.rng``). Plus its folder, the rank and topology, the
run's config (recorded, hashed, compared on resume) and the checkpoint and debug groups (a save fault).
It knows nothing of the trainer and decides no stop (the loop's guard does, ``fsdp_exp.guard``); what it
saved goes to ``on_saved``. Every method with a collective is called by all ranks; what cannot be
converted on resume is refused with what differs. Why it is laid out so: design.md ("Checkpoints").
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fsdp_exp.checkpoint.layout import (
    FORMAT,
    TRAINER_STATE,
    CheckpointError,
    config_changes,
    config_hash,
    find_resume,
    folder_bytes,
    latest_checkpoint,
    per_rank_file,
    prune,
    publish,
    read_meta,
    remove_unfinished,
    step_dir,
    tmp_dir,
    write_meta,
)
from fsdp_exp.debug.faults import storage_writer


# What places the parameters on pipeline stages; checkpoints saved before parallel.pp existed had one stage.
STAGE_CUT_KEYS = ("parallel.pp", "parallel.pp_stages_per_rank", "parallel.pp_split", "parallel.pp_schedule")


def _stage_cut(config: dict) -> dict:
    """The pipeline cut of a plain config (the schedule only matters under pp > 1: it places the stages)."""
    parallel = config.get("parallel", {})
    cut = {
        "parallel.pp": parallel.get("pp", 1),
        "parallel.pp_stages_per_rank": parallel.get("pp_stages_per_rank", 1),
        "parallel.pp_split": parallel.get("pp_split"),
    }
    if cut["parallel.pp"] > 1:
        cut["parallel.pp_schedule"] = parallel.get("pp_schedule")
    return cut


class Checkpointer:
    def __init__(
        self,
        *,
        root: Path,
        info,
        topology,
        config: dict,
        sharded,
        replicated: dict,
        per_rank: dict,
        settings,
        faults,
        total_steps: int,
        on_saved: Optional[Callable[[dict], None]] = None,
    ):
        self.root, self.info, self.topology, self.config = Path(root), info, topology, config
        self.sharded, self.replicated, self.per_rank = sharded, replicated, per_rank
        self.cfg, self.faults, self.total_steps, self.on_saved = settings, faults, total_steps, on_saved
        self.start_step = 0
        # The W&B run that checkpoints name: the checkpoint's on resume (the run to continue), then the
        # one rank 0 opened (set by whoever opens W&B).
        self.wandb_run_id: Optional[str] = None
        self.resumed: Optional[dict] = None
        # Rows of metrics.jsonl to keep on (re)start: None = leave the file alone (checkpoint.resume=none),
        # 0 = start afresh (resume=auto found nothing), k = the rows through step k (resumed at k).
        self.metrics_keep_through: Optional[int] = None
        self.last_saved: Optional[dict] = None
        self._reported: Optional[dict] = None  # the last_saved handed to on_saved
        self._pending = None  # (future, step, tmp, final, meta, t0) of an async save in flight
        self._pending_thread: Optional[threading.Thread] = None
        self._async_error: Optional[tuple[int, BaseException]] = None
        self._async_group = None
        names = [None] * info.world_size
        dist.all_gather_object(names, f"{socket.gethostname()}:{self._device_name()}")
        self.devices = names
        if settings.async_save:
            # DCP's background thread runs collectives; on their own group they never interleave with
            # the training step's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")

    def _device_name(self) -> str:
        device = self.info.device
        return str(device) if device.type != "cuda" else f"cuda:{device.index}"

    def _layout(self) -> dict:
        """The layout this run shards over (compared with a checkpoint's on resume)."""
        return {
            "world_size": self.topology.world_size,
            "mesh_shape": list(self.topology.mesh_shape),
            "mesh_dim_names": list(self.topology.mesh_dim_names),
            "backend": self.config["sharding"]["backend"],
        }

    def _meta(self, step: int, reason: str) -> dict:
        from fsdp_exp import __version__

        data = self.replicated.get("data")
        return {
            "format": FORMAT,
            "step": step,
            "reason": reason,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **self._layout(),  # world_size, mesh_shape, mesh_dim_names, backend
            "strategy": self.config["sharding"]["strategy"],
            "checkpoint_format": self.sharded.backend.checkpoint_format,
            "tp": self.topology.tp_size,
            "devices": self.devices,  # rank r ran on devices[r] ("host:device")
            "config_hash": config_hash(self.config),
            "config": self.config,
            "data": data.state_dict() if data is not None else None,
            "wandb_run_id": self.wandb_run_id,
            "torch_version": torch.__version__,
            "fsdp_exp_version": __version__,
        }

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, reason: str) -> Path:
        """Write checkpoint ``step_<step>`` from every rank; returns its final folder (complete when this
        returns, unless ``checkpoint.async_save``: then complete once the background write commits)."""
        self.wait()  # one save in flight at a time
        t0 = time.perf_counter()
        final, tmp = step_dir(self.root, step), tmp_dir(self.root, step)
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_unfinished(self.root)  # left by a crash mid-save
        dist.barrier()
        for name, obj in self.per_rank.items():
            path = per_rank_file(tmp, name, self.info.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj.state_dict(), path)
        if self.info.is_main:
            replicated = {name: obj.state_dict() if obj is not None else None for name, obj in self.replicated.items()}
            torch.save({"step": step, **replicated}, tmp / TRAINER_STATE)
        writer = storage_writer(tmp, step, self.info.rank, self.faults)
        meta = self._meta(step, reason) if self.info.is_main else None
        backend = self.sharded.backend  # writes the shards in its format (DCP by default)
        saved = dict(writer=writer, step=step, rank=self.info.rank, debug=self.faults)
        if self.cfg.async_save:
            future = backend.save_checkpoint(
                self.sharded, tmp, **saved, process_group=self._async_group, async_save=True
            )
            self._pending = (future, step, tmp, final, meta, t0)
            # Commit in the background too: wait for every rank's write, then rank 0 renames.
            self._pending_thread = threading.Thread(target=self._commit_async, daemon=True)
            self._pending_thread.start()
            return final
        backend.save_checkpoint(self.sharded, tmp, **saved)
        self._commit(step, tmp, final, meta, t0, group=None)
        self._report_saved()
        return final

    def _commit_async(self) -> None:
        future, step, tmp, final, meta, t0 = self._pending
        try:
            future.result()  # DCP raises on every rank when any rank's write failed
            self._commit(step, tmp, final, meta, t0, group=self._async_group)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by wait()
            self._async_error = (step, err)

    def _commit(self, step: int, tmp: Path, final: Path, meta: Optional[dict], t0: float, group) -> None:
        dist.barrier(group=group)  # every rank's files (DCP shards, per-rank state) are written
        if self.info.is_main:
            meta["save_s"] = round(time.perf_counter() - t0, 4)
            meta["bytes"] = folder_bytes(tmp)
            write_meta(tmp, meta)
            publish(tmp, final)
            prune(self.root, self.cfg.keep)
            self.last_saved = {
                "path": str(final),
                "step": step,
                "reason": meta["reason"],
                "save_s": meta["save_s"],
                "bytes": meta["bytes"],
            }
        dist.barrier(group=group)  # nobody goes on (or exits) before the checkpoint is visible

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (None if none), once a save in flight has completed."""
        self.wait()
        return latest_checkpoint(self.root)

    def wait(self) -> None:
        """Block until an async save in flight is complete (visible)."""
        thread, self._pending_thread = self._pending_thread, None
        if thread is not None:
            thread.join()
            self._pending = None
        if self._async_error is not None:
            step, err = self._async_error
            self._async_error = None
            raise CheckpointError(
                f"the background save of step_{step} failed ({type(err).__name__}: {err}); "
                "the previous checkpoints are intact"
            ) from err
        self._report_saved()

    def _report_saved(self) -> None:
        """Hand a newly completed checkpoint to ``on_saved`` (rank 0, from the main thread)."""
        if self.info.is_main and self.last_saved and self.last_saved is not self._reported:
            self._reported = self.last_saved
            if self.on_saved is not None:
                self.on_saved({**self.last_saved, "dir": str(self.root)})

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> int:
        """Load the checkpoint ``checkpoint.resume`` names, if any; returns the step to start at."""
        box: list = [None]
        if self.info.is_main:
            try:
                path = find_resume(self.cfg.resume, self.root)
                box = [("path", str(path)) if path else None]
            except CheckpointError as err:
                box = [("error", str(err))]
        dist.broadcast_object_list(box, src=0)  # every rank loads what rank 0 found
        if box[0] is None:
            self.metrics_keep_through = None if self.cfg.resume == "none" else 0
            return 0
        kind, value = box[0]
        if kind == "error":
            raise CheckpointError(value)
        path = Path(value)
        meta = read_meta(path)
        self._check_convertible(path, meta)
        t0 = time.perf_counter()
        self._load(path, meta)
        step = int(meta["step"])
        layout_now = self._layout()
        layout_then = {k: meta.get(k) for k in layout_now}
        self.resumed = {
            "path": str(path),
            "step": step,
            "load_s": round(time.perf_counter() - t0, 4),
            "resharded": layout_now != layout_then,
            "saved_layout": layout_then,
            "layout": layout_now,
            "device_map_changed": meta.get("devices") != self.devices,
            "config_hash_matches": meta.get("config_hash") == config_hash(self.config),
            "config_changes": config_changes(meta.get("config", {}), self.config),
        }
        if self.info.is_main:

            def describe(d: dict) -> str:
                return f"{d['backend']} on {d['world_size']} ranks, mesh {d['mesh_shape']}"

            moved = (
                f" (resharded: {describe(layout_then)} -> {describe(layout_now)})" if self.resumed["resharded"] else ""
            )
            if self.resumed["device_map_changed"] and not moved:
                moved = " (same layout; some ranks now run on other hosts or devices)"
            print(f"fsdp_exp: resuming from {path} at step {step}{moved}", file=sys.stderr, flush=True)
        self.wandb_run_id = meta.get("wandb_run_id")
        self.metrics_keep_through = step
        self.start_step = step
        return step

    def _check_convertible(self, path: Path, meta: dict) -> None:
        """Refuse, with what differs, the checkpoints that cannot continue this run."""
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} has format {meta.get('format')!r}, this fsdp_exp reads {FORMAT!r}")
        saved_format = meta.get("checkpoint_format", "torch.distributed.checkpoint")
        backend = self.sharded.backend
        if saved_format != backend.checkpoint_format:
            raise CheckpointError(
                f"cannot resume from {path}: sharding.backend={meta.get('backend')} wrote its shards as "
                f"{saved_format}, and sharding.backend={backend.name} reads {backend.checkpoint_format}; no "
                f"conversion between the two is wired. Resume it with sharding.backend={meta.get('backend')}, "
                "or pass checkpoint.resume=none"
            )
        saved_model, model = meta["config"]["model"], self.config["model"]
        diff = {
            k: (saved_model.get(k), model.get(k))
            for k in set(saved_model) | set(model)
            if saved_model.get(k) != model.get(k)
        }
        if diff:
            listed = ", ".join(f"model.{k}: {a} in the checkpoint, {b} now" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(
                f"cannot resume from {path}: it holds another architecture ({listed}); no "
                "resharding converts that. Pass the checkpoint's model settings, or "
                "checkpoint.resume=none to start afresh"
            )
        saved_cut, cut = _stage_cut(meta["config"]), _stage_cut(self.config)
        if saved_cut != cut:
            raise CheckpointError(
                f"cannot resume from {path}: its model was cut into pipeline stages as {saved_cut}, "
                f"this run as {cut} ({', '.join(STAGE_CUT_KEYS)}); each rank saved its own stages' "
                "parameters, and no resharding across stage cuts is wired. Pass the checkpoint's "
                "parallel.pp* settings, or checkpoint.resume=none"
            )
        if self.replicated.get("data") is None:
            return
        saved_data, data = meta.get("data", {}), self.replicated["data"].state_dict()
        for key in ("fingerprint", "global_batch_size"):
            if saved_data.get(key) != data.get(key):
                raise CheckpointError(
                    f"cannot resume from {path}: its data position was saved with {key}={saved_data.get(key)!r}, "
                    f"this run has {data.get(key)!r}, so resuming would not continue the same sequence of batches. "
                    "Pass the checkpoint's data and trainer.global_batch_size, or checkpoint.resume=none"
                )

    def _load(self, path: Path, meta: dict) -> None:
        try:
            self.sharded.backend.load_checkpoint(self.sharded, path, meta, self.topology.world_size)
        except CheckpointError:
            raise  # the backend already said why
        except Exception as err:  # torch refuses this conversion: say from what to what
            now_layout = self._layout()
            saved = (
                f"sharding.backend={meta.get('backend')} on {meta.get('world_size')} ranks, mesh "
                f"{meta.get('mesh_shape')} {meta.get('mesh_dim_names')}"
            )
            now = (
                f"sharding.backend={now_layout['backend']} on {now_layout['world_size']} ranks, mesh "
                f"{now_layout['mesh_shape']} {now_layout['mesh_dim_names']}"
            )
            raise CheckpointError(
                f"cannot convert checkpoint {path} ({saved}) to this run ({now}): torch "
                f"refused with {type(err).__name__}: {err}. Resume it with the saved layout "
                f"(sharding.backend={meta.get('backend')} trainer.nproc_per_node="
                f"{meta.get('world_size')}), or pass checkpoint.resume=none"
            ) from err
        saved = torch.load(path / TRAINER_STATE, weights_only=True)
        for name, obj in self.replicated.items():
            if obj is not None and saved.get(name) is not None:
                obj.load_state_dict(saved[name])
        for name, obj in self.per_rank.items():
            own = per_rank_file(path, name, self.info.rank)
            if own.is_file():  # a rank the saving run did not have keeps its seeded state
                obj.load_state_dict(torch.load(own, weights_only=True))

    # ------------------------------------------------------------------------------- each step
    def saves_at(self, step: int) -> bool:
        """Whether step ``step`` (1-based count of completed steps) is one ``checkpoint.every`` saves
        (its multiples, and the last step)."""
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == self.total_steps)

    def save_if_due(self, step: int) -> None:
        """After step ``step`` is logged: the periodic save, or the final one at the last step."""
        if self.saves_at(step):
            self.save(step, "periodic" if step % self.cfg.every == 0 else "final")

    def finish(self) -> None:
        self.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
