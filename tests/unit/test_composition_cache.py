"""The tests' composition cache (conftest.compose_config) returns what Hydra's own compose() returns for the same
overrides: a cached composition of the group choices with the value overrides set on a copy is the same config,
with the same types and flags, and a refused override is refused with the same exception and message."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from conftest import compose_config

CASES = {
    # a group choice, values set in it, a value added to an open map and a value of another group's key
    "choice and values": ["model=hf_qwen2_7b", "+model.hf_overrides.hidden_size=64", "trainer.steps=3"],
    # a dict value for a group's own key is a value override, whatever the group
    "dict value": ["+model.hf_overrides={num_hidden_layers:2}", "model=hf_mistral_7b", "sharding=hybrid"],
}
REFUSED = {
    "unknown key": ["sharding=zero2", "trainer.stepz=3"],
    "a list given one value": ["data=text", "data.files=/some/train.txt"],
}


def _hydra(overrides):
    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_the_cached_composition_is_what_hydra_composes(overrides):
    cached, whole = compose_config(overrides), _hydra(overrides)
    assert OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(whole)
    assert OmegaConf.is_struct(cached) and OmegaConf.is_struct(whole)
    for key in ("model", "sharding", "trainer"):  # the typed schema nodes stay typed
        assert OmegaConf.get_type(cached, key) is OmegaConf.get_type(whole, key)
    cached.trainer.steps = 99  # a copy: the next caller gets the composition, not this change
    assert compose_config(overrides).trainer.steps == whole.trainer.steps


@pytest.mark.parametrize("overrides", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_override_is_refused_as_hydra_refuses_it(overrides):
    with pytest.raises(Exception) as cached:
        compose_config(overrides)
    with pytest.raises(Exception) as whole:
        _hydra(overrides)
    assert (type(cached.value), str(cached.value)) == (type(whole.value), str(whole.value))
    assert str(cached.value.__cause__) == str(whole.value.__cause__)
