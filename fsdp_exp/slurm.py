"""``hydra/launcher=slurm``: every job of a sweep is a SLURM job, with one task per rank.

The launcher is hydra-submitit-launcher's, with the resources decided per job from the job's own
config (``trainer.nnodes`` nodes of ``trainer.nproc_per_node`` tasks, GPUs with ``trainer.device=cuda``),
so a sweep over those keys gets jobs of the right sizes, one job array per size. An interpolation in
the launcher config could not do this: it is resolved once for the whole sweep, and
``nproc_per_node: auto`` is not a task count. Inside a job each task ``srun`` starts is a rank
(``fsdp_exp.env.external_world``); a job that ends without a result is recorded as failed and the sweep
goes on. SIGUSR1 before the time limit: every rank saves, then task 0 requeues the job through
submitit; SIGTERM (preemption, ``scontrol requeue``): the ranks save and SLURM's decision stands; the
next start resumes in the same folder. Before submitting, every job's node count is checked against
its partition's. What ends a job and what follows: the docs page sweeps.md.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import DictConfig, OmegaConf

from fsdp_exp.config import ConfigError, fail, resolve_nproc
from fsdp_exp.errors import EXIT_BAD_CONFIG

log = logging.getLogger(__name__)

# Decided per job from the trainer config; setting them on the launcher would contradict it.
PER_JOB = ("tasks_per_node", "nodes")
# The signals SLURM stops a job with: SIGUSR1 before its time limit (the launcher's signal_delay_s),
# SIGTERM when it preempts, requeues or cancels it.
TIME_LIMIT_SIGNAL = "SIGUSR1"
STOP_SIGNALS = [TIME_LIMIT_SIGNAL, "SIGTERM"]
# Each task's Python starts with the stop signals blocked: one that SLURM sends while the task is still
# starting (importing, for seconds; on a loaded node or a slow shared file system, far longer) stays
# pending until the handlers are in place (checkpoint/signals.handle_stop_signals unblocks it),
# where its default action would have killed the task. A signal mask survives exec; this first
# interpreter runs without site (-S) and replaces itself with the real task at once.
_HOLD_STOP_SIGNALS = (
    "import os, signal, sys; "
    f"signal.pthread_sigmask(signal.SIG_BLOCK, [{', '.join(f'signal.{s}' for s in STOP_SIGNALS)}]); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
# How often the sweep asks SLURM for its jobs' states while it waits (one sacct call for all of them);
# after how long in the queue a job's wait is reported, and how often again.
POLL_S = 3.0
QUEUED_NOTE_S = 10.0
QUEUED_REPEAT_S = 300.0
# The least time between a job's start and its time-limit signal (timeout_min * 60 - signal_delay_s): a
# job signalled while its ranks are still starting would save and be requeued again and again with
# hardly a step trained in between.
MIN_SIGNAL_LEAD_S = 60
# How long the other tasks of a job may run on after task 0 ended before they are taken for stuck.
HUNG_TASKS_S = 20.0


def task_python() -> str:
    """The command submitit starts each task's Python with (its own arguments follow)."""
    return f"{shlex.quote(sys.executable)} -S -c {shlex.quote(_HOLD_STOP_SIGNALS)}"


def job_resources(trainer: Any, gpus_per_node: Optional[int]) -> dict:
    """What one job asks SLURM for, from its ``trainer`` config. ``gpus_per_node``: the launcher's
    setting (None: GPUs only when ``trainer.device=cuda``, one per rank)."""
    if trainer.nproc_per_node == "auto" and trainer.device == "cuda" and not gpus_per_node:
        fail(
            "trainer.nproc_per_node=auto means one rank per GPU, and how many GPUs a SLURM node has is not "
            "known where the sweep is submitted.",
            "pass trainer.nproc_per_node=<GPUs per node> (or hydra.launcher.gpus_per_node=<GPUs per node>)",
        )
    # "auto": the GPUs asked for, else 2 ranks: what it means on a machine without GPUs.
    nproc = resolve_nproc(str(trainer.nproc_per_node), gpus_per_node or 0)
    if gpus_per_node is None and trainer.device == "cuda":
        gpus_per_node = nproc
    return {"tasks_per_node": nproc, "nodes": int(trainer.nnodes), "gpus_per_node": gpus_per_node}


