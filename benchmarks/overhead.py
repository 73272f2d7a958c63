"""Framework overhead: fsdp_exp's training throughput vs. a minimal hand-written FSDP2 loop.

    python benchmarks/overhead.py              # 5 interleaved pairs (--pairs N), about 4 minutes
    python benchmarks/overhead.py --quick      # 1 pair, smoke test
    python benchmarks/overhead.py --metrics    # what the per-step metrics cost, within one run (2 minutes)

Both sides train the same Llama (MODEL below), on the same world size (2 gloo ranks on CPU, one
thread each, as the framework sets), with the same FSDP2 settings (fully_shard per block then the
root, reshard_after_forward=True, explicit forward/backward prefetch of one block = prefetch=default),
the same AdamW + warm-up/cosine schedule, fp32 cross-entropy and clip_grad_norm_(1.0). Each side times
every step on rank 0 with time.perf_counter around the same region (batch, zero_grad, forward, loss,
backward, clip, optimizer step, scheduler step) and reports the median global tokens/s over the
post-warm-up steps. The framework's number is run.json's summary/tokens_per_s_median, whose step time
includes the framework's per-step metric all-reduces (loss, memory); the baseline has none.

Runs alternate framework, baseline, framework, baseline, ... so that slow drift of the machine hits
both sides alike; the result is the median over pairs of (framework tokens/s / baseline tokens/s).
The project's goal is a ratio >= 0.98. The "other cores" column says how much CPU other programs took
during each run: on a 2-core machine anything above ~0.1 makes that pair noisy (rerun when quiet).

``--metrics`` answers a narrower question inside one run: what do the default per-step metrics
(memory accounting, the two metric all-reduces, metrics.jsonl, the offline W&B run) add to a step?
Each rank builds the framework's own Trainer and runs its step loop with two step kinds, interleaved
(F M M F F M ...: which kind goes first alternates, so drift and ordering hit both): "full" is the
step as ``fit()`` runs it (train_step, the stop guard's flag poll, the step metrics' ``log``); "minimal"
replaces ``log`` with ``loss.item()``, what any loop that prints its loss pays. Both are timed on rank 0 with
time.perf_counter around the same region; the result is median(full) / median(minimal), for the
default experiment's model and for the model above. The memory-tracked step is off (it is a warm-up
step, sampled once, not a per-step cost), and so is the progress bar.
"""

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
# Big enough that a step takes a few tenths of a second on a 2-core CPU, so timer and scheduler
# noise stay small next to it; small enough that a whole benchmark takes minutes.
MODEL = dict(dim=256, n_layers=3, n_heads=8, n_kv_heads=4, vocab_size=4096, multiple_of=64, max_seq_len=256)
BATCH, SEQ = 8, 128  # global sequences per step, tokens per sequence
# The framework's optim=adamw defaults, restated here so the baseline does not depend on them.
LR, BETAS, EPS, WD, LR_WARMUP, MIN_LR_RATIO, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 2, 0.1, 1.0


