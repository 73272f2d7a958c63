"""Strict keys and meaningful values: nothing the user writes is silently ignored.

Hydra refuses a misspelt key of a group's YAML or a plain override, but a key added with ``+`` or ``++``
(or in a user's own YAML) lands in the composed config even when the schema has no such field, and
OmegaConf then carries it along unused. ``check_keys`` walks the composed config against the schema's
dataclasses and refuses every key the schema does not declare, with the closest real key. A field the
schema types as a mapping (``dict[str, Any]``) is an open map whose keys its owner checks instead.
``check_values`` refuses numbers that cannot mean anything (NaN, infinities) wherever the schema
expects a number.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Iterator

from fsdp_exp.config.aliases import fix_text, meant
from fsdp_exp.errors import closest, did_you_mean, fail

IGNORED_TOP_LEVEL = frozenset({"hydra"})  # Hydra's own node, when a config carries it


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _families(schema: type) -> dict[str, dict]:
    """Fields whose schema depends on their value (the model group: one schema per family), with the
    metadata that says how: ``schemas`` (every one) and ``select`` (node -> its schema)."""
    return {f.name: f.metadata for f in dataclasses.fields(schema) if "select" in f.metadata}


def _dataclass_of(annotation: Any) -> type | None:
    """The dataclass a field holds (``Optional[X]`` included), else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _is_open_map(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Dict):
        return True
    return any(typing.get_origin(arg) in (dict, typing.Dict) for arg in typing.get_args(annotation))


def composable_schema(schema: type):
    """The schema as the node Hydra composes onto (ConfigStore), its open maps open to assignment.

    Hydra composes in struct mode, so a plain ``model.hf_fields={model_type: gpt2}`` would be refused for
    keys the (empty) map lacks, and only ``+model.hf_fields=...`` would work. A map's keys are its owner's
    to check (``unknown_keys`` skips them), so its node leaves struct mode: assigning it, or one of its
    keys (``model.hf_overrides.n_layer=2``), works with or without ``+``."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(schema)
    _open_maps(node, schema)
    return node


def _open_maps(node: Any, schema: type) -> None:
    for name, annotation in _field_types(schema).items():
        if _is_open_map(annotation) and node[name] is not None:
            from omegaconf import OmegaConf

            OmegaConf.set_struct(node[name], False)
        inner = _dataclass_of(annotation)
        if inner is not None and node[name] is not None:
            _open_maps(node[name], inner)


def schema_keys(schema: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key the schema declares (open maps as their own key)."""
    families = _families(schema)
    for name, annotation in _field_types(schema).items():
        key = f"{prefix}{name}"
        yield key
        inner = _dataclass_of(annotation)
        if inner is not None:
            yield from schema_keys(inner, key + ".")
        if name in families:  # every family's keys, once
            yield from dict.fromkeys(
                k for family in families[name]["schemas"].values() for k in schema_keys(family, key + ".")
            )


def unknown_keys(node: Any, schema: type, prefix: str = "") -> Iterator[str]:
    """Dotted keys present in ``node`` (a mapping) that ``schema`` does not declare."""
    fields = _field_types(schema)
    families = _families(schema)
    for key in node.keys():
        path = f"{prefix}{key}"
        if not prefix and key in IGNORED_TOP_LEVEL:
            continue
        if key not in fields:
            yield path
            continue
        annotation = fields[key]
        if _is_open_map(annotation):
            continue  # its owner checks its keys
        inner = _dataclass_of(annotation)
        value = node[key]
        if key in families and hasattr(value, "keys"):
            inner = _family_schema(value, families[key])
        if inner is not None and hasattr(value, "keys"):
            yield from unknown_keys(value, inner, path + ".")


def _family_schema(node: Any, family: dict) -> type:
    """The schema of a family-typed node: by its own ``name``; without one (a sweep checks a lone
    ``+model.x`` key), the first family that declares every key it has."""
    if node.get("name") is not None:
        return family["select"](node)
    schemas = list(family["schemas"].values())
    return next((s for s in schemas if not set(node.keys()) - set(_field_types(s))), schemas[0])


def check_keys(cfg: Any, schema: type) -> None:
    """Refuse keys the schema does not declare (exit 2 upstream), naming the closest real key."""
    unknown = list(unknown_keys(cfg, schema))
    if not unknown:
        return
    known = list(schema_keys(schema))
    problems, fixes = [], []
    for key in unknown:
        owner = _other_family(cfg, schema, key)
        if owner:
            problems.append(
                f"{key} is a setting of the {owner[1]} model family, and this model is "
                f"{owner[0]}.name={_value(cfg, owner[0] + '.name')}"
            )
            fixes.append(f"drop {key}, or pick a model of the {owner[1]} family")
            continue
        # Compare with keys of the same group first: "trainer.stpes" is closer to "trainer.steps" than
        # to any top-level key.
        group = key.rsplit(".", 1)[0] + "." if "." in key else ""
        candidates = [k for k in known if k.startswith(group) and k.count(".") == key.count(".")] or known
        near = closest(key, candidates)
        problems.append(f"{key} is not a setting of fsdp_exp" + did_you_mean(near, before=" (", after=")"))
        fixes.append(f"drop {key}" + (f", or write {near}=..." if near else ""))
    fail(
        "unknown key" + ("s" if len(unknown) > 1 else "") + ": " + "; ".join(problems) + ".",
        "; ".join(fixes) + " (python -m fsdp_exp --cfg job lists every key)",
    )


