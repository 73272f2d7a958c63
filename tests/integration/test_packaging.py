"""The package as a user installs it: a wheel built from this checkout, installed into a fresh
environment, composes, plans and runs from a folder outside the checkout, with the config groups of
conf/ shipped inside the package as fsdp_exp/conf; a user's own presets join through Hydra's search path.

Nothing is downloaded: the wheel is built without build isolation, and the fresh environment reaches
torch, Hydra and the rest through this test's own site-packages, listed in a ``.pth`` file. A ``.pth``
line only adds a folder to ``sys.path``; the ``.pth`` files inside that folder are not run, so this
checkout's editable install (one of them) stays invisible, and the tests assert it did.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import QUIET, REPO


@dataclass
class Installed:
    python: Path  # the fresh environment's interpreter
    scripts: Path  # its console scripts (fsdp-exp)
    package: Path  # where it installed fsdp_exp
    elsewhere: Path  # a folder outside the checkout, where every command runs


def _checkout_files() -> list[Path]:
    """What a clone of this checkout holds (tracked files, and new ones git does not ignore)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell the checkout's files from build leftovers")
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    return [Path(name) for name in listed.stdout.split("\0") if name and (REPO / name).is_file()]


def _run(args: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("packaging")
    assert REPO not in base.parents
    # Build from a copy of what a clone holds: an in-place build would reuse build/ leftovers.
    source = base / "source"
    for name in _checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    _ok(
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-w",
                base / "dist",
                source,
            ],
            cwd=base,
        )
    )
    (wheel,) = (base / "dist").glob("fsdp_exp-*.whl")

    _ok(_run([sys.executable, "-m", "venv", "--without-pip", base / "venv"], cwd=base))
    python = base / "venv" / "bin" / "python"
    purelib = Path(
        _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=base)).strip()
    )
    (purelib / "_test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: pip sees this checkout's editable fsdp_exp through that path and must leave it be
    _ok(
        _run(
            [
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--ignore-installed",
                "--no-compile",
                wheel,
            ],
            cwd=base,
        )
    )
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return Installed(python=python, scripts=python.parent, package=purelib / "fsdp_exp", elsewhere=elsewhere)


def _composed(installed: Installed, *overrides: str) -> dict:
    out = _ok(_run([installed.python, "-m", "fsdp_exp", "--cfg", "job", *overrides], cwd=installed.elsewhere))
    return yaml.safe_load(out)


def test_the_installed_package_is_the_one_imported_and_ships_every_config_file(installed):
    out = _ok(
        _run(
            [
                installed.python,
                "-c",
                "import fsdp_exp, hydra_plugins.fsdp_exp_launcher as l; print(fsdp_exp.__file__); print(l.__file__)",
            ],
            cwd=installed.elsewhere,
        )
    )
    package_file, launcher_file = (Path(line) for line in out.split())
    assert package_file.parent == installed.package, "the checkout's fsdp_exp was imported, not the wheel's"
    assert installed.package.parent in launcher_file.parents
    assert REPO not in package_file.parents and REPO not in launcher_file.parents

    assert (installed.package / "conf" / "config.yaml").is_file()
    shipped = {p.relative_to(installed.package / "conf") for p in (installed.package / "conf").rglob("*.yaml")}
    ours = {p.relative_to(REPO / "conf") for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped == ours
    assert not (installed.package.parent / "conf").exists(), "conf/ must ship inside the package, not beside it"


@pytest.mark.parametrize("entry", ["python -m fsdp_exp", "fsdp-exp"])
def test_the_installed_package_composes_a_preset_from_outside_the_checkout(installed, entry):
    command = [installed.python, "-m", "fsdp_exp"] if entry.startswith("python") else [installed.scripts / "fsdp-exp"]
    cfg = yaml.safe_load(_ok(_run([*command, "--cfg", "job", "model=llama7b"], cwd=installed.elsewhere)))
    assert (cfg["model"]["dim"], cfg["model"]["n_layers"], cfg["model"]["vocab_size"]) == (4096, 32, 32000)
    assert cfg["sharding"]["backend"] == "fsdp2"  # the rest of config.yaml's defaults came along


def test_the_installed_package_finds_the_slurm_launcher_preset(installed):
    out = _ok(
        _run([installed.python, "-m", "fsdp_exp", "--cfg", "hydra", "hydra/launcher=slurm"], cwd=installed.elsewhere)
    )
    launcher = yaml.safe_load(out)["hydra"]["launcher"]
    assert launcher["_target_"] == "hydra_plugins.fsdp_exp_launcher.SlurmLauncher"
    assert launcher["signal_delay_s"] == 120  # conf/hydra/launcher/slurm.yaml, over submitit's defaults


def test_the_installed_planner_composes_from_outside_the_checkout(installed):
    out = _ok(
        _run([installed.python, "-m", "fsdp_exp.plan", "model=llama7b", "plan.format=json"], cwd=installed.elsewhere)
    )
    assert "6738415616" in json.dumps(json.loads(out))  # Llama-2 7B's parameter count


def test_the_installed_package_runs_the_default_experiment(installed):
    result = _run(
        [installed.python, "-m", "fsdp_exp", "trainer.steps=3", "logger.wandb.mode=disabled", *QUIET],
        cwd=installed.elsewhere,
        timeout=240,
    )
    _ok(result)
    (record,) = (installed.elsewhere / "outputs" / "runs").glob("*/run.json")
    assert json.loads(record.read_text())["status"] == "completed"


@pytest.fixture
def my_conf(tmp_path) -> Path:
    """A user's own folder of presets, laid out like conf/: a model that starts from a shipped one."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_model.yaml").write_text("defaults:\n  - llama_tiny\n  - _self_\nn_layers: 3\n")
    return tmp_path


@pytest.mark.parametrize("how", ["hydra.searchpath", "--config-dir"])
def test_a_users_own_preset_joins_through_hydras_search_path(installed, my_conf, how):
    added = [f"hydra.searchpath=[{my_conf.as_uri()}]"] if how == "hydra.searchpath" else ["--config-dir", str(my_conf)]
    model = _composed(installed, *added, "model=my_model")["model"]
    assert (model["n_layers"], model["dim"]) == (3, 64)  # its own change over the shipped llama_tiny


def test_without_the_users_folder_the_preset_is_unknown(installed, my_conf):
    result = _run([installed.python, "-m", "fsdp_exp", "--cfg", "job", "model=my_model"], cwd=installed.elsewhere)
    assert result.returncode != 0
    assert "my_model" in result.stderr
