"""FSDP vs DeepSpeed, measured side by side: the sweep ``experiment=fsdp_vs_deepspeed`` and its table.

    python benchmarks/fsdp_vs_deepspeed.py                    # the sweep (7 configurations x 3 repeats), then the table
    python benchmarks/fsdp_vs_deepspeed.py --sweep-dir DIR    # the table of a sweep already run
    python benchmarks/fsdp_vs_deepspeed.py --set trainer.nproc_per_node=4   # extra overrides for every run

The sweep is an ordinary Hydra multirun (``python -m fsdp_exp -m experiment=fsdp_vs_deepspeed``): FSDP2
and FSDP1 (full sharding), DeepSpeed ZeRO-1/2/3, DDP and DDP + ZeroRedundancyOptimizer on the same model,
data and seed, each run its own process group, the repeats interleaved. Per configuration, over its 3
repeats (fsdp_exp.report.intervals: the median of the runs' medians, and a 95% bootstrap interval over
them, which with 3 repeats is their range):

- tok/s: summary/tokens_per_s_median (global);
- setup s: perf/setup_time_s (build, shard / wrap, materialize, engine; slowest rank);
- 1st step s: perf/first_step_time_s (where lazy buffers are allocated);
- peak MiB: the host peak RSS per rank (max over ranks), the one peak measured the same way for every
  backend here (torch's tracker follows neither FSDP1's flat parameters nor DeepSpeed's partitions); it
  includes each process's runtime, DeepSpeed's import among it;
- states MiB: the model states per rank as each backend holds them (summary/model_states_gib_max);
- comm ms: the profiled step's collectives in flight (comm/total_s), and the exposed part;
- loss: summary/final_loss (the same model, data and seed: equal up to each backend's arithmetic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ORDER = [
    ("fsdp2", "full"),
    ("fsdp1", "full"),
    ("deepspeed", "optimizer"),
    ("deepspeed", "grad_op"),
    ("deepspeed", "full"),
    ("ddp", "no_shard"),
    ("ddp", "optimizer"),
]
NAMES = {
    ("fsdp2", "full"): "FSDP2 full",
    ("fsdp1", "full"): "FSDP1 FULL_SHARD",
    ("deepspeed", "optimizer"): "DeepSpeed ZeRO-1",
    ("deepspeed", "grad_op"): "DeepSpeed ZeRO-2",
    ("deepspeed", "full"): "DeepSpeed ZeRO-3",
    ("ddp", "no_shard"): "DDP",
    ("ddp", "optimizer"): "DDP + ZeroRedundancyOptimizer",
}
PRESETS = {
    ("fsdp2", "full"): "full",
    ("fsdp1", "full"): "fsdp1",
    ("deepspeed", "optimizer"): "zero1",
    ("deepspeed", "grad_op"): "zero2",
    ("deepspeed", "full"): "zero3",
    ("ddp", "no_shard"): "ddp",
    ("ddp", "optimizer"): "optimizer",
}


def run_sweep(sweep_dir: Path, extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "fsdp_exp",
        "-m",
        "experiment=fsdp_vs_deepspeed",
        "logger.wandb.mode=disabled",
        "logger.progress=false",
        "logger.summary_table=false",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def load(sweep_dir: Path) -> dict[tuple, list[dict]]:
    """Completed runs by (backend, strategy): each run's summary, its first row and its profiled row."""
    runs: dict[tuple, list[dict]] = {}
    for record_file in sorted(sweep_dir.glob("*/run.json")):
        record = json.loads(record_file.read_text())
        if record.get("status") != "completed":
            print(f"skipped {record_file.parent.name}: {record.get('status')} {record.get('error', '')}")
            continue
        rows = [json.loads(line) for line in (record_file.parent / "metrics.jsonl").read_text().splitlines()]
        key = (record["config"]["sharding"]["backend"], record["config"]["sharding"]["strategy"])
        runs.setdefault(key, []).append(
            {
                "summary": record["summary"],
                "first": rows[0],
                "comm": next((r for r in rows if "comm/total_s" in r), {}),
                "env": record["env"],
            }
        )
    return runs


def table(runs: dict[tuple, list[dict]]) -> str:
    from fsdp_exp.report.intervals import estimate

    def est(values):
        values = [v for v in values if v is not None]
        return estimate(values) if values else None

    def cell(e, spec, scale=1.0):
        if e is None:
            return "n/a"
        text = format(e.median * scale, spec)
        return f"{text} [{format(e.low * scale, spec)}, {format(e.high * scale, spec)}]" if e.has_interval else text

    mib = 1024.0
    lines = [
        "| configuration | `sharding=` | runs | tok/s (median [95% interval]) | setup s | 1st step s | "
        "peak RSS MiB/rank | model states MiB/rank | comm ms (exposed) | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in ORDER:
        if key not in runs:
            continue
        rs = runs[key]
        s = [r["summary"] for r in rs]
        tok = est([x["summary/tokens_per_s_median"] for x in s])
        setup = est([r["first"].get("perf/setup_time_s") for r in rs])
        first = est([r["first"].get("perf/first_step_time_s") for r in rs])
        peak = est([x["summary/host_peak_rss_gib_max"] for x in s])
        states = statistics.median(x["summary/model_states_gib_max"] for x in s) * mib
        comm = [r["comm"].get("comm/total_s") for r in rs if r["comm"]]
        exposed = [r["comm"].get("comm/exposed_s") for r in rs if r["comm"]]
        comm_cell = f"{statistics.median(comm) * 1e3:.1f} ({statistics.median(exposed) * 1e3:.1f})" if comm else "n/a"
        loss = statistics.median(x["summary/final_loss"] for x in s)
        lines.append(
            f"| {NAMES[key]} | `{PRESETS[key]}` | {len(rs)} | {cell(tok, '.0f')} | {cell(setup, '.2f')} | "
            f"{cell(first, '.2f')} | {cell(peak, '.0f', mib)} | {states:.1f} | {comm_cell} | {loss:.5f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep-dir", type=Path, help="tabulate this sweep folder (run it first when it has no runs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    args = ap.parse_args()
    sweep_dir = (
        args.sweep_dir or REPO / "outputs" / "sweeps" / f"fsdp_vs_deepspeed_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    )
    if not list(sweep_dir.glob("*/run.json")):
        started = time.perf_counter()
        run_sweep(sweep_dir, args.set)
        print(f"sweep: {time.perf_counter() - started:.0f} s in {sweep_dir}")
    runs = load(sweep_dir)
    print(table(runs))
    env = next(iter(runs.values()))[0]["env"] if runs else {}
    print(
        f"\n{env.get('world_size')} ranks, {env.get('threads_per_rank')} thread(s) per rank, "
        f"{env.get('device_type')}, torch {env.get('torch_version')}; {env.get('num_params')} parameters"
    )


if __name__ == "__main__":
    main()
