"""Every CUDA-only path of fsdp_exp, checked by one command on the first GPU machine at hand.

    python benchmarks/gpu_check.py --out gpu_check.json        # a GPU machine: under 8 minutes on one H200
    python benchmarks/gpu_check.py --device cpu --size tiny    # the same checks on a CPU (tests/integration/test_gpu_check.py)
    python benchmarks/gpu_check.py --only fsdp2_bf16,planner   # a rerun of some checks (their runs only)
    python benchmarks/gpu_check.py --dry-run --gpus 8          # any machine: validate and plan every GPU run
    python benchmarks/gpu_check.py --list                      # the checks: what each runs, needs and covers
    python benchmarks/gpu_check.py --inventory                 # fsdp_exp's CUDA-only places, and who names each

Each check is a real ``python -m fsdp_exp`` run (or ``python -m fsdp_exp.plan``) read back from its run
folder (``run.json``, ``metrics.jsonl``, traces, the memory snapshot): the script goes through the
framework's public entry points only. Several checks read one run: the Llama-3 8B-shaped run (2 of
its 32 blocks, bf16, FSDP2, 16K tokens a step on each GPU) gives throughput and MFU, the memory
tracker's phases and the CUDA allocator's peaks beside the planner's, the allocator snapshot and the
profiled step. Checks print as they finish, with their wall time, then one table; ``--out`` writes
the same as JSON after every check and ``--save DIR`` copies each run's log, run.json, metrics.jsonl
and errors (a call cut short keeps what it has). Exit 1 if a check that ran failed. ``--budget``
(seconds, default 450) bounds the whole: a run gets at most what is left, and a check that would
start later is skipped with that reason. ``--set KEY=VALUE`` adds an override to every run.

Without a GPU (or with ``--device cpu``) the checks whose code exists on a CPU run at tiny size
(``--size tiny``: the default llama_tiny) through the same overrides and the same reading of the
records, on gloo instead of NCCL and with CPU offload unpinned; the CUDA-only ones say "skipped:
needs CUDA". With one GPU everything runs at world size 1 and the checks that need several ranks say
"skipped: needs 2 GPUs"; with more, every run uses every GPU and those checks run. On a CPU,
``--jobs N`` starts the runs N at a time ahead of the checks that read them (a tiny run keeps about
one core busy; the checks and their order stay the same). ``--dry-run`` needs no GPU: it hands every
GPU run's overrides to the planner (``python -m fsdp_exp.plan``'s ``main``, called in this process)
with ``plan.device=h200_141gb``, so a refused or misspelt override is found before the loan, and
says whether each fits.

The inventory: ``cuda_places`` scans ``fsdp_exp/**/*.py`` (the syntax tree, so comments and docstrings
never count) for the code that behaves differently on CUDA, and names each place by file and
enclosing function (``fsdp_exp/metrics/step.py:StepMetrics.log``; ``<module>`` at top level), not by line,
so unrelated edits keep the names. A place is code containing any of:

- ``torch.cuda`` (any attribute or call; ``from torch import cuda`` and every use of that name) or an
  attribute named ``CUDA`` (``ProfilerActivity.CUDA``);
- a comparison (``==``, ``!=``, ``in``, ``not in``) with the string ``"cuda"`` or ``"cpu"`` as a direct
  operand (``device.type == "cuda"``, ``kind == "cpu"``, ``"cuda" in state``): a device branch, whose
  other side is the CUDA behaviour; a tuple of names (``x in ("auto", "cpu", "cuda")``) is input
  validation, not a branch, and does not count;
- the string ``"nccl"`` (any case) as a value: NCCL's process group, NCCL's kernels.

tests/integration/test_gpu_check.py fails when a place is named by no check's ``covers`` (nor by ``RUN_ELSEWHERE``,
places that compare a config string but never touch CUDA), or when a name there no longer is a place.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import functools
import importlib.util
import io
import json
import math
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
# A planner prediction further than this from the measurement fails its check. The planner is within
# 3% of torch's tracker on CPU; on CUDA its margin (10% + 1 GiB) is meant to absorb the allocator's
# rounding and workspaces. Beyond 20% it is wrong on CUDA, which is what the check is for.
PLANNER_TOLERANCE = 0.20
MODEL_STATES_TOLERANCE = 0.02  # model states are counted exactly on CPU


# ------------------------------------------------------------------------------------ inventory
def _is_device_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in ("cuda", "cpu")


def _cuda_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to ``torch.cuda`` (``from torch import cuda``, ``import torch.cuda as tc``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "cuda"}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.cuda" and a.asname}
    return names


def _marks_cuda(node: ast.AST, aliases: set[str]) -> bool:
    """One node of the pattern in the module docstring."""
    if isinstance(node, ast.Attribute):
        return node.attr == "CUDA" or (
            node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch"
        )
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("torch.cuda") or (
            node.module == "torch" and any(a.name == "cuda" for a in node.names)
        )
    if isinstance(node, ast.Import):
        return any(a.name.startswith("torch.cuda") for a in node.names)
    if isinstance(node, ast.Compare):
        return any(_is_device_string(n) for n in (node.left, *node.comparators))
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() == "nccl"
    return False


def cuda_places(package: Path) -> dict[str, list[int]]:
    """``{"fsdp_exp/<file>.py:<Class.function>": [lines]}`` of every place the pattern finds under
    ``package`` (a folder of Python files), named relative to the package's parent."""
    places: dict[str, list[int]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _cuda_aliases(tree)

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = (*scope, node.name)
            if _marks_cuda(node, aliases):
                places.setdefault(f"{rel}:{'.'.join(scope) or '<module>'}", []).append(node.lineno)
            for child in ast.iter_child_nodes(node):
                visit(child, scope)

        visit(tree, ())
    return {place: sorted(set(lines)) for place, lines in places.items()}


# Places the pattern finds that read a config string and never touch CUDA: tested on a CPU, where named.
RUN_ELSEWHERE = {
    "fsdp_exp/plan/activations/hf.py:HfActivations.notes": "the planner's note text by device kind; no CUDA call "
    "(tests/unit/test_hf_model_specs.py)",
    "fsdp_exp/tune/calibrate.py:run_samples": "reads a measured run's recorded device type to pick its table "
    "entry; no CUDA call (tests/unit/test_tune_prediction.py)",
    "fsdp_exp/slurm.py:job_resources": "sizes a SLURM job from trainer.device (GPUs per node); no CUDA call "
    "(tests/integration/test_slurm.py)",
}


# ------------------------------------------------------------------------------------- machine
def machine() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    info = {
        "host": os.uname().nodename,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpus": os.cpu_count(),
        "deepspeed": importlib.util.find_spec("deepspeed") is not None,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1), capability=f"{props.major}.{props.minor}"
        )
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - a version string is not worth failing for
            info["nccl"] = None
    return info


# ------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    """One ``python -m fsdp_exp`` (or ``fsdp_exp.plan``) call and what it left."""

    name: str
    argv: list[str]
    timeout_s: float
    folder: Optional[str] = None  # another run's folder (a resume), else its own
    module: str = "fsdp_exp"
    fits: bool = True  # False: the run is meant to be refused for its memory (--dry-run)
    feature: str = ""  # a word of the refusal when the feature this run needs is not in fsdp_exp yet
    # filled in by run():
    rc: Optional[int] = None
    wall_s: float = 0.0
    stdout: str = ""
    stderr: str = ""
    run_dir: Optional[Path] = None

    @property
    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def rows(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines() if line]

    def error(self) -> str:
        """Why the run failed, in one line."""
        if self.rc in (124, -signal.SIGKILL):
            return f"timed out after {self.wall_s:.0f} s"
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        # fsdp_exp's own verdict ("fsdp_exp: invalid configuration: ...", its fix), else the last line.
        own = [i for i, line in enumerate(lines) if line.startswith("fsdp_exp:")]
        if own:
            said = " ".join(
                line.strip() for line in lines[own[-1] : own[-1] + 2] if line.startswith(("fsdp_exp:", "  fix:"))
            )
            return f"exit {self.rc}: {said[:400]}"
        return f"exit {self.rc}: {lines[-1][:300] if lines else 'no output'}"


