"""The run configuration: the schema (``schema``), the resolved topology (``topology``) and a config's
variants under a few overrides (``variants``). The checks before launch (``fsdp_exp.preflight``) stand
above every owner they ask, outside this package.

Importing this package registers the schema with Hydra's ConfigStore, which the primary config
(``config.yaml``) names first in its defaults, and the ``run_stamp`` resolver of the run folder.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fsdp_exp.config.schema import *  # noqa: F401,F403 - the schema's dataclasses are the package's API
from fsdp_exp.config.schema import MODEL_SCHEMAS, RunConfig, model_schema
from fsdp_exp.config.topology import Topology, resolve_nproc  # noqa: F401
from fsdp_exp.errors import ConfigError, fail  # noqa: F401


def register_configs() -> None:
    from fsdp_exp.env import run_stamp

    from fsdp_exp.config.strict import composable_schema

    store = ConfigStore.instance()
    store.store(name="schema", node=composable_schema(RunConfig))
    for name, schema in MODEL_SCHEMAS.items():  # a model preset names its family's: schema/<name>@_here_
        store.store(group="model/schema", name=name, node=composable_schema(schema))
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)  # one value per process
    if not OmegaConf.has_resolver("job_dirname"):
        OmegaConf.register_new_resolver("job_dirname", job_dirname)


MAX_DIRNAME_BYTES = 200  # file systems refuse names over 255 bytes; the job number and a digest come on top


def job_dirname(override_dirname: str) -> str:
    """A sweep job's folder name (``${job_dirname:${hydra.job.override_dirname}}`` in the primary config): its
    overrides as Hydra writes them, or, when they are longer than a file name may be (a few
    ``+model.hf_overrides.*`` are), their first bytes and a digest of the whole, so names stay unique."""
    import hashlib

    raw = override_dirname.encode()
    if len(raw) <= MAX_DIRNAME_BYTES:
        return override_dirname
    digest = hashlib.sha256(raw).hexdigest()[:12]
    return raw[: MAX_DIRNAME_BYTES - 13].decode(errors="ignore") + "-" + digest


register_configs()


def to_run_config(cfg: DictConfig | dict) -> RunConfig:
    """Turn a composed (or plain, as handed to workers) config into typed dataclasses, refusing keys the
    schema does not declare and numbers that are not finite (``fsdp_exp.config.strict``)."""
    from fsdp_exp.config.strict import check_keys, check_values

    check_keys(cfg, RunConfig)
    # Hydra's composition is typed by the schema already (config.yaml's defaults start from it): its values were
    # validated as they were set, and a second merge (~16 ms, a third of a conversion) would change nothing
    typed = isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RunConfig
    merged = cfg if typed else OmegaConf.merge(_schema_node(RunConfig), cfg)
    run_config = OmegaConf.to_object(merged)
    run_config.model = _model_config(merged.model)
    check_values(run_config)
    return run_config


@functools.cache
def _schema_node(schema: type) -> DictConfig:
    """A schema dataclass as an OmegaConf node, built once per process: building it is most of a conversion
    (~20 ms of ~40), and ``OmegaConf.merge`` deep-copies its first argument, so the node is never changed
    (the schema's defaults are constants)."""
    return OmegaConf.structured(schema)


def _model_config(node: Any) -> Any:
    """The model node typed by its family's schema (``schema.MODEL_SCHEMAS``): a preset that named its
    schema is typed already; a plain mapping (a worker's payload, a preset without one) is checked here."""
    from omegaconf.errors import ValidationError

    schema = model_schema(node)
    try:
        return OmegaConf.to_object(OmegaConf.merge(_schema_node(schema), node))
    except ValidationError as err:
        key = f"model.{err.key}" if getattr(err, "key", None) else "model"
        fail(
            f"{key}: {str(err).splitlines()[0]}",
            f"pass a value of the type {schema.__name__} declares for {key} "
            "(python -m fsdp_exp --cfg job lists every key)",
        )


def plain(cfg: Any) -> dict:
    """A JSON-ready dict of a RunConfig (what workers, run.json and W&B receive)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
