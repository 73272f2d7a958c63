"""How long the default experiment takes from the command to the prompt, and where the time goes.

    python benchmarks/startup.py                 # median wall time of 5 runs, then one traced run's phases
    python benchmarks/startup.py --runs 9 -- trainer.steps=20   # more runs; overrides after --
    python benchmarks/startup.py --no-phases     # the median only
    python benchmarks/startup.py --runs 0        # the traced run only

Each run is ``python -m fsdp_exp`` in a fresh process, with its own run folder, timed from the
moment it is started to its exit. The first run is a warm-up (file cache, the CPU matmul peak's cache
entry) and is not counted. The traced run is the same command in a process that wraps the launcher's
and one rank's stages with timers (nothing else changes), and prints when each stage ended, in seconds
since the process started, and the CPU seconds every process used: the machine has 2 cores, so CPU time
and wall time differ when ranks and the launcher compute at once, or when others' programs run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE_ENV = "FSDP_EXP_STARTUP_TRACE"  # the traced run's folder for its stage times (one JSON per process)
# Heavy packages a process may import; the trace says which each one did (none is needed everywhere).
HEAVY = (
    "torch",
    "torch._dynamo",
    "torch._inductor",
    "sympy",
    "wandb",
    "wandb.sdk.launch",
    "transformers",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "deepspeed",
    "torchao",
    "scipy",
    "pandas",
    "matplotlib",
)


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc: what runs before Python code counts too."""
    ticks = os.sysconf("SC_CLK_TCK")
    since_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


class Stages:
    """Times at which named stages of this process end, written to the trace folder at the end."""

    def __init__(self, name: str):
        self.name, self.marks = name, [("process start", process_start_time())]

    def mark(self, label: str) -> None:
        self.marks.append((label, time.time()))

    def wrap(self, owner, attribute: str, label: str, first_only: bool = False) -> None:
        """Mark when ``owner.attribute`` (a function) returns; where it is absent, mark nothing."""
        original = getattr(owner, attribute, None)
        if original is None:
            return
        done = []

        def timed(*args, **kwargs):
            result = original(*args, **kwargs)
            if not (first_only and done):
                done.append(True)
                self.mark(label)
            return result

        setattr(owner, attribute, timed)

    def save(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        folder = Path(os.environ[TRACE_ENV])
        (folder / f"{self.name}.json").write_text(
            json.dumps(
                {
                    "marks": self.marks,
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                    "imported": [name for name in HEAVY if name in sys.modules],
                }
            )
        )


def traced_rank(local_rank: int, nprocs: int, port: int, payload, *how) -> None:
    """A spawned rank (in place of the launcher's own), with its stages timed."""
    stages = Stages(f"rank{local_rank}")
    stages.mark("rank up (forked: at once; spawned: a new interpreter and torch)")
    import fsdp_exp.trainer as trainer
    from fsdp_exp import launch

    stages.mark("imports (fsdp_exp.trainer)")
    stages.wrap(trainer, "init_distributed", "process group")
    stages.wrap(trainer.Trainer, "__init__", "trainer built (model, shards, optimizer, data)")
    stages.wrap(trainer.Trainer, "_start_record", "record opened (env, W&B init)")
    stages.wrap(trainer.Trainer, "train_step", "first step", first_only=True)
    stages.wrap(trainer.Trainer, "fit", "steps done, record closed")
    run_worker = trainer.run_worker

    def timed_worker(payload):
        run_worker(payload)
        stages.mark("process group closed")
        stages.save()

    trainer.run_worker = timed_worker
    # A forked rank has the launcher's modules, where _spawned_rank is this function: call the original.
    untraced = getattr(launch, "untraced_rank", launch._spawned_rank)
    untraced(local_rank, nprocs, port, payload, *how)


def traced_launcher(overrides: list[str]) -> None:
    stages = Stages("launcher")
    import fsdp_exp.__main__ as entry
    import fsdp_exp.data
    import fsdp_exp.fit_check
    from fsdp_exp import launch
    from fsdp_exp.record import RunRecord

    stages.mark("imports (fsdp_exp.__main__, launch)")
    original_launch = launch.launch

    def timed_launch(*args, **kwargs):
        stages.mark("composed (Hydra) and typed")
        return original_launch(*args, **kwargs)

    launch.launch = timed_launch
    stages.wrap(launch, "validate", "validated")
    stages.wrap(fsdp_exp.fit_check, "check_fit", "planned (fit check)")
    stages.wrap(fsdp_exp.data, "prepare_data", "data prepared")
    stages.wrap(RunRecord, "starting", "run.json started")
    stages.wrap(launch, "_spawn", "ranks ended")
    launch.untraced_rank, launch._spawned_rank = launch._spawned_rank, traced_rank
    sys.argv = ["fsdp_exp", *overrides]

    @atexit.register  # run by the launcher's own way out (fsdp_exp.__main__.leave_when_done), as any exit's
    def save() -> None:
        stages.mark("launcher done")
        stages.save()

    leave = getattr(entry, "leave_when_done", None)
    leave(entry.main) if leave else entry.main()


def run_once(overrides: list[str], run_dir: Path, env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", f"hydra.run.dir={run_dir}", *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def print_phases(folder: Path, started: float, ended: float) -> None:
    traces = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    cpu = sum(trace["cpu_s"] for trace in traces.values())
    print(
        f"\ntraced run: {ended - started:.2f} s wall, {cpu:.2f} CPU s in all (times: seconds since the command started)"
    )
    for name, trace in traces.items():
        print(f"  {name} (CPU {trace['cpu_s']:.2f} s; imported {', '.join(trace['imported'])})")
        previous = None
        for label, at in trace["marks"]:
            took = "" if previous is None else f"  (+{at - previous:.2f})"
            print(f"    {at - started:6.2f}  {label}{took}")
            previous = at
    print(f"    {ended - started:6.2f}  exit (the command returned)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=5, help="counted runs, after one warm-up run (0: only the traced run)"
    )
    parser.add_argument("--no-phases", action="store_true", help="skip the traced run")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="fsdp_exp_startup_") as tmp:
        root = Path(tmp)
        if args.runs > 0:
            run_once(args.overrides, root / "warmup", env)
            walls = []
            for i in range(args.runs):
                walls.append(run_once(args.overrides, root / f"run{i}", env))
                print(f"run {i + 1}: {walls[-1]:.2f} s (load average {os.getloadavg()[0]:.2f})", flush=True)
            print(
                f"median wall time of {args.runs} runs: {statistics.median(walls):.2f} s (min {min(walls):.2f}, "
                f"max {max(walls):.2f}); `python -m fsdp_exp {' '.join(args.overrides)}`"
            )
        if args.no_phases:
            return
        folder = root / "trace"
        folder.mkdir()
        started = time.time()
        subprocess.run(
            [sys.executable, __file__, "--traced", f"hydra.run.dir={root / 'traced'}", *args.overrides],
            cwd=REPO,
            env={**env, TRACE_ENV: str(folder)},
            stdout=subprocess.DEVNULL,
            check=True,
        )
        print_phases(folder, started, time.time())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--traced"]:
        traced_launcher(sys.argv[2:])
    else:
        main()
