"""End to end on real gloo process groups: parity with a single process, memory falling as 1/N,
every option of every group running, what W&B received, and a failing rank ending the job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_exp.metrics.schema import STEP_METRICS, SUMMARY_METRICS

from conftest import TINY_BATCH, TINY_MODEL, leftover_processes, read_metrics, run_cli, run_config, run_experiment
from reference import reference_losses

STEPS = 5
# Large enough that sharding is not all padding, small enough for seconds per run; every
# dimension divides by 4 so shards are exactly equal at 1, 2 and 4 ranks.
SMALL = [*TINY_MODEL, *TINY_BATCH, f"trainer.steps={STEPS}", "trainer.warmup_steps=1", "logger.wandb.mode=disabled"]


def _losses(run_dir: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run_dir)]


@pytest.mark.parametrize(
    "sharding,extra",
    [
        ("full", []),
        ("grad_op", ["trainer.micro_batch_size=2"]),  # with gradient accumulation, 2 micro-batches per rank
    ],
)
def test_two_rank_losses_match_single_process(tmp_path, sharding, extra):
    overrides = [*SMALL, f"sharding={sharding}", *extra]
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed"
    expected = reference_losses(run_config(overrides), STEPS)
    got = _losses(tmp_path)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) / abs(b) < 1e-5, f"step {step}: sharded {a} vs single process {b}"
    assert expected[-1] < expected[0]  # it trains


@pytest.mark.slow
def test_hybrid_on_four_ranks_matches_single_process(tmp_path):
    overrides = [
        *SMALL,
        "sharding=hybrid",
        "trainer.nproc_per_node=4",
        "sharding.replicate_size=2",
        "sharding.shard_size=2",
    ]
    record = run_experiment(overrides, tmp_path)
    assert record["applied"]["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    digests = record["shard_digests"]  # replicas (ranks r and r+2) hold identical shards after training
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    expected = reference_losses(run_config(overrides), STEPS)
    for a, b in zip(_losses(tmp_path), expected):
        assert abs(a - b) / abs(b) < 1e-5


@pytest.mark.slow
def test_model_states_per_rank_fall_as_one_over_n(tmp_path):
    per_rank = {}
    for n in (1, 2, 4):
        run_experiment(
            [*SMALL, "sharding=full", f"trainer.nproc_per_node={n}", "trainer.steps=2", "trainer.warmup_steps=0"],
            tmp_path / str(n),
        )
        last = read_metrics(tmp_path / str(n))[-1]
        per_rank[n] = {k: last[f"mem/{k}_gib_max"] for k in ("params", "grads", "optim_state", "model_states")}
    # fp32 AdamW: params + grads + two moments = 4 copies of the parameters.
    assert per_rank[1]["model_states"] == pytest.approx(4 * per_rank[1]["params"], rel=1e-9)
    for n in (2, 4):
        for key, value in per_rank[n].items():
            assert abs(value * n / per_rank[1][key] - 1) < 0.02, (key, n, value, per_rank[1][key])


# Every option of every group, covered in a few runs: run i takes option i (mod count) of each group.
GROUP_OPTIONS = {
    "model": ["llama_tiny", "llama7b", "llama13b", "llama70b", "llama3_8b"],
    "sharding": ["full", "grad_op", "hybrid", "no_shard"],
    "precision": ["fp32", "bf16", "bf16_pure", "fp16"],
    "offload": ["none", "params"],
    "prefetch": ["default", "none", "deep"],
    "wrap": ["block", "none"],
}
# The big presets keep their structure (GQA ratio, FFN multiplier, RoPE theta) at tiny width.
TINY_WIDTH = {
    "llama_tiny": [],
    "llama7b": ["model.n_heads=8"],
    "llama13b": ["model.n_heads=8"],
    "llama70b": ["model.n_heads=8", "model.n_kv_heads=1"],
    "llama3_8b": ["model.n_heads=8", "model.n_kv_heads=2"],
}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _covering_runs() -> list[dict[str, str]]:
    n = max(len(v) for v in GROUP_OPTIONS.values())
    return [{g: opts[i % len(opts)] for g, opts in GROUP_OPTIONS.items()} for i in range(n)]


@pytest.mark.parametrize("choice", _covering_runs(), ids=lambda c: ",".join(c.values()))
def test_every_option_runs_two_steps(tmp_path, choice):
    overrides = [f"{g}={o}" for g, o in choice.items()] + TINY_WIDTH[choice["model"]]
    if choice["model"] != "llama_tiny":
        overrides += ["model.dim=64", "model.n_layers=2", "model.vocab_size=256", "model.multiple_of=32"]
    overrides += ["trainer.steps=2", "trainer.warmup_steps=0", "trainer.seq_len=16", "logger.wandb.mode=disabled"]
    record = run_experiment(overrides, tmp_path)
    assert record["status"] == "completed"
    assert record["choices"]["sharding"] == choice["sharding"]
    losses = _losses(tmp_path)
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)  # finite, positive

    # What reached fully_shard, per unit.
    applied = record["applied"]
    precision = run_config(overrides).precision
    assert applied["num_units"] == (3 if choice["wrap"] == "block" else 1)
    for unit in applied["units"]:
        args = unit["fully_shard"]
        # The last block stays unsharded after forward: backward needs it first.
        last = unit["module"] == "layers.1"
        assert args["reshard_after_forward"] == (choice["sharding"] in ("full", "hybrid") and not last)
        mp = args["mp_policy"]["MixedPrecisionPolicy"]
        assert mp["param_dtype"] == DTYPE_NAMES[precision.param_dtype]
        assert mp["reduce_dtype"] == DTYPE_NAMES[precision.reduce_dtype]
        assert ("CPUOffloadPolicy" in args["offload_policy"]) == (choice["offload"] == "params")
    expected_mesh = {"full": [2], "grad_op": [2], "hybrid": [1, 2], "no_shard": [2, 1]}[choice["sharding"]]
    assert applied["mesh"]["shape"] == expected_mesh
    if choice["wrap"] == "block":
        first = applied["units"][0]
        depth = {"default": 1, "none": 0, "deep": 2}[choice["prefetch"]]
        assert first["forward_prefetch"] == ["layers.1"][:depth]


def _read_wandb(run_dir: Path) -> tuple[dict, list[dict]]:
    """What an offline W&B run holds, read back with W&B's own reader (no server)."""
    (run_folder,) = (run_dir / "wandb").glob("offline-run-*")
    wandb_bin = Path(sys.executable).with_name("wandb")
    summary = json.loads(
        subprocess.run(
            [str(wandb_bin), "leet", "inspect", "--summary", "--json", str(run_folder)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    (log,) = run_folder.glob("*.wandb")
    records = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--json", str(log)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    history = [r["history"]["item"] for r in map(json.loads, records) if r["type"] == "history"]
    return summary, history


@pytest.mark.slow
def test_default_experiment_from_the_command_line(tmp_path):
    """`python -m fsdp_exp` as the README says: record, metrics and W&B run, all complete."""
    result = run_cli([], tmp_path / "run", quiet=False)
    assert result.returncode == 0, result.stderr
    assert "tokens_per_s_median" in result.stdout  # the summary table
    record = result.record
    assert record["status"] == "completed"
    assert record["topology"]["world_size"] == 2
    assert record["env"]["torch_version"] and record["env"]["devices"]
    assert record["applied"]["api"] == "torch.distributed.fsdp.fully_shard"
    assert (
        record["summary"]["summary/steps_measured"]
        == record["config"]["trainer"]["steps"] - record["config"]["trainer"]["warmup_steps"]
    )

    cpu_step_metrics = {m.name for m in STEP_METRICS if m.device != "cuda"}
    metrics = result.metrics
    assert [m["step"] for m in metrics] == list(range(1, record["config"]["trainer"]["steps"] + 1))
    for m in metrics:
        assert cpu_step_metrics <= set(m), cpu_step_metrics - set(m)
        assert m["perf/mfu"] > 0  # against this CPU's measured matmul peak

    summary, history = _read_wandb(tmp_path / "run")
    assert summary["state"] == "finished" and summary["project"] == "fsdp_exp"
    assert "sharding:full" in summary["tags"] and "model:llama_tiny" in summary["tags"]
    assert summary["config"]["sharding"]["strategy"] == "full"
    assert summary["config"]["applied"]["num_units"] == record["applied"]["num_units"]
    assert len(history) == len(metrics)
    for logged, local in zip(history, metrics):
        assert logged["_step"] == local["step"]
        for name in cpu_step_metrics - {"step"}:
            assert logged[name] == pytest.approx(local[name]), name
    # W&B's summary keeps no nulls: the FP8 figures are null outside precision=float8 (run.json says so).
    fp8_only = {"summary/mfu_fp8_median", "summary/peak_tflops_fp8"}
    assert all(record["summary"][name] is None for name in fp8_only)
    # and the MoE and validation figures are null in a dense run without validation
    absent = {"summary/moe_", "summary/val_"}
    assert all(record["summary"].get(name) is None for name in record["summary"] if name.startswith(tuple(absent)))
    cpu_summary = {m.name for m in SUMMARY_METRICS if m.device != "cuda"} - {"summary/mfu_median"} - fp8_only
    cpu_summary = {name for name in cpu_summary if not name.startswith(tuple(absent))}
    assert cpu_summary <= set(summary["summary"])


def test_a_rank_that_raises_ends_the_run_naming_it(tmp_path):
    result = run_cli(
        [
            "debug=fail_rank",
            "debug.fail_at_step=2",
            "debug.fail_rank=1",
            "trainer.steps=50",
            "logger.wandb.mode=disabled",
        ],
        tmp_path / "run",
    )
    assert result.returncode == 1
    assert result.seconds < 30, f"took {result.seconds:.1f}s"
    assert "rank 1" in result.stderr and "InjectedFailure" in result.stderr, result.stderr
    record = result.record
    assert record["status"] == "failed" and record["error"]["rank"] == 1
    assert "debug.fail_at_step=2" in (tmp_path / "run" / "errors" / "rank1.txt").read_text()
    assert len(result.metrics) == 2  # the steps before the failure are kept
    time.sleep(1)
    assert leftover_processes(tmp_path / "run") == []


def test_metric_docs_match_the_schema():
    from fsdp_exp.metrics.schema import render_markdown

    docs = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert docs.read_text() == render_markdown(), "regenerate: python -m fsdp_exp.metrics.schema > docs/metrics.md"


@pytest.mark.slow
def test_a_run_goes_on_when_wandb_dies(tmp_path):
    """W&B is a copy of metrics.jsonl: when its service process dies mid-run (as under a scheduler's
    SIGTERM to a whole job step), the run completes without it and run.json says what happened."""
    import os
    import signal

    import psutil

    from conftest import MARKER, QUIET, REPO

    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "fsdp_exp",
        "trainer.steps=300",
        "logger.wandb.mode=offline",
        *QUIET,
        f"hydra.run.dir={run_dir}",
    ]
    # Without WANDB_SERVICE: an earlier in-process wandb.init of this pytest session (a launcher noting a
    # failure) leaves it set, and the run would log through pytest's own service instead of starting one.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, MARKER: str(run_dir)}
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.2)
        services = []  # this run's W&B service: found by the environment marker it inherited
        for candidate in psutil.process_iter(["cmdline"]):
            try:
                if "wandb-core" in " ".join(candidate.info["cmdline"] or []) and candidate.environ().get(MARKER) == str(
                    run_dir
                ):
                    services.append(candidate)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        assert services, "no W&B service process found under the run"
        for service in services:
            service.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed"
    assert "Connection" in record["wandb"]["error"] or "Error" in record["wandb"]["error"]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 301))
    assert "W&B stopped working" in stderr
