"""Sharded checkpoints, exact resume, and the faults around them (signals, NaN/inf loss).

Layout of one checkpoint, ``<checkpoint.dir>/step_<N>/`` (``checkpoint.dir`` defaults to
``<run dir>/checkpoints``)::

    .metadata, __<rank>_0.distcp     torch.distributed.checkpoint: model + optimizer, each rank its shards
    trainer_state.pt                 LR schedule, grad scaler, data position (rank 0; identical on every rank)
    rng/rank<r>.pt                   every RNG state of rank r (Python, NumPy, torch CPU, CUDA)
    fsdp_exp_checkpoint.json         step, world size, mesh, backend, config hash, W&B run id, per-rank devices

Atomicity: everything is written into ``step_<N>.tmp/``; when every rank has finished writing (DCP's
own commit, then a barrier), rank 0 renames the folder to ``step_<N>``. A folder named ``step_<N>``
(with its JSON) is therefore always complete; a crash mid-save leaves only a ``.tmp`` folder, which
resume ignores and the next save removes. Older checkpoints are deleted only after a newer one is
complete (``checkpoint.keep``).

Model and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict``, which speak canonical parameter names for FSDP2, FSDP1 and DDP alike; DCP stores
each tensor by its global shape and offsets, so a checkpoint loads at another world size, mesh or
backend (resharding). What cannot be converted (another architecture, other data, a layout torch
refuses) is refused with a message that says what differs.

Signals: ``install_signal_handlers`` makes SIGTERM / SIGUSR1 (``checkpoint.signals``) only set a
flag. Each step every rank all-reduces two numbers (the signal, "my loss is not finite") without
blocking and reads the result one step later, so all ranks agree at the same step to save and stop,
or to stop with an error on a NaN/inf loss; before any save the current step's flags are agreed at
once, so a non-finite state is never saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import threading
import warnings
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

META_FILE = "fsdp_exp_checkpoint.json"
TRAINER_STATE = "trainer_state.pt"
RNG_DIR = "rng"
STEP_PREFIX = "step_"
TMP_SUFFIX = ".tmp"
FORMAT = "fsdp_exp.checkpoint/1"
# Config groups that do not change what the model computes: left out of the config hash.
UNHASHED_GROUPS = ("logger", "checkpoint", "debug")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or cannot be converted to this run's layout; the message says why."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf: the run stops; the last good checkpoint stays on disk."""


# ------------------------------------------------------------------------------------- signals
_requested: dict[str, Optional[str]] = {"signal": None}


