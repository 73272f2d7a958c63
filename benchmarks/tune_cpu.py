"""How good are the tuner's predictions on this CPU? 8 configurations measured 3 times each.

    python benchmarks/tune_cpu.py                  # about 10-15 minutes on 2 idle cores
    python benchmarks/tune_cpu.py --repeats 2 --out /tmp/tune_bench
    python benchmarks/tune_cpu.py --precisions fp32        # one precision only (the earlier benchmark)

1. ``python -m fsdp_exp.tune`` on a small Llama (4 blocks of width 128) over FSDP2, FSDP1 and DDP, AC on and
   off, every micro-batch size, precisions fp32, bf16 and bf16_pure (``--precisions``), with a fresh cache (so the model starts from the CPU probe alone, uncalibrated),
   measures the 3 best predicted candidates, 4 more spread over the ranking and the 2 baselines (DDP, full
   shard): 8 or 9 configurations (a baseline may be among the best), each ``--repeats`` times, in one
   interleaved sweep. It reports the Spearman rank correlation of predicted and measured tokens/s, the
   measured winner and whether the predicted one ties with it (95% bootstrap intervals over the repeats),
   the measured winner's predicted rank, and predicted / measured of every measured configuration.
2. ``tune.calibrate_from`` that sweep, then the same space predicted again: the same figures against the same
   measurements (in-sample: the calibration saw them).

The figures go to ``<out>/summary.json`` and are printed; benchmarks/RESULTS.md quotes a run of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "trainer.seq_len=128",
    "trainer.global_batch_size=16",
    "trainer.steps=8",
    "trainer.warmup_steps=3",
    "logger.wandb.mode=disabled",
    "logger.progress=false",
    "logger.summary_table=false",
]
SPACE = [
    "tune.space.backend=[fsdp2,fsdp1,ddp]",
    "tune.space.offload=[none]",
    "tune.space.prefetch=[default]",
    "tune.space.ac=[none,full]",
]


def tune(args: list[str], env: dict) -> None:
    subprocess.run([sys.executable, "-m", "fsdp_exp.tune", *args], cwd=REPO, env=env, check=True)


def figures(path: Path) -> dict:
    data = json.loads(path.read_text())
    rows = [
        {
            "ratio": c["predicted"]["tokens_per_s"] / c["measured"]["tokens_per_s"],
            "id": c["id"],
            "rank": c["rank"],
            "roles": c["roles"],
            "predicted": c["predicted"]["tokens_per_s"],
            "measured": c["measured"]["tokens_per_s"],
            "interval": c["measured"]["tokens_per_s_ci"],
            "candidate": " ".join(c["choices"]),
        }
        for c in data["candidates"]
        if c["measured"] and c["measured"].get("tokens_per_s")
    ]
    best = max(rows, key=lambda r: r["measured"]) if rows else None
    return {
        "winner_predicted_rank": best["rank"] if best else None,
        "largest_factor": max(max(r["ratio"], 1 / r["ratio"]) for r in rows) if rows else None,
        "spearman": data["spearman"],
        "winner": data["winner"],
        "mae_tokens_per_s": data["mae_tokens_per_s"],
        "configurations": len(rows),
        "rows": rows,
        "calibration": data["device"]["calibration"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="fsdp_exp_tune_bench_")))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,bf16,bf16_pure", help="the precision presets searched")
    args = parser.parse_args()
    space = [*SPACE, f"tune.space.precision=[{args.precisions}]"]
    env = {**os.environ, "XDG_CACHE_HOME": str(args.out / "cache"), "OMP_NUM_THREADS": "1"}
    start, load_before = time.time(), os.getloadavg()
    measured = args.out / "measured"
    tune(
        [
            *RUN,
            *space,
            "tune.top_k=3",
            "tune.spread=4",
            f"tune.repeats={args.repeats}",
            "tune.run=true",
            f"tune.out={measured}",
        ],
        env,
    )
    calibrated = args.out / "calibrated"
    tune(
        [
            *RUN,
            *space,
            "tune.top_k=3",
            "tune.spread=4",
            f"tune.repeats={args.repeats}",
            f"tune.calibrate_from={measured / 'sweep'}",
            f"tune.out={calibrated}",
        ],
        env,
    )
    summary = {
        "uncalibrated": figures(measured / "tune.json"),
        "calibrated (in-sample)": figures(calibrated / "tune.json"),
        "repeats": args.repeats,
        "minutes": (time.time() - start) / 60,
        # the machine's load average (1, 5, 15 min) before and after: other programs slow the measured runs
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "out": str(args.out),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name in ("uncalibrated", "calibrated (in-sample)"):
        f = summary[name]
        print(
            f"{name}: {f['configurations']} configurations, Spearman {f['spearman']}, "
            f"MAE {f['mae_tokens_per_s']:.0f} tokens/s; {f['winner']['verdict']}; the measured winner predicted "
            f"#{f['winner_predicted_rank']}; predicted / measured within x{f['largest_factor']:.2f} everywhere"
        )
        for row in sorted(f["rows"], key=lambda r: -r["measured"]):
            lo, hi = row["interval"] or (None, None)
            print(
                f"  {row['id']} #{row['rank']:<4} predicted {row['predicted']:8.0f}  "
                f"measured {row['measured']:8.0f} [{lo:.0f}, {hi:.0f}] (x{row['ratio']:.2f})  {row['candidate']}  "
                f"({', '.join(row['roles'])})"
            )
    load = summary["load_average"]
    print(
        f"{summary['minutes']:.1f} minutes; load average {load['before'][0]:.1f} before, {load['after'][1]:.1f} over "
        f"the last 5 minutes; {args.out / 'summary.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
