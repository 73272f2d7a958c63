"""Who started this process and what it may use, decided once: torchrun, a SLURM job step, or fsdp_exp's
own launcher; how many CUDA devices there are; how many CPU threads a rank gets; how much memory this
process may really use (RAM, its memory cgroup's limit, a GPU's free memory).

Every other module asks here instead of reading launcher variables itself, so that "is this process
one rank of an outside launcher's job?" has one answer everywhere (the run folder's name, the
launcher's choice to spawn or not, the rendezvous).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fsdp_exp.errors import fail
from fsdp_exp.units import GIB


def _slurm_step_id() -> Optional[str]:
    return os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")


def started_by() -> str:
    """``torchrun`` (or any launcher that sets RANK and WORLD_SIZE), ``slurm`` (one task of a SLURM job
    step of several tasks), else ``fsdp_exp`` (this process launches its own ranks)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") and "RANK" in env:
        return "torchrun"
    if (
        "SLURM_PROCID" in env
        and _slurm_step_id()
        and int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1) > 1
    ):
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
        fail(
            f"this SLURM step runs a different number of tasks on its nodes (SLURM tasks per node: {layout}); "
            "fsdp_exp runs the same number of ranks on every node.",
            "ask for the same count on every node: srun/sbatch --ntasks-per-node=N (hydra/launcher=slurm does)",
        )
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return world, counts.pop() if counts else max(1, world // nodes)


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu[003-010,015],cpu01`` (``gpu003``): where the step's
    task 0 runs. ``scontrol show hostnames`` expands it as SLURM itself does (any syntax it has); where
    scontrol is missing or fails, a parser of the common syntax (prefix[ranges],...) stands in."""
    if nodelist and shutil.which("scontrol"):
        try:
            # Expanding a node list needs no controller; 10 s bounds a scontrol that retries a missing
            # SLURM_CONF for a minute.
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_first_node(nodelist)


def parse_first_node(nodelist: str) -> str:
    """The first host of a node list, without SLURM's tools (see ``first_node``)."""
    first, depth = "", 0
    for char in nodelist:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            break
        first += char
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def export_slurm_rendezvous() -> None:
    """Set the variables torch.distributed's env:// rendezvous reads, from the SLURM step's.

    Every task of the step derives the same rendezvous: the step's first node and a port from the job
    and step ids. Values inherited from the submitting shell are overwritten: sbatch passes its whole
    environment on, and a MASTER_PORT left there would make every job of a sweep that lands on one node
    rendezvous on the same port. (submitit's TorchDistributedEnvironment refuses such inherited
    variables, counts the allocation's tasks instead of the step's, and restricts CUDA_VISIBLE_DEVICES
    to one GPU per task, whereas fsdp_exp's ranks pick cuda:LOCAL_RANK among all of the node's GPUs.)
    """
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    world = external_world()
    if world is None:
        return
    import socket

    master = first_node(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "") or socket.gethostname()
    # Below the kernel's ephemeral range (32768+), where an outgoing connection could hold the port.
    # Consecutive jobs (the tasks of one array are consecutive jobs) get ports 4 apart: a clash needs
    # 3000 jobs between two that run on the same node at the same time.
    job = int(env.get("SLURM_JOB_ID", "0"))
    step = int(_slurm_step_id() or 0)
    port = 20000 + (job * 4 + step % 4) % 12000
    env.update(
        rank_env(
            int(env["SLURM_PROCID"]),
            world[0],
            port,
            master=master,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world=world[1],
        )
    )


def rank_env(
    rank: int,
    world: int,
    port: int,
    master: str = "127.0.0.1",
    local_rank: Optional[int] = None,
    local_world: Optional[int] = None,
) -> dict[str, str]:
    """The variables torch.distributed's env:// rendezvous reads for rank ``rank`` of ``world``, meeting at
    ``master``:``port``, and the rank's place on its node (LOCAL_RANK picks its GPU; by default every rank
    is on one node). For ``os.environ.update``: what fsdp_exp's spawner, the SLURM rendezvous, the
    benchmarks and the tests' own process groups set."""
    return {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
    }


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def placement() -> dict:
    """Where this rank runs: its host name and the address its traffic to the rendezvous host leaves
    from (on a cluster, the node's address on the job's network; 127.0.0.1 on one machine)."""
    import socket

    host, address = socket.gethostname(), None
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:  # a UDP "connection" sends nothing: it only asks the kernel which route, so which address
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, int(os.environ.get("MASTER_PORT") or 1)))
                address = probe.getsockname()[0]
        except OSError:
            address = None
    return {"host": host, "address": address}


