"""Where a Hugging Face model's transformers config comes from (``model=hf``, ``fsdp_exp.models.hf``).

``model.hf_config`` is a folder holding a config.json, a config.json, or a hub name
(``mistralai/Mistral-7B-v0.1``); ``model.hf_fields`` is a config.json written out in the YAML (the
shipped presets: no file, no network). Then ``model.hf_overrides`` sets fields of the architecture's
config class: a key the class does not declare, or a value of the wrong type, is refused by name.

A hub name is read from the hub's local cache only: the launcher (``fetch``) downloads config.json
into that cache before preflight, honouring ``HF_HUB_OFFLINE``; preflight and the ranks never touch
the network. ``transformers`` is an optional dependency: ``pip install "fsdp_exp[hf]"``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from fsdp_exp.errors import closest, did_you_mean, fail

INSTALL = 'pip install "fsdp_exp[hf]" (in a checkout: pip install -c constraints.txt -e ".[hf]")'
HUB_FILE = "config.json"
# Fields every transformers config accepts that say nothing about the architecture's shape.
GENERIC_FIELDS = {"architectures", "transformers_version", "torch_dtype", "dtype", "model_type", "_name_or_path"}


def transformers():
    """The transformers module, or a refusal naming the install command."""
    try:
        import transformers as tf
    except ImportError:
        fail(
            "model=hf builds the model with Hugging Face transformers, which is not installed.",
            f"install it: {INSTALL}",
        )
    return tf


# ------------------------------------------------------------------------------------ the file
def shipped_preset(hub_name: str) -> Optional[str]:
    """The ``model=`` preset shipped with fsdp_exp that writes out ``hub_name``'s config.json field by field (its
    first line names the hub repository in parentheses), so that it plans and runs offline; None if none does."""
    from importlib.resources import files

    # the package fsdp_exp.conf, wherever it is installed from (conf/ in a checkout: setup.py)
    folder = files("fsdp_exp.conf") / "model"
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yaml"):
            continue
        first = path.read_text().partition("\n")[0]
        if f"({hub_name.lower()})" in first.lower():
            return path.name.removesuffix(".yaml")
    return None


def _shipped_fix(hub_name: str) -> str:
    preset = shipped_preset(hub_name)
    return f"pass model={preset} (shipped with fsdp_exp: no hub, no file needed), or " if preset else ""


def _without_transformers() -> str:
    import importlib.util

    missing = importlib.util.find_spec("transformers") is None
    return f" transformers, which model=hf builds with, is not installed either ({INSTALL})." if missing else ""


def is_local(spec: str) -> bool:
    """Whether ``model.hf_config`` names a local file or folder (else it is a hub name)."""
    return Path(spec).expanduser().exists() or spec.startswith(("/", ".", "~")) or spec.endswith(".json")


def cached_hub_file(name: str, revision: str | None) -> Path | None:
    """The hub's config.json of ``name`` in the local hub cache (HF_HOME / HF_HUB_CACHE), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, HUB_FILE, revision=revision)
    return Path(found) if isinstance(found, str) else None


def fetch(m) -> None:
    """The launcher's part, before preflight: a hub name whose config.json is not in the local cache is
    downloaded into it; with HF_HUB_OFFLINE set or no way to reach the hub (fsdp_exp.hub) that is refused by name."""
    if not m.hf_config or is_local(m.hf_config) or cached_hub_file(m.hf_config, m.revision):
        return
    from huggingface_hub import constants, hf_hub_download

    from fsdp_exp import hub

    why = hub.unreachable()  # the offline variables, or a probe of seconds where hf_hub_download retries for 30
    if why:
        fail(
            f"model.hf_config={m.hf_config!r} is a hub name, {why}, and the hub cache ({constants.HF_HUB_CACHE}) "
            f"holds no copy of its {HUB_FILE}." + _without_transformers(),
            _shipped_fix(m.hf_config)
            + f"pass model.hf_config=<a local folder or config.json>, or {hub.how_to_reach()}",
        )
    try:
        hf_hub_download(m.hf_config, HUB_FILE, revision=m.revision, etag_timeout=5)
    except Exception as exc:  # noqa: BLE001 - every hub failure is the same refusal: name it
        fail(
            f"model.hf_config={m.hf_config!r}: its {HUB_FILE} could not be fetched from the hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}).",
            "check the name (and model.revision), or pass model.hf_config=<a local folder or config.json>",
        )


