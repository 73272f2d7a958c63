"""Every pair composes, is refused, and trains as one process would: a pairwise covering set of runs
(fsdp_exp.composability) over every option of the layout's groups (sharding backend and strategy, precision
with float8, offload, prefetch, wrap, activation checkpointing, compile), each parallel degree (tp with and
without sequence parallel, pp, cp, ep at 2) and the mixture of experts' options (its balance loss, the loss-free bias, a capacity factor, a shared
expert), each run trained 3 steps on the tiny Llama (moe_tiny where an expert option is on) at 2 ranks, 4 where
two degrees take 2.

Every pair of values preflight accepts appears in some run that preflight accepts; every pair it refuses is
refused by name, with its fix. Every run must train (a crash preflight did not refuse fails here, naming the
run), and each step's loss and gradient norm must be the single process's (tests/reference.py) within its
precision's tolerance: the reference forwards the global batch in the pieces a run's ranks and micro-batches
forward, so that an expert layer's capacity and balance loss (a forward's) are the same ones.

The runs share one spawned process group per rank count (test_deepspeed.run_cases: each rank trains them in
turn); a crash ends its group, and the runs after it train in a new one."""

from __future__ import annotations

import json

import pytest

from fsdp_exp import composability
from fsdp_exp.parallel.pipeline import settings_from
from fsdp_exp.preflight import validate

from conftest import read_metrics, run_config
from reference import reference_steps
from test_deepspeed import run_cases, with_defaults

DIMENSIONS = (
    *("sharding", "tp", "pp", "cp", "ep", "compile", "ac", "offload", "precision", "prefetch", "wrap"),
    *("aux", "bias", "capacity", "shared", "router", "mask"),
)
# FSDP1's no_shard is its full_shard's code path with a shard group of one; DeepSpeed's compiled engine hits
# dynamo's recompile limit for minutes here (test_deepspeed trains zero3 compiled once).
LEFT_OUT = ("fsdp1 no_shard", *((f"sharding=deepspeed zero{stage}", "compile=true") for stage in (1, 2, 3)))
# Pairs the covering set must hold: issue 43's (A: EP with a capacity factor crashed; B: EP with selective_op
# crashed; C: the balance loss's gradient vanished under fp16, which only a reference sees) and the balancing
# options under EP, whose counts cross the expert-parallel ranks; the balance loss compiled.
REQUIRED = (
    (("ep", "2"), ("capacity", "1.0")),
    (("ep", "2"), ("ac", "selective_op")),
    (("aux", "0.2"), ("precision", "fp16")),
    (("ep", "2"), ("aux", "0.2")),
    (("ep", "2"), ("bias", "0.01")),
    (("ep", "2"), ("shared", "1")),
    (("ep", "2"), ("router", "grouped")),
    (("compile", "true"), ("aux", "0.2")),  # compiled, the balance loss's gradient was lost; fp32 experts crashed
)
STEPS = 3
# Open problems the every-pair test found (2026-12-06), each a set of (dimension, value) a run holds all of, and
# what is wrong; a run matching one is still trained, and reported, but not failed on that count. Each entry must
# still match a run of the covering set (a stale entry fails), and each is written up in the session's notes.
OPEN_CRASHES = {
    (("tp", "2"), ("compile", "true"), ("precision", "float8")): "IndexError inside dynamo's guards (float8 x TP x "
    "compile, with AC, offload and block_causal in the same run): not reduced to its smallest pair yet",
}
OPEN_MISMATCHES = {
    (("cp", "2"), ("aux", "0.2")): "the balance loss is taken over each CP rank's part of the sequence, the "
    "reference's over whole sequences: a different loss by construction (5e-4 in the grad norm)",
}


def _open(name: str, overrides: list[str], table: dict) -> list[str]:
    """The reasons of ``table`` whose (dimension, value) sets the run holds (read from its overrides)."""
    held = set(overrides)
    return [
        why
        for pairs, why in table.items()
        if all(set(composability.overrides_of({dim: value})) <= held for dim, value in pairs)
    ]


# Each step's loss and gradient norm against the fp32 process, relative: fp32 to its rounding (compile and TP
# reorder sums: test_backends' 1e-4), bf16 compute (and float8's matmuls, which keep bf16 elsewhere) to
# test_backends' 1e-2, fp16 to 1e-3.
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-3}


@pytest.fixture(scope="module")
def covering():
    return composability.covering_runs(DIMENSIONS, LEFT_OUT)


def _name(run: dict[str, str]) -> str:
    return "-".join(f"{dim}_{value.replace(' ', '_')}" for dim, value in run.items() if value != _default(dim))


def _default(dim: str) -> str:
    return next(iter(composability.DIMENSIONS[dim]))


