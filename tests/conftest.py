"""Shared helpers: compose configs with Hydra's compose API, run experiments for real.

Experiments run through the same launcher users hit: ``run_cli`` calls ``python -m fsdp_exp`` in a
subprocess (exit codes, messages); ``run_experiment`` calls the launcher in-process, which spawns
fresh gloo workers exactly as the CLI does but saves the launcher's own start-up.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

REPO = Path(__file__).resolve().parents[1]

# Quiet, offline, and never touching the user's caches.
BASE_ENV = {"WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
# Overrides every test run takes: no progress bar, no table, W&B offline unless a test asks.
QUIET = ["logger.progress=false", "logger.summary_table=false"]
# The small Llama most tests train: 2 blocks of width 64, grouped-query attention (4 query heads, 2
# key/value heads), 256 tokens; 8 sequences of 32 tokens per step. One definition for every test file.
TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256"]
TINY_BATCH = ["trainer.seq_len=32", "trainer.global_batch_size=8"]


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    for key, value in BASE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb_config"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "wandb_data"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    # fsdp_exp caches this CPU's measured matmul peak there: one folder for the whole session, so the
    # tests measure it once (per thread count and world size), never in the user's ~/.cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg_cache"))


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process_group(monkeypatch, request):
    """tests/unit: no process group, no spawned rank (a test that starts one fails: it belongs in
    tests/integration/), so the quick tier stays under a minute. Subprocesses that exit before any rank
    starts (a refused CLI call) are allowed."""
    if "unit" not in request.node.path.relative_to(REPO / "tests").parts[:1]:
        yield
        return
    import multiprocessing.process

    import torch.distributed as dist

    started: list[str] = []
    init_process_group = dist.init_process_group

    def guarded_init(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if backend != "fake":  # torch's in-process fake group (shape checks) is not a process group
            started.append(f"torch.distributed.init_process_group(backend={backend!r})")
        return init_process_group(*args, **kwargs)

    def guarded_start(self):
        started.append(f"a spawned process ({self.name})")
        raise RuntimeError("tests/unit must not spawn processes: move this test to tests/integration/")

    monkeypatch.setattr(dist, "init_process_group", guarded_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
    yield
    assert not started, f"a unit test started {started}: move it to tests/integration/"


def compose_config(overrides: list[str], return_hydra_config: bool = False):
    if return_hydra_config:  # the hydra node holds this process's state (its cwd): composed each time
        with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
            return compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return copy.deepcopy(_composed(tuple(overrides)))  # a copy: callers may change theirs


# FSDP_EXP_TESTS_COMPOSE=hydra: every composition is Hydra's own compose() of the whole override list (to check
# that the split below changes no test's outcome: tests/README.md).
WHOLE_COMPOSE = os.environ.get("FSDP_EXP_TESTS_COMPOSE") == "hydra"


@functools.cache
def _composed(overrides: tuple[str, ...]):
    """What Hydra composes from these overrides, once per session (~0.15 s a composition; the quick tier asks
    for some 360, most differing from another only in values). It cannot change meanwhile: conf/ and the
    registered schema are fixed, and composing resolves no interpolation. A refused composition raises each
    time (exceptions are not cached).

    Hydra composes in two steps: the config-group choices build the defaults list, whose configs it merges
    (the cost); then it sets the value overrides (``key=value``, ``+key=value``, ``~key``) on the merged,
    struct-mode config in order (``ConfigLoaderImpl._apply_overrides_to_config``). The group choices alone
    decide the first step, so its result is cached by them and the second step is Hydra's own function run on
    a copy: 360 compositions become ~120. Which override is a group choice is Hydra's test
    (``defaults_list.Overrides``); overrides of the hydra node (a search path changes the groups) and sweeps
    take the whole composition."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        if WHOLE_COMPOSE:
            return compose(config_name="config", overrides=list(overrides))
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
        if any(o.is_hydra_override() or o.is_sweep_override() for o in parsed):
            return compose(config_name="config", overrides=list(overrides))
        repo = GlobalHydra.instance().config_loader().repository
        is_value = [isinstance(o.value(), dict) or not repo.group_exists(o.key_or_group) for o in parsed]
        if not any(is_value):
            return compose(config_name="config", overrides=list(overrides))
        choices = tuple(o.input_line for o, value in zip(parsed, is_value) if not value)
        values = [o for o, value in zip(parsed, is_value) if value]
    cfg = copy.deepcopy(_composed(choices))
    try:  # as Hydra's load_configuration reports an OmegaConf error while composing
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as err:
        raise ConfigCompositionException().with_traceback(err.__traceback__) from err
    return cfg


