"""``run.json``, the record of one run: its config, what reached torch, the environment, status, summary
and the facts of its life (checkpoints, memory breakdown, communication, failure).

``RunRecord`` is the only code that writes it. The launcher, the trainer (rank 0), the checkpointer
(through the trainer) and the SLURM launcher hand it facts through the named methods below, each a
moment of the run's life; a write merges the new fields into what is there and replaces the file
atomically (a temporary file, then a rename), so a crash never leaves half a record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from fsdp_exp.metrics.schema import SCHEMA_VERSION
from fsdp_exp.record.values import json_safe

RUN_RECORD = "run.json"


class RunRecord:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RUN_RECORD

    def read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def _write(self, fields: dict[str, Any]) -> dict:
        record = self.read()
        record.setdefault("schema_version", SCHEMA_VERSION)
        record.update(json_safe(fields))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.path)
        return record

    # ------------------------------------------------------------------------- the launcher's
    def starting(
        self,
        *,
        config: dict,
        topology: dict,
        overrides: list,
        choices: dict,
        sweep: Optional[dict] = None,
        plan: Optional[dict] = None,
        data: Optional[dict] = None,
    ) -> dict:
        """Before any rank starts: what will run, the only time it is written (``plan``: the planner's
        prediction; ``data``: what preparing the data found)."""
        fields = {
            "status": "starting",
            "config": config,
            "topology": topology,
            "overrides": overrides,
            "choices": choices,
        }
        if plan is not None:
            fields["plan"] = plan
        if sweep is not None:
            fields["sweep"] = sweep
        if data is not None:
            fields["data"] = data
        return self._write(fields)

    def on_slurm(self, **facts: Any) -> dict:
        """Facts about the SLURM job this run is (fsdp_exp/slurm.py, fsdp_exp/env.py ``slurm_job``), merged
        into ``slurm``: its id, nodes, restarts; each time SLURM stopped it (``stops``, appended; ``requeued``:
        True when fsdp_exp requeued it, None when SLURM decided); why it was not requeued (``not_requeued``)."""
        slurm = dict(self.read().get("slurm") or {})
        for key, value in facts.items():
            if key == "stops":
                slurm["stops"] = [*slurm.get("stops", []), *value]
            else:
                slurm[key] = value
        return self._write({"slurm": slurm})

    def failed(self, rank: Optional[int], message: str, *, config: Optional[dict] = None, **context: Any) -> dict:
        """The run failed (before its ranks started, or because rank ``rank`` did; None: unknown):
        status and error, the ``context`` given (overrides, choices, sweep, slurm), and ``config`` when
        the record holds none yet."""
        fields = {"status": "failed", "error": {"rank": rank, "message": message}, **context}
        if config is not None and "config" not in self.read():
            fields["config"] = config
        return self._write(fields)

    def wandb_noted(self, mode: str, run_id: Optional[str]) -> dict:
        """The failure is in W&B too, in run ``run_id``."""
        return self._write({"wandb": {**(self.read().get("wandb") or {}), "mode": mode, "run_id": run_id}})

    # --------------------------------------------------------------------------- rank 0's, in a run
    def running(
        self,
        *,
        applied: dict,
        env: dict,
        wandb: dict,
        resumed_from: Optional[dict] = None,
        init_check: Optional[dict] = None,
    ) -> dict:
        """The ranks are up and about to train: what they learnt (the config, topology and plan are the
        launcher's, written by ``starting``). A run resumed from a checkpoint (``resumed_from``) is no
        longer failed or interrupted; what the earlier attempt left is kept as its ``previous_attempt``."""
        fields: dict[str, Any] = {}
        if resumed_from:
            before = self.read()
            previous = {k: before[k] for k in ("error", "interrupted") if before.get(k)}
            if previous:
                resumed_from = {**resumed_from, "previous_attempt": previous}
            fields.update(resumed_from=resumed_from, error=None, interrupted=None)
        if init_check is not None:
            fields["init_check"] = init_check
        fields.update(status="running", applied=applied, env=env, wandb=wandb)
        return self._write(fields)

    def checkpoint_saved(self, saved: dict) -> dict:
        """The newest complete checkpoint (path, step, reason, save time, bytes, dir)."""
        return self._write({"checkpoint": saved})

    def memory_breakdown(self, breakdown: dict) -> dict:
        """The tracked step's memory by kind and phase, every rank's."""
        return self._write({"memory_breakdown": breakdown})

    def comm(self, steps: list[dict]) -> dict:
        """Every profiled step's collectives, every rank's."""
        return self._write({"comm": steps})

    def exported(self, export: Optional[dict]) -> dict:
        return self._write({"export": export})

    def shard_digests(self, digests: list[str]) -> dict:
        return self._write({"shard_digests": digests})

    def interrupted(self, signal: str, checkpoint: Optional[dict]) -> dict:
        """A signal stopped the run after every rank saved ``checkpoint``."""
        return self._write({"interrupted": {"signal": signal, "checkpoint": checkpoint}})

    def ended(
        self,
        status: str,
        *,
        summary: Optional[dict] = None,
        error: Optional[str] = None,
        artifacts: Optional[list[str]] = None,
    ) -> dict:
        """Rank 0 closes the run: its status, the summary, rank 0's error (``error``) and the files of
        its sampled steps. Under torchrun / SLURM the rank whose error is its own records it first
        (fsdp_exp/launch.py); rank 0 usually fails only on its vanished peer and must not overwrite that."""
        fields: dict[str, Any] = {"status": status}
        if summary is not None:
            fields["summary"] = summary
        if error is not None:
            earlier = self.read().get("error")
            if not (isinstance(earlier, dict) and earlier.get("rank") not in (None, 0)):
                fields["error"] = {"rank": 0, "message": error}
        if artifacts:
            fields["artifacts"] = artifacts
        return self._write(fields)

    def wandb_stopped(self, error: str) -> dict:
        """W&B stopped working mid-run; the run went on (fsdp_exp/record/wandb_sink.py)."""
        return self._write({"wandb": {**self.read().get("wandb", {}), "error": error}})
