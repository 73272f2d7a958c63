"""The run configuration: the schema (``schema``), the resolved topology (``topology``) and the checks
before launch (``preflight``, imported by whoever launches: it reaches into every owner's checks).

Importing this package registers the schema with Hydra's ConfigStore, which ``conf/config.yaml``
names first in its defaults, and the ``run_stamp`` resolver of the run folder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fsdp_exp.config.schema import *  # noqa: F401,F403 - the schema's dataclasses are the package's API
from fsdp_exp.config.schema import RunConfig
from fsdp_exp.config.topology import Topology, resolve_nproc  # noqa: F401
from fsdp_exp.errors import ConfigError, fail  # noqa: F401


def register_configs() -> None:
    from fsdp_exp.env import run_stamp

    ConfigStore.instance().store(name="schema", node=RunConfig)
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)  # one value per process


register_configs()


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Turn a composed (or plain, as handed to workers) config into typed dataclasses, refusing keys the
    schema does not declare and numbers that are not finite (fsdp_exp/config/strict.py)."""
    from fsdp_exp.config.strict import check_keys, check_values

    check_keys(cfg, RunConfig)
    run_config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    check_values(run_config)
    return run_config


def plain(cfg: Any) -> dict:
    """A JSON-ready dict of a RunConfig (what workers, run.json and W&B receive)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
