"""How ranks come to be, and how a failing rank ends the job.

- Under torchrun (or any launcher that sets RANK/WORLD_SIZE) or a multi-task SLURM step, this process
  is one rank: it runs the worker itself.
- Otherwise this process is only the launcher. It never joins a process group (re-initializing one
  in the same process is flaky on gloo, and Hydra multiruns would need exactly that): it spawns
  ``trainer.nproc_per_node`` fresh workers on a free local port, hands them plain data, and waits.
  When one worker fails, ``torch.multiprocessing`` terminates the others at once; the launcher
  names the rank and its error, marks the run record failed and exits non-zero.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Optional

from fsdp_exp.config import RunConfig, Topology, plain, validate
from fsdp_exp.sinks import RunRecord

ERRORS_DIR = "errors"


class RunFailed(RuntimeError):
    """A rank failed. ``rank`` and ``summary`` say which and why; the record holds the details."""

    def __init__(self, rank: Optional[int], summary: str):
        super().__init__(f"rank {rank} failed: {summary}" if rank is not None else summary)
        self.rank, self.summary = rank, summary


def external_world() -> Optional[tuple[int, int]]:
    """(world size, ranks on this node) when an outside launcher made this process one rank, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return world, int(env.get("LOCAL_WORLD_SIZE", world))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        return world, int(per_node) if per_node.isdigit() else world // int(env.get("SLURM_NNODES", "1"))
    return None


def _export_slurm_env() -> None:
    """Map SLURM's task variables onto the ones torch.distributed reads."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    import submitit  # only needed on a cluster

    submitit.helpers.TorchDistributedEnvironment().export()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(cfg: RunConfig, world: Optional[tuple[int, int]] = None) -> Topology:
    """Validate before anything is spawned; raises ConfigError naming the fix."""
    if world is not None:
        # The outside launcher decided the ranks; the config's counts must not contradict it.
        cfg.trainer.nproc_per_node = str(world[1])
        cfg.trainer.nnodes = max(1, world[0] // world[1])
    return validate(cfg, cuda_devices=cuda_device_count(), world_size=world[0] if world else None)


def launch(cfg: RunConfig, run_dir: Path, meta: dict) -> dict:
    """Run one experiment to the end; return its run record. Raises RunFailed if a rank failed."""
    run_dir = Path(run_dir)
    world = external_world()
    topology = prepare(cfg, world)
    # Real data is tokenized and packed into its cache here, once, before any rank exists (under
    # torchrun every rank gets here: the first builds under a file lock, the others reuse it).
    from fsdp_exp.data import prepare_data

    data_info = prepare_data(cfg)
    payload = {"config": plain(cfg), "topology": topology.as_dict(), "run_dir": str(run_dir), "meta": meta}

    if world is not None:  # torchrun / SLURM: we are one rank of the job
        _export_slurm_env()
        from fsdp_exp.trainer import run_worker

        run_worker(payload)
        return RunRecord(run_dir).read()

    record = RunRecord(run_dir)
    record.update(status="starting", config=payload["config"], topology=payload["topology"],
                  overrides=meta.get("overrides", []), choices=meta.get("choices", {}))
    if data_info is not None:
        record.update(data=data_info)
    try:
        _spawn(payload, topology.nproc_per_node)
    except RunFailed as failure:
        record.update(status="failed", error={"rank": failure.rank, "message": failure.summary})
        raise
    return record.read()


def _spawn(payload: dict, nprocs: int) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    try:
        mp.start_processes(_spawned_rank, args=(nprocs, port, payload), nprocs=nprocs, join=True,
                           start_method="spawn")
    except mp.ProcessRaisedException as exc:
        rank = exc.error_index
        raise RunFailed(rank, _error_summary(Path(payload["run_dir"]), rank, str(exc))) from None
    except mp.ProcessExitedException as exc:
        how = f"killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        raise RunFailed(exc.error_index, f"the process {how}") from None


def _spawned_rank(local_rank: int, nprocs: int, port: int, payload: dict) -> None:
    """A worker process started by ``_spawn``: set the torch.distributed environment, then run."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    try:
        from fsdp_exp.trainer import run_worker

        run_worker(payload)
    except BaseException:
        # Keep the whole traceback in the run folder; the launcher prints only its last line.
        errors = Path(payload["run_dir"]) / ERRORS_DIR
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"rank{local_rank}.txt").write_text(traceback.format_exc())
        raise
    # The run is complete and every rank has left the process group. Leave without running
    # interpreter and C++ static teardown: on CPU/gloo a rank was seen, rarely (about 1 run in 20
    # under load), to abort there ("terminate called without an active exception", no Python frame),
    # which turned a finished run into a failed one.
    import multiprocessing.util

    multiprocessing.util._run_finalizers()  # what a normal exit runs first: releases semaphores (tqdm's lock)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _error_summary(run_dir: Path, rank: int, fallback: str) -> str:
    path = run_dir / ERRORS_DIR / f"rank{rank}.txt"
    text = path.read_text() if path.exists() else fallback
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "unknown error"
    return f"{last} (traceback: {path})" if path.exists() else last


def report_failure(failure: RunFailed) -> None:
    print(f"fsdp_exp: run failed: {failure}", file=sys.stderr)
