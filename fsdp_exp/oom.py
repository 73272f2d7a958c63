"""Was a rank that died by SIGKILL killed by the kernel's OOM killer? The launcher asks when one does.

A SIGKILL leaves no Python error: without this, a rank that ran out of host memory and one killed by a
person or a scheduler read the same ("the process was killed by SIGKILL"). ``OomWatch`` notes, before the
ranks start, the OOM killer's counters and the memory the node has; ``explain`` then weighs the evidence,
best first:

- the kernel log (/dev/kmsg, where this process may read it) naming the dead rank's process id;
- the oom_kill counter of the memory cgroup the ranks share with the launcher (cgroup v2 memory.events,
  v1 memory.oom_control), against its value before the ranks started;
- the machine's own counter (/proc/vmstat oom_kill), which any process's death moves.
"""

from __future__ import annotations

import os
import re
import time
from typing import Optional

from fsdp_exp.env import HostMemory, host_memory, memory_cgroup
from fsdp_exp.units import GIB


def _machine_oom_kills() -> Optional[int]:
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def kernel_log_oom_line(pid: int, since_s: float = 0.0) -> Optional[str]:
    """The kernel log's line about the OOM killer killing process ``pid`` (logged at or after ``since_s``,
    in seconds of CLOCK_MONOTONIC); "" when the log is readable but has none; None when it is not
    readable (no /dev/kmsg, or not allowed: kernel.dmesg_restrict, a container)."""
    try:
        kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = ""
    killed = re.compile(rf"(Killed process {pid}\b|oom-kill:.*[,:]pid={pid}[,\s])")
    try:
        while True:
            try:
                record = os.read(kmsg, 8192).decode(errors="replace")
            except BlockingIOError:  # the end of the log
                break
            except OSError:  # EPIPE: the ring buffer overwrote the record being read; go on with the next
                continue
            header, _, message = record.partition(";")
            parts = header.split(",")
            stamp_s = int(parts[2]) / 1e6 if len(parts) > 2 and parts[2].isdigit() else since_s
            if stamp_s + 1.0 >= since_s and killed.search(message):
                # "Memory cgroup out of memory: Killed process ..." beats the "oom-kill:constraint=..." line
                if not found or "Killed process" in message:
                    found = message.strip().splitlines()[0]
    finally:
        os.close(kmsg)
    return found


class OomWatch:
    """The OOM killer's counters and the node's memory, noted when the ranks start."""

    def __init__(self) -> None:
        self.since_s = time.monotonic()
        self.cgroup = memory_cgroup()
        self.cgroup_kills = self.cgroup.oom_kills() if self.cgroup is not None else None
        self.machine_kills = _machine_oom_kills()
        try:
            self.memory: Optional[HostMemory] = host_memory(self.cgroup)
        except Exception:  # noqa: BLE001 - a diagnosis must never stop a run
            self.memory = None

    def killed_by_oom(self, pid: Optional[int]) -> tuple[Optional[bool], str]:
        """(True: the OOM killer did it, False: it did not, None: cannot tell; the evidence in words)."""
        line = kernel_log_oom_line(pid, self.since_s) if pid is not None else None
        if line:
            return True, f"kernel log: {line[:200]}"
        cgroup_kills = self.cgroup.oom_kills() if self.cgroup is not None else None
        if cgroup_kills is not None and self.cgroup_kills is not None:
            n = cgroup_kills - self.cgroup_kills
            if n > 0:
                return True, f"the OOM killer killed {n} process(es) of this run's memory cgroup {self.cgroup.name}"
            if line == "":
                return False, "no OOM kill of it in the kernel log, none in this run's memory cgroup"
            return False, f"no OOM kill in this run's memory cgroup {self.cgroup.name}"
        machine = _machine_oom_kills()
        if machine is not None and self.machine_kills is not None:
            n = machine - self.machine_kills
            if n > 0:
                return None, f"the OOM killer killed {n} process(es) on this machine meanwhile (/proc/vmstat)"
            return False, "no OOM kill on this machine meanwhile (/proc/vmstat)"
        return None, "neither the kernel log nor the OOM killer's counters are readable here"

    def explain(self, pid: Optional[int]) -> str:
        """What to add to "the process was killed by SIGKILL": whether the OOM killer did it, and the
        memory the node had."""
        verdict, evidence = self.killed_by_oom(pid)
        head = {
            True: "out of memory: the kernel's OOM killer killed it",
            False: "not by the OOM killer",
            None: "perhaps out of memory",
        }[verdict]
        return f"{head} ({evidence}). {self.node_memory()}"

    def node_memory(self) -> str:
        m = self.memory
        if m is None:
            return "The node's memory is not known."
        text = f"The node has {m.total / GIB:.2f} GiB of RAM"
        if m.cgroup_limit is not None:
            text += f", {m.cgroup_limit / GIB:.2f} GiB of it for the memory cgroup {m.cgroup}"
        text += f"; {m.usable / GIB:.2f} GiB was free for the ranks when they started"
        return text + " (python -m fsdp_exp.plan with the same overrides predicts what each rank needs)."
