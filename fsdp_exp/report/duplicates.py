"""Runs that measured the same thing under different labels.

Two labels can reach the backend as the same call: ``sharding=no_shard sharding.backend=ddp`` is
``sharding=ddp``; on a 2-block model ``prefetch=deep`` (two blocks ahead) prefetches exactly what
``prefetch=default`` does. A ranking that counted both would show one setting twice, and a sweep's
per-option means would credit one option with another's run. So runs are compared by what they ran.

The key of a run:
- ``applied``: what each backend call got and what torch holds afterwards (``inspected``). It is the
  translation of the config groups the backends read (sharding, prefetch, wrap, offload), so those
  groups' config values are compared only through it: that is how ``prefetch=deep`` and
  ``prefetch=default`` come out equal when they prefetch the same units.
- the config groups that change the run without passing through ``applied``: model, precision, ac,
  compile, parallel, optim, data, trainer (seeds included), debug, checkpoint; minus paths and the
  launch counts that ``topology`` states resolved (``nproc_per_node=auto`` and ``=2`` are one layout).
- ``topology`` and the machine: device type and names, threads per rank, torch and CUDA versions (the
  same settings on another GPU are another measurement).
Left out: the run folder, times, host name, git commit, logger settings.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

from fsdp_exp.report.load import Run

# Config groups compared as config (the rest reach the run through "applied").
CONFIG_PARTS = ("model", "precision", "ac", "compile", "parallel", "optim", "data", "trainer", "debug", "checkpoint")
# Within those: where files go, and the counts "topology" holds resolved.
IGNORED_KEYS = {
    "data": {"cache_dir"},
    "trainer": {"nproc_per_node", "nnodes", "device"},
    "checkpoint": {"dir", "export_dir", "resume"},
}
ENV_KEYS = ("device_type", "devices", "threads_per_rank", "torch_version", "cuda_version")
# Object reprs that describe() could not turn into values (FSDP1's auto_wrap_policy is a partial)
# carry a per-process address: the setting is the same, the number is not.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return _ADDRESS.sub("", value)
    return value


def settings(run: Run) -> Optional[dict]:
    """What the run ran, as a plain dict; None when the record lacks what the key needs."""
    applied, config = run.applied, run.config
    if applied is None or not config:
        return None
    parts = {}
    for group in CONFIG_PARTS:
        value = config.get(group)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in IGNORED_KEYS.get(group, ())}
        parts[group] = value
    env = {k: run.env.get(k) for k in ENV_KEYS}
    return _normalize({"applied": applied, "config": parts, "topology": run.topology, "env": env})


def settings_key(run: Run) -> Optional[str]:
    value = settings(run)
    if value is None:
        return None
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def find_duplicates(runs: list[Run]) -> dict[int, int]:
    """Index of each duplicate run -> index of the first run (in the given order) with its settings.

    The first of a group is the one counted: in a Hydra sweep that is the lowest job number, a choice
    that does not depend on the measured numbers (keeping the faster copy would favour noise).
    """
    first: dict[str, int] = {}
    same_as: dict[int, int] = {}
    for index, run in enumerate(runs):
        key = settings_key(run)
        if key is None:
            continue
        if key in first:
            same_as[index] = first[key]
        else:
            first[key] = index
    return same_as
