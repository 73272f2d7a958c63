"""``hydra/launcher=slurm``: every job of a sweep is a SLURM job, with one task per rank.

The launcher is hydra-submitit-launcher's, with the resources decided per job instead of once for the
sweep. A job asks for ``trainer.nnodes`` nodes with ``trainer.nproc_per_node`` tasks each (and, with
``trainer.device=cuda``, as many GPUs per node) from its own config, so a sweep over
``trainer.nproc_per_node`` or ``trainer.nnodes`` gets jobs of the right sizes: jobs of one size are
one job array. A plain interpolation in the launcher config could do neither: the launcher config is
resolved once for the whole sweep, and ``nproc_per_node: auto`` is not a task count.

Inside a job, submitit's ``srun`` starts the tasks and each one is a rank (fsdp_exp/launch.py
``external_world``). A job that ends without a result (its tasks killed: by a signal, the OOM killer,
a node failure) is recorded as failed in its ``run.json``, and the sweep goes on to the end, where
fsdp_exp/sweep.py reports every job from the records.
"""

from __future__ import annotations

import logging
import sys
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


def job_resources(trainer: Any, gpus_per_node: Optional[int]) -> dict:
    """What one job asks SLURM for, from its ``trainer`` config. ``gpus_per_node``: the launcher's
    setting (None: GPUs only when ``trainer.device=cuda``, one per rank)."""
    if trainer.nproc_per_node == "auto" and trainer.device == "cuda" and not gpus_per_node:
        fail("trainer.nproc_per_node=auto means one rank per GPU, and how many GPUs a SLURM node has is not "
             "known where the sweep is submitted.",
             "pass trainer.nproc_per_node=<GPUs per node> (or hydra.launcher.gpus_per_node=<GPUs per node>)")
    # "auto": the GPUs asked for, else 2 ranks: what it means on a machine without GPUs.
    nproc = resolve_nproc(str(trainer.nproc_per_node), gpus_per_node or 0)
    if gpus_per_node is None and trainer.device == "cuda":
        gpus_per_node = nproc
    return {"tasks_per_node": nproc, "nodes": int(trainer.nnodes), "gpus_per_node": gpus_per_node}


class SlurmLauncher(SubmititSlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher, with per-job resources and jobs that die recorded."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        params = dict(self.params)
        # Every job's size is known before the first is submitted: a sweep is refused whole (exit 2, as
        # an invalid configuration), never half-submitted.
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        arrays: dict[tuple, list[int]] = {}  # jobs of one size are one array (one sbatch)
        try:
            set_by_hand = [o for o in self.config.hydra.overrides.hydra
                           if o.lstrip("+~").split("=")[0] in {f"hydra.launcher.{key}" for key in PER_JOB}]
            if set_by_hand:
                fail(f"{', '.join(set_by_hand)}: hydra/launcher=slurm takes each job's tasks and nodes from "
                     "its trainer config.",
                     "pass trainer.nproc_per_node=N (tasks per node) and trainer.nnodes=M instead")
            for i, cfg in enumerate(configs):
                resources = job_resources(cfg.trainer, params.get("gpus_per_node"))
                arrays.setdefault(tuple(sorted(resources.items())), []).append(i)
        except ConfigError as err:
            print(f"fsdp_exp: invalid configuration, nothing was submitted: {err}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_CONFIG) from None

        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout"))
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        shared = {key if key in generic else f"slurm_{key}": value for key, value in params.items()
                  if key not in (*PER_JOB, "gpus_per_node")}

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
                f", {resources['gpus_per_node']} GPUs per node" if resources["gpus_per_node"] else "")
            arguments = []
            for i in members:
                num = initial_job_idx + i
                log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[i]))} ({size})")
                arguments.append((list(job_overrides[i]), "hydra.sweep.dir", num, f"job_id_for_{num}",
                                  Singleton.get_state()))
            for i, job in zip(members, executor.map_array(self, *zip(*arguments))):
                jobs[i] = job
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
            reason = (f"SLURM job {job.job_id} ended {job.state} and rank 0 left no result: its process was "
                      f"killed (a signal, out of memory, the time limit) or crashed; see {job.paths.stderr}")
        run_dir = _job_dir(cfg, num)
        from fsdp_exp.record import RunRecord

        record = RunRecord(run_dir)
        # A record the ranks already closed keeps its own words (rank 0 usually names the dead rank).
        previous = record.read()
        if previous.get("status") not in ("completed", "interrupted", "failed"):
            config = None if "config" in previous else \
                {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
            record.failed(None, reason, config=config, overrides=list(overrides),
                          slurm={"job_id": job.job_id, "state": job.state, "log": str(job.paths.stderr)})
        log.error(f"#{num}: {reason}")
        return JobReturn(overrides=list(overrides), working_dir=str(run_dir), task_name=str(cfg.hydra.job.name),
                         status=JobStatus.COMPLETED, _return_value={"status": "failed", "error": reason})


def _job_dir(cfg: DictConfig, num: int) -> Path:
    """Where Hydra put job ``num`` of the sweep: hydra.sweep.dir / hydra.sweep.subdir, as in its run_job."""
    from omegaconf import open_dict

    cfg = cfg.copy()
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = num
    return Path(str(cfg.hydra.sweep.dir)) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
