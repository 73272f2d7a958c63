"""How ranks come to be, and how a failing rank ends the job.

- Under torchrun (or any launcher that sets RANK/WORLD_SIZE) or a multi-task SLURM step, this process
  is one rank: it runs the worker itself.
- Otherwise this process is only the launcher. It never joins a process group (re-initializing one
  in the same process is flaky on gloo, and Hydra multiruns would need exactly that): it spawns
  ``trainer.nproc_per_node`` fresh workers on a free local port, hands them plain data, and waits.
  When one worker fails (raises, or dies by a signal such as SIGKILL), the launcher gives the others
  a few seconds to end on their own, then kills them; it names the rank and its error, marks the run
  record failed and exits non-zero. SIGTERM / SIGUSR1 sent to the launcher (a scheduler's preemption or
  pre-timeout signal) are forwarded to every worker, which save a checkpoint and exit cleanly
  (fsdp_exp/checkpoint.py). Workers die with the launcher (PR_SET_PDEATHSIG): no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from fsdp_exp.config import RunConfig, Topology, plain, validate
from fsdp_exp.sinks import RunRecord

ERRORS_DIR = "errors"
# After a rank fails, how long the others get to end on their own (they usually fail at once on the
# dead peer's closed connections) before they are killed.
FAILURE_GRACE_S = 5.0


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
    if "sweep" in meta:
        record.update(sweep=meta["sweep"])
    if data_info is not None:
        record.update(data=data_info)
    forward = list(cfg.checkpoint.signals) if cfg.checkpoint.on_signal else ["SIGTERM"]
    try:
        _spawn(payload, topology.nproc_per_node, forward)
    except RunFailed as failure:
        record_failure(run_dir, cfg, meta, failure.rank, failure.summary)
        raise
    result = record.read()
    if result.get("status") == "interrupted":
        stop = result.get("interrupted") or {}
        saved = stop.get("checkpoint") or {}
        print(f"fsdp_exp: stopped by {stop.get('signal')} after step {saved.get('step')}; every rank saved "
              f"{saved.get('path')}. Run again with hydra.run.dir={run_dir} (checkpoint.resume=auto) to continue.",
              file=sys.stderr)
    return result


def record_failure(run_dir: Path, cfg, meta: dict, rank: Optional[int], message: str) -> dict:
    """Record a run that failed (before its ranks started, or because one of them failed): run.json gets
    status "failed" and the error; W&B (unless disabled) gets the same, in the run rank 0 opened if
    there is one. ``cfg``: the RunConfig, or the composed config when it could not be typed."""
    record = RunRecord(run_dir)
    previous = record.read()
    fields = {"status": "failed", "error": {"rank": rank, "message": message},
              "overrides": meta.get("overrides", []), "choices": meta.get("choices", {})}
    if "sweep" in meta:
        fields["sweep"] = meta["sweep"]
    if "config" not in previous:
        try:
            fields["config"] = plain(cfg)
        except Exception:  # noqa: BLE001 - an unresolvable config still deserves its failure record
            pass
    result = record.update(**fields)
    wandb_cfg = cfg.logger.wandb
    if wandb_cfg.mode != "disabled":
        from fsdp_exp.sinks import note_failure_in_wandb

        run_id = (previous.get("wandb") or {}).get("run_id")
        try:
            run_id = note_failure_in_wandb(wandb_cfg, run_dir, fields.get("config") or previous.get("config", {}),
                                           meta.get("overrides", []), meta.get("choices", {}), run_id,
                                           fields["error"])
        except Exception as exc:  # noqa: BLE001 - W&B trouble must not hide the run's own error
            print(f"fsdp_exp: could not record the failure in W&B: {exc}", file=sys.stderr)
        else:
            result = record.update(wandb={**(previous.get("wandb") or {}), "mode": wandb_cfg.mode, "run_id": run_id})
    return result


def _spawn(payload: dict, nprocs: int, forward: list[str] = ("SIGTERM",)) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(_spawned_rank, args=(nprocs, port, payload), nprocs=nprocs, join=False,
                             start_method="spawn")
    previous = _forward_signals(ctx.processes, forward)
    try:
        failed = _wait_for_ranks(ctx.processes, Path(payload["run_dir"]))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for path in ctx.error_files:  # torch's per-worker error pickles (we read errors/rank<N>.txt)
            try:
                os.unlink(path)
            except OSError:
                pass
    if failed is not None:
        raise _failure(Path(payload["run_dir"]), failed, ctx.processes[failed].exitcode)


def _forward_signals(processes, names) -> dict:
    """Pass these signals on to every live worker; returns the handlers to restore."""

    def forward(signum, frame):  # noqa: ARG001
        for process in processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    previous = {}
    for name in names:
        try:
            previous[getattr(signal, name)] = signal.signal(getattr(signal, name), forward)
        except ValueError:  # not the main thread: leave signals alone
            break
    return previous


def _wait_for_ranks(processes, run_dir: Path) -> Optional[int]:
    """Wait until every worker has exited; on the first failure, end the others. Returns the failed rank."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    while pending:
        failed = False
        for sentinel in wait(list(pending)):
            rank = pending.pop(sentinel)
            processes[rank].join()
            failed = failed or processes[rank].exitcode != 0
        if failed:
            killed = _end_all(processes)
            # Of the ranks that failed by themselves, name the cause: an error of its own, or a death by
            # a signal, before a rank that failed only on a dead peer's closed connections.
            failed_ranks = [r for r, p in enumerate(processes) if p.exitcode != 0 and r not in killed]
            return min(failed_ranks, key=lambda r: (_is_peer_error(run_dir, r), processes[r].exitcode >= 0, r))
    return None


PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
               "DistNetworkError", "NCCL communicator was aborted")


def _is_peer_error(run_dir: Path, rank: int) -> bool:
    """Did this rank fail only because a peer went away (its traceback says so)?"""
    path = run_dir / ERRORS_DIR / f"rank{rank}.txt"
    try:
        text = path.read_text()
    except OSError:
        return False
    return any(marker in text for marker in PEER_ERRORS)


def _end_all(processes) -> set[int]:
    """Give the other ranks FAILURE_GRACE_S to end by themselves, then kill them; returns those killed."""
    deadline = time.monotonic() + FAILURE_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    killed = set()
    for rank, process in enumerate(processes):
        if process.is_alive():
            process.kill()  # SIGKILL: a worker's SIGTERM handler would only ask it to save
            killed.add(rank)
    for process in processes:
        process.join()
    return killed


def _failure(run_dir: Path, rank: int, exitcode: int) -> RunFailed:
    if (run_dir / ERRORS_DIR / f"rank{rank}.txt").exists():  # it raised: its own words
        return RunFailed(rank, _error_summary(run_dir, rank, ""))
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return RunFailed(rank, f"the process was killed by {name}")
    return RunFailed(rank, f"the process exited with code {exitcode}")


def _die_with_launcher() -> None:
    """Linux: this worker gets SIGKILL when the launcher dies, however it dies (no orphaned ranks)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _spawned_rank(local_rank: int, nprocs: int, port: int, payload: dict) -> None:
    """A worker process started by ``_spawn``: set the torch.distributed environment, then run."""
    _die_with_launcher()
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
        # Leave at once, as below: interpreter teardown with collectives still queued (a non-blocking
        # all-reduce in flight, gloo's threads) can abort ("terminate called without an active
        # exception"), which would turn this rank's error into a SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # The run is complete and every rank has left the process group. Leave without running
    # interpreter and C++ static teardown: on CPU/gloo a rank was seen, rarely (about 1 run in 20
    # under load), to abort there ("terminate called without an active exception", no Python frame),
    # which turned a finished run into a failed one.
    import multiprocessing.util

    multiprocessing.util._run_finalizers()  # what a normal exit runs first: releases semaphores (tqdm's lock)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _error_summary(run_dir: Path, rank: int, fallback: str, max_lines: int = 12) -> str:
    """The exception of a rank's traceback: its 'Type: message' line, and the message's further lines."""
    path = run_dir / ERRORS_DIR / f"rank{rank}.txt"
    text = path.read_text() if path.exists() else fallback
    lines = [line for line in text.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1:] if frames else lines[-1:]
    start = next((i for i, line in enumerate(after) if not line[:1].isspace()), len(after) - 1)
    message = after[start:start + max_lines] if after else ["unknown error"]
    last = "\n".join(line.rstrip() for line in message)
    return f"{last} (traceback: {path})" if path.exists() else last


def report_failure(failure: RunFailed) -> None:
    print(f"fsdp_exp: run failed: {failure}", file=sys.stderr)
