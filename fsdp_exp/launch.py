"""How ranks come to be, and how a failing rank ends the job.

- Under torchrun (or any launcher that sets RANK/WORLD_SIZE) or a multi-task SLURM step, this process
  is one rank: it runs the worker itself.
- Otherwise this process is only the launcher. It never joins a process group (re-initializing one
  in the same process is flaky on gloo, and Hydra multiruns would need exactly that): it starts
  ``trainer.nproc_per_node`` workers on a free local port (forked from it where that is safe, which
  saves each one torch's import; else spawned), hands them the run context, and waits.
  When one worker fails (raises, or dies by a signal such as SIGKILL), the launcher gives the others
  a few seconds to end on their own, then kills them; it names the rank and its error, marks the run
  record failed and exits non-zero. SIGTERM / SIGUSR1 sent to the launcher (a scheduler's preemption or
  pre-timeout signal) are forwarded to every worker, which save a checkpoint and exit cleanly
  (fsdp_exp/checkpoint/). Workers die with the launcher (PR_SET_PDEATHSIG): no orphans.

Either way the launcher's work (validate, plan, the labels) reaches the worker as one ``RunContext``
(fsdp_exp/context.py), and run.json gets the run's config, topology, labels and plan once, from here.
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

from fsdp_exp.checkpoint.checks import check_resume_path
from fsdp_exp.config import RunConfig, Topology, fail, plain
from fsdp_exp.context import Labels, Prediction, RunContext
from fsdp_exp.preflight import validate
from fsdp_exp.env import (
    cuda_device_count,
    die_with_parent,
    export_slurm_rendezvous,
    external_world,
    local_rank,
    rank_env,
    slurm_job,
)
from fsdp_exp.errors import RunFailed  # noqa: F401 - raised here, caught by __main__ and slurm
from fsdp_exp.record import RunRecord, wandb_process

ERRORS_DIR = "errors"
# After a rank fails, how long the others get to end on their own (they usually fail at once on the
# dead peer's closed connections) before they are killed.
FAILURE_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(cfg: RunConfig, world: Optional[tuple[int, int]] = None) -> Topology:
    """Validate before anything is spawned, and check that the run fits this node's memory
    (fsdp_exp/fit_check.py; ``trainer.check_fit``); raises ConfigError naming the fix."""
    from fsdp_exp.models import fetch_model_files

    fetch_model_files(cfg.model)  # a hub name's config.json into the hub cache: preflight reads local files only
    if world is not None:
        # The outside launcher decided the ranks; the config's counts must not contradict it.
        nodes = max(1, world[0] // world[1])
        given = cfg.trainer.nproc_per_node
        if given != "auto" and str(given) != str(world[1]):
            fail(
                f"trainer.nproc_per_node={given}, but the launcher (torchrun / SLURM) started {world[1]} ranks "
                f"per node.",
                f"drop trainer.nproc_per_node (or pass {world[1]}), or start {given} ranks per node",
            )
        if cfg.trainer.nnodes not in (1, nodes):
            fail(
                f"trainer.nnodes={cfg.trainer.nnodes}, but the launcher started {nodes} node(s) of ranks.",
                f"drop trainer.nnodes (or pass {nodes}), or start the job on {cfg.trainer.nnodes} nodes",
            )
        cfg.trainer.nproc_per_node = str(world[1])
        cfg.trainer.nnodes = nodes
    topology = validate(cfg, cuda_devices=cuda_device_count(), world_size=world[0] if world else None)
    # Then ask the planner whether it fits this node (above validate: the planner validates its variants).
    # Under torchrun / SLURM every rank asks, before the process group starts, for its own GPU.
    from fsdp_exp.fit_check import check_fit

    check_fit(
        cfg, topology, world_size=world[0] if world else None, rank_of_node=local_rank() if world is not None else None
    )
    return topology


def run_context(cfg: RunConfig, topology: Topology, run_dir: Path, labels: Labels = Labels()) -> RunContext:
    """What every rank is handed, for a validated config: the planner's prediction made here, once, and
    ``trainer.loss_chunks=auto`` settled into the config the ranks get (the planner's rule)."""
    from fsdp_exp.plan import loss_chunks_for, plan_for_run
    from fsdp_exp.plan.loss_chunks import with_chunks
    from fsdp_exp.tune.step_time import run_prediction

    chosen = loss_chunks_for(cfg, topology)
    if str(cfg.trainer.loss_chunks) != str(chosen.chunks):
        cfg = with_chunks(cfg, chosen.chunks)
    # After the fit check this asks the planner again, from its cache (the model's inventory).
    record, row, phases = plan_for_run(cfg, topology)
    # the step-time model's parts of the step, beside the planner's memory: the report compares each with the run
    record = {**record, "step_time": run_prediction(cfg, topology)}
    return RunContext(
        config=cfg,
        topology=topology,
        run_dir=Path(run_dir),
        labels=labels,
        prediction=Prediction(record=record, row=row, phases=phases),
        loss_chunks=chosen.record(),
    )


def launch(cfg: RunConfig, run_dir: Path, labels: Labels) -> dict:
    """Run one experiment to the end; return its run record. Raises RunFailed if a rank failed."""
    run_dir = Path(run_dir)
    world = external_world()
    if world is None and _may_fork() and cfg.logger.wandb.mode != "disabled" and not wandb_process.started_ahead():
        wandb_process.start_ahead()  # rank 0's W&B writer, warming up on the idle core meanwhile
    try:
        topology = prepare(cfg, world)
        check_resume_path(cfg)  # the folder must exist now, when the ranks would read it
        context = run_context(cfg, topology, run_dir, labels)
        # Real data is tokenized and packed into its cache here, once, before any rank exists (under
        # torchrun every rank gets here: the first builds under a file lock, the others reuse it).
        from fsdp_exp.data import prepare_data

        data_info = prepare_data(cfg)
    except BaseException:
        wandb_process.discard_ahead()  # no rank will start
        raise

    if world is not None:  # torchrun / SLURM: this process is one rank of the job
        export_slurm_rendezvous()
        from fsdp_exp.trainer import run_worker

        rank = int(os.environ["RANK"])
        errors = run_dir / ERRORS_DIR
        # A rank's error file from an earlier attempt in this folder (a rerun, a requeue) must not be
        # taken for this one's: each rank clears its own before it joins the others.
        (errors / f"rank{rank}.txt").unlink(missing_ok=True)
        if rank == 0:  # the folder every rank will write to: rank 0's (fsdp_exp.trainer.run_worker)
            _record_start(context, data_info)
        if rank == 0 and (job := slurm_job()) is not None:
            RunRecord(run_dir).on_slurm(**job)  # a requeued job's next start says so (restarts)
        try:
            run_worker(context)
        except Exception:
            raise _record_rank_failure(run_dir, cfg, labels, rank, world[0]) from None
        return RunRecord(run_dir).read()

    record = _record_start(context, data_info)
    forward = list(cfg.checkpoint.signals) if cfg.checkpoint.on_signal else ["SIGTERM"]
    try:
        _spawn(context, context.topology.nproc_per_node, forward)
    except RunFailed as failure:
        record_failure(run_dir, cfg, labels, failure.rank, failure.summary)
        raise
    result = record.read()
    if result.get("status") == "interrupted":
        stop = result.get("interrupted") or {}
        saved = stop.get("checkpoint") or {}
        print(
            f"fsdp_exp: stopped by {stop.get('signal')} after step {saved.get('step')}; every rank saved "
            f"{saved.get('path')}. Run again with hydra.run.dir={run_dir} (checkpoint.resume=auto) to continue.",
            file=sys.stderr,
        )
    return result


def _record_start(context: RunContext, data_info: Optional[dict]) -> RunRecord:
    """run.json before any rank trains: what will run (the only time the config and the plan are written)."""
    record = RunRecord(context.run_dir)
    record.starting(
        config=plain(context.config),
        topology=context.topology.as_dict(),
        plan=context.prediction.record,
        data=data_info,
        **context.labels.as_record(),
    )
    return record


def _record_rank_failure(run_dir: Path, cfg: RunConfig, labels: Labels, rank: int, world_size: int) -> RunFailed:
    """Under torchrun / SLURM, a rank whose run raised records the failure itself: no launcher process
    watches these ranks. Returns the RunFailed to raise.

    The rank whose error is its own (not a dead peer's closed connection) is the cause: it writes
    run.json before it exits, since rank 0 may never get to (killed by torchrun once this rank exits,
    or blocked in an NCCL collective until its timeout). Rank 0, which usually only sees its peer
    vanish, then looks for that rank's error file and records the failure again, with its W&B run. A
    file lock keeps two failing ranks from writing run.json at once.
    """
    from filelock import FileLock

    errors = run_dir / ERRORS_DIR
    errors.mkdir(parents=True, exist_ok=True)
    (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
    own = _error_summary(run_dir, rank, "")
    failure = RunFailed(rank, own)
    if rank == 0 and _is_peer_error(run_dir, 0):
        deadline = time.monotonic() + FAILURE_GRACE_S
        while True:
            reported = {int(p.stem[4:]) for p in errors.glob("rank*.txt") if p.stem[4:].isdigit()} - {0}
            causes = sorted(r for r in reported if not _is_peer_error(run_dir, r))
            if causes or len(reported) >= world_size - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        silent = sorted(set(range(1, world_size)) - reported)
        if causes:
            failure = RunFailed(causes[0], _error_summary(run_dir, causes[0], ""))
        elif silent:  # no Python error: killed by a signal (SIGKILL, the OOM killer), crashed, stuck
            failure = RunFailed(silent[0] if len(silent) == 1 else None, _silent_ranks(run_dir, silent, own))
    if rank == 0 or not _is_peer_error(run_dir, rank):
        with FileLock(str(errors / ".record.lock")):
            record_failure(run_dir, cfg, labels, failure.rank, failure.summary, note_wandb=rank == 0)
    return failure


def _silent_ranks(run_dir: Path, silent: list[int], own: str) -> str:
    """Why the job failed when ranks ``silent`` left no error: they died without a word. Where every rank
    of a host is among them (run.json's env.ranks says which ranks shared a node), the node was lost."""
    placed = (RunRecord(run_dir).read().get("env") or {}).get("ranks") or []
    hosts: dict[str, list[int]] = {}
    for entry in placed:
        hosts.setdefault(entry.get("host"), []).append(entry.get("rank"))
    lost = sorted(host for host, ranks in hosts.items() if len(hosts) > 1 and set(ranks) <= set(silent))
    if lost:
        ranks = sorted(r for host in lost for r in hosts[host])
        nodes = ", ".join(lost)
        return (
            f"node {nodes} lost: ranks {ranks} (every rank on {nodes}) left no error of their own (killed, "
            f"out of memory, stuck, or the node failed or stopped answering: see the job's log); rank 0 then "
            f"failed with: {own}"
        )
    who = f"rank {silent[0]}" if len(silent) == 1 else f"one of ranks {silent}"
    return (
        f"{who} left no error of its own (killed by a signal, out of memory, crashed or stuck: see the "
        f"job's log); rank 0 then failed with: {own}"
    )


def record_failure(
    run_dir: Path, cfg, labels: Labels, rank: Optional[int], message: str, note_wandb: bool = True
) -> dict:
    """Record a run that failed (before its ranks started, or because one of them failed): run.json gets
    status "failed" and the error; W&B (unless disabled) gets the same, in the run rank 0 opened if
    there is one. ``cfg``: the RunConfig, or the composed config when it could not be typed."""
    try:
        config = plain(cfg)
    except Exception:  # noqa: BLE001 - an unresolvable config still deserves its failure record
        config = None
    record = RunRecord(run_dir)
    result = record.failed(rank, message, config=config, **labels.as_record())
    wandb_cfg = cfg.logger.wandb
    if note_wandb and wandb_cfg.mode != "disabled":
        from fsdp_exp.record import note_failure_in_wandb

        try:
            run_id = note_failure_in_wandb(
                wandb_cfg,
                run_dir,
                result.get("config", {}),
                list(labels.overrides),
                dict(labels.choices),
                (result.get("wandb") or {}).get("run_id"),
                result["error"],
            )
        except Exception as exc:  # noqa: BLE001 - W&B trouble must not hide the run's own error
            print(f"fsdp_exp: could not record the failure in W&B: {exc}", file=sys.stderr)
        else:
            result = record.wandb_noted(wandb_cfg.mode, run_id)
    return result


def _spawn(context: RunContext, nprocs: int, forward: list[str] = ("SIGTERM",)) -> None:
    import torch.multiprocessing as mp

    from fsdp_exp.oom import OomWatch

    port = free_port()
    oom = OomWatch()  # the OOM killer's counters and the node's memory before the ranks start
    method = "fork" if forked_ranks_allowed(context) else "spawn"
    if method == "fork":
        import fsdp_exp.trainer  # noqa: F401 - imported once, here: every rank has it
    else:
        wandb_process.discard_ahead()  # a spawned rank 0 starts its own W&B writer
    ctx = mp.start_processes(
        _spawned_rank, args=(nprocs, port, context, method), nprocs=nprocs, join=False, start_method=method
    )
    writer = wandb_process.let_go_ahead()  # forked rank 0 writes to it
    previous = _forward_signals(ctx.processes, forward)
    try:
        failed = _wait_for_ranks(ctx.processes, context.run_dir)
    finally:
        wandb_process.reap(writer)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for path in ctx.error_files:  # torch's per-worker error pickles (we read errors/rank<N>.txt)
            try:
                os.unlink(path)
            except OSError:
                pass
    if failed is not None:
        process = ctx.processes[failed]
        raise _failure(context.run_dir, failed, process.exitcode, oom, process.pid)


# Starting the local ranks. A spawned rank is a new interpreter: it imports torch and fsdp_exp's trainer
# again (1.5-2.5 s per rank on 2 cores, while the launcher has already imported torch). Forked from the
# launcher, a rank starts with every module imported once, there. Forking copies the whole process, so
# it is done only from a launcher in a state that copies safely (``forked_ranks_allowed``): CUDA never
# initialised (no CUDA device on the machine), no thread of its own (Python's or a library's pool, an
# OpenMP one above all, which a forked child cannot use); anywhere else, ranks are spawned as before.
_threads_when_clean: Optional[int] = None


def allow_forked_ranks(wandb: bool) -> None:
    """The command line's launcher calls this once, before it has computed anything: from then on its
    ranks may be forked from it. What threads it has then (torch's import starts numpy's BLAS pool, which
    is fork-safe) is the count it must still have when it forks. A process that does not call this (a
    test, a notebook, a benchmark launching runs in-process) keeps spawning its ranks. ``wandb``: the run
    logs to W&B; rank 0's W&B writer then starts now, before torch's import (``launch`` discards it if
    no rank is forked)."""
    global _threads_when_clean
    if _threads_when_clean is not None:
        return
    if wandb and external_world() is None:
        wandb_process.start_ahead()
    import torch  # noqa: F401 - imported now, so that its import's threads count as clean

    _threads_when_clean = _os_threads()


def _os_threads() -> int:
    """This process's threads, as the kernel counts them: Python's and every library's."""
    return len(os.listdir("/proc/self/task"))


def _may_fork() -> bool:
    """Is this process (still) one its ranks may be forked from (see above)?"""
    import threading

    return _threads_when_clean is not None and threading.active_count() == 1 and _os_threads() <= _threads_when_clean


def forked_ranks_allowed(context: RunContext) -> bool:
    """May this run's ranks be forked from this process now?"""
    return _may_fork() and context.topology.device_type == "cpu" and cuda_device_count() == 0


def _as_a_new_process() -> None:
    """In a forked rank, undo what the launcher set up that a spawned rank would not have: Hydra's log
    handlers (its console and the run folder's log file) on the root logger."""
    import logging

    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)


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


# A collective that timed out (trainer.collective_timeout_s) waited for a peer that stopped answering.
PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL communicator was aborted",
    "Timed out waiting",
)


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


