"""Where checkpoints live and what makes one complete; no torch, no process group.

A checkpoint is ``<root>/step_<N>/`` (``root`` is ``checkpoint.dir``, by default ``<run dir>/checkpoints``)::

    .metadata, __<rank>_0.distcp     torch.distributed.checkpoint: the sharded state (model, optimizer)
                                     (sharding.backend=deepspeed: zero/, DeepSpeed's save_checkpoint)
    trainer_state.pt                 the replicated state: LR schedule, grad scaler, data position (rank 0)
    rng/rank<r>.pt                   the per-rank state: every RNG of rank r
    fsdp_exp_checkpoint.json         step, world size, mesh, backend, config hash, W&B run id, per-rank devices

Everything is written into ``step_<N>.tmp/`` and renamed to ``step_<N>`` (``publish``) once every rank has
finished, so a ``step_<N>`` folder is always complete; a crash mid-save leaves a ``.tmp`` folder only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

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


def checkpoint_root(directory: Optional[str], run_dir: Path) -> Path:
    """``checkpoint.dir``, or ``<run dir>/checkpoints`` when it is unset."""
    return Path(directory).expanduser() if directory else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(f"{step_dir(root, step)}{TMP_SUFFIX}")


def per_rank_file(folder: Path, name: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its own state ``name`` (e.g. ``rng/rank1.pt``)."""
    return Path(folder) / name / f"rank{rank}.pt"


def is_complete(path: Path) -> bool:
    """Its JSON is written last, once every rank finished; a torch.distributed.checkpoint one also has
    DCP's ``.metadata`` (a backend with its own format, DeepSpeed, writes its own files instead)."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return False
    dcp = (Path(path) / ".metadata").is_file()
    if dcp:
        return True
    try:
        return (
            json.loads(meta.read_text()).get("checkpoint_format", "torch.distributed.checkpoint")
            != "torch.distributed.checkpoint"
        )
    except (OSError, ValueError):
        return False


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
        number = name[len(STEP_PREFIX) :]
        if number.isdigit() and is_complete(path):
            found.append((int(number), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def find_resume(value: str, root: Path) -> Optional[Path]:
    """The checkpoint folder that ``checkpoint.resume=value`` names, or None to start at step 0."""
    if value == "none":
        return None
    if value == "auto":
        return latest_checkpoint(root)
    refused = resume_refusal(value)
    if refused is not None:
        raise CheckpointError("; ".join(refused))
    path = Path(value).expanduser()
    return latest_checkpoint(path) if _is_checkpoints_folder(path) else path


def resume_refusal(value: str) -> Optional[tuple[str, str]]:
    """Why ``checkpoint.resume=value`` (a path) names no checkpoint to continue from, as (problem, fix), or
    None when it names one: a step_<N> folder that is complete, or a folder of them holding a complete one."""
    path = Path(value).expanduser()
    if not path.exists():
        return (
            f"checkpoint.resume={value}: no such folder",
            "pass the step_<N> folder of a saved run (or the checkpoints folder that holds it), auto or none",
        )
    if _is_checkpoints_folder(path):  # a checkpoint dir: its newest
        if latest_checkpoint(path) is None:
            return (
                f"checkpoint.resume={value}: no complete checkpoint (step_<N>/{META_FILE}) in it",
                "pass checkpoint.resume=auto or none",
            )
        return None
    if not is_complete(path):
        return (
            f"checkpoint.resume={value} is not a complete checkpoint (no {META_FILE} / .metadata: "
            "an unfinished save leaves only a .tmp folder)",
            "pass a step_<N> folder, auto or none",
        )
    return None


def _is_checkpoints_folder(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith(STEP_PREFIX)


def resolve_resume(cfg, run_dir: Path) -> Optional[Path]:
    """The checkpoint folder a run of ``cfg`` in ``run_dir`` continues from, or None to start at step 0."""
    return find_resume(cfg.checkpoint.resume, checkpoint_root(cfg.checkpoint.dir, run_dir))


# ------------------------------------------------------------------------------- the meta file
def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def write_meta(folder: Path, meta: dict) -> None:
    with open(Path(folder) / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=2, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


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


# ------------------------------------------------------------------------ folders on the disk
def remove_unfinished(root: Path) -> None:
    """Drop the ``.tmp`` folders a crash mid-save left behind."""
    for stale in Path(root).glob(f"{STEP_PREFIX}*{TMP_SUFFIX}"):
        shutil.rmtree(stale, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written ``step_<N>.tmp`` the checkpoint ``step_<N>``: fsync its files, rename it
    (replacing a ``step_<N>`` saved before, e.g. by a rerun from an older checkpoint), fsync the root."""
    _fsync_tree(tmp)
    if final.exists():
        old = Path(f"{final}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_path(final.parent)


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (0: all); called only after a newer one is complete."""
    if keep < 1:
        return
    for _, path in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


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