# Overrides every run takes: no progress bar, no summary table, no W&B.
QUIET = ["logger.wandb.mode=disabled", "logger.progress=false", "logger.summary_table=false"]


@dataclass
class Context:
    device: str  # cuda | cpu
    gpus: int
    size: str  # full | tiny
    work: Path
    deadline: float
    runs: dict[str, Run] = field(default_factory=dict)
    # --jobs: the runs started ahead by background threads; a run is started once, by whoever claims it
    # first, and every other reader waits for it to end.
    claimed: dict[str, threading.Event] = field(default_factory=dict)
    running: set = field(default_factory=set)  # the Popen of every run in flight
    stopped: bool = False  # set by stop(): start nothing more
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ranks(self) -> int:
        """Ranks of the main run: every GPU, or 2 CPU ranks (so the CPU run has communication too)."""
        return self.gpus if self.device == "cuda" else 2

    def run(self, name: str) -> Run:
        """The named run, started now if it has not run yet (every check that reads it shares it; one
        started ahead by ``prefetch`` is waited for)."""
        spec = self.runs[name]
        with self.lock:
            done = self.claimed.get(name)
            mine = done is None
            if mine:
                done = self.claimed[name] = threading.Event()
        if not mine:
            done.wait()
            return spec
        try:
            self._start(spec)
        finally:
            done.set()
        return spec

    def _start(self, spec: Run) -> None:
        left = self.deadline - time.monotonic()
        spec.run_dir = self.work / (spec.folder or spec.name)
        cmd = [sys.executable, "-m", spec.module, *spec.argv]
        if spec.module == "fsdp_exp":
            cmd += [*QUIET, f"hydra.run.dir={spec.run_dir}"]
        start = time.monotonic()
        with self.lock:
            if self.stopped:
                return
            # Its own session: on a timeout the launcher and every rank go together.
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            self.running.add(proc)
        try:
            spec.stdout, spec.stderr = proc.communicate(timeout=max(1.0, min(spec.timeout_s, left)))
            spec.rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            spec.stdout, spec.stderr = proc.communicate()
            spec.rc = 124
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the run's session must not outlive us
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            with self.lock:
                self.running.discard(proc)
        spec.wall_s = time.monotonic() - start
        (self.work / f"{spec.name}.log").write_text(f"$ {' '.join(cmd)}\n{spec.stdout}\n{spec.stderr}")

    def prefetch(self, names: list[str], jobs: int) -> None:
        """Start these runs ``jobs`` at a time in background threads, in this order, while the checks read
        them in theirs (``--jobs``; on a CPU, where one run keeps about one core busy). A run that
        continues another's folder (a resume) is started by the same thread right after that run."""
        chains: dict[str, list[str]] = {}
        for name in dict.fromkeys(names):
            first = self.runs[name].folder
            chains.setdefault(first if first in chains else name, []).append(name)
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for chain in chains.values():
            todo.put(chain)

        def work() -> None:
            while not self.stopped:
                try:
                    chain = todo.get_nowait()
                except queue.Empty:
                    return
                for name in chain:
                    # As run_checks does: a run that could not finish in the budget is left to its check
                    # ("skipped: time budget").
                    if self.stopped or self.deadline - time.monotonic() < 20:
                        break
                    self.run(name)

        for _ in range(jobs):
            threading.Thread(target=work, name="gpu_check-prefetch", daemon=True).start()

    def stop(self) -> None:
        """Start no more runs and kill those in flight (what no check waited for: an interrupted or
        over-budget check)."""
        with self.lock:
            self.stopped = True
            for proc in self.running:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def plan_here(self, name: str) -> Run:
        """The named ``python -m fsdp_exp.plan`` run called in this process (``--dry-run``: one start-up of
        Python, torch and Hydra for all of its calls): the same ``main``, from the repository as ``-m``
        has it, its exit status and output kept as ``run`` keeps a subprocess's."""
        spec = self.runs[name]
        assert spec.module == "fsdp_exp.plan", spec.module
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from fsdp_exp.plan.cli import main as plan_main

        out, err = io.StringIO(), io.StringIO()
        start, cwd = time.monotonic(), os.getcwd()
        os.chdir(REPO)  # where the subprocess would run
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                spec.rc = plan_main(list(spec.argv))
        except SystemExit as exit_:
            spec.rc = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # noqa: BLE001 - as a crashed subprocess: exit 1, its traceback on stderr
            err.write(traceback.format_exc())
            spec.rc = 1
        finally:
            os.chdir(cwd)
        spec.wall_s = time.monotonic() - start
        spec.stdout, spec.stderr = out.getvalue(), err.getvalue()
        (self.work / f"{spec.name}.log").write_text(
            f"$ python -m {spec.module} {' '.join(spec.argv)}  (in process)\n{spec.stdout}\n{spec.stderr}"
        )
        return spec

    def completed(self, name: str) -> Run:
        """The named run, which must have completed (else the check fails with its error)."""
        run = self.run(name)
        if run.rc != 0:
            raise CheckFailed(run.error())
        status = run.record.get("status")
        if status != "completed":
            raise CheckFailed(f"run.json status {status!r}")
        return run


