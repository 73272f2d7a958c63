"""A package only running needs: refused for a run on this machine, noted (not refused) while planning for another
machine (fsdp_exp.packages). torchao is hidden from the import system here, as on a machine without it."""

from __future__ import annotations

import sys

import pytest

from fsdp_exp.errors import ConfigError
from fsdp_exp.packages import planning_elsewhere
from fsdp_exp.parallel import float8

from conftest import compose_config


@pytest.fixture
def without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # importlib.util.find_spec -> None: not installed


def test_float8_without_torchao_is_refused_for_a_run_here_with_the_install_command(without_torchao):
    cfg = compose_config(["precision=float8"])
    with pytest.raises(ConfigError, match=r"needs torchao, which is not installed\.\n  fix: pip install"):
        float8.check(cfg, "cuda")


def test_float8_without_torchao_passes_while_planning_for_another_machine_and_names_the_package(without_torchao):
    cfg = compose_config(["precision=float8"])
    with planning_elsewhere() as missing:
        float8.check(cfg, "cuda")
    assert list(missing) == ["torchao"] and "fsdp_exp[float8]" in missing["torchao"][1]
    with pytest.raises(ConfigError):  # once the plan is done, a run is refused again
        float8.check(cfg, "cuda")


def test_an_unknown_device_name_offers_the_closest_one(capsys):
    """``plan.device=h100`` is refused before anything is composed, naming ``h100_80gb``."""
    from fsdp_exp.plan.cli import main

    assert main(["plan.device=h100"]) == 2
    assert "did you mean plan.device=h100_80gb?" in capsys.readouterr().err
