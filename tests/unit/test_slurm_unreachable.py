"""A SLURM sweep from a machine that cannot submit is refused before anything is submitted (exit 2), naming
what is missing (sbatch or srun not on PATH, no configuration, no controller) and the command that runs the same
sweep here; never submitit's traceback. CI has a real SLURM: these tests hide it (a PATH without it, a SLURM_CONF
naming no file) rather than depend on its absence."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from fsdp_exp.slurm import local_command, unreachable

REPO = Path(__file__).resolve().parents[2]


def _commands(folder: Path, names: tuple[str, ...], say: str = "") -> Path:
    """``folder`` holding the named commands: SLURM's own where installed, else stand-ins that only exist (the
    check looks them up, it does not run sbatch or srun)."""
    folder.mkdir(exist_ok=True)
    for name in names:
        real = shutil.which(name)
        if real and not say:
            (folder / name).symlink_to(real)
        else:
            (folder / name).write_text(f"#!/bin/sh\n{say or 'exit 1'}\n")
            (folder / name).chmod(0o755)
    return folder


def test_a_slurm_sweep_without_sbatch_on_path_is_refused_naming_it_and_the_local_command(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "PYTHONPATH": str(REPO)}
    (tmp_path / "bin").mkdir()
    command = ["-m", "hydra/launcher=slurm", "sharding=full,grad_op", "hydra.launcher.partition=gpu"]
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "sbatch and srun are not on PATH" in done.stderr and "nothing was submitted" in done.stderr
    assert "run the sweep here instead: python -m fsdp_exp -m sharding=full,grad_op;" in done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.rglob(".submitit")), done.stderr[-3000:]


def test_a_slurm_conf_that_names_no_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_commands(tmp_path / "bin", ("sbatch", "srun", "scontrol"))))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere" / "slurm.conf"))
    assert (
        unreachable()
        == f"SLURM_CONF={tmp_path / 'nowhere' / 'slurm.conf'} names no file: SLURM's commands have no configuration to read"
    )


def test_srun_missing_alone_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(_commands(tmp_path / "bin", ("sbatch", "scontrol"))))
    assert unreachable().startswith("srun is not on PATH")


def test_no_configuration_is_named_in_slurms_words(tmp_path, monkeypatch):
    # What scontrol says where it finds no slurm.conf and no configless controller (SLURM 22-24); the stand-in
    # answers so where this machine has a configuration of its own to find.
    fatal = "scontrol: fatal: Could not establish a configuration source"
    monkeypatch.delenv("SLURM_CONF", raising=False)
    has_own = Path("/etc/slurm/slurm.conf").exists() or Path("/etc/slurm-llnl/slurm.conf").exists()
    say = f"echo '{fatal}' >&2; exit 1" if has_own or not shutil.which("scontrol") else ""
    monkeypatch.setenv("PATH", str(_commands(tmp_path / "bin", ("sbatch", "srun", "scontrol"), say)))
    answer = unreachable()
    assert answer is not None and answer.startswith("no SLURM configuration was found"), answer


def test_the_local_command_drops_the_launcher_and_its_settings_only():
    argv = [
        "-m",
        "hydra/launcher=slurm",
        "sharding=full,grad_op",
        "hydra.launcher.partition=gpu",
        "+hydra.launcher.x=1",
    ]
    assert (
        local_command([*argv, "hydra.sweep.dir=a b"])
        == "python -m fsdp_exp -m sharding=full,grad_op 'hydra.sweep.dir=a b'"
    )
