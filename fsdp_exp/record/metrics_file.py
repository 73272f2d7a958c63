"""``metrics.jsonl``: one row per logged step, flushed line by line so that a crash loses nothing logged."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from fsdp_exp.record.values import json_safe

METRICS_FILE = "metrics.jsonl"


class JsonlSink:
    """``metrics.jsonl``, one row per logged step. ``keep_through_step``: on a (re)start in a run directory
    that already has rows, keep those with ``step <= keep_through_step`` (``kept``) and drop the rest,
    which a resumed run logs again; None appends to whatever is there."""

    def __init__(self, run_dir: Path, keep_through_step: Optional[int] = None):
        path = Path(run_dir) / METRICS_FILE
        self.kept: list[dict] = []
        if keep_through_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if row.get("step", 0) <= keep_through_step:
                    self.kept.append(row)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.kept))
            os.replace(tmp, path)
        self.file = open(path, "a", buffering=1)  # line-buffered

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(json_safe(metrics)) + "\n")

    def close(self) -> None:
        self.file.close()