def define_runs(ctx: Context, extra: list[str]) -> dict[str, Run]:
    """Every run the checks read, sized for this machine; ``extra`` (``--set``) goes to every one."""
    gpu, n = ctx.device == "cuda", ctx.ranks
    if ctx.size == "full":
        # Llama-3 8B's shapes (dim 4096, GQA 32/8, FFN 14336, vocab 128K), 2 of its 32 blocks: 1.49B
        # parameters, 16 bytes each at rest, plus 8 sequences of 2048 tokens per GPU.
        big = ["model=llama3_8b", "model.n_layers=2", "trainer.seq_len=2048", f"trainer.global_batch_size={8 * n}"]
        # The paths whose numbers matter less than that they run: 320M parameters (a CPU AdamW step
        # under offload takes about a second); checkpoints of 90M (1 GiB a save).
        small = [
            "model.dim=2048",
            "model.n_layers=4",
            "model.n_heads=16",
            "model.n_kv_heads=8",
            "model.vocab_size=32000",
            "model.multiple_of=256",
            "model.max_seq_len=2048",
            "trainer.seq_len=1024",
        ]
        saved = [
            "model.dim=1024",
            "model.n_layers=2",
            "model.n_heads=8",
            "model.n_kv_heads=4",
            "model.vocab_size=32000",
            "model.multiple_of=256",
        ]
        batch, steps, short = (
            4,
            ["trainer.steps=10", "trainer.warmup_steps=3"],
            ["trainer.steps=6", "trainer.warmup_steps=2"],
        )
    else:  # the default llama_tiny; as few steps as each check needs (start-up is most of a run on a CPU)
        big, small, saved, batch = [], [], [], 2
        steps, short = ["trainer.steps=5", "trainer.warmup_steps=2"], ["trainer.steps=4", "trainer.warmup_steps=2"]
    # The functional runs: every GPU; one rank on a CPU (the 2-core test machine is slow enough).
    m = n if gpu else 1
    ranks = [f"trainer.nproc_per_node={m}", f"trainer.global_batch_size={batch * m}"]
    where = [f"trainer.device={ctx.device}", *extra]
    # Step 1 (0-based) is sampled: tracked, and on CUDA the allocator's history; step 2 is profiled.
    # Both stay out of the medians (a warm-up step; profiled steps are left out).
    main = [
        *where,
        *big,
        f"trainer.nproc_per_node={n}",
        "sharding=full",
        "precision=bf16",
        *steps,
        "trainer.track_memory_step=1",
        "trainer.profile_steps=[2]",
        "trainer.digest_shards=false",
        *(["trainer.memory_snapshot=true"] if gpu else []),
    ]
    # main's model and knobs, compiled, without the sampled steps (a tracker under compile measures
    # itself). On a CPU one rank: a cold inductor cache costs each rank about 40 s there.
    compiled = [
        *where,
        *big,
        f"trainer.nproc_per_node={n if gpu else 1}",
        "sharding=full",
        "precision=bf16",
        *steps,
        "trainer.track_memory=false",
        "trainer.digest_shards=false",
        "compile=true",
    ]
    # The same compiled run with torchao's float8 matmuls (tensorwise, float8 all-gathers): tokens/s against
    # the compiled bf16 run on the same shapes. CUDA only: on a CPU tests/integration/test_float8.py runs it.
    float8 = [*[o for o in compiled if o != "precision=bf16"], "precision=float8", "precision.float8_all_gather=true"]
    functional = [*where, *small, *ranks]
    ckpt = [
        *where,
        *saved,
        *ranks,
        "precision=bf16",
        "trainer.seq_len=256",
        "data=text",
        f"data.num_workers={2 if gpu else 1}",
        f"data.cache_dir={ctx.work / 'data_cache'}",
        "checkpoint=periodic",
        "checkpoint.every=2",
        "trainer.warmup_steps=1",
    ]
    big_timeout = 240 if ctx.size == "full" else 150
    runs = [
        Run("main", main, big_timeout),
        Run("plan", [*main, "plan.format=json"], 90, module="fsdp_exp.plan"),
        # Predict only (tune.run is off): the search on this machine's device, its own tune.json.
        Run("tune", [*main, "tune.show=5", f"tune.out={ctx.work / 'tune'}"], 180, module="fsdp_exp.tune"),
        Run(
            "fp32",
            [*functional, "precision=fp32", *short, "trainer.track_memory_step=1", "trainer.digest_shards=false"],
            150,
        ),
        Run("offload", [*functional, "precision=bf16", "offload=params", *short], 180),
        Run(
            "fsdp1_sync",
            [
                *functional,
                "precision=bf16",
                "sharding.backend=fsdp1",
                "sharding.sync_module_states=true",
                "checkpoint.export=safetensors",
                *short,
            ],
            150,
        ),
        Run("fsdp1_offload", [*functional, "precision=bf16", "sharding.backend=fsdp1", "offload=params", *short], 180),
        Run("ddp_bf16", [*functional, "sharding=ddp", "precision=bf16_pure", *short, "trainer.profile_steps=[2]"], 150),
        # Saves at steps 2 and 4; the second call continues in the same folder from step 4 to 6.
        Run("ckpt_save", [*ckpt, "trainer.steps=4"], 150),
        Run("ckpt_resume", [*ckpt, "trainer.steps=6"], 150, folder="ckpt_save"),
        # Llama 70B does not fit one rank of any machine (1 TiB on a CPU host; 140 GiB on each of 8 GPUs):
        # refused before any rank starts, with the free memory of the GPU and changes that would fit.
        Run(
            "fit_refused",
            [
                *where,
                "model=llama70b",
                "trainer.seq_len=4096",
                "precision=bf16",
                f"trainer.nproc_per_node={m}",
                f"trainer.global_batch_size={m}",
                "trainer.check_fit=true",
            ],
            120,
            fits=False,
            feature="check_fit",
        ),
        Run("deepspeed_probe", [*where, "sharding.backend=deepspeed", "plan.format=json"], 60, module="fsdp_exp.plan"),
        Run(
            "deepspeed",
            [*functional, "precision=bf16", "sharding.backend=deepspeed", *short],
            240,
            feature="sharding.backend",
        ),
        # Context parallel with torch's ring attention (CUDA's SDPA kernels only): the same global batch at cp 1
        # and cp 2, the second splitting every sequence over 2 GPUs.
        Run("cp1", [*functional, "precision=bf16", *short, "trainer.digest_shards=false"], 150),
        Run(
            "cp2_ring",
            [
                *functional,
                "precision=bf16",
                *short,
                "trainer.digest_shards=false",
                "parallel.cp=2",
                "parallel.cp_method=ring",
            ],
            150,
            feature="parallel.cp",
        ),
        # Packed documents kept apart (model.attention_mask=block_causal, positions restarting per document) on
        # the shipped corpus: FlexAttention with a BlockMask built once a batch (compiled) on CUDA, SDPA with an
        # additive mask elsewhere; the sampled step tracked against the planner.
        Run(
            "block_causal",
            [
                *functional,
                "precision=bf16",
                *short,
                "data=text",
                f"data.cache_dir={ctx.work / 'data_cache'}",
                "trainer.seq_len=256",
                "model.attention_mask=block_causal",
                "data.positions=document",
                "trainer.track_memory_step=1",
                "trainer.digest_shards=false",
            ],
            200,
            feature="model.attention_mask",
        ),
        Run("compile", compiled, 300 if ctx.size == "full" else 200),
        Run("float8", float8, 300 if ctx.size == "full" else 200),
        # torchao's float8 tensor-parallel styles under sequence parallel gather the sequence in float8, which
        # gloo cannot carry (preflight refuses it on a CPU): NCCL's run, on 2 GPUs as (1 dp x) 2 tp ranks.
        Run(
            "float8_tp_sp",
            [
                *where,
                *small,
                f"trainer.nproc_per_node={n}",
                f"trainer.global_batch_size={batch * max(1, n // 2)}",
                # one GPU (its check skipped; --dry-run --gpus 1 validates the rest): no tensor parallel
                *(["parallel.tp=2", "parallel.sequence_parallel=true"] if n >= 2 else []),
                "precision=float8",
                *short,
            ],
            180,
        ),
    ]
    return {r.name: r for r in runs}


# ---------------------------------------------------------------------------------------- checks
class CheckFailed(Exception):
    """A check's verdict: what did not hold, with the figures read so far (a failure's numbers matter most)."""

    def __init__(self, message: str, figures: Optional[dict] = None):
        super().__init__(message)
        self.figures = figures or {}


class Skip(Exception):
    """A check that cannot run here, and why."""


def expect(condition: bool, message: str, figures: Optional[dict] = None) -> None:
    if not condition:
        raise CheckFailed(message, figures)


def find_key(tree, key: str) -> list:
    """Every value under ``key`` anywhere in a JSON tree (the record's layout may move; its names stay)."""
    found = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == key:
                found.append(v)
            found += find_key(v, key)
    elif isinstance(tree, list):
        for v in tree:
            found += find_key(v, key)
    return found


def sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits (a CPU's TFLOPS are thousandths, a GPU's hundreds)."""
    return float(f"{x:.{digits}g}")


def gib(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def perf(run: Run) -> dict:
    s = run.record["summary"]
    return {
        "tokens/s": round(s["summary/tokens_per_s_median"] or 0),
        "step ms": round((s["summary/step_time_s_median"] or 0) * 1e3, 1),
    }


def check_throughput(ctx: Context) -> dict:
    run = ctx.completed("main")
    s, env, rows = run.record["summary"], run.record["env"], run.rows
    mfu = s["summary/mfu_median"]
    out = {
        **perf(run),
        "MFU": mfu and sig(mfu),
        "TFLOPS/rank": sig(s["summary/tflops_per_rank_median"] or 0),
        "peak TFLOPS": s["summary/peak_tflops"] and sig(s["summary/peak_tflops"]),
        "params": env["num_params"],
        "ranks": env["world_size"],
        "loss": f"{rows[0]['train/loss']:.3f} -> {rows[-1]['train/loss']:.3f}",
    }
    expect(out["tokens/s"] > 0, "no tokens/s", out)
    expect(mfu is not None and mfu > 0, f"MFU {mfu}", out)
    if ctx.device == "cuda":
        # The data-sheet peak of this GPU: an unknown device name gives no MFU at all.
        expect(
            str(s["summary/peak_tflops_source"]).startswith("table:"),
            f"peak TFLOPS not from the table: {s['summary/peak_tflops_source']}",
            out,
        )
        expect(mfu < 1, f"MFU {mfu:.3f} above 1: the peak or the FLOPs are wrong", out)
        expect(any("nvidia" in str(d).lower() for d in env["devices"]), f"devices {env['devices']}", out)
    return out


def check_compile(ctx: Context) -> dict:
    run = ctx.completed("compile")
    expect(find_key(run.record["applied"], "compile"), "no compile entry in run.json applied")
    s, rows = run.record["summary"], run.rows
    out = {**perf(run), "MFU": sig(s["summary/mfu_median"] or 0), "first step s": round(rows[0]["perf/step_time_s"], 1)}
    eager = ctx.runs["main"]
    if eager.rc == 0 and eager.record["env"]["world_size"] == run.record["env"]["world_size"]:
        ratio = s["summary/tokens_per_s_median"] / eager.record["summary"]["summary/tokens_per_s_median"]
        out["x eager"] = round(ratio, 3)
    return out


def check_float8(ctx: Context) -> dict:
    """float8 against bf16, both compiled, same shapes: tokens/s, and MFU against the bf16 and the FP8 peak."""
    run = ctx.completed("float8")
    s, applied = run.record["summary"], run.record["applied"]
    converted = (find_key(applied, "converted") or [[]])[0]
    out = {
        **perf(run),
        "MFU (bf16 peak)": sig(s["summary/mfu_median"] or 0),
        "MFU (fp8 peak)": s["summary/mfu_fp8_median"] and sig(s["summary/mfu_fp8_median"]),
        "fp8 peak TFLOPS": s["summary/peak_tflops_fp8"],
        "converted layers": len(converted),
    }
    expect(len(converted) > 0, "no layer converted to float8 (run.json applied.float8)", out)
    expect(
        s["summary/peak_tflops_fp8"],
        f"no FP8 peak for this GPU: {run.record['env'].get('peak_tflops_fp8_source')}",
        out,
    )
    bf16 = ctx.runs["compile"]
    if bf16.rc == 0 and bf16.record["env"]["world_size"] == run.record["env"]["world_size"]:
        out["x bf16 compiled"] = round(
            s["summary/tokens_per_s_median"] / bf16.record["summary"]["summary/tokens_per_s_median"], 3
        )
    return out


def check_float8_tp_sp(ctx: Context) -> dict:
    """Tensor parallel with torchao's float8 styles and sequence parallel: the run completes, its blocks took
    the float8 styles (the sequence gathered in float8 before the projections) and its loss is finite."""
    run = ctx.completed("float8_tp_sp")
    plan = (find_key(run.record["applied"], "block_plan") or [{}])[0]
    out = {**perf(run), "block styles": sorted(set(plan.values()))}
    expect("PrepareFloat8ModuleInput" in plan.values(), "the blocks did not take torchao's float8 styles", out)
    expect(math.isfinite(run.record["summary"]["summary/final_loss"]), "the loss is not finite", out)
    return out


def check_planner(ctx: Context, run_name: str) -> dict:
    """Memory per phase: torch's tracker (on CUDA it counts the CUDA tensors) against the planner; on
    CUDA also the allocator's peaks against the planner's peak and its peak + margin."""
    run = ctx.completed(run_name)
    tracked = next((r for r in run.rows if "mem/tracked_total_gib_max" in r), None)
    expect(tracked is not None, "no memory-tracked row in metrics.jsonl")
    out, bad = {}, []
    for phase in ("forward", "backward", "optimizer"):
        measured, predicted = tracked[f"mem/tracked_{phase}_total_gib_max"], tracked[f"mem/predicted_{phase}_peak_gib"]
        err = predicted / measured - 1
        out[phase] = f"{gib(measured)} vs {gib(predicted)} ({pct(err)})"
        if abs(err) > PLANNER_TOLERANCE:
            bad.append(f"{phase} {pct(err)}")
    states, predicted_states = tracked["mem/model_states_gib_max"], tracked["mem/predicted_model_states_gib"]
    out["model states"] = f"{gib(states)} vs {gib(predicted_states)} ({pct(predicted_states / states - 1)})"
    if abs(predicted_states / states - 1) > MODEL_STATES_TOLERANCE:
        bad.append(f"model states {pct(predicted_states / states - 1)}")
    if ctx.device == "cuda":
        s, plan = run.record["summary"], run.record["plan"]
        allocated, reserved = s["summary/peak_allocated_gib_max"], s["summary/peak_reserved_gib_max"]
        peak, total = plan["peak"]["total"] / GIB, plan["per_rank_bytes"]["total"] / GIB
        out["allocated"] = f"{gib(allocated)} vs {gib(peak)} ({pct(peak / allocated - 1)})"
        out["reserved"] = f"{gib(reserved)} vs peak+margin {gib(total)}"
        # The sampled step's own interval: what the allocator held beyond the tensors the tracker saw.
        out["sampled step allocated"] = gib(tracked.get("mem/peak_allocated_gib_max"))
        out["alloc retries"], out["OOMs"] = s["summary/alloc_retries_max"], s["summary/ooms_max"]
        if abs(peak / allocated - 1) > PLANNER_TOLERANCE:
            bad.append(f"allocator peak {pct(peak / allocated - 1)}")
        if reserved > total:
            bad.append(f"reserved {gib(reserved)} GiB above the planned peak + margin {gib(total)} GiB")
    out["unit"] = "GiB measured vs planned"
    expect(not bad, "; ".join(bad) + f" (tolerance {PLANNER_TOLERANCE:.0%})", out)
    return out


def check_snapshot(ctx: Context) -> dict:
    run = ctx.completed("main")
    files = sorted((run.run_dir / "memory").glob("rank0_step*"))
    expect(files, "no memory/rank0_step* file")
    with open(files[0], "rb") as f:
        snapshot = pickle.load(f)
    expect(
        isinstance(snapshot, dict) and {"segments", "device_traces"} <= set(snapshot),
        f"not an allocator snapshot: keys {list(snapshot)[:5] if isinstance(snapshot, dict) else type(snapshot)}",
    )
    events = sum(len(t) for t in snapshot["device_traces"])
    expect(events > 0, "the snapshot recorded no allocator event")
    artifacts = run.record.get("artifacts") or []
    expect(any(a.startswith("memory/") for a in artifacts), "run.json artifacts does not list the snapshot")
    return {
        "file": files[0].name,
        "MiB": round(files[0].stat().st_size / 2**20, 1),
        "events": events,
        "segments": len(snapshot["segments"]),
        "reserved GiB": gib(sum(seg.get("total_size", 0) for seg in snapshot["segments"]) / GIB),
    }


def _comm_entry(run: Run) -> dict:
    comm = run.record.get("comm") or []
    expect(comm, "no profiled step in run.json comm")
    return comm[0]


def check_profiler(ctx: Context) -> dict:
    run = ctx.completed("main")
    traces = sorted((run.run_dir / "traces").glob("rank0_step*.json"))
    expect(traces, "no traces/rank0_step*.json")
    trace = json.loads(traces[0].read_text())
    kernels = sum(1 for e in trace.get("traceEvents", []) if e.get("cat") == "kernel")
    if ctx.device == "cuda":
        expect(kernels > 0, "the trace has no CUDA kernel: ProfilerActivity.CUDA recorded nothing")
    rank0 = _comm_entry(run)["per_rank"][0]
    expect(rank0["compute_s"] > 0, "no compute in the profiled step")
    return {
        "trace MiB": round(traces[0].stat().st_size / 2**20, 1),
        "kernels": kernels,
        "comm device": _comm_entry(run)["device"],
        "compute ms": round(rank0["compute_s"] * 1e3, 1),
        "step ms": round(rank0["step_s"] * 1e3, 1),
    }


def check_comm(ctx: Context) -> dict:
    run = ctx.completed("main")
    entry = _comm_entry(run)
    expect(entry["device"] == ctx.device, f"comm read as {entry['device']!r} on {ctx.device}")
    per_rank = entry["per_rank"]
    for kind in ("all_gather_s", "reduce_scatter_s"):
        expect(all(r[kind] > 0 for r in per_rank), f"a rank shows no {kind[:-2]}")
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    return {
        "AG ms": round(worst["all_gather_s"] * 1e3, 2),
        "RS ms": round(worst["reduce_scatter_s"] * 1e3, 2),
        "AR ms": round(worst["all_reduce_s"] * 1e3, 2),
        "exposed ms": round(worst["exposed_s"] * 1e3, 2),
        "exposed": round(worst["exposed_fraction"], 3),
        "collectives": entry["collectives_rank0"],
    }


def check_offload(ctx: Context) -> dict:
    run = ctx.completed("offload")
    record = run.record
    policies = find_key(record["applied"], "CPUOffloadPolicy")
    expect(policies, "no CPUOffloadPolicy in run.json applied")
    pinned = {bool(p.get("pin_memory")) for p in policies}
    expect(pinned == {ctx.device == "cuda"}, f"pin_memory {pinned} on {ctx.device}")
    host = record["plan"]["model_states"]["host"]["total"] / GIB
    if ctx.device == "cuda":
        expect(record["plan"]["model_states"]["device"]["total"] == 0, "the planner keeps model states on the GPU")
    s = record["summary"]
    return {
        **perf(run),
        "pinned": ctx.device == "cuda",
        "planned host GiB": gib(host),
        "host peak RSS GiB": gib(s["summary/host_peak_rss_gib_max"]),
        **({"GPU peak GiB": gib(s["summary/peak_allocated_gib_max"])} if ctx.device == "cuda" else {}),
    }


def check_fsdp1_sync(ctx: Context) -> dict:
    run = ctx.completed("fsdp1_sync")
    expect(find_key(run.record["applied"], "sync_module_states") == [True], "sync_module_states not applied")
    # The export gathers FSDP1's full state dict offloaded to the CPU (on a CPU device it cannot offload).
    export = run.record.get("export") or {}
    expect(
        export.get("format") == "safetensors" and Path(export.get("file", "")).is_file(),
        f"the FSDP1 export was not written: {export}",
    )
    return {
        **perf(run),
        "final loss": round(run.record["summary"]["summary/final_loss"], 4),
        "export MB": round(export["bytes"] / 1e6, 1),
    }


def check_fsdp1_offload(ctx: Context) -> dict:
    run = ctx.completed("fsdp1_offload")
    offload = find_key(run.record["applied"], "offload_params")
    expect(offload == [True], f"CPUOffload(offload_params=True) not applied: {offload}")
    s = run.record["summary"]
    return {
        **perf(run),
        "GPU peak GiB": gib(s.get("summary/peak_allocated_gib_max")),
        "final loss": round(s["summary/final_loss"], 4),
    }


def check_ddp_bf16(ctx: Context) -> dict:
    run = ctx.completed("ddp_bf16")
    hooks = find_key(run.record["applied"], "comm_hook")
    expect(hooks == ["bf16_compress_hook"], f"comm hook {hooks}")
    out = {**perf(run), "hook": hooks[0]}
    if ctx.gpus >= 2:
        entry = _comm_entry(run)
        expect(
            entry["device"] == "cuda" and all(r["all_reduce_s"] > 0 for r in entry["per_rank"]),
            "no NCCL all-reduce in the profiled step",
        )
        out["AR ms"] = round(max(r["all_reduce_s"] for r in entry["per_rank"]) * 1e3, 2)
    return out


def check_ring_attention(ctx: Context) -> dict:
    """CP 2 with torch's ring attention against CP 1 on the same batches: the same losses (bf16: within 1e-2)."""
    one, two = ctx.completed("cp1"), ctx.completed("cp2_ring")
    methods = find_key(two.record["applied"], "method")
    expect(methods == ["ring"], f"cp_method applied: {methods}")
    a = [r["train/loss"] for r in one.rows() if "train/loss" in r]
    b = [r["train/loss"] for r in two.rows() if "train/loss" in r]
    worst = max(abs(x / y - 1) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
    figures = {"cp1 losses": [round(x, 4) for x in a], "cp2 losses": [round(x, 4) for x in b], "worst": sig(worst)}
    expect(worst < 1e-2, f"ring CP 2 losses differ from CP 1's by {worst:.3g} (relative)", figures)
    return {**perf(two), **figures}


def check_block_causal(ctx: Context) -> dict:
    """model.attention_mask=block_causal trains (finite losses that fall) on this device's kernel, the record
    says which mask, position scheme and attention span ran, and the planner's phases hold (mask included)."""
    run = ctx.completed("block_causal")
    masks, positions = find_key(run.record, "attention_mask"), find_key(run.record, "positions")
    expect("block_causal" in masks and "document" in positions, f"recorded: mask {masks}, positions {positions}")
    losses = [r["train/loss"] for r in run.rows if "train/loss" in r]
    expect(losses and all(math.isfinite(x) for x in losses), f"losses {losses}")
    expect(losses[-1] < losses[0], f"the loss did not fall: {losses}")
    spans = find_key(run.record, "attention_span")
    kernel = "FlexAttention (BlockMask, compiled)" if ctx.device == "cuda" else "SDPA, additive mask"
    figures = {"kernel": kernel, "losses": [round(x, 4) for x in losses], "attention span": spans}
    return {**perf(run), **figures, **check_planner(ctx, "block_causal")}


def check_checkpoint(ctx: Context) -> dict:
    first = ctx.completed("ckpt_save")
    saved = {p.name for p in (first.run_dir / "checkpoints").glob("step_*")}
    expect("step_4" in saved, f"checkpoints {sorted(saved)}")
    run = ctx.completed("ckpt_resume")
    resumed = run.record.get("resumed_from") or {}
    expect("step_4" in json.dumps(resumed), f"resumed_from {resumed}")
    steps = [r["step"] for r in run.rows]
    expect(steps == list(range(1, 7)), f"metrics.jsonl steps {steps}")
    out = {"resumed from": "step_4", "save+resume s": round(first.wall_s + run.wall_s, 1)}
    if ctx.device == "cuda":  # every RNG state of a rank is saved: the CUDA generator's among them
        import torch

        files = (run.run_dir / "checkpoints" / "step_4").rglob("*rank0*.pt")  # rng/rank0.pt, wherever it moves
        states = [torch.load(p, weights_only=False) for p in files]
        expect(any("cuda" in s for s in states if isinstance(s, dict)), "no CUDA RNG state in the checkpoint")
        out["cuda rng"] = "saved"
    return out


def check_data_workers(ctx: Context) -> dict:
    run = ctx.completed("ckpt_save")
    workers = run.record["config"]["data"]["num_workers"]
    expect(workers > 0, "data.num_workers did not reach the run")
    waits = [r["perf/data_time_s"] * 1e3 for r in run.rows]
    # The first step waits for the workers to start; later ones for what they had not read ahead.
    return {
        "workers": workers,
        "pinned": ctx.device == "cuda",
        "first wait ms": round(waits[0], 1),
        "later max wait ms": round(max(waits[1:] or [0]), 2),
    }


def check_plan_cli(ctx: Context) -> dict:
    cli = ctx.run("plan")
    expect(cli.rc == 0, cli.error())
    planned = json.loads(cli.stdout)
    device = planned.get("device") or {}
    if ctx.device == "cuda":
        expect(planned["device_kind"] == "cuda", f"planned for {planned['device_kind']}")
        expect(device.get("name") == "cuda:0", f"device {device.get('name')}: not this machine's GPU")
        expect(device.get("fits") is True, f"does not fit: needs {device.get('needed_bytes')}")
    else:
        expect(device.get("name") == "cpu_host", f"device {device.get('name')}")
    out = {
        "device": device.get("description") or device.get("name"),
        "needs GiB": gib(device.get("needed_bytes", 0) / GIB),
        "peak phase": planned["peak"]["phase"],
    }
    main = ctx.runs["main"]
    if main.rc == 0:  # the run's own plan (computed at start-up) must be the command's
        expect(main.record["plan"]["peak"]["total"] == planned["peak"]["total"], "the run planned another peak")
    return out


def check_tune_cli(ctx: Context) -> dict:
    """python -m fsdp_exp.tune predicts for the device this machine has (a GPU is found by its CUDA name in
    the device table, else the measured CPU host) and ranks candidates that fit it."""
    cli = ctx.run("tune")
    expect(cli.rc == 0, cli.error())
    result = json.loads((ctx.work / "tune" / "tune.json").read_text())
    fitting = [c for c in result["candidates"] if c.get("fits")]
    expect(bool(fitting), "no candidate fits this machine's device")
    return {
        "candidates": len(result["candidates"]),
        "fit": len(fitting),
        "best predicted tok/s": round(fitting[0]["predicted"]["tokens_per_s"] or 0),
    }


def check_fit(ctx: Context) -> dict:
    run = ctx.run("fit_refused")
    if run.rc != 0 and "does not fit" not in run.stderr and run.feature in run.stderr:
        raise Skip("trainer.check_fit not available yet")
    expect(run.rc == 2, f"expected a refusal (exit 2), got {run.error() if run.rc else 'a run'}")
    message = run.stderr[run.stderr.find("does not fit") :]
    expect("does not fit" in run.stderr and "fix:" in message, f"refused, but not for memory: {run.error()}")
    if ctx.device == "cuda":  # what the GPU has free, asked from a child process of the launcher
        expect("cuda:" in message, "the refusal does not name the GPU's free memory")
        expect("error band" in message, "the refusal does not say how sure it is (the planner's error band)")
    first = message.splitlines()[0]
    return {"refused in s": round(run.wall_s, 1), "says": first[:160]}


def check_deepspeed(ctx: Context) -> dict:
    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("DeepSpeed not installed")
    probe = ctx.run("deepspeed_probe")
    if probe.rc != 0 and "sharding.backend" in probe.stderr:
        raise Skip("sharding.backend=deepspeed not available yet")
    run = ctx.completed("deepspeed")
    expect("deepspeed" in json.dumps(run.record["applied"]).lower(), "applied does not name DeepSpeed")
    return {**perf(run), "final loss": round(run.record["summary"]["summary/final_loss"], 4)}


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    runs: tuple[str, ...]
    evaluate: Callable[[Context], dict]
    needs: str = ""  # "" (any device), "cuda", "2 ranks" (2 GPUs on CUDA; the CPU run has 2 ranks), "cuda 2 ranks"
    covers: tuple[str, ...] = ()  # the inventory's places this check exercises


# The places below are named as fsdp_exp has them on 2026-12-06: re-sync them when files
# move (tests/integration/test_gpu_check.py lists what is missing and what is stale; --inventory prints the map).
# Every run on CUDA goes through these: the launcher's GPU count and fit check (a child process asks each
# GPU's free memory), preflight's device choice, NCCL, the device names in the record and the checkpointer.
EVERY_CUDA_RUN = (
    "fsdp_exp/env.py:cuda_device_count",
    "fsdp_exp/env.py:cuda_free_memory",
    "fsdp_exp/fit_check.py:node_memory",
    "fsdp_exp/fit_check.py:_need",
    "fsdp_exp/config/topology.py:resolve_where",  # preflight's device choice
    "fsdp_exp/tune/step_time.py:run_prediction",  # the launcher records the step-time model's parts on the GPU
    "fsdp_exp/dist.py:init_distributed",
    "fsdp_exp/record/recorder.py:device_name",
    "fsdp_exp/checkpoint/manager.py:Checkpointer._device_name",
    "fsdp_exp/launch.py:forked_ranks_allowed",  # the command line's launcher: a CUDA node's ranks are spawned
)
# The planner's CUDA rules, which every CUDA run's plan (run.json["plan"]) goes through.
PLANNER_CUDA_RULES = (
    "fsdp_exp/plan/states.py:model_states",
    "fsdp_exp/plan/step.py:StepWalk.__init__",
    "fsdp_exp/plan/step.py:StepWalk.optimizer_step",
    "fsdp_exp/plan/devices.py:allocator_margin",
    "fsdp_exp/plan/activations/llama.py:LlamaActivations.notes",
)

CHECKS = (
    Check(
        "fsdp2_bf16",
        "Llama-3 8B-shaped, 2 blocks, bf16, FSDP2: tokens/s and MFU against the data sheet",
        ("main",),
        check_throughput,
        covers=(*EVERY_CUDA_RUN, "fsdp_exp/metrics/device_peak.py:compute_peak_tflops"),
    ),
    Check(
        "planner",
        "memory per phase (tracker), CUDA allocator peaks, against the planner's phases and margin",
        ("main",),
        functools.partial(check_planner, run_name="main"),
        covers=(
            *PLANNER_CUDA_RULES,
            "fsdp_exp/metrics/step.py:StepMetrics.log",
            "fsdp_exp/metrics/step.py:StepMetrics.summary",
            "fsdp_exp/metrics/memory.py:cuda_bytes",
            "fsdp_exp/metrics/memory.py:cuda_counts",
        ),
    ),
    Check(
        "memory_snapshot",
        "the CUDA allocator history of the sampled step: written, loads with pickle",
        ("main",),
        check_snapshot,
        needs="cuda",
        covers=(
            "fsdp_exp/context.py:sampled_steps",
            "fsdp_exp/context.py:check_trainer",
            "fsdp_exp/metrics/step.py:StepMetrics._sampled",
        ),
    ),
    Check(
        "profiler",
        "the profiled step's trace, CUDA kernels recorded, comm/* read from it",
        ("main",),
        check_profiler,
        covers=("fsdp_exp/metrics/comm.py:profiled",),
    ),
    Check(
        "comm",
        "collectives of the profiled step (NCCL kernels on CUDA): all-gather, reduce-scatter, exposed",
        ("main",),
        check_comm,
        needs="2 ranks",
        covers=("fsdp_exp/metrics/comm.py:comm_from_trace",),
    ),
    Check(
        "planner_fp32_gqa",
        "fp32 with grouped-query attention: the planner assumes SDPA's math fallback on CUDA",
        ("fp32",),
        functools.partial(check_planner, run_name="fp32"),
        needs="cuda",
        covers=("fsdp_exp/plan/activations/llama.py:LlamaActivations.math_attention",),
    ),
    Check(
        "plan_cli",
        "python -m fsdp_exp.plan on this machine's device, the run's own plan equal to it",
        ("plan",),
        check_plan_cli,
        covers=(
            "fsdp_exp/plan/cli.py:plan_from_argv",
            "fsdp_exp/plan/devices.py:local_cuda_device",
            "fsdp_exp/plan/devices.py:fits",
        ),
    ),
    Check(
        "fit_refusal",
        "a run too big for this node (Llama 70B) refused before any rank, by the GPU's free memory",
        ("fit_refused",),
        check_fit,
        covers=(
            "fsdp_exp/fit_check.py:check_fit",
            "fsdp_exp/fit_check.py:_problem",
            "fsdp_exp/fit_check.py:_fixes",
            "fsdp_exp/fit_check.py:_fitting_changes",
            "fsdp_exp/fit_check.py:_gpu_layouts",
        ),
    ),
    Check(
        "offload_pinned",
        "FSDP2 offload=params: pinned host memory on CUDA (unpinned on a CPU)",
        ("offload",),
        check_offload,
        covers=(
            "fsdp_exp/parallel/fsdp2.py:offload_policy",
            "fsdp_exp/parallel/checks.py:check_offload",
            "fsdp_exp/plan/states.py:model_states",
        ),
    ),
    Check(
        "fsdp1_sync_module_states",
        "FSDP1 sharding.sync_module_states=true (broadcast from rank 0), and "
        "its export (the full state dict, offloaded to the CPU)",
        ("fsdp1_sync",),
        check_fsdp1_sync,
        needs="cuda",
        covers=("fsdp_exp/parallel/fsdp1.py:FSDP1.check", "fsdp_exp/parallel/fsdp1.py:FSDP1.full_state_dict"),
    ),
    Check(
        "fsdp1_cpu_offload",
        "FSDP1 offload=params: CPUOffload(offload_params=True)",
        ("fsdp1_offload",),
        check_fsdp1_offload,
        needs="cuda",
        covers=("fsdp_exp/parallel/fsdp1.py:FSDP1.check",),
    ),
    Check(
        "ddp_bf16_hook",
        "DDP precision=bf16_pure: bf16_compress_hook (needs NCCL)",
        ("ddp_bf16",),
        check_ddp_bf16,
        needs="cuda",
        covers=("fsdp_exp/parallel/ddp.py:DDP.check", "fsdp_exp/parallel/ddp.py:DDP.apply"),
    ),
    Check(
        "checkpoint_resume",
        "periodic save, resume in the same folder (CUDA RNG state saved and restored)",
        ("ckpt_save", "ckpt_resume"),
        check_checkpoint,
        covers=("fsdp_exp/checkpoint/rng.py:rng_state", "fsdp_exp/checkpoint/rng.py:set_rng_state"),
    ),
    Check(
        "data_workers",
        "data=text through DataLoader workers (pinned batches on CUDA)",
        ("ckpt_save",),
        check_data_workers,
        covers=("fsdp_exp/data/loader.py:StepData._start",),
    ),
    Check(
        "deepspeed",
        "DeepSpeed (sharding.backend=deepspeed) if installed and available",
        ("deepspeed_probe", "deepspeed"),
        check_deepspeed,
        covers=(
            "fsdp_exp/parallel/deepspeed.py:ds_config",
            "fsdp_exp/parallel/deepspeed.py:DeepSpeed.check",
            "fsdp_exp/plan/states.py:zero_model_states",
        ),
    ),
    Check(
        "tune_cli",
        "python -m fsdp_exp.tune predicts for this machine's device (no runs)",
        ("tune",),
        check_tune_cli,
        covers=(
            "fsdp_exp/tune/search.py:resolve_device",
            "fsdp_exp/tune/search.py:weigh",
            "fsdp_exp/tune/search.py:_weigh",  # a GPU's capacity is the device's, a CPU's shared by its ranks
            "fsdp_exp/tune/search.py:memory_verdict",  # a GPU over its memory within the fit band: borderline
        ),
    ),
    Check(
        "compile",
        "the same as fsdp2_bf16 with compile=true: tokens/s, MFU, speed-up, first step",
        ("compile",),
        check_compile,
    ),
    Check(
        "float8",
        "the compiled run with precision=float8 (float8 all-gathers): tokens/s against compiled bf16, "
        "MFU against both peaks",
        ("float8", "compile"),
        check_float8,
        needs="cuda",
        # its ranks ask their GPU's FP8 tensor cores before building (an A100 is refused: a CPU test feeds names)
        covers=("fsdp_exp/metrics/device_peak.py:fp8_peak_tflops", "fsdp_exp/parallel/float8.py:check_rank_device"),
    ),
    Check(
        "float8_tp_sp",
        "precision=float8 with parallel.tp=2 and sequence parallel: torchao's float8 styles gather the sequence "
        "in float8 (NCCL; gloo cannot)",
        ("float8_tp_sp",),
        check_float8_tp_sp,
        needs="cuda 2 ranks",
        covers=("fsdp_exp/parallel/float8.py:check",),
    ),
    Check(
        "block_causal",
        "packed documents kept apart: block-causal attention (FlexAttention on CUDA) with document positions on "
        "the shipped corpus trains, is recorded, and the planner holds",
        ("block_causal",),
        check_block_causal,
        covers=(
            "fsdp_exp/models/attention_mask.py:document_mask",
            "fsdp_exp/models/attention_mask.py:check",
            "fsdp_exp/models/attention_mask.py:mask_bytes",
        ),
    ),
    Check(
        "ring_attention",
        "context parallel, torch's ring attention: CP 2 against CP 1 on the same batches, the same losses",
        ("cp1", "cp2_ring"),
        check_ring_attention,
        needs="cuda 2 ranks",
        covers=("fsdp_exp/parallel/context.py:resolve_method", "fsdp_exp/parallel/context.py:method_refusal"),
    ),
)


def skip_reason(check: Check, ctx: Context) -> Optional[str]:
    if check.needs.startswith("cuda") and ctx.device != "cuda":
        return "skipped: needs CUDA"
    if check.needs.endswith("2 ranks") and ctx.ranks < 2:
        return f"skipped: needs 2 GPUs ({ctx.gpus} here)"
    return None


# ------------------------------------------------------------------------------------------ main
def save_runs(ctx: Context, names: tuple[str, ...], save: Path) -> None:
    """The small files of these runs (log, run.json, metrics.jsonl, errors/) into ``save/<run>/``: what
    comes back from a borrowed machine, without checkpoints, traces and snapshots."""
    for name in names:
        run = ctx.runs[name]
        if run.rc is None:
            continue
        target = save / name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ctx.work / f"{name}.log", target / "command.log")
        if run.module == "fsdp_exp" and run.run_dir and run.run_dir.exists():
            for path in [
                run.run_dir / "run.json",
                run.run_dir / "metrics.jsonl",
                *(run.run_dir / "errors").glob("*.txt"),
            ]:
                if path.exists():
                    copy = target / path.relative_to(run.run_dir)
                    copy.parent.mkdir(exist_ok=True)
                    shutil.copy2(path, copy)


