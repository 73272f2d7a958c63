"""Nothing the user writes is silently ignored: keys the schema does not declare and numbers that
cannot mean anything are refused before any rank starts, naming the key and the closest real one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from fsdp_exp.config import ConfigError, RunConfig
from fsdp_exp.config.strict import check_keys, schema_keys

from conftest import compose_config, run_config


@dataclass
class Inner:
    overrides: dict[str, Any] = field(default_factory=dict)
    size: int = 1


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)


@pytest.mark.parametrize(
    "override,named,suggested",
    [
        ("+unknown_key=1", "unknown_key", None),
        ("+trainer.stpes=5", "trainer.stpes", "trainer.steps"),
        ("++model.dimm=3", "model.dimm", "model.dim"),
        ("+logger.wandb.projct=x", "logger.wandb.projct", "logger.wandb.project"),
    ],
)
def test_an_added_key_that_the_schema_lacks_is_refused_with_the_closest_key(override, named, suggested):
    with pytest.raises(ConfigError) as err:
        run_config([override])
    message = str(err.value)
    assert named in message
    if suggested:
        assert f"did you mean {suggested}?" in message


@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.grad_clip=nan", "trainer.grad_clip"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.betas=[0.9,-inf]", "optim.betas[1]"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        run_config([override])


def test_keys_the_schema_declares_and_group_selections_pass():
    cfg = run_config(["experiment=zero_stages", "++trainer.steps=4", "trainer.grad_clip=0.5"])
    assert cfg.trainer.steps == 4 and cfg.trainer.grad_clip == 0.5


def test_an_open_map_is_left_to_its_owner():
    """A field typed as a mapping is open: its keys are its owner's to check (e.g. a model family's
    pass-through settings), not the schema's."""
    check_keys({"inner": {"overrides": {"anything": 1, "num_hidden_layers": 2}, "size": 3}}, Outer)
    with pytest.raises(ConfigError, match="inner.sise"):
        check_keys({"inner": {"sise": 3}}, Outer)
    assert "inner.overrides" in set(schema_keys(Outer))


def test_an_open_map_is_assigned_with_or_without_a_plus_and_its_neighbours_stay_strict():
    """``model.hf_fields={...}`` and ``model.hf_overrides.<field>=...`` compose as ``+`` does (a map's keys are
    its owner's to check); a misspelt key beside them is still refused by name."""
    fields = run_config(["model=hf", "model.hf_fields={model_type: gpt2, n_layer: 2}"]).model.hf_fields
    assert fields == {"model_type": "gpt2", "n_layer": 2}
    assert run_config(["model=hf", "+model.hf_fields={model_type: gpt2, n_layer: 2}"]).model.hf_fields == fields
    gpt2 = run_config(["model=hf_gpt2_xl", "model.hf_overrides.n_layer=2", "model.hf_fields.n_head=5"]).model
    assert gpt2.hf_overrides == {"n_layer": 2} and gpt2.hf_fields["n_head"] == 5 and gpt2.hf_fields["n_embd"] == 1600
    with pytest.raises(ConfigError, match="did you mean model.hf_fields"):
        run_config(["model=hf", "+model.hf_fieldz={model_type: gpt2}"])


def test_every_schema_key_is_listed():
    keys = set(schema_keys(RunConfig))
    assert {"trainer.steps", "model.dim", "logger.wandb.mode", "checkpoint.every"} <= keys


@pytest.mark.parametrize(
    "override,fix",
    [
        ("data.files=/some/train.txt", "fix: pass data.files=[/some/train.txt] (a list of one"),
        ("trainer.profile_steps=3", "fix: pass trainer.profile_steps=[3] (a list of one"),
    ],
)
def test_one_value_for_a_key_that_holds_a_list_names_the_same_value_in_brackets(override, fix):
    from fsdp_exp.config.strict import explain_composition_error

    with pytest.raises(Exception) as info:
        compose_config(["data=text", override])
    message = explain_composition_error(info.value, RunConfig)
    assert fix in message, message
    assert "ListConfig" not in message  # OmegaConf's words, not the user's