def _value(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg.get(part) if hasattr(cfg, "get") else None
    return cfg


def _other_family(cfg: Any, schema: type, key: str) -> tuple[str, str] | None:
    """(field, family name) when ``key`` is declared by another family of a family-typed field."""
    head, _, rest = key.partition(".")
    family = _families(schema).get(head)
    if family is None or not rest:
        return None
    for name, family_schema in family["schemas"].items():
        if f"{head}.{rest}" in set(schema_keys(family_schema, head + ".")):
            return head, name
    return None


def non_finite_values(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            yield path, value
        elif dataclasses.is_dataclass(value):
            yield from non_finite_values(value, path + ".")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, float) and not math.isfinite(item):
                    yield f"{path}[{i}]", item


def check_values(run_config: Any) -> None:
    """Refuse NaN and infinities wherever the schema expects a number."""
    bad = list(non_finite_values(run_config))
    if not bad:
        return
    defaults = type(run_config)()
    fixes = []
    for path, _ in bad:
        default: Any = defaults
        for part in path.split("[")[0].split("."):
            default = getattr(default, part, None)
        fixes.append(
            f"pass a finite {path}"
            + (f" (the default is {default})" if default is not None and not isinstance(default, (list, tuple)) else "")
        )
    fail(
        ", ".join(f"{path}={value}" for path, value in bad) + " is not a finite number, and no setting means "
        "anything with NaN or infinity.",
        "; ".join(fixes),
    )


def refusal(exc: BaseException) -> str | None:
    """What a command-line tool (fsdp_exp.plan, fsdp_exp.tune) says of input it refuses, after its
    name: a ConfigError in its own words, a config Hydra could not compose in the words the run gives;
    None for any other error (fsdp_exp's own bug: raised on, not called bad input)."""
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.errors import ConfigError

    if isinstance(exc, ConfigError):
        return f"invalid configuration: {exc}"
    explained = explain_composition_error(exc, RunConfig)
    return None if explained is None else f"invalid configuration: {explained}"


def _one_line_options(message: str) -> str:
    """Hydra lists a group's options one a line (twenty-odd models): a paragraph lists them in one line."""
    lines = message.splitlines()
    head = [line for line in lines if not line.startswith("\t")]
    options = [line.strip() for line in lines if line.startswith("\t")]
    if not options:
        return message
    listed = next((i for i, line in enumerate(head) if line.startswith("Available options in")), len(head) - 1)
    head[listed] = f"{head[listed]} {', '.join(options)}"
    return "\n".join(line for line in head if line.strip())


def explain_composition_error(exc: BaseException, schema: type) -> str | None:
    """The message for a config that Hydra could not compose, with the closest real key or option; None
    when ``exc`` is not a composition error (an error of fsdp_exp's own code is not bad input)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(exc, MissingConfigException):
        message = _one_line_options(str(exc).split("\nConfig search path")[0].strip())
        missing = (exc.missing_cfg_file or "").rsplit("/", 1)
        if len(missing) == 2 and exc.options:
            alias = meant(missing[0], missing[1], list(exc.options))  # spelling checked against what was meant
            message += did_you_mean(fix_text(alias) if alias else None, before="\n  fix: ")
        return message
    if isinstance(exc, OverrideParseException):
        return str(exc).strip()
    if not isinstance(exc, (ConfigCompositionException, OmegaConfBaseException)):
        return None
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    where = str(exc).splitlines()[0] if isinstance(exc, ConfigCompositionException) else ""
    import re

    text = f"{exc}\n{cause or ''}"
    # Hydra keeps the OmegaConf error as the cause for an override, and only in its text for a YAML file.
    found = re.search(r"Key '[^']+' not in '[^']+'\s+full_key: (\S+)", text)
    unknown_key = isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or found
    key = str(getattr(cause, "full_key", "") or (found.group(1) if found else ""))
    if unknown_key and key and "not in" in text:
        known = list(schema_keys(schema))
        group = key.rsplit(".", 1)[0] + "." if "." in key else ""
        candidates = [k for k in known if k.startswith(group) and k.count(".") == key.count(".")] or known
        near = closest(key, candidates)
        return (
            f"{where}\n{key} is not a setting of fsdp_exp"
            + did_you_mean(near, before=" (", after=")")
            + f".\n  fix: drop {key}"
            + (f", or write {near}" if near else "")
            + " (python -m fsdp_exp --cfg job lists every key)"
        ).strip()
    # One value for a key that holds a list (data.files=/some/train.txt): Hydra cannot merge a string into a
    # typed list, so the fix is the same value in brackets, a one-element list.
    given = re.match(r"Error merging override (\S+?)=(.*)$", where)
    if given and key == given.group(1).lstrip("+~") and "is not a ListConfig" in text:
        value = given.group(2)
        return (
            f"{where}\n{key} holds a list, and {value} is a single value.\n"
            f"  fix: pass {key}=[{value}] (a list of one, in brackets; several are comma-separated)"
        )
    details = f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else ""
    return f"{exc}{details}".strip()
