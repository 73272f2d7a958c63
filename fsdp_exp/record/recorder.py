"""One rank's side of recording a run: ``Recorder``, the sinks the trainer and its step metrics write to.

On rank 0 it holds the run's record (run.json), metrics.jsonl, the console and, once the run starts,
W&B; on the other ranks every write is a no-op and only the collective (the environment) runs. It
also gathers the environment: versions, hosts and devices of every rank, the model's size. Import it
by name (``fsdp_exp.record.recorder``): it pulls in torch, which the launcher's imports of fsdp_exp.record
must not.
"""

from __future__ import annotations

import platform
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from fsdp_exp import __version__
from fsdp_exp.config import plain
from fsdp_exp.env import placement
from fsdp_exp.models import count_params, spec_for
from fsdp_exp.record.console import ConsoleSink
from fsdp_exp.record.metrics_file import JsonlSink
from fsdp_exp.record.run_record import RunRecord
from fsdp_exp.record.wandb_process import WandbProcess

if TYPE_CHECKING:
    from fsdp_exp.context import Labels


class Recorder:
    def __init__(self, run_dir: Path, is_main: bool):
        self.run_dir, self.is_main = run_dir, is_main
        self.record = RunRecord(run_dir) if is_main else None  # run.json's writer (rank 0's part)
        self.jsonl: Optional[JsonlSink] = None
        self.console: Optional[ConsoleSink] = None
        self.wandb: Optional[WandbProcess] = None
        self.open = False

    def open_sinks(self, cfg, keep_through_step: Optional[int]) -> list[dict]:
        """Open metrics.jsonl and the console (rank 0); returns the rows kept from an earlier attempt.
        A resumed run keeps the rows through its checkpoint's step (later ones are trained again) and
        summarizes them with its own."""
        if not self.is_main:
            return []
        self.jsonl = JsonlSink(self.run_dir, keep_through_step=keep_through_step)
        self.console = ConsoleSink(
            cfg.trainer.steps, cfg.logger.progress, cfg.logger.summary_table, start_step=keep_through_step or 0
        )
        self.open = True
        return list(self.jsonl.kept)

    def start(
        self,
        cfg,
        topology,
        info,
        *,
        applied: dict,
        labels: "Labels",
        facts: dict,
        resumed_from: Optional[dict],
        init_check: Optional[dict],
        wandb_run_id: Optional[str],
    ) -> Optional[str]:
        """The ranks are up: gather the environment (a collective: every rank calls it), open W&B and
        record the run as running (rank 0; the launcher recorded the config, ``labels`` and plan before).
        ``facts``: the step metrics' FLOPs and peaks, in the env.
        ``wandb_run_id``: the W&B run a resumed run continues. Returns the W&B run its checkpoints
        name from now on."""
        env = {**environment(cfg, info), **facts}
        if not self.is_main:
            return wandb_run_id
        if cfg.logger.wandb.mode != "disabled":
            overrides, choices = list(labels.overrides), dict(labels.choices)
            self.wandb = WandbProcess(
                cfg.logger.wandb,
                self.run_dir,
                {
                    **plain(cfg),
                    "applied": applied,
                    "topology": topology.as_dict(),
                    "env": env,
                    "choices": choices,
                    "overrides": overrides,
                },
                overrides,
                choices,
                run_id=wandb_run_id,
            )  # a resumed run continues its W&B run
        wandb_run_id = self.wandb.run_id if self.wandb else None
        self.record.running(
            applied=applied,
            env=env,
            wandb={"mode": cfg.logger.wandb.mode, "run_id": wandb_run_id},
            resumed_from=resumed_from,
            init_check=init_check,
        )
        return wandb_run_id

    # ------------------------------------------------------------------- during the run (rank 0)
    def log(self, row: dict) -> None:
        """One logged step's row: metrics.jsonl, W&B, the progress bar."""
        if not self.open:
            return
        self.jsonl.log(row)
        if self.wandb:
            self.wandb.log(row)
        self.console.log(row)

    def memory_breakdown(self, breakdown: dict) -> None:
        if self.record:
            self.record.memory_breakdown(breakdown)

    def comm(self, steps: list[dict]) -> None:
        if self.record:
            self.record.comm(steps)

    def checkpoint_saved(self, saved: dict) -> None:
        if self.record:
            self.record.checkpoint_saved(saved)

    def exported(self, export: Optional[dict]) -> None:
        if self.record:
            self.record.exported(export)

    def shard_digests(self, digests: list[str]) -> None:
        if self.record:
            self.record.shard_digests(digests)

    def interrupted(self, signal: str, checkpoint: Optional[dict]) -> None:
        if self.record:
            self.record.interrupted(signal, checkpoint)

    # ------------------------------------------------------------------------------------ end
    def close(self, status: str, summary: Optional[dict] = None, error: Optional[str] = None) -> None:
        """Rank 0 ends the run: status, summary or error and the measured steps' files in run.json,
        the files and summary in W&B, the summary table. Once only (a failure while closing is not
        recorded over the first)."""
        if not self.open:
            return
        self.open = False
        files = sorted(p for folder in ("traces", "memory") for p in (self.run_dir / folder).glob("rank*_step*.*"))
        self.record.ended(
            status, summary=summary, error=error, artifacts=[str(p.relative_to(self.run_dir)) for p in files]
        )
        self.jsonl.close()
        if self.wandb:
            if files:
                self.wandb.log_files(files, self.run_dir)
            if summary:
                self.wandb.summary(summary)
            self.wandb.close(exit_code=0 if status in ("completed", "interrupted") else 1)
            if self.wandb.error:  # W&B stopped mid-run; the run went on (record.WandbSink._guarded)
                self.record.wandb_stopped(self.wandb.error)
        if summary is not None:
            self.console.summary(summary, title=f"fsdp_exp run: {self.run_dir}")
        else:
            self.console.close()


def environment(cfg, info) -> dict:
    """Versions, this host, and every rank's host, address and device (a collective): on a multi-node
    job, which ranks shared a node (and were lost together when it failed: the launcher names them by
    this list)."""
    ranks: list = [None] * info.world_size
    dist.all_gather_object(ranks, {"rank": info.rank, **placement(), "device": device_name(info.device)})
    return {
        "fsdp_exp_version": __version__,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "world_size": info.world_size,
        "device_type": info.device.type,
        "devices": [f"{r['host']}:{r['device']}" for r in ranks],
        "ranks": ranks,
        "threads_per_rank": torch.get_num_threads(),
        "num_params": count_params(cfg.model),
        "architecture": spec_for(cfg.model).architecture(cfg.model),  # e.g. MistralForCausalLM
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