@pytest.fixture(scope="module")
def trained(covering, tmp_path_factory):
    """name -> (overrides, the run's dir, or None and the crash's last lines)."""
    runs, _ = covering
    root = tmp_path_factory.mktemp("compose")
    cases = {_name(run) or "defaults": [*composability.TINY, *composability.overrides_of(run)] for run in runs}
    results = {}
    for ranks in (2, 4):
        left = {n: o for n, o in cases.items() if _ranks(o) == ranks}
        while left:
            try:
                run_cases(left, root, nprocs=ranks)
                crash = None
            except Exception as err:  # the group died: in its first run not completed
                crash = str(err).strip().splitlines()[-3:]
            done = [n for n in left if _completed(root / n)]
            results.update({n: (left[n], root / n, None) for n in done})
            if crash is None:
                break
            failed = next(n for n in left if n not in done)
            results[failed] = (left[failed], None, crash)
            names = list(left)
            left = {n: left[n] for n in names[names.index(failed) + 1 :] if n not in done}
    return results


def _ranks(overrides: list[str]) -> int:
    return 4 if "trainer.nproc_per_node=4" in overrides else 2


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_pair_of_options_trains_or_is_refused_by_preflight(covering, trained):
    runs, refused = covering
    # Each refused pair is refused by preflight by name (a message with its fix), never by a crash.
    assert all("\n  fix: " in message or message.startswith("needs ") for message in refused.values()), refused
    for a, b in REQUIRED:
        assert any(run[a[0]] == a[1] and run[b[0]] == b[1] for run in runs), (a, b)
    # the layout's products of issue #40, each in some run (4 ranks), pipeline stages beside sequence parallel
    for pair in (("pp", "cp"), ("pp", "ep"), ("pp", "tp"), ("cp", "ep")):
        assert any(run[pair[0]] != "1" and run[pair[1]] != "1" for run in runs), pair
    assert any(run["pp"] == "2" and run["tp"] == "2 sp" for run in runs)
    for dim in DIMENSIONS:  # every value of every dimension is in some run (but a missing package's)
        values = {v for v in composability.DIMENSIONS[dim] if v not in LEFT_OUT}
        missing = {
            v
            for v in values
            if (composability.outcome(composability.overrides_of({dim: v})) or "").startswith("needs ")
        }
        assert {run[dim] for run in runs} == values - missing, dim
    crashed = [
        f"{name}: {crash[-1]}"
        for name, (overrides, run_dir, crash) in trained.items()
        if run_dir is None and not _open(name, overrides, OPEN_CRASHES)
    ]
    assert crashed == [], f"{len(crashed)} of {len(trained)} runs crashed:\n" + "\n".join(crashed)
    for pairs in (*OPEN_CRASHES, *OPEN_MISMATCHES):  # every open problem is still in some run, or is stale here
        assert any(_open(n, o, {pairs: "x"}) for n, (o, _, _) in trained.items()), pairs


@pytest.mark.slow
def test_every_run_matches_the_single_process_reference(trained):
    cache, wrong = {}, []
    for name, (overrides, run_dir, _) in trained.items():
        if run_dir is None or _open(name, overrides, OPEN_MISMATCHES):
            continue  # the test above names a crash; an open mismatch is in OPEN_MISMATCHES
        cfg = run_config(with_defaults(overrides))
        forward = _forward_samples(cfg)
        key = repr((cfg.model, cfg.optim, cfg.data, cfg.trainer.grad_clip, forward))
        if key not in cache:
            cache[key] = reference_steps(cfg, STEPS, forward)
        tolerance = TOLERANCE[cfg.precision.param_dtype]
        rows = read_metrics(run_dir)
        for label, got, expected in zip(
            ("loss", "grad_norm"),
            ([r["train/loss"] for r in rows], [r["train/grad_norm"] for r in rows]),
            cache[key],
        ):
            errors = [abs(a / b - 1) for a, b in zip(got, expected)]
            if len(got) != STEPS or max(errors) > tolerance:
                wrong.append(f"{name} {label}: {got} vs {expected} (largest error {max(errors):.1e} > {tolerance})")
    assert wrong == [], "\n".join(wrong)


def _forward_samples(cfg) -> int:
    """The sequences one forward of the run takes: its micro-batch, or under pipeline stages the schedule's."""
    topology = validate(cfg, cuda_devices=0)
    if cfg.parallel.pp == 1:
        return topology.micro_batch_size
    local = cfg.trainer.global_batch_size // topology.dp_size
    return local // settings_from(cfg, local).n_microbatches


def _completed(run_dir) -> bool:
    record = run_dir / "run.json"
    return record.exists() and json.loads(record.read_text()).get("status") == "completed"
