"""Who started this process and what it may use, decided once: torchrun, a SLURM job step, or fsdp_exp's
own launcher; how many CUDA devices there are; how many CPU threads a rank gets.

Every other module asks here instead of reading launcher variables itself, so that "is this process
one rank of an outside launcher's job?" has one answer everywhere (the run folder's name, the
launcher's choice to spawn or not, the rendezvous).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

from fsdp_exp.errors import fail


def _slurm_step_id() -> Optional[str]:
    return os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")


def started_by() -> str:
    """``torchrun`` (or any launcher that sets RANK and WORLD_SIZE), ``slurm`` (one task of a SLURM job
    step of several tasks), else ``fsdp_exp`` (this process launches its own ranks)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") and "RANK" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and _slurm_step_id() and \
            int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    return "fsdp_exp"


def external_world() -> Optional[tuple[int, int]]:
    """(world size, ranks on this node) when an outside launcher made this process one rank, else None.

    torchrun sets RANK and WORLD_SIZE. Under SLURM a rank is one task of a job step with more than one
    task (``srun``, as in the jobs of ``hydra/launcher=slurm``); the step's own counts apply, not the
    allocation's (a step may use fewer tasks; the allocation's SLURM_NTASKS_PER_NODE is wrong for it).
    A batch script is not a step: it has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no
    SLURM_STEP_ID, and a ``python -m fsdp_exp`` there is the launcher of its own local ranks, not rank
    0 of a world that nobody else would join.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return world, int(env.get("LOCAL_WORLD_SIZE", world))
    if started_by() != "slurm":
        return None  # one task: fsdp_exp spawns trainer.nproc_per_node ranks inside it, as on any machine
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    # Tasks per node, e.g. "2(x3),1": every node must run as many ranks (one trainer.nproc_per_node).
    layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = {int(part.split("(")[0]) for part in filter(None, layout.split(","))}
    if len(counts) > 1:
        fail(f"this SLURM step runs a different number of tasks on its nodes (SLURM tasks per node: {layout}); "
             "fsdp_exp runs the same number of ranks on every node.",
             "ask for the same count on every node: srun/sbatch --ntasks-per-node=N (hydra/launcher=slurm does)")
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return world, counts.pop() if counts else max(1, world // nodes)


def run_stamp() -> str:
    """The name of a run's default folder (``${run_stamp:}`` in conf/config.yaml): the time, or, when an
    outside launcher started this process as one rank, an id every rank of the job shares. Each rank
    composes its own config, at its own second: time stamps would give one folder per rank (and per
    node), with the record in rank 0's and another rank's error file elsewhere."""
    env, who = os.environ, started_by()
    if who == "torchrun" and env.get("TORCHELASTIC_RUN_ID"):  # its --rdzv-id (standalone: one uuid)
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if who == "slurm":
        return f"slurm-{env['SLURM_JOB_ID']}.{_slurm_step_id()}"
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_threads(ranks_per_node: int) -> int:
    """CPU threads for one rank: what SLURM allots each task (a rank) inside a job step, else this
    process's CPUs (its affinity: a cgroup or taskset may hold fewer than the machine has) shared by
    the node's ranks."""
    if _slurm_step_id() and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    return max(1, usable_cores() // ranks_per_node)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