def config_file(m) -> Path:
    """The config.json ``model.hf_config`` names, on this machine (refused when there is none)."""
    spec = m.hf_config
    if is_local(spec):
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / HUB_FILE
        if not path.is_file():
            fail(
                f"model.hf_config={spec!r}: there is no such file"
                + (" (a folder needs a config.json)" if Path(spec).expanduser().is_dir() else "")
                + ".",
                "pass model.hf_config=<a folder holding config.json, a config.json, or a hub name>",
            )
        return path
    found = cached_hub_file(spec, m.revision)
    if found is None:
        fail(
            f"model.hf_config={spec!r} is a hub name whose {HUB_FILE} is not in the local hub cache.",
            _shipped_fix(spec) + "run through python -m fsdp_exp (its launcher fetches it), or pass a local folder or "
            "config.json",
        )
    return found


def raw_fields(m) -> dict[str, Any]:
    """The config.json's fields (from the file, or ``model.hf_fields``), before the overrides."""
    if bool(m.hf_config) == bool(m.hf_fields):
        fail(
            "model=hf needs exactly one of model.hf_config (a folder, a config.json or a hub name) and "
            "model.hf_fields (a config written out, with its model_type)"
            + (", and both are set." if m.hf_config else ", and neither is set."),
            "pass model.hf_config=<folder|config.json|hub name>, or pick a preset such as model=hf_mistral_7b",
        )
    if m.hf_fields:
        return dict(m.hf_fields)
    path = config_file(m)
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        fail(
            f"model.hf_config={m.hf_config!r}: {path} is not a readable JSON file ({err}).",
            "pass a config.json written by transformers (config.save_pretrained)",
        )
    if not isinstance(fields, dict):
        fail(f"model.hf_config={m.hf_config!r}: {path} does not hold a JSON object.", "pass a transformers config.json")
    return fields


# ----------------------------------------------------------------------------- the config class
def config_class(fields: dict, where: str):
    tf = transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = fields.get("model_type")
    if model_type not in CONFIG_MAPPING:
        fail(
            f"{where} has model_type={model_type!r}, which transformers {tf.__version__} does not know"
            + did_you_mean(closest(model_type, CONFIG_MAPPING.keys()), before=" (", after=")")
            + ".",
            "pass a config.json with a model_type that transformers knows (e.g. mistral, qwen2, gpt2)",
        )
    return CONFIG_MAPPING[model_type]


def field_names(cls) -> set[str]:
    """Every field the config class declares, its aliases (``attribute_map``) included."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}))


def load(m):
    """The transformers config of model config ``m`` (an HfModelConfig), overrides applied, checked."""
    where = f"model.hf_config={m.hf_config!r}" if m.hf_config else "model.hf_fields"
    fields = raw_fields(m)
    cls = config_class(fields, where)
    names = field_names(cls)
    aliases = getattr(cls, "attribute_map", {})
    overrides = dict(m.hf_overrides)
    for key in overrides:
        if key not in names or key in GENERIC_FIELDS:
            near = closest(key, sorted(names - GENERIC_FIELDS))
            fail(
                f"model.hf_overrides.{key}: {cls.__name__} has no field {key!r}"
                + did_you_mean(near, before=" (", after=")")
                + ".",
                "drop it" + (f", or write +model.hf_overrides.{near}=..." if near else ""),
            )
    for key, value in overrides.items():
        fields.pop(key, None)
        fields[aliases.get(key, key)] = value
    try:
        config = cls.from_dict(fields)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation: wrong types, bad values
        message = " ".join(str(exc).split())
        # transformers quotes the field it refuses as 'name' (a type check) or `name` (a validator's message)
        bad = next(
            (k for k in overrides if any(f"{q}{name}{q}" in message for q in "'`" for name in (k, aliases.get(k, k)))),
            None,
        )
        key = f"model.hf_overrides.{bad}" if bad else where
        fail(
            f"{key}: {cls.__name__} refuses it: {message}",
            f"pass a {key}=... of the type and range {cls.__name__} accepts" if bad else "fix the config file's field",
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        fail(
            f"{where} is a {config.model_type} config, which has no causal language model "
            f"(AutoModelForCausalLM does not build it).",
            "pass the config of a decoder-only language model (e.g. mistral, qwen2, gemma, gpt2, llama)",
        )
    return config