def partition_sizes() -> dict[str, int]:
    """{partition: its node count} of the cluster, the default partition also under "" (SLURM's own
    answer: ``scontrol show partition``). Empty when SLURM cannot be asked (no scontrol, no controller):
    the request then goes to sbatch, which judges it itself."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "partition", "--oneliner"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    sizes: dict[str, int] = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "PartitionName" in fields and fields.get("TotalNodes", "").isdigit():
            sizes[fields["PartitionName"]] = int(fields["TotalNodes"])
            if fields.get("Default") == "YES":
                sizes[""] = int(fields["TotalNodes"])
    return sizes


def check_partition(partition: Optional[str], nodes: int, sizes: dict[str, int]) -> None:
    """Refuse a job of ``nodes`` nodes that its partition (None: the default) can never hold: SLURM would
    keep it pending forever, without a word."""
    if not sizes:
        return
    name = partition or ""
    shown = partition or "the default partition"
    if name not in sizes:
        known = ", ".join(sorted(p for p in sizes if p))
        problem = (
            f"hydra.launcher.partition={partition}: the cluster has no such partition"
            if partition
            else "no partition was named and the cluster has no default partition"
        )
        fail(f"{problem} (it has: {known}).", f"pass hydra.launcher.partition=<one of: {known}>")
    if nodes > sizes[name]:
        fail(
            f"trainer.nnodes={nodes}, but {shown} has {sizes[name]} node(s): the job would wait in the queue forever.",
            f"pass trainer.nnodes={sizes[name]} or less, or a larger partition (hydra.launcher.partition=...)",
        )


# sbatch submits each job array; srun starts each job's tasks (submitit looks for it before submitting anything).
SLURM_COMMANDS = ("sbatch", "srun")
SCONTROL_TIMEOUT_S = 30


def unreachable() -> Optional[str]:
    """Why no job can be submitted from here, or None: SLURM's commands not on PATH, ``SLURM_CONF`` naming no
    file, or ``scontrol`` (the controller, through the configuration the commands find) not answering. Asked
    before submitting, so that a machine without SLURM gets one sentence instead of submitit's traceback."""
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        return (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH: SLURM's client commands "
            "are not installed on this machine (or not on its PATH)"
        )
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # SLURM itself would retry reading it for a minute before giving up
        return f"SLURM_CONF={conf} names no file: SLURM's commands have no configuration to read"
    if shutil.which("scontrol") is None:
        return None  # nothing to ask: sbatch judges for itself
    try:
        out = subprocess.run(
            ["scontrol", "show", "partition", "--oneliner"],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"SLURM's controller did not answer `scontrol show partition` within {SCONTROL_TIMEOUT_S} s"
    except OSError as err:
        return f"scontrol could not run: {err}"
    if out.returncode == 0:
        return None
    said = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()[-1]
    if "configuration source" in said:
        return (
            "no SLURM configuration was found (no slurm.conf where SLURM_CONF or SLURM's default path says, and no "
            f"configless controller): scontrol says {said!r}"
        )
    return f"SLURM's controller cannot be reached from here: scontrol says {said!r}"


def local_command(argv: Sequence[str]) -> str:
    """``argv`` (a sweep's command line) without the SLURM launcher and its settings: the same sweep, run on
    this machine one job after another."""
    kept = [
        arg
        for arg in argv
        if arg.lstrip("+~") not in ("hydra/launcher=slurm",) and not arg.lstrip("+~").startswith("hydra.launcher.")
    ]
    return shlex.join(["python", "-m", "fsdp_exp", *kept])


def _requeue_after_time_limit(max_num_timeout: int) -> Optional[str]:
    """Task 0, after every rank saved on the time-limit signal: requeue the job through submitit (the
    launcher's ``checkpoint()`` becomes the job's next submission; ``hydra.launcher.max_num_timeout``
    bounds how often, on submitit's counter). Returns None when the job was requeued, else why not."""
    import submitit
    from submitit.core.job_environment import SignalHandler
    from submitit.core.utils import DelayedSubmission, UncompletedJobError

    class Requeued(Exception):
        pass

    class TimeLimit(SignalHandler):
        """submitit's handler, told that this was the time limit (it would guess from the elapsed time),
        returning instead of exiting so that the run can record the requeue first."""

        def has_timed_out(self) -> bool:
            return True

        def _exit(self) -> None:
            raise Requeued

    environment = submitit.JobEnvironment()
    delayed = DelayedSubmission.load(environment.paths.submitted_pickle)
    try:
        TimeLimit(environment, environment.paths, delayed).checkpoint_and_try_requeue(signal.SIGUSR1)
    except Requeued:
        return None
    except UncompletedJobError:
        times = max_num_timeout - delayed._timeout_countdown + 1  # noqa: SLF001 - submitit's counter: requeues left
        return (
            f"the job reached its time limit {times} time(s), and hydra.launcher.max_num_timeout={max_num_timeout} "
            f"requeues it at most {max_num_timeout} time(s). Its checkpoint stays: raise "
            "hydra.launcher.max_num_timeout (or hydra.launcher.timeout_min), or rerun the sweep with the same "
            "hydra.sweep.dir, to continue"
        )
    except subprocess.CalledProcessError as err:
        return f"`scontrol requeue` failed ({err}): the cluster may not allow requeueing (JobRequeue=0)"
    return "submitit did not requeue the job"


class SlurmLauncher(SubmititSlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher, with per-job resources, jobs that die recorded, and jobs
    that SLURM stops requeued to resume from their checkpoint."""

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str, singleton_state: dict
    ) -> JobReturn:
        """One task of a job (one rank), on a node of the cluster."""
        from fsdp_exp.checkpoint.signals import handle_stop_signals, signal_requested

        # SLURM may send its signals before the trainer has read its config: from the first moment they
        # only ask the run to stop (the run then keeps those of checkpoint.signals, none with
        # checkpoint.on_signal=false, and restores the others' defaults). One that came while the task
        # started was held (task_python) and arrives now.
        handle_stop_signals(STOP_SIGNALS)
        if signal_requested():
            log.warning(f"{signal_requested()} came while this task was starting; it was held until now")
        result = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        # Only task 0's result counts (``SlurmLauncher._result``); the others' are left as they are.
        ran = result._return_value if result.status == JobStatus.COMPLETED else None  # noqa: SLF001 - no raise
        if (
            int(os.environ.get("SLURM_PROCID", "0")) != 0
            or not isinstance(ran, dict)
            or ran.get("status") != "interrupted"
        ):
            return result
        stop = (ran.get("interrupted") or {}).get("signal")  # the signal every rank agreed to stop on
        step = ((ran.get("interrupted") or {}).get("checkpoint") or {}).get("step")
        from fsdp_exp.record import RunRecord

        assert self.hydra_context is not None and self.config is not None
        record = RunRecord(
            _job_dir(self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides), job_num)
        )
        if stop == TIME_LIMIT_SIGNAL:
            why_not = _requeue_after_time_limit(int(self.params.get("max_num_timeout") or 0))
            if why_not is not None:
                log.error(f"not requeued: {why_not}")
                record.on_slurm(not_requeued=why_not)
                return result  # the job ends here, interrupted: the sweep reports it
            record.on_slurm(
                stops=[
                    {"signal": stop, "reason": "time limit", "saved_step": step, "requeued": True, "at": time.time()}
                ]
            )
            log.info(f"time limit: every rank saved step {step}; the job is requeued and resumes from there")
        else:
            record.on_slurm(
                stops=[
                    {
                        "signal": stop,
                        "reason": "preempted, requeued or cancelled by SLURM",
                        "saved_step": step,
                        "requeued": None,
                        "at": time.time(),
                    }
                ]
            )
            log.info(f"{stop}: every rank saved step {step}; SLURM decides whether the job comes back")
        # No result from task 0: the sweep keeps waiting for the job's next start (or for SLURM to say
        # that it ended: cancelled).
        sys.exit(-1)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        params = dict(self.params)
        # Every job's size is known before the first is submitted: a sweep is refused whole (exit 2, as
        # an invalid configuration), never half-submitted.
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        arrays: dict[tuple, list[int]] = {}  # jobs of one size are one array (one sbatch)
        try:
            set_by_hand = [
                o
                for o in self.config.hydra.overrides.hydra
                if o.lstrip("+~").split("=")[0] in {f"hydra.launcher.{key}" for key in PER_JOB}
            ]
            if set_by_hand:
                fail(
                    f"{', '.join(set_by_hand)}: hydra/launcher=slurm takes each job's tasks and nodes from "
                    "its trainer config.",
                    "pass trainer.nproc_per_node=N (tasks per node) and trainer.nnodes=M instead",
                )
            lead = int(params["timeout_min"]) * 60 - int(params.get("signal_delay_s") or 0)
            if lead < MIN_SIGNAL_LEAD_S:
                fail(
                    f"hydra.launcher.signal_delay_s={params.get('signal_delay_s')} with timeout_min={params['timeout_min']}: "
                    f"the time-limit signal would come {max(lead, 0)} s after a job starts (SLURM sends it up to "
                    "~30 s early), while its ranks are still starting: every start would save and be "
                    "requeued with hardly a step trained.",
                    f"keep timeout_min * 60 - signal_delay_s at {MIN_SIGNAL_LEAD_S} s or more, e.g. "
                    f"hydra.launcher.signal_delay_s={max(0, int(params['timeout_min']) * 60 - MIN_SIGNAL_LEAD_S)}",
                )
            problem = unreachable()
            if problem:
                fail(
                    f"hydra/launcher=slurm cannot submit from this machine: {problem}.",
                    f"run the sweep here instead: {local_command(sys.argv[1:])}; or run it where SLURM is set up "
                    "(sbatch and srun on PATH, and SLURM_CONF naming the cluster's slurm.conf where it is not at "
                    "SLURM's default path)",
                )
            sizes = partition_sizes()
            for i, cfg in enumerate(configs):
                resources = job_resources(cfg.trainer, params.get("gpus_per_node"))
                check_partition(params.get("partition"), resources["nodes"], sizes)
                arrays.setdefault(tuple(sorted(resources.items())), []).append(i)
        except ConfigError as err:
            print(f"fsdp_exp: invalid configuration, nothing was submitted: {err}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_CONFIG) from None

        executor = submitit.AutoExecutor(
            cluster="slurm",
            folder=params.pop("submitit_folder"),
            slurm_max_num_timeout=params.pop("max_num_timeout"),
            slurm_python=task_python(),
        )
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        shared = {
            key if key in generic else f"slurm_{key}": value
            for key, value in params.items()
            if key not in (*PER_JOB, "gpus_per_node")
        }

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"SLURM sweep output dir: {sweep_dir}")

        jobs: list = [None] * len(job_overrides)
        for key, members in arrays.items():
            resources = dict(key)
            executor.update_parameters(**shared, **resources)
            size = f"{resources['nodes']} node(s) x {resources['tasks_per_node']} tasks" + (
                f", {resources['gpus_per_node']} GPUs per node" if resources["gpus_per_node"] else ""
            )
            arguments = []
            for i in members:
                num = initial_job_idx + i
                log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[i]))} ({size})")
                arguments.append(
                    (list(job_overrides[i]), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
                )
            for i, job in zip(members, executor.map_array(self, *zip(*arguments))):
                jobs[i] = job
        _wait(jobs, initial_job_idx)
        return [self._result(job, configs[i], initial_job_idx + i, job_overrides[i]) for i, job in enumerate(jobs)]

    def _result(self, job, cfg: DictConfig, num: int, overrides: Sequence[str]) -> JobReturn:
        """Job ``num``'s return; a job that ended without one (its task killed, or gone without a trace)
        becomes a failed run in its folder, so that the sweep goes on and the verdict counts it."""
        try:
            # Every task must have ended, but only rank 0's return counts: a rank killed by a signal
            # leaves no result, and rank 0 has recorded that in run.json.
            job.wait()
            return job.task(0).result()
        except Exception as exc:  # noqa: BLE001 - whatever submitit raises, this job is over
            log.debug(f"#{num}: {exc}")
            reason = (
                f"SLURM job {job.job_id} ended {job.state} and rank 0 left no result: its process was "
                f"killed (a signal, out of memory, the time limit) or crashed; see {job.paths.stderr}"
            )
        run_dir = _job_dir(cfg, num)
        from fsdp_exp.record import RunRecord

        record = RunRecord(run_dir)
        # A record the ranks already closed keeps its own words (rank 0 usually names the dead rank).
        previous = record.read()
        if previous.get("status") not in ("completed", "interrupted", "failed"):
            # The run's part only: resolving hydra's would need this job's hydra.job.num, which is unset here.
            config = (
                None
                if "config" in previous
                else {
                    k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                    for k in cfg
                    if k != "hydra"
                }
            )
            record.failed(None, reason, config=config, overrides=list(overrides))
            record.on_slurm(job_id=job.job_id, state=job.state, log=str(job.paths.stderr))
        log.error(f"#{num}: {reason}")
        return JobReturn(
            overrides=list(overrides),
            working_dir=str(run_dir),
            task_name=str(cfg.hydra.job.name),
            status=JobStatus.COMPLETED,
            _return_value={"status": "failed", "error": reason},
        )


def _wait(jobs: list, first_num: int) -> None:
    """Wait for every job of the sweep to end, saying when one starts, is requeued, or is held in the
    queue (and why): a job that cannot start is seen, not waited on in silence."""
    seen: dict[int, str] = {}  # each job's state at the last look
    ended_alone: dict[int, float] = {}  # jobs whose task 0 has ended while other tasks run on: since when
    queued_since: dict[int, float] = {}
    noted: dict[int, int] = {}  # how many times a job's wait in the queue was reported
    while True:
        # One sacct call for all jobs (submitit's watcher is shared); left to itself, submitit asks ever less
        # often (up to every 10 minutes), and a requeue would go unseen.
        jobs[0].watcher.update()
        waiting = [(num, job) for num, job in enumerate(jobs, start=first_num) if not job.done()]
        if not waiting:
            return
        for num, job in waiting:
            _cancel_if_hung(job, num, ended_alone)
            state, before = job.state, seen.get(num)
            seen[num] = state
            if state in ("PENDING", "REQUEUED"):
                if state == "REQUEUED" and before != "REQUEUED":
                    log.info(
                        f"\t#{num}: SLURM job {job.job_id} was requeued: it resumes from its checkpoint "
                        "when it starts again"
                    )
                # A job normally starts within seconds: say so only when it does not.
                waited = time.monotonic() - queued_since.setdefault(num, time.monotonic())
                if waited >= QUEUED_NOTE_S + QUEUED_REPEAT_S * noted.get(num, 0):
                    noted[num] = noted.get(num, 0) + 1
                    log.info(
                        f"\t#{num}: SLURM job {job.job_id} has waited {waited:.0f} s in the queue "
                        f"({_pending_reason(job.job_id)})"
                    )
                continue
            queued_since.pop(num, None)
            noted.pop(num, None)
            if state == "RUNNING" and before != "RUNNING":
                log.info(f"\t#{num}: SLURM job {job.job_id} is running" + (" again" if before == "REQUEUED" else ""))
        time.sleep(POLL_S)


def _cancel_if_hung(job, num: int, ended_alone: dict) -> None:
    """Cancel a job whose task 0 (rank 0, which records the run) ended HUNG_TASKS_S ago while other
    tasks still run. Ranks end together; those that do not are stuck: on a node that stopped answering,
    or blocked on one (srun waits for every task, so the job would hold its nodes until its time limit
    and the sweep would wait with it)."""
    if not job.task(0).done():
        return
    since = ended_alone.setdefault(job.job_id, time.monotonic())
    if time.monotonic() - since < HUNG_TASKS_S:
        return
    log.error(
        f"SLURM job {job.job_id}: task 0 ended {HUNG_TASKS_S:.0f} s ago and other tasks still run (stuck, or "
        "on a node that stopped answering): cancelling the job"
    )
    job.cancel(check=False)
    ended_alone[job.job_id] = float("inf")  # once


def _pending_reason(job_id: str) -> str:
    """Why SLURM keeps a job pending, in squeue's words (Resources, Priority, BeginTime, ...)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True, timeout=30)
        return f"reason: {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else "reason unknown"
    except (OSError, subprocess.SubprocessError):
        return "reason unknown"


def _job_dir(cfg: DictConfig, num: int) -> Path:
    """Where Hydra put job ``num`` of the sweep: hydra.sweep.dir / hydra.sweep.subdir, as in its run_job."""
    from omegaconf import open_dict

    cfg = cfg.copy()
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = num
    return Path(str(cfg.hydra.sweep.dir)) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