# ------------------------------------------------------------------------------- the framework
def run_framework(steps: int, warmup: int, run_dir: Path) -> tuple[float, list[float]]:
    """One `python -m fsdp_exp` run: (its run.json's median tokens/s, its post-warm-up step times)."""
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"trainer.steps={steps}",
        f"trainer.warmup_steps={warmup}",
        f"trainer.nproc_per_node={WORLD}",
        f"trainer.global_batch_size={BATCH}",
        f"trainer.seq_len={SEQ}",
        "prefetch=default",
        # The loss as a user gets it: trainer.loss_chunks=auto, which the planner settles on 1 here (the logits are
        # too small a part of the peak to pay for the chunked loss's second pass through the output head), the
        # baseline's way; run.json applied.loss_chunks says what was chosen (printed per run below).
        "logger.wandb.mode=disabled",
        "logger.progress=false",
        "logger.summary_table=false",
        f"hydra.run.dir={run_dir}",
    ]
    subprocess.run([sys.executable, "-m", "fsdp_exp", *overrides], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    record = json.loads((run_dir / "run.json").read_text())
    steps_s = [m["perf/step_time_s"] for m in map(json.loads, open(run_dir / "metrics.jsonl"))][warmup:]
    CHOSEN.append(record["applied"]["loss_chunks"])
    return record["summary"]["summary/tokens_per_s_median"], steps_s


CHOSEN: list[dict] = []  # each framework run's applied.loss_chunks (trainer.loss_chunks=auto's choice)


# -------------------------------------------------------------------------------- the baseline
def baseline_rank(rank: int, port: int, steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_exp.config import ModelConfig  # the model definition only
    from fsdp_exp.env import rank_env
    from fsdp_exp.models.llama import Llama

    os.environ.update(rank_env(rank, WORLD, port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))  # as the framework does
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)

    with torch.device("meta"):
        model = Llama(ModelConfig(**MODEL))
    # The framework passes fp32 explicitly for precision=fp32; do the same so FSDP2 sees equal policies.
    fsdp = dict(
        mesh=mesh,
        reshard_after_forward=True,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    )
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, **fsdp)
    fully_shard(model, **fsdp)
    for prev, nxt in zip(blocks, blocks[1:]):  # prefetch one block ahead in forward, one back in backward
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    model.to_empty(device="cpu")
    with torch.no_grad():  # values only matter for the loss to be sane; each rank fills its own shard
        for name, p in model.named_parameters():
            std = model.init_std(name)  # None: a norm weight
            if std is None:
                p.to_local().fill_(1.0)
            else:
                p.to_local().normal_(0.0, std)
    model.init_buffers(torch.device("cpu"))

    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    decay = max(1, steps - LR_WARMUP)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / LR_WARMUP
            if s < LR_WARMUP
            else MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - LR_WARMUP) / decay)))
        ),
    )

    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        # A fresh batch of this rank's share: the framework also draws its synthetic batch in the timer.
        tokens = torch.randint(0, MODEL["vocab_size"], (BATCH // WORLD, SEQ + 1))
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)  # CPU: every op above has finished, no sync needed

    if rank == 0:  # the framework also reports rank 0's clock
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_baseline(steps: int, warmup: int, out: Path) -> tuple[float, list[float]]:
    """One hand-written run: (median tokens/s, post-warm-up step times), as run_framework."""
    with socket.socket() as s:  # a free port for this run's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(baseline_rank, args=(port, steps, str(out)), nprocs=WORLD, start_method="spawn")
    measured = json.loads(out.read_text())[warmup:]  # same steps the framework's summary keeps
    return statistics.median(BATCH * SEQ / t for t in measured), measured


# ----------------------------------------------------------------------------- --metrics
def metrics_rank(rank: int, port: int, overrides: list[str], steps: int, run_dir: str, out: str) -> None:
    """One rank of the in-run comparison: the real Trainer, full and minimal steps interleaved."""
    from fsdp_exp.preflight import validate
    from fsdp_exp.dist import init_distributed
    from fsdp_exp.env import rank_env
    from fsdp_exp.launch import run_context
    from fsdp_exp.plan import compose
    from fsdp_exp.trainer import Trainer

    os.environ.update(rank_env(rank, WORLD, port))
    cfg = compose(overrides)
    topology = validate(cfg, cuda_devices=0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))  # as the framework does
    trainer = Trainer(run_context(cfg, topology, Path(run_dir)), init_distributed(topology))
    trainer._start_record()
    times: list[tuple[int, bool, float, float]] = []  # (step, full?, seconds, of which in metrics.log)
    for step in range(steps):
        pair, second = divmod(step, 2)
        full = (pair % 2 == 0) != bool(second)  # F M, M F, F M, ...
        start = time.perf_counter()
        loss, grad_norm, lr = trainer.train_step(step)
        trainer.guard.poll(step + 1, loss, saves=trainer.checkpointer.saves_at(step + 1))
        logging = time.perf_counter()
        if full:
            trainer.metrics.log(step + 1, start, loss, grad_norm, lr, trainer.evaluate)
        else:
            loss.item()
        logged = time.perf_counter()
        trainer.checkpointer.save_if_due(step + 1)
        times.append((step, full, time.perf_counter() - start, logged - logging))
    trainer.guard.finish()
    trainer.checkpointer.finish()
    trainer.recorder.close(status="completed")
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_metrics_comparison(name: str, overrides: list[str], steps: int, warmup: int, work: Path) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / f"metrics_{name}.json"
    (work / name).mkdir()  # the run directory (the launcher makes it for a normal run)
    overrides = [
        *overrides,
        f"trainer.steps={steps}",
        f"trainer.nproc_per_node={WORLD}",
        "trainer.track_memory=false",
        "logger.progress=false",
        "logger.summary_table=false",
    ]
    _, other = timed(
        lambda: mp.start_processes(
            metrics_rank, args=(port, overrides, steps, str(work / name), str(out)), nprocs=WORLD, start_method="spawn"
        )
    )
    times = [t for t in json.loads(out.read_text()) if t[0] >= warmup]
    full, minimal = [t[2] for t in times if t[1]], [t[2] for t in times if not t[1]]
    in_log = statistics.median(t[3] for t in times if t[1])
    ratio = statistics.median(full) / statistics.median(minimal)
    lo, hi = statistics.median(minimal), statistics.median(full)
    print(
        f"{name:<14} {len(full):>5} + {len(minimal):<5} {lo * 1e3:>11.2f} {hi * 1e3:>11.2f} {(hi - lo) * 1e3:>9.2f} "
        f"{in_log * 1e3:>9.2f} {ratio:>7.4f} {other:>12.2f}",
        flush=True,
    )
    return ratio