def run_checks(
    ctx: Context, checks: list[Check], out: Optional[Path], header: dict, save: Optional[Path] = None, jobs: int = 1
) -> list[dict]:
    if jobs > 1:  # the runs of every check that will not be skipped, started ahead in check order
        ctx.prefetch([r for c in checks if skip_reason(c, ctx) is None for r in c.runs], jobs)
    try:
        return _run_checks(ctx, checks, out, header, save)
    finally:
        ctx.stop()


def _run_checks(
    ctx: Context, checks: list[Check], out: Optional[Path], header: dict, save: Optional[Path]
) -> list[dict]:
    results: list[dict] = []
    started, interrupted = time.monotonic(), False
    for check in checks:
        if interrupted:
            break
        t0 = time.monotonic()
        result = {
            "check": check.name,
            "what": check.what,
            "needs": check.needs or "any",
            "cpu": not check.needs.startswith("cuda"),
            "covers": list(check.covers),
            "figures": {},
            "note": "",
        }
        reason = skip_reason(check, ctx)
        pending = [r for r in check.runs if ctx.runs[r].rc is None]
        if reason is None and pending and ctx.deadline - time.monotonic() < 20:
            reason = "skipped: time budget (--budget)"
        if reason:
            result["status"] = reason
        else:
            try:
                result["figures"] = check.evaluate(ctx)
                result["status"] = "pass"
            except Skip as skip:
                result["status"] = f"skipped: {skip}"
            except CheckFailed as failed:
                result["status"], result["note"], result["figures"] = "fail", str(failed), failed.figures
            except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: keep what the earlier checks found
                result["status"], result["note"] = "fail", f"interrupted ({stop or 'Ctrl-C'})"
                interrupted = True
            except Exception as exc:  # noqa: BLE001 - a record that changed shape is this check's failure
                result["status"], result["note"] = "fail", f"{type(exc).__name__}: {exc}"
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["runs"] = [
            {"name": r, "dir": str(ctx.runs[r].run_dir), "rc": ctx.runs[r].rc, "wall_s": round(ctx.runs[r].wall_s, 1)}
            for r in check.runs
            if ctx.runs[r].rc is not None
        ]
        results.append(result)
        print(
            f"[{time.monotonic() - started:6.1f} s] {check.name:<26} {result['status']:<30} "
            f"{result['wall_s']:6.1f} s  {describe(result)}",
            flush=True,
        )
        if out:
            write_json(out, header, results)
        if save:
            save_runs(ctx, check.runs, save)
    return results