def _failure(run_dir: Path, rank: int, exitcode: int, oom=None, pid: Optional[int] = None) -> RunFailed:
    """Why a rank failed. ``oom`` (fsdp_exp.oom.OomWatch, from before the ranks started) tells whether
    a rank killed by SIGKILL, which leaves no error of its own, was killed by the OOM killer."""
    if (run_dir / ERRORS_DIR / f"rank{rank}.txt").exists():  # it raised: its own words
        return RunFailed(rank, _error_summary(run_dir, rank, ""))
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = f"the process was killed by {name}"
        if exitcode == -signal.SIGKILL and oom is not None:
            why += f": {oom.explain(pid)}"
        return RunFailed(rank, why)
    return RunFailed(rank, f"the process exited with code {exitcode}")


def _spawned_rank(local_rank: int, nprocs: int, port: int, context: RunContext, method: str = "spawn") -> None:
    """A worker process started by ``_spawn`` (``method``: fork or spawn): set the torch.distributed
    environment, then run."""
    die_with_parent()  # no orphaned ranks
    if method == "fork":
        _as_a_new_process()
        if local_rank != 0:
            wandb_process.let_go_ahead()  # rank 0's
    os.environ.update(rank_env(local_rank, nprocs, port))
    try:
        from fsdp_exp.trainer import run_worker

        run_worker(context)
    except BaseException:
        # Keep the whole traceback in the run folder; the launcher prints only its last line.
        errors = context.run_dir / ERRORS_DIR
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
    after = lines[frames[-1] + 1 :] if frames else lines[-1:]
    start = next((i for i, line in enumerate(after) if not line[:1].isspace()), len(after) - 1)
    message = after[start : start + max_lines] if after else ["unknown error"]
    last = "\n".join(line.rstrip() for line in message)
    return f"{last} (traceback: {path})" if path.exists() else last


def report_failure(failure: RunFailed) -> None:
    print(f"fsdp_exp: run failed: {failure}", file=sys.stderr)