def _on_signal(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    if _requested["signal"] is None:
        _requested["signal"] = signal.Signals(signum).name


def install_signal_handlers(names: list[str]) -> None:
    """From now on these signals only ask the run to save and stop (main thread only)."""
    for name in names:
        signal.signal(getattr(signal, name), _on_signal)


def signal_requested() -> Optional[str]:
    return _requested["signal"]


# -------------------------------------------------------------------------------------- layout
def checkpoint_root(cfg, run_dir: Path) -> Path:
    d = cfg.checkpoint.dir
    return Path(d).expanduser() if d else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    found = []
    root = Path(root)
    if not root.is_dir():
        return found
    for path in root.iterdir():
        name = path.name
        if not name.startswith(STEP_PREFIX) or name.endswith(TMP_SUFFIX) or not path.is_dir():
            continue
        number = name[len(STEP_PREFIX):]
        if number.isdigit() and (path / META_FILE).is_file() and (path / ".metadata").is_file():
            found.append((int(number), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def resolve_resume(cfg, run_dir: Path) -> Optional[Path]:
    """The checkpoint folder this run continues from, or None to start at step 0."""
    value = cfg.checkpoint.resume
    if value == "none":
        return None
    if value == "auto":
        return latest_checkpoint(checkpoint_root(cfg, run_dir))
    path = Path(value).expanduser()
    if path.is_dir() and not path.name.startswith(STEP_PREFIX):  # a checkpoint dir: its newest
        newest = latest_checkpoint(path)
        if newest is None:
            raise CheckpointError(f"checkpoint.resume={value}: no complete checkpoint (step_<N>/{META_FILE}) in it; "
                                  "pass checkpoint.resume=auto or none")
        return newest
    if not (path / META_FILE).is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint.resume={value} is not a complete checkpoint (no {META_FILE} / .metadata: "
                              "an unfinished save leaves only a .tmp folder); pass a step_<N> folder, auto or none")
    return path


def config_hash(config: dict) -> str:
    kept = {k: v for k, v in config.items() if k not in UNHASHED_GROUPS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _flatten(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def config_changes(saved: dict, current: dict) -> dict[str, list]:
    """``key: [saved, now]`` for every config value that differs (groups outside the hash left out)."""
    a = _flatten({k: v for k, v in saved.items() if k not in UNHASHED_GROUPS})
    b = _flatten({k: v for k, v in current.items() if k not in UNHASHED_GROUPS})
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


# ------------------------------------------------------------------------------------- RNG state
def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.copy()), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Save, resume and the per-step fault checks of one rank. Built by the Trainer once the model,
    optimizer, schedule, scaler and data exist; every method with a collective is called by all ranks."""

    def __init__(self, trainer):
        self.t = trainer
        self.cfg = trainer.cfg.checkpoint
        self.debug = trainer.cfg.debug
        self.info = trainer.info
        self.device = trainer.device
        self.root = checkpoint_root(trainer.cfg, trainer.run_dir)
        self.start_step = 0
        self.wandb_run_id: Optional[str] = None
        self.resumed: Optional[dict] = None
        # Rows of metrics.jsonl to keep on (re)start: None = leave the file alone (checkpoint.resume=none),
        # 0 = start afresh (resume=auto found nothing), k = the rows through step k (resumed at k).
        self.metrics_keep_through: Optional[int] = None
        self.last_saved: Optional[dict] = None
        self._pending = None  # (future, step, tmp, final, meta, t0) of an async save in flight
        self._pending_thread: Optional[threading.Thread] = None
        self._async_error: Optional[tuple[int, BaseException]] = None
        self._async_group = None
        self.checks_per_step = self.cfg.on_signal or self.cfg.nan_check
        self._inflight = None  # (work, flags, step) of the per-step flag all-reduce in flight
        # The flags travel on a CPU group of their own: never queued behind (or between) the model's
        # collectives, and no device synchronization on CUDA.
        self._flag_group = dist.new_group(backend="gloo") if self.checks_per_step else None
        names = [None] * self.info.world_size
        dist.all_gather_object(names, f"{socket.gethostname()}:{self._device_name()}")
        self.devices = names
        if trainer.cfg.sharding.backend == "fsdp1":
            # FSDP1's sharded state dicts go through ShardedTensor, which warns on every tensor at save/load.
            warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor")
        if self.cfg.async_save:
            # DCP's background thread runs collectives; on their own group they never interleave with
            # the training step's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")

    def _device_name(self) -> str:
        return str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index}"

    # ----------------------------------------------------------------------------- state dicts
    def _model_optim(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.t.model, self.t.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _trainer_state(self, step: int) -> dict:
        return {
            "step": step,
            "scheduler": self.t.scheduler.state_dict(),
            "scaler": self.t.scaler.state_dict() if self.t.scaler is not None else None,
            "data": self.t.data.state_dict(),
        }

    def _meta(self, step: int, reason: str, wandb_run_id: Optional[str]) -> dict:
        from fsdp_exp import __version__
        from fsdp_exp.config import plain

        cfg, topo = self.t.cfg, self.t.topology
        config = plain(cfg)
        return {
            "format": FORMAT,
            "step": step,
            "reason": reason,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": topo.world_size,
            "mesh_shape": list(topo.mesh_shape),
            "mesh_dim_names": list(topo.mesh_dim_names),
            "backend": cfg.sharding.backend,
            "strategy": cfg.sharding.strategy,
            "tp": topo.tp_size,
            "devices": self.devices,  # rank r ran on devices[r] ("host:device")
            "config_hash": config_hash(config),
            "config": config,
            "data": self.t.data.state_dict(),
            "wandb_run_id": wandb_run_id,
            "torch_version": torch.__version__,
            "fsdp_exp_version": __version__,
        }

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, reason: str) -> Path:
        """Write checkpoint ``step_<step>`` from every rank; returns its final folder (complete when this
        returns, unless ``checkpoint.async_save``: then complete once the background write commits)."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight at a time
        t0 = time.perf_counter()
        final, tmp = step_dir(self.root, step), Path(f"{step_dir(self.root, step)}{TMP_SUFFIX}")
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        (tmp / RNG_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(self.device), tmp / RNG_DIR / f"rank{self.info.rank}.pt")
        if self.info.is_main:
            torch.save(self._trainer_state(step), tmp / TRAINER_STATE)
        state = self._model_optim()
        writer = self._writer(tmp, step)
        wandb_id = getattr(getattr(self.t, "wandb", None), "run_id", None) if self.info.is_main else None
        meta = self._meta(step, reason, wandb_id) if self.info.is_main else None
        if self.cfg.async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._async_group)
            self._pending = (future, step, tmp, final, meta, t0)
            # Commit in the background too: wait for every rank's write, then rank 0 renames.
            self._pending_thread = threading.Thread(target=self._commit_async, daemon=True)
            self._pending_thread.start()
            return final
        dcp.save(state, storage_writer=writer)
        self._commit(step, tmp, final, meta, t0, group=None)
        self._record_saved()
        return final

    def _writer(self, tmp: Path, step: int):
        from torch.distributed.checkpoint import FileSystemWriter

        d = self.debug
        if d.fail_during == "save" and d.fail_at_step == step and self.info.rank == d.fail_rank:
            return _FailingWriter(tmp, d.fail_signal)
        return FileSystemWriter(tmp)

    def _commit_async(self) -> None:
        future, step, tmp, final, meta, t0 = self._pending
        try:
            future.result()  # DCP raises on every rank when any rank's write failed
            self._commit(step, tmp, final, meta, t0, group=self._async_group)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by wait()
            self._async_error = (step, err)

    def _commit(self, step: int, tmp: Path, final: Path, meta: Optional[dict], t0: float, group) -> None:
        dist.barrier(group=group)  # every rank's files (DCP shards, RNG) are written
        if self.info.is_main:
            meta["save_s"] = round(time.perf_counter() - t0, 4)
            meta["bytes"] = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            _write_json(tmp / META_FILE, meta)
            _fsync_tree(tmp)
            if final.exists():  # the same step saved before (a rerun from an older checkpoint)
                old = Path(f"{final}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_path(final.parent)
            self._prune()
            self.last_saved = {"path": str(final), "step": step, "reason": meta["reason"],
                               "save_s": meta["save_s"], "bytes": meta["bytes"]}
        dist.barrier(group=group)  # nobody goes on (or exits) before the checkpoint is visible

    def _prune(self) -> None:
        if self.cfg.keep < 1:
            return
        for _, path in complete_checkpoints(self.root)[:-self.cfg.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Block until an async save in flight is complete (visible)."""
        thread, self._pending_thread = self._pending_thread, None
        if thread is not None:
            thread.join()
            self._pending = None
        if self._async_error is not None:
            step, err = self._async_error
            self._async_error = None
            raise CheckpointError(f"the background save of step_{step} failed ({type(err).__name__}: {err}); "
                                  "the previous checkpoints are intact") from err
        self._record_saved()

    def _record_saved(self) -> None:
        if self.info.is_main and self.last_saved and getattr(self.t, "record", None) is not None:
            self.t.record.update(checkpoint={**self.last_saved, "dir": str(self.root)})

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> int:
        """Load the checkpoint ``checkpoint.resume`` names, if any; returns the step to start at."""
        from fsdp_exp.config import plain

        mode = self.cfg.resume
        box: list = [None]
        if self.info.is_main:
            try:
                path = resolve_resume(self.t.cfg, self.t.run_dir)
                box = [("path", str(path)) if path else None]
            except CheckpointError as err:
                box = [("error", str(err))]
        dist.broadcast_object_list(box, src=0)  # every rank loads what rank 0 found
        if box[0] is None:
            self.metrics_keep_through = None if mode == "none" else 0
            return 0
        kind, value = box[0]
        if kind == "error":
            raise CheckpointError(value)
        path = Path(value)
        meta = read_meta(path)
        current = plain(self.t.cfg)
        self._check_convertible(path, meta, current)
        t0 = time.perf_counter()
        self._load(path, meta)
        step = int(meta["step"])
        layout_now = {"world_size": self.t.topology.world_size, "mesh_shape": list(self.t.topology.mesh_shape),
                      "mesh_dim_names": list(self.t.topology.mesh_dim_names), "backend": self.t.cfg.sharding.backend}
        layout_then = {k: meta.get(k) for k in layout_now}
        self.resumed = {
            "path": str(path),
            "step": step,
            "load_s": round(time.perf_counter() - t0, 4),
            "resharded": layout_now != layout_then,
            "saved_layout": layout_then,
            "layout": layout_now,
            "device_map_changed": meta.get("devices") != self.devices,
            "config_hash_matches": meta.get("config_hash") == config_hash(current),
            "config_changes": config_changes(meta.get("config", {}), current),
        }
        if self.info.is_main:  # what the interrupted attempt left in run.json
            from fsdp_exp.sinks import RunRecord

            before = RunRecord(self.t.run_dir).read()
            previous = {k: before[k] for k in ("error", "interrupted") if before.get(k)}
            if previous:
                self.resumed["previous_attempt"] = previous
            def layout(d: dict) -> str:
                return f"{d['backend']} on {d['world_size']} ranks, mesh {d['mesh_shape']}"

            moved = f" (resharded: {layout(layout_then)} -> {layout(layout_now)})" if self.resumed["resharded"] else ""
            if self.resumed["device_map_changed"] and not moved:
                moved = " (same layout; some ranks now run on other hosts or devices)"
            print(f"fsdp_exp: resuming from {path} at step {step}{moved}", file=sys.stderr, flush=True)
        self.wandb_run_id = meta.get("wandb_run_id")
        self.metrics_keep_through = step
        self.start_step = step
        return step

    def _check_convertible(self, path: Path, meta: dict, current: dict) -> None:
        """Refuse, with what differs, the checkpoints that cannot continue this run."""
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} has format {meta.get('format')!r}, this fsdp_exp reads {FORMAT!r}")
        saved_model, model = meta["config"]["model"], current["model"]
        diff = {k: (saved_model.get(k), model.get(k)) for k in set(saved_model) | set(model)
                if saved_model.get(k) != model.get(k)}
        if diff:
            listed = ", ".join(f"model.{k}: {a} in the checkpoint, {b} now" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(f"cannot resume from {path}: it holds another architecture ({listed}); no "
                                  "resharding converts that. Pass the checkpoint's model settings, or "
                                  "checkpoint.resume=none to start afresh")
        saved_data, data = meta.get("data", {}), self.t.data.state_dict()
        for key in ("fingerprint", "global_batch_size"):
            if saved_data.get(key) != data.get(key):
                raise CheckpointError(
                    f"cannot resume from {path}: its data position was saved with {key}={saved_data.get(key)!r}, "
                    f"this run has {data.get(key)!r}, so resuming would not continue the same sequence of batches. "
                    "Pass the checkpoint's data and trainer.global_batch_size, or checkpoint.resume=none")

    def _load(self, path: Path, meta: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._model_optim()
        try:
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(self.t.model, self.t.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except Exception as err:  # torch refuses this conversion: say from what to what
            saved = (f"sharding.backend={meta.get('backend')} on {meta.get('world_size')} ranks, mesh "
                     f"{meta.get('mesh_shape')} {meta.get('mesh_dim_names')}")
            now = (f"sharding.backend={self.t.cfg.sharding.backend} on {self.t.topology.world_size} ranks, mesh "
                   f"{list(self.t.topology.mesh_shape)} {list(self.t.topology.mesh_dim_names)}")
            raise CheckpointError(f"cannot convert checkpoint {path} ({saved}) to this run ({now}): torch "
                                  f"refused with {type(err).__name__}: {err}. Resume it with the saved layout "
                                  f"(sharding.backend={meta.get('backend')} trainer.nproc_per_node="
                                  f"{meta.get('world_size')}), or pass checkpoint.resume=none") from err
        trainer_state = torch.load(path / TRAINER_STATE, weights_only=True)
        self.t.scheduler.load_state_dict(trainer_state["scheduler"])
        if self.t.scaler is not None and trainer_state.get("scaler") is not None:
            self.t.scaler.load_state_dict(trainer_state["scaler"])
        self.t.data.load_state_dict(trainer_state["data"])
        rng = path / RNG_DIR / f"rank{self.info.rank}.pt"
        if rng.is_file():  # a rank the saving run did not have keeps its seeded state
            set_rng_state(torch.load(rng, weights_only=True), self.device)

    # ------------------------------------------------------------------------------- each step
    def poll(self, step: int, loss: torch.Tensor) -> tuple[Optional[str], Optional[int], Optional[int]]:
        """What all ranks agree on after step ``step``: (the signal that asks to stop, the highest rank whose
        loss was NaN/inf, the step it was). Each step's two flags are all-reduced without blocking, on a
        group of their own, and read one step later, so the collective hides behind the next step's
        compute; at a step that saves, and at the last, the current flags are agreed at once, so a
        NaN/inf state is never saved. Nothing at all when checkpoint.on_signal and nan_check are off."""
        if not self.checks_per_step:
            return None, None, None
        requested = signal_requested() if self.cfg.on_signal else None
        finite = not self.cfg.nan_check or bool(torch.isfinite(loss).all())
        flags = torch.tensor([float(getattr(signal, requested)) if requested else 0.0,
                              0.0 if finite else self.info.rank + 1.0], dtype=torch.float64)
        agreed: list[tuple[torch.Tensor, int]] = []
        if self._inflight is not None:
            work, buffer, at = self._inflight
            self._inflight = None
            work.wait()
            agreed.append((buffer, at))
        if self._saves_at(step) or step == self.t.cfg.trainer.steps:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._flag_group)
            agreed.append((flags, step))
        else:
            self._inflight = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._flag_group, async_op=True),
                              flags, step)
        stop = bad_rank = bad_step = None
        for buffer, at in agreed:
            signum, bad = buffer.tolist()
            if signum and stop is None:
                stop = signal.Signals(int(signum)).name
            if bad and bad_step is None:
                bad_rank, bad_step = int(bad) - 1, at
        return stop, bad_rank, bad_step

    def _saves_at(self, step: int) -> bool:
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == self.t.cfg.trainer.steps)

    def after_step(self, step: int, flags: tuple[Optional[str], Optional[int], Optional[int]]) -> Optional[str]:
        """After step ``step`` (1-based count of completed steps) is logged: raise on a NaN/inf loss, save
        periodically, and on a signal save and return its name (the caller stops)."""
        stop, bad_rank, bad_step = flags
        if bad_rank is not None:
            self.wait()  # an earlier save in flight is good: let it complete
            last = latest_checkpoint(self.root)
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
            raise NonFiniteLoss(f"train/loss is not finite (NaN or inf) at step {bad_step} (seen on rank {bad_rank}); "
                                f"stopping without saving this state: {where}. Lower optim.lr, raise "
                                "trainer.grad_clip or change precision, then resume from that checkpoint")
        total = self.t.cfg.trainer.steps
        if stop and step < total:
            self.save(step, f"signal:{stop}")
            self.wait()
            return stop
        if self._saves_at(step):
            self.save(step, "periodic" if step % self.cfg.every == 0 else "final")
        return None

    def finish(self) -> None:
        if self._inflight is not None:  # every rank started it: it completes
            self._inflight[0].wait()
            self._inflight = None
        self.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None


class _FailingWriter:
    """debug.fail_during=save: a FileSystemWriter that writes this rank's shards, then fails (raises, or
    sends the rank debug.fail_signal) before the checkpoint is complete."""

    def __new__(cls, path: Path, fail_signal: Optional[str]):
        from torch.distributed.checkpoint import FileSystemWriter

        class Failing(FileSystemWriter):
            def write_data(self, plan, planner):
                future = super().write_data(plan, planner)
                future.wait()
                if fail_signal:
                    os.kill(os.getpid(), getattr(signal, fail_signal))
                    time.sleep(60)  # a catchable signal still ends the rank here
                raise RuntimeError(f"debug.fail_during=save: injected failure while saving {path}")

        return Failing(path)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            _fsync_path(f)


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list, after a rename); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


# ----------------------------------------------------------------------- identical initialization
def init_digests(model, seed: int, backend: str) -> list[dict]:
    """This rank's view of its initial parameters: per tensor, the hash of the local shard, which slice of
    the full tensor it is (``[start, end)`` of the flattened tensor, or DTensor shape and offset), and the
    hash that the seeded initialization (a function of seed and name only) says that slice must have."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from fsdp_exp.models import canonical_name, full_param_init

    if backend == "fsdp1":
        return _fsdp1_digests(model, seed)
    root = getattr(model, "module", model)  # DDP wraps the model
    rows = []
    for name, param in root.named_parameters():
        name = canonical_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        full = full_param_init(root, name, param.shape, seed, local.device)
        if isinstance(param, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            where = f"shape {list(shape)} at {list(offset)}"
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        else:
            where = "whole"
        rows.append({"name": name, "slice": where, "hash": _hash(local), "expected": _hash(full.to(local.dtype))})
    return rows


def _fsdp1_digests(model, seed: int) -> list[dict]:
    """FSDP1 keeps each unit's parameters in one flat parameter; this rank holds a contiguous piece of
    it, i.e. a ``[start, end]`` range of some of the flattened original tensors."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_exp.models import canonical_name, full_param_init

    root = model.module
    rows = []
    for prefix, unit in model.named_modules():
        if not isinstance(unit, FSDP) or unit._handle is None:
            continue
        flat = unit._handle.flat_param
        base = canonical_name(prefix)
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            if not info.in_shard:
                continue
            name = canonical_name(f"{base}.{fqn}" if base else fqn)
            local = flat.data[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
            start, end = info.intra_param_start_idx, info.intra_param_end_idx
            full = full_param_init(root, name, shape, seed, local.device).flatten()[start:end + 1]
            rows.append({"name": name, "slice": f"flat [{start}, {end}]", "hash": _hash(local),
                         "expected": _hash(full.to(local.dtype))})
    return rows


def _hash(t: torch.Tensor) -> str:
    data = t.detach().float().cpu().contiguous()
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16] if data.numel() else "empty"


def compare_init_digests(per_rank: list[list[dict]]) -> list[str]:
    """What differs in every rank's ``init_digests``: ranks holding the same slice of a tensor with
    different values (replicas), and shards that are not the slice of the seeded initialization."""
    problems = []
    groups: dict[tuple, dict[int, str]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            groups.setdefault((row["name"], row["slice"]), {})[rank] = row["hash"]
    for (name, where), hashes in sorted(groups.items()):
        if len(set(hashes.values())) > 1:
            by_hash: dict[str, list[int]] = {}
            for rank, h in sorted(hashes.items()):
                by_hash.setdefault(h, []).append(rank)
            split = " vs ".join(f"ranks {ranks}" for ranks in by_hash.values())
            problems.append(f"{name} ({where}): replicas differ between {split}")
    for rank, rows in enumerate(per_rank):
        for row in rows:
            if row["hash"] != row["expected"]:
                problems.append(f"rank {rank}: {row['name']} ({row['slice']}) is not the seeded initial value")
    return problems


def check_identical_init(model, cfg, info) -> dict:
    """debug.check_identical_init: gather every rank's digests; raise naming ranks and tensors on a mismatch."""
    rows = init_digests(model, cfg.trainer.seed, cfg.sharding.backend)
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, rows)
    problems = compare_init_digests(gathered)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise RuntimeError(f"debug.check_identical_init: the ranks did not build identical initial parameters:\n  {shown}")
    return {"result": "identical", "ranks": info.world_size, "shards_checked": sum(len(r) for r in gathered),
            "distinct_slices": len({(r["name"], r["slice"]) for rows in gathered for r in rows})}