def run_config(overrides: list[str]):
    from fsdp_exp.config import to_run_config

    return to_run_config(compose_config(overrides))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path

    @property
    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_cli(overrides: list[str], run_dir: Path, timeout: float = 240, quiet: bool = True) -> CliResult:
    """Run ``python -m fsdp_exp`` as a user would. Its process tree carries a marker in its
    environment, so ``leftover_processes`` can find any process of it still alive afterwards."""
    cmd = [sys.executable, "-m", "fsdp_exp", *overrides, *(QUIET if quiet else []), f"hydra.run.dir={run_dir}"]
    env = {**os.environ, MARKER: str(run_dir)}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start, Path(run_dir))


MARKER = "FSDP_EXP_TEST_RUN"

# What the multi-node tests (torchrun, the 2-node SLURM cluster) train: the default experiment, 4 steps;
# on 4 ranks of this machine (FOUR_LOCAL_RANKS), the losses their 2 x 2 ranks must reproduce.
MULTI_NODE_TRAINING = ["trainer.steps=4", "trainer.warmup_steps=1"]
FOUR_LOCAL_RANKS = [*MULTI_NODE_TRAINING, "trainer.nproc_per_node=4", "logger.wandb.mode=disabled"]


@pytest.fixture(scope="session")
def four_local_ranks(tmp_path_factory) -> list[float]:
    """The losses of FOUR_LOCAL_RANKS, launched by fsdp_exp: one run for every test that compares a
    multi-node job with it (test_torchrun.py, test_slurm_nodes.py). A session fixture starts before the
    per-test environment, so it isolates its run itself."""
    home = tmp_path_factory.mktemp("four_local_home")
    run_dir = tmp_path_factory.mktemp("four_local") / "run"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {
            **BASE_ENV,
            "HF_HOME": str(home / "hf"),
            "XDG_CACHE_HOME": str(tmp_path_factory.getbasetemp() / "xdg_cache"),
        }.items():
            patch.setenv(key, value)
        result = run_cli(FOUR_LOCAL_RANKS, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = result.metrics
    assert [row["step"] for row in rows] == [1, 2, 3, 4], "every step once, in order"
    return [row["train/loss"] for row in rows]


def leftover_processes(run_dir: Path) -> list[str]:
    """Processes started by ``run_cli(..., run_dir)`` that are still alive."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(MARKER) == str(run_dir):
                left.append(" ".join(proc.info["cmdline"] or []))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return left


def run_experiment(overrides: list[str], run_dir: Path) -> dict:
    """Compose, validate and launch in this process (workers are fresh spawned processes)."""
    from fsdp_exp.context import Labels
    from fsdp_exp.launch import launch

    from omegaconf import open_dict, read_write

    from fsdp_exp.config import to_run_config

    overrides = [*overrides, *QUIET]
    cfg = compose_config(overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    # what hydra.main hands fsdp_exp's entry point: the same composition less its hydra node (one composition)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return launch(to_run_config(cfg), Path(run_dir), Labels(overrides=tuple(overrides), choices=choices))


# Qwen2 (transformers) shrunk to 4 layers of width 64 and a vocabulary of 256: the pipeline tests' HF model.
TINY_QWEN2 = [
    "model=hf_qwen2_7b",
    "+model.hf_overrides.num_hidden_layers=4",
    "+model.hf_overrides.hidden_size=64",
    "+model.hf_overrides.intermediate_size=128",
    "+model.hf_overrides.num_attention_heads=4",
    "+model.hf_overrides.num_key_value_heads=2",
    "+model.hf_overrides.vocab_size=256",
]
