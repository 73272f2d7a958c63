"""What makes two runs the same measurement, or repeats of one configuration.

Two labels can reach the backend as the same call (``sharding=no_shard sharding.backend=ddp`` is
``sharding=ddp``; on a 2-block model ``prefetch=deep`` prefetches what ``prefetch=default`` does), so
runs are compared by what they ran, not by their overrides. A run's settings are its ``applied``
settings (how the backend groups were translated, and what torch holds), the config groups that change
the run without passing through them (``CONFIG_PARTS``, less ``IGNORED_KEYS``), its topology and the
machine (``ENV_KEYS``). Runs with one settings key are duplicates; runs whose keys differ only in
``trainer.repeat`` are repeats of one configuration. A leaf: the report and the W&B sink both call it,
so the two group runs alike. What is compared and what is left out: the docs page reports.md
("Comparing runs").
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any, Optional

# Config groups compared as config (the rest reach the run through "applied").
CONFIG_PARTS = ("model", "precision", "ac", "compile", "parallel", "optim", "data", "trainer", "debug", "checkpoint")
# Within those: where files go, and the counts "topology" holds resolved.
IGNORED_KEYS = {
    "data": {"cache_dir"},
    "trainer": {
        "nproc_per_node",
        "nnodes",
        "device",
        "collective_timeout_s",
    },  # the last: how long to wait on a lost peer
    "checkpoint": {"dir", "export_dir", "resume"},
}
ENV_KEYS = ("device_type", "devices", "threads_per_rank", "torch_version", "cuda_version")
REPEAT_KEY = "trainer.repeat"
# Object reprs that describe() could not turn into values (FSDP1's auto_wrap_policy is a partial)
# carry a per-process address: the setting is the same, the number is not.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return _ADDRESS.sub("", value)
    return value


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def settings(config: Any, applied: Any, topology: Any, env: Any) -> Optional[dict]:
    """What a run ran, repeat included, as a plain dict; None without ``applied`` or a config (a run that
    failed before its backend call: nothing to compare)."""
    if not isinstance(applied, dict) or not isinstance(config, dict) or not config:
        return None
    parts = {}
    for group in CONFIG_PARTS:
        value = config.get(group)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in IGNORED_KEYS.get(group, ())}
        parts[group] = value
    # Older records have no repeat: they were the first (and only) measurement of their configuration.
    if isinstance(parts.get("trainer"), dict):
        parts["trainer"].setdefault("repeat", 0)
    machine = {k: _dict(env).get(k) for k in ENV_KEYS}
    return _normalize({"applied": applied, "config": parts, "topology": _dict(topology), "env": machine})


def configuration(config: Any, applied: Any, topology: Any, env: Any) -> Optional[dict]:
    """The settings less ``trainer.repeat``: what every repeat of one configuration shares."""
    value = settings(config, applied, topology, env)
    if value is None:
        return None
    value = copy.deepcopy(value)
    if isinstance(value["config"].get("trainer"), dict):
        value["config"]["trainer"].pop("repeat", None)
    return value


def digest(value: Optional[dict]) -> Optional[str]:
    if value is None:
        return None
    # Through JSON first, so that a dict in memory (the W&B sink's) and the same dict read back from
    # run.json (int keys become strings, tuples lists) give one key.
    plain_json = json.loads(json.dumps(value, default=str))
    return hashlib.sha256(json.dumps(plain_json, sort_keys=True).encode()).hexdigest()


def repeat_index(config: Any) -> int:
    """The run's ``trainer.repeat``; 0 for records older than the key."""
    value = _dict(_dict(config).get("trainer")).get("repeat")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def configuration_id(config: Any, applied: Any, topology: Any, env: Any) -> Optional[str]:
    """A short name for the configuration (its key's first 12 hex digits, ``cfg-``): the W&B job type of
    every repeat of it, and the report's ``config_id``."""
    key = digest(configuration(config, applied, topology, env))
    return f"cfg-{key[:12]}" if key else None
