"""Small measured facts kept between runs: this CPU's matmul peak, the gloo probe, tune's calibration.

Each is a JSON table (key -> entry) in fsdp_exp's cache folder (``$XDG_CACHE_HOME/fsdp_exp``, else
``~/.cache/fsdp_exp``). Writes are atomic (a temporary file, then a rename), so a reader never sees a
half-written table, and concurrent writers lose at most each other's newest entry, never the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


def cache_file(name: str) -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "fsdp_exp" / name


def read_table(path: Path) -> dict:
    """The whole table (empty where the file is missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_entry(path: Path, key: str) -> Optional[dict]:
    return read_table(path).get(key)


def write_entry(path: Path, key: str, entry: dict) -> None:
    table = read_table(path)
    table[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
