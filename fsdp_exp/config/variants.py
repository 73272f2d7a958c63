"""A run config with a few overrides applied, as a command line naming them would compose it: the variants
the fit check and the planner's price list try (``fsdp_exp.fit_check``, ``fsdp_exp.plan.cli``) without
composing the whole run again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Optional

from omegaconf import OmegaConf

from fsdp_exp.config.schema import RunConfig


def apply_changes(cfg: RunConfig, changes: tuple[str, ...]) -> RunConfig:
    """``cfg`` with these overrides: ``group=option`` takes the option's whole node (the group's schema
    defaults under the option's file), as a command line selecting it would; ``a.b=value`` sets one key."""
    variant = copy.deepcopy(cfg)
    for change in changes:
        key, _, value = change.partition("=")
        section, _, name = key.lstrip("+").partition(".")  # +key / ++key: set it whether or not it exists
        current = getattr(variant, section)
        node = OmegaConf.from_dotlist([f"{name}={value}"]) if name else _option(section, value)
        base = OmegaConf.structured(current if name else type(current)())
        variant = dataclasses.replace(variant, **{section: OmegaConf.to_object(OmegaConf.merge(base, node))})
    return variant


def variant_of(cfg: RunConfig, changes: tuple[str, ...]) -> Optional[RunConfig]:
    """``cfg`` with these changes; None where they change nothing or cannot be composed."""
    from fsdp_exp.config import plain

    try:
        variant = apply_changes(cfg, changes)
    except Exception:  # noqa: BLE001 - an option this config cannot take
        return None
    return None if plain(variant) == plain(cfg) else variant


@contextlib.contextmanager
def _hydra():
    """Hydra's config sources: the running app's (a run, a sweep's callback), else fsdp_exp's own configs."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    from hydra import initialize_config_module

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def _option(group: str, option: str):
    """An option's own node, read from the first config source that has it (a file of the group's
    package without a defaults list: the options fsdp_exp suggests); else composed in full."""
    with _hydra() as loader:
        path = f"{group}/{option}"
        for source in loader.get_sources():
            if source.is_config(path):
                found = source.load_config(path)
                if found.header.get("package") in (None, "_group_", group) and "defaults" not in found.config:
                    return found.config
                break
        from hydra import compose

        return compose(config_name="config", overrides=[f"{group}={option}"])[group]


def group_options(group: str) -> list[str]:
    try:
        with _hydra() as loader:
            return sorted(loader.get_group_options(group))
    except Exception:  # noqa: BLE001 - no config source to list: no preset to offer
        return []
