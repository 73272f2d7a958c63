"""Composing many run configs in one process: one Hydra initialization for all of them (what tune's search and
the published-record benchmark need; a run composes its one config in ``fsdp_exp.__main__``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig


@contextlib.contextmanager
def hydra_session():
    """Compose any number of configs under one Hydra initialization; also lists a group's options."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from fsdp_exp.config import to_run_config

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def run_config(overrides: list[str]) -> "RunConfig":
            return to_run_config(compose(config_name="config", overrides=overrides))

        def options(group: str, overrides: list[str]) -> list[str]:
            return sorted(loader.get_group_options(group, config_name="config", overrides=overrides))

        yield run_config, options