def slurm_job() -> Optional[dict]:
    """The SLURM job this rank runs in, for the record: its id (an array element's as ``<array>_<task>``,
    as squeue and sacct name it), partition, nodes, and how many times it was started again (requeued
    after a time limit, a preemption or a failed node); None outside a SLURM step."""
    env = os.environ
    if started_by() != "slurm":
        return None
    job_id = env["SLURM_JOB_ID"]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return {
        "job_id": job_id,
        "partition": env.get("SLURM_JOB_PARTITION"),
        "nodes": env.get("SLURM_JOB_NODELIST"),
        "restarts": int(env.get("SLURM_RESTART_COUNT") or 0),
    }


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


def local_rank() -> int:
    """This process's rank on its node when an outside launcher started it (torchrun's LOCAL_RANK, a SLURM
    task's SLURM_LOCALID), else 0."""
    env = os.environ
    return int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or 0)


# ------------------------------------------------------------------------------------------- memory
# What this process may really use, for the fit check before launch (fsdp_exp/fit_check.py) and for
# telling an out-of-memory death from another SIGKILL (fsdp_exp/oom.py).

# cgroup v1 writes "no limit" as 2**63 - 1 rounded down to a page; anything this large is no limit.
NO_LIMIT = 2**62


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup: ``name`` as /proc/self/cgroup gives it, its ``folder`` under the
    hierarchy's mount point ``top``, and the cgroup ``version``: 2 (the unified hierarchy: memory.max,
    memory.current, memory.events) or 1 (the memory controller's own: memory.limit_in_bytes,
    memory.usage_in_bytes, memory.oom_control). The limits of ``folder`` and of every folder above it
    up to ``top`` apply to this process."""

    name: str
    folder: Path
    top: Path
    version: int

    def _read(self, folder: Path, file: str) -> Optional[str]:
        try:
            return (folder / file).read_text()
        except OSError:
            return None

    def _keyed(self, folder: Path, file: str, key: str) -> Optional[int]:
        """The value of ``key`` in a file of "key value" lines (memory.stat, memory.events, memory.oom_control)."""
        for line in (self._read(folder, file) or "").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
        return None

    def _limit(self, folder: Path) -> Optional[int]:
        text = self._read(folder, "memory.max" if self.version == 2 else "memory.limit_in_bytes")
        limits = [int(text)] if text is not None and text.strip().isdigit() else []  # v2 "max": none
        if self.version == 1:  # also the limits above the visible hierarchy (a container's own cgroup)
            limits += [v for v in [self._keyed(folder, "memory.stat", "hierarchical_memory_limit")] if v is not None]
        limits = [v for v in limits if v < NO_LIMIT]
        return min(limits) if limits else None

    def _used(self, folder: Path) -> Optional[int]:
        """Bytes charged to the cgroup (its descendants included), less the page cache it would drop
        first (inactive files): what cannot be had back without swapping or killing."""
        text = self._read(folder, "memory.current" if self.version == 2 else "memory.usage_in_bytes")
        if text is None or not text.strip().isdigit():
            return None
        cache = self._keyed(folder, "memory.stat", "inactive_file" if self.version == 2 else "total_inactive_file")
        return max(0, int(text) - (cache or 0))

    def folders(self) -> list[Path]:
        """This cgroup's folder and those above it, up to the mount point."""
        chain, folder = [self.folder], self.folder
        while folder != self.top and folder.parent != folder:
            folder = folder.parent
            chain.append(folder)
        return chain

    def tightest_limit(self) -> Optional[tuple[int, int, str]]:
        """(limit, bytes in use, cgroup name) of the limit with the least room left, over this cgroup and
        those above it; None when none of them is limited."""
        best = None
        for folder in self.folders():
            limit, used = self._limit(folder), self._used(folder)
            if limit is None:
                continue
            used = used or 0
            name = "/" + str(folder.relative_to(self.top)).lstrip(".").lstrip("/")
            if best is None or limit - used < best[0] - best[1]:
                best = (limit, used, name)
        return best

    def oom_kills(self) -> Optional[int]:
        """How many processes of this cgroup the OOM killer has killed so far (v2 counts descendants too;
        v1 counts the processes of this cgroup itself, where fsdp_exp's ranks live with their launcher)."""
        if self.version == 2:
            return self._keyed(self.folder, "memory.events", "oom_kill")
        return self._keyed(self.folder, "memory.oom_control", "oom_kill")