def describe(result: dict) -> str:
    """A check's figures; a failure's reason first."""
    figures = "; ".join(f"{k} {v}" for k, v in result["figures"].items())
    return " | ".join(filter(None, [result["note"], figures]))


def write_json(out: Path, header: dict, results: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "checks": results}, indent=1, default=str) + "\n")


def print_table(header: dict, results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    m = header["machine"]
    where = f"{m['gpus']} x {m['gpu']}" if m.get("gpu") and header["device"] == "cuda" else f"{m['cpus']} CPUs"
    table = Table(
        title=f"fsdp_exp GPU paths: {where}, torch {m['torch']}, CUDA {m['cuda']}, size {header['size']}",
        caption=f"{header['total_s']:.0f} s in all; run folders and logs: {header['work']}",
    )
    table.add_column("check")
    table.add_column("result")
    table.add_column("s", justify="right")
    table.add_column("figures (failed: why)")
    styles = {"pass": "green", "fail": "bold red"}
    for r in results:
        table.add_row(
            r["check"], f"[{styles.get(r['status'], 'yellow')}]{r['status']}[/]", f"{r['wall_s']:.1f}", describe(r)
        )
    Console(width=max(160, Console().width)).print(table)


def inventory_report() -> int:
    """Print every place the pattern finds with the checks that name it; 1 if one is unnamed or stale."""
    places = cuda_places(REPO / "fsdp_exp")
    named: dict[str, list[str]] = {}
    for check in CHECKS:
        for place in check.covers:
            named.setdefault(place, []).append(check.name)
    for place, lines in places.items():
        by = ", ".join(named.get(place, [])) or (
            f"(run elsewhere) {RUN_ELSEWHERE[place]}" if place in RUN_ELSEWHERE else "MISSING: no check names it"
        )
        print(f"{place:<64} lines {','.join(map(str, lines)):<14} {by}")
    stale = sorted((set(named) | set(RUN_ELSEWHERE)) - set(places))
    for place in stale:
        print(f"{place:<64} STALE: named in benchmarks/gpu_check.py, not a CUDA-only place (moved or renamed?)")
    missing = [p for p in places if p not in named and p not in RUN_ELSEWHERE]
    return 1 if missing or stale else 0


def dry_run(ctx: Context, checks: list[Check], plan_device: str) -> int:
    """Each run of these checks through ``python -m fsdp_exp.plan ... plan.device=<GPU>`` (its ``main``,
    called in this process): every override the GPU machine will get is composed and validated here,
    and its memory planned against that GPU. 1 if one is refused or does not fit (DeepSpeed's, before
    that backend exists, is left out)."""
    names = list(dict.fromkeys(r for c in checks for r in c.runs))
    bad = 0
    for name in names:
        spec = ctx.runs[name]
        if spec.module != "fsdp_exp":
            continue
        probe = Run(
            f"dry_{name}", [*spec.argv, f"plan.device={plan_device}", "plan.format=json"], 120, module="fsdp_exp.plan"
        )
        ctx.runs[probe.name] = probe
        ctx.plan_here(probe.name)
        if probe.rc != 0:
            waived = bool(spec.feature) and spec.feature in probe.stderr
            bad += not waived
            print(f"{name:<14} {'not available yet' if waived else 'REFUSED'}: {probe.error()}")
            continue
        device = json.loads(probe.stdout)["device"]
        bad += device["fits"] != spec.fits
        verdict = "fits" if device["fits"] else "does not fit" + (" (as meant)" if not spec.fits else "")
        print(
            f"{name:<14} {verdict if device['fits'] == spec.fits else verdict.upper()}: needs "
            f"{device['needed_bytes'] / GIB:.1f} of {device['bytes'] / GIB:.1f} GiB per rank  "
            f"({' '.join(spec.argv)})"
        )
    return 1 if bad else 0


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when there is a GPU")
    ap.add_argument(
        "--size",
        choices=["auto", "full", "tiny"],
        default="auto",
        help="full: the 8B-shaped model (GPU); tiny: the default llama_tiny (auto: full on CUDA)",
    )
    ap.add_argument("--out", type=Path, help="write the results as JSON here (after every check)")
    ap.add_argument("--save", type=Path, help="copy each run's log, run.json, metrics.jsonl and errors here")
    ap.add_argument("--work", type=Path, help="the folder for run folders and logs (default: a new temp folder)")
    ap.add_argument("--budget", type=float, default=450, help="seconds for everything (default 450)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every run (e.g. one renamed since this script was written)",
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="runs at a time (--device cpu only: each GPU run uses every GPU; default 1)"
    )
    ap.add_argument("--only", default="", help="comma-separated check names to run")
    ap.add_argument("--skip", default="", help="comma-separated check names to leave out")
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU needed: validate and plan every GPU run with python -m fsdp_exp.plan, then exit",
    )
    ap.add_argument("--gpus", type=int, default=1, help="--dry-run: the GPUs to plan for (default 1)")
    ap.add_argument("--plan-device", default="h200_141gb", help="--dry-run: the planner's device (default h200_141gb)")
    ap.add_argument("--inventory", action="store_true", help="print fsdp_exp's CUDA-only places and exit")
    args = ap.parse_args(argv)

    if args.inventory:
        return inventory_report()
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<26} needs {c.needs or 'any':<8} runs {','.join(c.runs):<26} {c.what}")
            for place in c.covers:
                print(f"{'':<28}covers {place}")
        return 0
    names = {c.name for c in CHECKS}
    only, skip = [set(filter(None, s.split(","))) for s in (args.only, args.skip)]
    if (only | skip) - names:
        ap.error(f"unknown check(s) {', '.join(sorted((only | skip) - names))}; --list shows them")
    checks = [c for c in CHECKS if (not only or c.name in only) and c.name not in skip]

    if args.dry_run:
        work = args.work or Path(tempfile.mkdtemp(prefix="fsdp_exp_gpu_check_dry_"))
        work.mkdir(parents=True, exist_ok=True)
        size = args.size if args.size != "auto" else "full"
        ctx = Context(
            device="cuda", gpus=args.gpus, size=size, work=work.resolve(), deadline=time.monotonic() + args.budget
        )
        ctx.runs = define_runs(ctx, args.set)
        return dry_run(ctx, checks, args.plan_device)
    info = machine()
    device = args.device if args.device != "auto" else ("cuda" if info["gpus"] else "cpu")
    if device == "cuda" and not info["gpus"]:
        ap.error("--device cuda but torch sees no CUDA device (pass --device cpu)")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: pass 1 or more")
    if args.jobs > 1 and device == "cuda":
        ap.error(f"--jobs {args.jobs} is for --device cpu: each GPU run uses every GPU, one run at a time")
    size = args.size if args.size != "auto" else ("full" if device == "cuda" else "tiny")
    work = args.work or Path(tempfile.mkdtemp(prefix="fsdp_exp_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ctx = Context(
        device=device,
        gpus=info["gpus"] if device == "cuda" else 0,
        size=size,
        work=work.resolve(),
        deadline=start + args.budget,
    )
    ctx.runs = define_runs(ctx, args.set)
    header = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": info,
        "device": device,
        "size": size,
        "work": str(ctx.work),
        "budget_s": args.budget,
        "total_s": None,
    }
    where = f"{info['gpus']} x {info.get('gpu')}" if device == "cuda" else f"{info['cpus']} CPUs"
    print(
        f"fsdp_exp GPU check on {where} (torch {info['torch']}, CUDA {info['cuda']}, NCCL {info.get('nccl')}), "
        f"size {size}, budget {args.budget:.0f} s{f', {args.jobs} runs at a time' if args.jobs > 1 else ''}; "
        f"runs in {ctx.work}",
        flush=True,
    )
    # SIGTERM (a time limit) ends the script like Ctrl-C: the running run's processes are killed with it.
    signal.signal(signal.SIGTERM, _interrupted)
    results = run_checks(ctx, checks, args.out, header, args.save, jobs=args.jobs)
    header["total_s"] = round(time.monotonic() - start, 1)
    if args.out:
        write_json(args.out, header, results)
    print_table(header, results)
    failed = [r["check"] for r in results if r["status"] == "fail"]
    if failed:
        print(f"failed: {', '.join(failed)} (logs: {ctx.work}/<run>.log)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
