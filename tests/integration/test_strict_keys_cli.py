"""Strict keys through the command line: `python -m fsdp_exp` exits 2 naming the key (and the closest real
one) within seconds, a sweep with an unknown key starts no job, and Hydra's own refusals are bad input too."""

from __future__ import annotations

import pytest

from conftest import run_cli


@pytest.mark.parametrize("override", ["+unknown_key=1", "+trainer.stpes=5", "++model.dimm=3", "trainer.grad_clip=nan"])
def test_the_cli_exits_2_naming_the_key_fast(override, tmp_path):
    result = run_cli([override], tmp_path / "run", timeout=60)
    assert result.returncode == 2, result.stderr
    assert override.lstrip("+").split("=")[0] in result.stderr
    assert result.seconds < 10
    assert not (tmp_path / "run" / "run.json").exists()  # nothing started


def test_a_sweep_with_an_unknown_key_starts_no_job(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_exp", "-m", "+trainer.stpes=5,6", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "did you mean trainer.steps?" in proc.stderr
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())


def test_a_key_in_a_users_yaml_that_the_schema_lacks_exits_2_with_the_closest_key(tmp_path):
    user = tmp_path / "my_conf"
    (user / "model").mkdir(parents=True)
    (user / "model" / "my_model.yaml").write_text("defaults:\n  - llama_tiny\n  - _self_\ndimm: 3\n")
    result = run_cli(["--config-dir", str(user), "model=my_model"], tmp_path / "run", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "model.dimm" in result.stderr and "did you mean model.dim?" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.stpes=3", "did you mean trainer.steps?"),
        ("model=llama_tin", "did you mean model=llama_tiny?"),
        ("trainer.steps=abc", "trainer.steps"),
    ],
)
def test_hydras_own_refusals_are_bad_input_too(override, needle, tmp_path):
    result = run_cli([override], tmp_path / "run", timeout=60)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
