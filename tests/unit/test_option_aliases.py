"""An unknown config option is answered with what the user meant, not the nearest spelling: ``sharding=fsdp2``
is FSDP2 (``sharding=full``), not ``sharding=fsdp1``; ``precision=fp8`` is ``precision=float8``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_exp.config import RunConfig
from fsdp_exp.config.aliases import ALIASES
from fsdp_exp.config.strict import explain_composition_error
from fsdp_exp.preflight import validate

from conftest import compose_config, run_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def refusal(override: str) -> str:
    with pytest.raises(Exception) as info:
        compose_config([override])
    message = explain_composition_error(info.value, RunConfig)
    assert message is not None, info.value
    return message.split("  fix: ", 1)[1]


@pytest.mark.parametrize(
    "override,fix,not_offered",
    [
        ("sharding=fsdp2", "did you mean sharding=full or sharding.backend=fsdp2", "fsdp1"),
        ("precision=fp8", "did you mean precision=float8 ", None),
        ("precision=bf16-mixed", "did you mean precision=bf16 ", None),
        ("precision=fp16-mixed", "did you mean precision=fp16 ", None),
        ("precision=bf16_mixd", "did you mean precision=bf16 ", None),  # a slip of an alias lands on its fix
        ("sharding=zero-2", "did you mean sharding=zero2 or sharding=grad_op", None),
        ("sharding=full_shard", "did you mean sharding=full ", None),
        ("sharding=ddp_spawn", "did you mean sharding=ddp ", None),
        ("sharding=Full", "did you mean sharding=full?", None),
        ("sharding=fulll", "did you mean sharding=full?", None),  # a plain misspelling still gets the nearest
    ],
)
def test_an_unknown_option_is_answered_with_what_the_user_meant(override, fix, not_offered):
    answer = refusal(override)
    assert answer.startswith(fix), answer
    if not_offered:
        assert not_offered not in answer, answer


def test_every_alias_is_no_real_option_and_every_fix_it_offers_composes():
    for (group, word), alias in ALIASES.items():
        assert not (CONF / group / f"{word}.yaml").exists(), f"{group}={word} is a real option: its alias is never used"
    for fix in sorted({fix for alias in ALIASES.values() for fix in alias.fixes}):
        key, _, value = fix.partition("=")
        if (CONF / key).is_dir():  # a group's option: its YAML (Hydra composes nothing else)
            assert (CONF / key / f"{value}.yaml").exists(), f"{fix} names no option of the {key} group"
        else:
            validate(run_config([fix]), cuda_devices=0)  # a key's value: refused where either does not exist


def test_a_sweep_value_is_answered_the_same_way():
    from hydra import initialize_config_module

    from fsdp_exp.sweep import sweep_problems

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        (problem,) = sweep_problems(["sharding=full,fsdp2", "precision=bf16"])
    assert "sharding=fsdp2: no such option; did you mean sharding=full or sharding.backend=fsdp2 " in problem
    assert "mean sharding=fsdp1" not in problem
