"""Where a run's numbers go: ``run.json`` (the record, ``RunRecord``: its only writer),
``metrics.jsonl``, Weights & Biases, the console.

Only rank 0 writes (and the launcher, before and after the ranks). Every sink takes the same metric
names (fsdp_exp.metrics.schema). Files are written so that a crash loses nothing already logged:
run.json is replaced atomically, metrics.jsonl is flushed line by line.
"""

from fsdp_exp.record.console import ConsoleSink
from fsdp_exp.record.metrics_file import METRICS_FILE, JsonlSink
from fsdp_exp.record.run_record import RUN_RECORD, RunRecord
from fsdp_exp.record.values import json_safe
from fsdp_exp.record.wandb_sink import TAGGED_GROUPS, WandbSink, note_failure_in_wandb, run_name, run_tags

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "METRICS_FILE",
    "RUN_RECORD",
    "RunRecord",
    "TAGGED_GROUPS",
    "WandbSink",
    "json_safe",
    "note_failure_in_wandb",
    "run_name",
    "run_tags",
]
