"""A hub name on a machine that cannot reach the hub (this one, the CI's): the launcher's data step refuses
it in seconds, naming the key and what fixes it, instead of after half a minute of the hub client's
retries; with HF_DATASETS_OFFLINE set, a copy in datasets' cache is read at once. (Where the hub is in
reach, a name it does not hold is refused by the hub itself, as fast.)"""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest

from fsdp_exp import hub
from fsdp_exp.config import ConfigError
from fsdp_exp.data import prepare_data

from conftest import run_config

pytest.importorskip("datasets")

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.fixture(autouse=True)
def online_settings(monkeypatch):
    """Each test starts from a machine whose offline variables are unset (its own setenv aside), as a user's
    would be: what these tests check is the reachability probe and each variable's own message."""
    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_a_hub_dataset_out_of_reach_is_refused_within_seconds_naming_the_key_and_the_fix(tmp_path):
    cfg = run_config(["data=hf", "data.dataset=nonexistent_org/x", f"data.cache_dir={tmp_path / 'blocks'}"])
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        prepare_data(cfg, log=None)
    seconds = time.monotonic() - started
    problem, _, fix = str(err.value).partition("\n  fix: ")
    assert "data.dataset='nonexistent_org/x'" in problem and fix, str(err.value)
    if hub.unreachable() is not None:  # this machine: the probe's refusal, not the client's after its retries
        assert "cannot be reached from this machine" in problem and "data.dataset=<a local folder" in fix
    assert seconds < 10, f"refused after {seconds:.1f} s"  # the hub client's retries took 26 s


def test_with_hf_datasets_offline_a_copy_in_datasets_cache_is_read_at_once(tmp_path, monkeypatch):
    import datasets

    # A copy of acme/tiny in datasets' cache, laid out as datasets writes a downloaded dataset there.
    cache = tmp_path / "datasets_cache"
    source = tmp_path / "tiny.jsonl"
    source.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(40)))
    datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(cache))
    built = next(p for p in cache.glob("json/default-*/0.0.0/*") if p.is_dir())
    copy = cache / "acme___tiny" / "default" / "0.0.0" / built.name
    shutil.copytree(built, copy)
    (copy / "json-train.arrow").rename(copy / "tiny-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # set after datasets read it at import: fsdp_exp reads it

    cfg = run_config(
        [
            "data=hf",
            "data.dataset=acme/tiny",
            "data.streaming=false",
            "data.val_split=null",
            "trainer.seq_len=32",
            f"data.cache_dir={tmp_path / 'blocks'}",
        ]
    )
    started = time.monotonic()
    info = prepare_data(cfg, log=None)
    assert info["train"]["num_blocks"] >= cfg.trainer.global_batch_size
    assert time.monotonic() - started < 10
    missing = run_config(["data=hf", "data.dataset=acme/other", f"data.cache_dir={tmp_path / 'blocks'}"])
    with pytest.raises(ConfigError, match="HF_DATASETS_OFFLINE is set") as err:
        prepare_data(missing, log=None)
    assert "unset HF_DATASETS_OFFLINE" in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data=text", "data.tokenizer=nonexistent_org/x"], "data.tokenizer='nonexistent_org/x'"),
        (["model=hf", "model.hf_config=nonexistent_org/x"], "model.hf_config='nonexistent_org/x'"),
    ],
    ids=["tokenizer", "model-config"],
)
def test_a_tokenizer_or_a_model_config_out_of_reach_is_refused_within_seconds(overrides, key):
    """The launcher's other hub names: the model's config.json (fetched before preflight) and the tokenizer
    (loaded by preflight's data check)."""
    from fsdp_exp.preflight import validate
    from fsdp_exp.models import fetch_model_files

    cfg = run_config(overrides)
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        fetch_model_files(cfg.model)
        validate(cfg, cuda_devices=0)
    seconds = time.monotonic() - started
    assert key in str(err.value) and "fix:" in str(err.value), str(err.value)
    if hub.unreachable() is not None:
        assert "cannot be reached from this machine" in str(err.value)
    assert seconds < 10, f"refused after {seconds:.1f} s"


def test_a_hub_model_out_of_reach_names_the_preset_shipped_offline_and_a_missing_transformers(monkeypatch):
    """``model=hf model.hf_config=mistralai/Mistral-7B-v0.1`` without the hub: the refusal offers model=hf_mistral_7b
    (its config.json written out, no hub needed) and says when transformers is not installed (hidden here)."""
    from fsdp_exp.models import fetch_model_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub, whatever this machine can reach
    monkeypatch.setitem(sys.modules, "transformers", None)
    cfg = run_config(["model=hf", "model.hf_config=mistralai/Mistral-7B-v0.1"])
    with pytest.raises(ConfigError) as err:
        fetch_model_files(cfg.model)
    text = str(err.value)
    assert "fix: pass model=hf_mistral_7b (shipped with fsdp_exp" in text, text
    assert "transformers, which model=hf builds with, is not installed" in text, text