def _unescape(field: str) -> str:
    """/proc/self/mountinfo writes spaces and other odd characters as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def memory_cgroup(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> Optional[MemoryCgroup]:
    """This process's memory cgroup (None where there is none to read: not Linux, not mounted).

    A v1 memory controller wins where one is mounted: a hybrid host keeps memory accounting there
    and the unified (v2) hierarchy holds no memory files."""
    try:
        memberships = Path(proc_cgroup).read_text().splitlines()
        mounts = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    paths = {}  # version -> this process's path in that hierarchy
    for line in memberships:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths.setdefault(2, path)
        elif "memory" in controllers.split(","):
            paths[1] = path
    for version in (1, 2):
        if version not in paths:
            continue
        for mount in mounts:
            fields, _, fs = mount.partition(" - ")
            fields, fs = fields.split(), fs.split()
            if len(fields) < 5 or len(fs) < 3:
                continue
            if (version == 2 and fs[0] == "cgroup2") or (
                version == 1 and fs[0] == "cgroup" and "memory" in fs[2].split(",")
            ):
                root, top = _unescape(fields[3]), Path(_unescape(fields[4]))
                path = paths[version]
                # The mount shows the hierarchy from ``root`` down (a container sees its own cgroup as /).
                relative = path[len(root) :] if root != "/" and path.startswith(root) else path
                folder = top / relative.lstrip("/")
                if folder.is_dir():
                    return MemoryCgroup(path, folder, top, version)
    return None


@dataclass(frozen=True)
class HostMemory:
    """This machine's RAM as this process may use it.

    ``available`` is the kernel's MemAvailable, not MemTotal: memory that other processes hold is not
    this run's to take (there may be no swap), as a GPU's memory held by another process is not, while
    the page cache the kernel would drop counts as free. A memory cgroup's limit, less what its
    processes already use, can be tighter still."""

    total: int  # MemTotal
    available: int  # MemAvailable
    cgroup: Optional[str] = None  # the memory cgroup whose limit leaves the least room, if any
    cgroup_limit: Optional[int] = None
    cgroup_used: Optional[int] = None

    @property
    def usable(self) -> int:
        if self.cgroup_limit is None:
            return self.available
        return min(self.available, max(0, self.cgroup_limit - (self.cgroup_used or 0)))

    @property
    def bound_by_cgroup(self) -> bool:
        return self.cgroup_limit is not None and self.usable < self.available

    def describe(self) -> str:
        """E.g. "23.10 GiB available (MemAvailable; 23.54 GiB of RAM)", or with a limiting memory cgroup
        "5.52 GiB left under the memory cgroup /x's limit of 6.00 GiB (0.48 GiB in use; 23.54 GiB of RAM)"."""
        if self.bound_by_cgroup:
            return (
                f"{self.usable / GIB:.2f} GiB left under the memory cgroup {self.cgroup}'s limit of "
                f"{self.cgroup_limit / GIB:.2f} GiB ({(self.cgroup_used or 0) / GIB:.2f} GiB in use; "
                f"{self.total / GIB:.2f} GiB of RAM)"
            )
        return f"{self.available / GIB:.2f} GiB available (MemAvailable; {self.total / GIB:.2f} GiB of RAM)"


def host_memory(cgroup: Optional[MemoryCgroup] = None) -> HostMemory:
    """This machine's RAM and, where this process's memory cgroup (default: read it) has a limit, the
    room left under it."""
    import psutil

    ram = psutil.virtual_memory()  # total = MemTotal, available = MemAvailable on Linux
    cgroup = cgroup or memory_cgroup()
    limit = cgroup.tightest_limit() if cgroup is not None else None
    if limit is None:
        return HostMemory(ram.total, ram.available)
    return HostMemory(ram.total, ram.available, cgroup=limit[2], cgroup_limit=limit[0], cgroup_used=limit[1])


_CUDA_FREE: dict[tuple[int, ...], tuple[float, list[tuple[int, int]]]] = {}
CUDA_FREE_TTL_S = 60.0  # a sweep checks its jobs one after another: ask the GPUs once a minute at most


def cuda_free_memory(devices: tuple[int, ...], *, in_process: bool) -> list[tuple[int, int]]:
    """(free, total) bytes of each CUDA device, as torch.cuda.mem_get_info reports them.

    ``in_process``: ask here, creating a CUDA context on each device (a rank that will use its device
    anyway). Otherwise ask in a short child process: a launcher that made contexts would hold hundreds
    of MiB on every GPU for the whole run, away from its ranks."""
    if in_process:
        import torch

        return [tuple(torch.cuda.mem_get_info(device)) for device in devices]
    asked, answer = _CUDA_FREE.get(devices, (0.0, []))
    if time.monotonic() - asked > CUDA_FREE_TTL_S:
        code = "import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(int(d)) for d in sys.argv[1:]]))"
        out = subprocess.run(
            [sys.executable, "-c", code, *map(str, devices)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        answer = [tuple(pair) for pair in json.loads(out.strip().splitlines()[-1])]
        _CUDA_FREE[devices] = (time.monotonic(), answer)
    return answer
