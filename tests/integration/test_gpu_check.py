"""benchmarks/gpu_check.py stays ready for the next GPU loan: its CPU mode passes, a failing run fails
it, and every CUDA-only place of fsdp_exp is named by one of its checks (the inventory in its
docstring says what counts as a place)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # wherever tests/ moves
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
# The only skips a check that exists on a CPU may report there: what it needs is not installed or not built.
AVAILABILITY_SKIPS = {
    "deepspeed": {"skipped: DeepSpeed not installed", "skipped: sharding.backend=deepspeed not available yet"},
    "fit_refusal": {"skipped: trainer.check_fit not available yet"},
}


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def run_script(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())["checks"]


@pytest.mark.slow
def test_cpu_mode_passes_every_check_that_exists_on_a_cpu(tmp_path, gpu_check):
    # Two runs at a time: a tiny run keeps about one of this machine's two cores busy.
    proc, results = run_script(tmp_path, "--jobs", "2")
    by_name = {r["check"]: r for r in results}
    assert list(by_name) == [c.name for c in gpu_check.CHECKS]
    failed = {
        name: f"{r['status']}: {r['note']}"
        for name, r in by_name.items()
        if r["status"] != "pass" and r["cpu"] and r["status"] not in AVAILABILITY_SKIPS.get(name, ())
    }
    assert not failed, f"{failed}\n(run logs: {tmp_path / 'work'}/<run>.log)\n{proc.stdout[-4000:]}"
    assert all(r["status"] == "skipped: needs CUDA" for r in results if not r["cpu"]), results
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Figures a reader of the table relies on, read back from the runs.
    assert by_name["fsdp2_bf16"]["figures"]["tokens/s"] > 0
    assert by_name["comm"]["figures"]["AG ms"] > 0
    assert by_name["checkpoint_resume"]["figures"]["resumed from"] == "step_4"


def test_a_run_that_fails_fails_the_script(tmp_path):
    # A refused configuration: the run exits 2 before any rank starts, the check fails with its message.
    proc, results = run_script(tmp_path, "--only", "fsdp2_bf16", "--set", "trainer.grad_clip=-1", timeout=180)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(r["check"], r["status"]) for r in results] == [("fsdp2_bf16", "fail")]
    assert "exit 2" in results[0]["note"] and "grad_clip" in results[0]["note"], results[0]["note"]


def test_every_gpu_run_is_a_valid_configuration_that_fits_an_h200(tmp_path):
    # The overrides only a GPU machine runs, composed and validated by the planner here: a misspelt or
    # refused override must not wait for the next GPU loan to be found.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--gpus", "1", "--work", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("fits: needs") >= 8, proc.stdout


def test_every_cuda_only_place_is_named_by_a_check(gpu_check):
    places = gpu_check.cuda_places(REPO / "fsdp_exp")
    named = {p for check in gpu_check.CHECKS for p in check.covers} | set(gpu_check.RUN_ELSEWHERE)
    missing = {p: lines for p, lines in places.items() if p not in named}
    stale = sorted(named - set(places))
    message = []
    if missing:
        message.append(
            "CUDA-only places of fsdp_exp that no check of benchmarks/gpu_check.py names; add each to "
            "the covers of the check whose run goes through it (or, if it only reads a config string "
            "and a CPU test covers it, to RUN_ELSEWHERE with the reason):\n"
            + "\n".join(f"  {p}  (lines {', '.join(map(str, lines))})" for p, lines in missing.items())
        )
    if stale:
        message.append(
            "names in benchmarks/gpu_check.py (covers / RUN_ELSEWHERE) that are not CUDA-only places "
            "any more (moved or renamed: name the new place):\n" + "\n".join(f"  {p}" for p in stale)
        )
    assert not message, "\n".join(message) + "\n`python benchmarks/gpu_check.py --inventory` prints the whole map."


def test_the_inventory_finds_each_kind_of_cuda_branch_and_nothing_else(tmp_path, gpu_check):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        textwrap.dedent('''
        """Prose never counts: torch.cuda.synchronize(), device.type == "cuda", "nccl"."""
        import torch
        from torch.profiler import ProfilerActivity

        DEVICES = ("auto", "cpu", "cuda")  # a tuple of names is validation, not a branch


        def version():
            return torch.version.cuda  # a version string: None on CPU-only torch, no branch


        def valid(name):
            return name not in ("auto", "cpu", "cuda")


        class Runner:
            def step(self, device):
                if device.type == "cuda":  # torch.cuda in a comment does not count either
                    torch.cuda.synchronize(device)

            def activities(self):
                return [ProfilerActivity.CUDA]


        def group():
            def join():
                return torch.distributed.init_process_group("NCCL")
            return join


        def margin(kind):
            return 0 if kind == "cpu" else 1


        def restore(state):
            return "cuda" in state


        if torch.cuda.is_available():
            pass
        ''')
    )
    (package / "sub").mkdir()
    # Imported by name, torch.cuda counts where it is imported and where the name is used.
    (package / "sub" / "peek.py").write_text(
        "from torch import cuda\n\n\ndef count():\n    return cuda.device_count()\n"
    )
    places = gpu_check.cuda_places(package)
    assert places == {
        "pkg/mod.py:Runner.step": [19, 20],
        "pkg/mod.py:Runner.activities": [23],
        "pkg/mod.py:group.join": [28],
        "pkg/mod.py:margin": [33],
        "pkg/mod.py:restore": [37],
        "pkg/mod.py:<module>": [40],
        "pkg/sub/peek.py:<module>": [1],
        "pkg/sub/peek.py:count": [5],
    }, places
