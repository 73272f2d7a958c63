"""A small matrix of configurations through the real framework: throughput, MFU, HFU, memory and comm.

    python benchmarks/matrix.py            # CPU: {full, grad_op, ddp} x {fp32, bf16} x ac {none, full}
    python benchmarks/matrix.py --full     # a GPU machine: a 1.3B Llama on every GPU, 4 x 2 x 3 configurations
    python benchmarks/matrix.py --quick    # two configurations, a smoke test
    python benchmarks/matrix.py --set trainer.nproc_per_node=4 --set model.n_layers=6   # extra overrides

Each configuration is one `python -m fsdp_exp` run (a fresh process tree, as a user runs it) with
W&B off. Its last warm-up step is the memory-tracked one (torch's tracker, per phase) and the first
step after warm-up is profiled (torch.profiler: comm/*); the summary's medians leave both out.
Columns, per configuration:

- tok/s: summary/tokens_per_s_median (global); step ms: summary/step_time_s_median.
- MFU, HFU: summary medians, against env.peak_tflops (its source is printed under the table: the
  GPU data sheet, or this CPU's measured matmul peak per rank).
- peak MiB / GiB: each phase's and the step's peak per rank as torch's tracker measured it
  (mem/tracked_*_total_gib_max, max over ranks), the planner's prediction (mem/predicted_peak_gib)
  and its error (predicted / measured - 1), and the worst per-phase error.
- CUDA: the allocator's peak allocated bytes (summary/peak_allocated_gib_max), which also hold
  what the tracker does not see (cuBLAS / NCCL workspaces are outside it; allocator rounding inside).
- AG / RS / AR / exposed ms: the profiled step's all-gather, reduce-scatter, all-reduce and exposed
  communication times (comm/*, max over ranks).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# CPU (the default): big enough that a step takes about a tenth of a second on a 2-core machine and
# the tracker's numbers are MiB, small enough that 12 runs take a few minutes.
CPU_MODEL = [
    "model.dim=256",
    "model.n_layers=3",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=4096",
    "model.multiple_of=64",
    "trainer.seq_len=128",
    "trainer.global_batch_size=8",
]
CPU_MATRIX = {"sharding": ["full", "grad_op", "ddp"], "precision": ["fp32", "bf16"], "ac": ["none", "full"]}
# GPU (--full): a 1.3B Llama, sequences of 2048, 4 sequences per GPU per step (no accumulation), on
# every GPU (trainer.global_batch_size is set from the GPU count).
GPU_MODEL = [
    "model.dim=2048",
    "model.n_layers=24",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.vocab_size=32000",
    "model.multiple_of=256",
    "model.max_seq_len=2048",
    "trainer.seq_len=2048",
]
GPU_SEQUENCES_PER_RANK = 4
GPU_MATRIX = {
    "sharding": ["full", "grad_op", "no_shard", "ddp"],
    "precision": ["fp32", "bf16"],
    "ac": ["none", "full", "selective"],
}
STEPS, WARMUP = 8, 2  # tracked step 1 (0-based), profiled step 2, 5 steps in the medians


def run(overrides: list[str], run_dir: Path) -> dict:
    """One experiment; its summary, env, the tracked step's row and the profiled step's row."""
    cmd = [
        sys.executable,
        "-m",
        "fsdp_exp",
        *overrides,
        f"trainer.steps={STEPS}",
        f"trainer.warmup_steps={WARMUP}",
        f"trainer.profile_steps=[{WARMUP}]",
        "logger.wandb.mode=disabled",
        "logger.progress=false",
        "logger.summary_table=false",
        "checkpoint.on_signal=false",
        "trainer.digest_shards=false",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    record = json.loads((run_dir / "run.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "summary": record["summary"],
        "env": record["env"],
        "tracked": next((r for r in rows if "mem/tracked_total_gib_max" in r), {}),
        "comm": next((r for r in rows if "comm/total_s" in r), {}),
    }


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the GPU matrix (a 1.3B Llama on every GPU)")
    ap.add_argument("--quick", action="store_true", help="two configurations only")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    args = ap.parse_args()

    model, matrix = (GPU_MODEL, GPU_MATRIX) if args.full else (CPU_MODEL, CPU_MATRIX)
    if args.full:
        import torch

        if not torch.cuda.is_available():
            sys.exit("--full is the GPU matrix; this machine has no CUDA device (run without --full)")
        model = [*model, f"trainer.global_batch_size={GPU_SEQUENCES_PER_RANK * torch.cuda.device_count()}"]
    configs = [dict(zip(matrix, values)) for values in itertools.product(*matrix.values())]
    if args.quick:
        configs = configs[:1] + configs[-1:]
    work = Path(tempfile.mkdtemp(prefix="fsdp_exp_matrix_"))
    big = args.full
    unit, scale = ("GiB", 1.0) if big else ("MiB", 1024.0)
    header = (
        f"{'config':<24} {'tok/s':>9} {'step ms':>8} {'MFU':>6} {'HFU':>6} {'fwd':>8} {'bwd':>8} {'opt':>8} "
        f"{'peak':>8} {'planned':>8} {'err':>6} {'worst':>6} "
        + (f"{'alloc':>8} " if big else "")
        + f"{'AG ms':>7} {'RS ms':>7} {'AR ms':>7} {'exposed':>8}"
    )
    print(
        f"peak memory per rank in {unit}: measured per phase (fwd, bwd, opt) and for the step (peak), the "
        "planner's prediction (planned), its error and its worst per-phase error",
        flush=True,
    )
    print(header, flush=True)
    peaks, errors, started = set(), [], time.perf_counter()
    for i, config in enumerate(configs):
        name = "-".join(config.values())
        result = run([*model, *(f"{k}={v}" for k, v in config.items()), *args.set], work / f"{i}_{name}")
        if "error" in result:
            print(f"{name:<24} {result['error']}", flush=True)
            continue
        s, env, tr, cm = result["summary"], result["env"], result["tracked"], result["comm"]
        peaks.add(f"{env['peak_tflops']:.4g} TFLOPS ({env['peak_tflops_source']})")

        def mem(key):
            return tr[key] * scale if tr.get(key) is not None else None

        phase_errors = [
            tr[f"mem/predicted_{p}_peak_gib"] / tr[f"mem/tracked_{p}_total_gib_max"] - 1
            for p in ("forward", "backward", "optimizer")
            if tr.get(f"mem/tracked_{p}_total_gib_max")
        ]
        worst = max(phase_errors, key=abs) if phase_errors else None
        err = s.get("summary/planner_peak_error")
        if err is not None:
            errors.append((name, err, worst))

        def ms(key):
            return cm[key] * 1e3 if cm.get(key) is not None else None

        print(
            f"{name:<24} {fmt(s['summary/tokens_per_s_median'], '9.0f')} "
            f"{fmt(s['summary/step_time_s_median'] * 1e3, '8.1f')} {fmt(s['summary/mfu_median'], '6.3f')} "
            f"{fmt(s['summary/hfu_median'], '6.3f')} {fmt(mem('mem/tracked_forward_total_gib_max'), '8.2f')} "
            f"{fmt(mem('mem/tracked_backward_total_gib_max'), '8.2f')} "
            f"{fmt(mem('mem/tracked_optimizer_total_gib_max'), '8.2f')} "
            f"{fmt(mem('mem/tracked_total_gib_max'), '8.2f')} "
            f"{fmt(mem('mem/predicted_peak_gib'), '8.2f')} {fmt(err and err * 100, '+5.1f')}% "
            f"{fmt(worst and worst * 100, '+5.1f')}% "
            + (f"{fmt(s.get('summary/peak_allocated_gib_max'), '8.2f')} " if big else "")
            + f"{fmt(ms('comm/all_gather_s'), '7.2f')} {fmt(ms('comm/reduce_scatter_s'), '7.2f')} "
            f"{fmt(ms('comm/all_reduce_s'), '7.2f')} {fmt(ms('comm/exposed_s'), '8.2f')}",
            flush=True,
        )

    if errors:
        lo, hi = min(e for _, e, _ in errors), max(e for _, e, _ in errors)
        worst = max((w for _, _, w in errors if w is not None), key=abs, default=None)
        print(
            f"\nplanner error of the step's peak over {len(errors)} configurations: {lo * 100:+.2f}% to "
            f"{hi * 100:+.2f}%; "
            f"worst per-phase error {fmt(worst and worst * 100, '+.2f')}%"
        )
    for peak in sorted(peaks):
        print(f"peak used for MFU/HFU: {peak}")
    print(
        f"settings: {' '.join([*model, *args.set])} | steps {STEPS}, warm-up {WARMUP} (tracked step {WARMUP}, "
        f"profiled step {WARMUP + 1}, 1-based) | {len(configs)} runs in {time.perf_counter() - started:.0f} s | "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    if args.keep:
        print(f"run folders: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