def metrics_main(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="fsdp_exp_metrics_overhead_"))
    os.environ.setdefault("WANDB_SILENT", "true")
    # The default experiment as `python -m fsdp_exp` composes it (llama_tiny, W&B offline), and the model above.
    cases = {
        "default": [],
        "benchmark": [f"model.{k}={v}" for k, v in MODEL.items()]
        + [f"trainer.global_batch_size={BATCH}", f"trainer.seq_len={SEQ}"],
    }
    steps = {"default": args.metrics_steps * 4, "benchmark": args.metrics_steps}
    # cost ms: median full - median minimal step; in log ms: rank 0's median time inside metrics.log (full steps).
    print(
        f"{'model':<14} {'steps (F + M)':>13} {'minimal ms':>11} {'full ms':>11} {'cost ms':>9} {'in log ms':>9} "
        f"{'ratio':>7} {'other cores':>12}",
        flush=True,
    )
    ratios = {
        name: run_metrics_comparison(name, [*overrides, *args.set], steps[name], args.warmup, work)
        for name, overrides in cases.items()
    }
    for name, ratio in ratios.items():
        print(
            f"{name}: per-step metrics add {(ratio - 1) * 100:+.2f}% to the median step "
            f"[{'within' if ratio < 1.02 else 'ABOVE'} the 2% goal]"
        )
    print(
        f"settings: world {WORLD} (gloo, {max(1, (os.cpu_count() or 1) // WORLD)} thread/rank) | "
        f"{' '.join(args.set) or 'W&B offline (the default)'} | "
        f"first {args.warmup} steps left out | torch {torch.__version__} | "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    if args.keep:
        print(f"run folders: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------ main
def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process and its finished children).

    The difference over a run is CPU that other programs took meanwhile: on a shared 2-core box a
    test suite running next to us slows whichever side it overlaps, so each pair shows it."""
    try:
        ticks = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    except OSError:  # not Linux: no contamination column
        return float("nan"), 0.0
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    own = sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )
    return busy, own


def timed(fn, *args):
    """fn(*args), plus the average number of cores other programs kept busy while it ran."""
    (busy0, own0), t0 = cpu_seconds(), time.perf_counter()
    result = fn(*args)
    (busy1, own1), wall = cpu_seconds(), time.perf_counter() - t0
    return result, max(0.0, (busy1 - busy0) - (own1 - own0)) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="framework/baseline pairs to run, interleaved")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    ap.add_argument("--quick", action="store_true", help="one pair: a smoke test")
    ap.add_argument("--keep", action="store_true", help="keep the framework's run folders")
    ap.add_argument("--metrics", action="store_true", help="the per-step metrics' cost, within one run")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--metrics: an override for both models (e.g. logger.wandb.mode=disabled)",
    )
    ap.add_argument(
        "--metrics-steps",
        type=int,
        default=100,
        help="--metrics: steps of the benchmark model (the default experiment's model runs 4x as many)",
    )
    args = ap.parse_args()
    if args.metrics:
        metrics_main(args)
        return
    pairs = 1 if args.quick else args.pairs

    work = Path(tempfile.mkdtemp(prefix="fsdp_exp_overhead_"))
    rows, fw_all, bl_all = [], [], []
    # "other cores": CPU cores other programs used during each run; near 0 is a clean measurement.
    print(
        f"{'pair':>4} {'framework tok/s':>16} {'baseline tok/s':>15} {'ratio':>6} "
        f"{'fw step ms':>11} {'bl step ms':>11} {'other cores fw/bl':>18}"
    )
    for i in range(pairs):
        (fw, fw_t), fw_other = timed(run_framework, args.steps, args.warmup, work / f"framework_{i}")
        (bl, bl_t), bl_other = timed(run_baseline, args.steps, args.warmup, work / f"baseline_{i}.json")
        rows.append(fw / bl)
        fw_all += fw_t
        bl_all += bl_t
        print(
            f"{i:>4} {fw:>16.1f} {bl:>15.1f} {fw / bl:>6.3f} {statistics.median(fw_t) * 1e3:>11.1f} "
            f"{statistics.median(bl_t) * 1e3:>11.1f} "
            f"{fw_other:>13.2f}/{bl_other:.2f}",
            flush=True,
        )

    ratio = statistics.median(rows)
    print(
        f"\nmedian ratio (framework / baseline tokens/s): {ratio:.3f}  "
        f"[{'meets' if ratio >= 0.98 else 'BELOW'} the 0.98 goal; per-pair min {min(rows):.3f}, max {max(rows):.3f}]"
    )
    # Second opinion: one median over every measured step of each side (steps are noisy one by one,
    # so pooling all pairs' steps is steadier than the median of per-pair ratios).
    print(
        f"pooled ratio (median step time, all baseline steps / all framework steps): "
        f"{statistics.median(bl_all) / statistics.median(fw_all):.3f}  [{len(fw_all)} + {len(bl_all)} steps]"
    )
    dims = " ".join(f"{k}={v}" for k, v in MODEL.items())
    print(
        f"settings: model {dims} | global batch {BATCH} x seq {SEQ} = {BATCH * SEQ} tokens/step | "
        f"world {WORLD} (gloo, {max(1, (os.cpu_count() or 1) // WORLD)} thread/rank) | "
        f"steps {args.steps}, warm-up {args.warmup} | torch {torch.__version__} | "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}"
    )
    chosen = {(c["trainer.loss_chunks"], c["resolved"], c.get("why", "")) for c in CHOSEN}
    for asked, resolved, why in sorted(chosen):
        print(f"framework loss: trainer.loss_chunks={asked} -> {resolved} ({why})")
    if args.keep:
        print(f"run folders: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
