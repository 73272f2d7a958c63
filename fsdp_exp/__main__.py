"""``python -m fsdp_exp [overrides]``: compose the config with Hydra, validate it, launch the ranks.

    python -m fsdp_exp                                         # tiny Llama, FSDP2 full shard, 2 ranks
    python -m fsdp_exp sharding=grad_op precision=bf16 trainer.steps=50
    python -m fsdp_exp -m sharding=full,grad_op precision=bf16,fp32   # a sweep: one run per combination
    python -m fsdp_exp --cfg job                               # print the composed config and exit

A single run that fails exits non-zero (2: the configuration cannot run, 1: a rank failed). In a
sweep (``-m``) a failing job is recorded as a failed run (run.json and W&B, with its error) and the
sweep goes on; ``fsdp_exp.sweep`` exits non-zero at the end, naming the failed jobs.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from fsdp_exp.config import to_run_config
from fsdp_exp.context import Labels, Sweep
from fsdp_exp.errors import EXIT_BAD_CONFIG, EXIT_RUN_FAILED, ConfigError


@hydra.main(version_base="1.3", config_path="pkg://fsdp_exp.conf", config_name="config")  # conf/, via setup.py
def hydra_entry(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fsdp_exp.launch import RunFailed, allow_forked_ranks, launch, record_failure, report_failure

    # This process is fsdp_exp's own; the first job's call comes before any work.
    allow_forked_ranks(wandb=cfg.logger.wandb.mode != "disabled")

    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    labels = Labels(
        overrides=tuple(hc.overrides.task),
        choices={k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
        sweep=Sweep(dir=hc.sweep.dir, name=Path(hc.sweep.dir).name, job=hc.job.num) if sweep else None,
    )
    if sweep and cfg.logger.wandb.group is None:  # the runs of one sweep share a W&B group: the sweep's name
        cfg.logger.wandb.group = labels.sweep.name
    try:
        return launch(to_run_config(cfg), run_dir, labels)
    except ConfigError as err:
        message = f"invalid configuration: {err}"
        print(f"fsdp_exp: {message}", file=sys.stderr)
        if not sweep:
            sys.exit(EXIT_BAD_CONFIG)
        return record_failure(run_dir, cfg, labels, None, message)
    except RunFailed as failure:
        report_failure(failure)
        if not sweep:
            sys.exit(EXIT_RUN_FAILED)
        return {"status": "failed", "error": {"rank": failure.rank, "message": failure.summary}}
    except Exception as exc:  # noqa: BLE001 - in a sweep, one job's unexpected error must not end the others
        if not sweep:
            raise
        traceback.print_exc()
        return record_failure(run_dir, cfg, labels, None, f"{type(exc).__name__}: {exc}")


def main() -> None:
    """Hydra's own refusals (a key its schema lacks in a YAML of the user's, an unknown option, an
    unparsable override) are bad input like fsdp_exp's: exit 2 with the closest real key or option."""
    import os

    from fsdp_exp.config import RunConfig
    from fsdp_exp.config.strict import explain_composition_error

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us instead of Hydra's exit 1
    try:
        hydra_entry()
    except Exception as exc:  # noqa: BLE001 - anything else is re-raised unchanged
        message = explain_composition_error(exc, RunConfig)
        if message is None:
            raise
        print(f"fsdp_exp: invalid configuration: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)


def leave_when_done(entry) -> None:
    """Run ``entry`` and end the process as soon as it returns, with the exit status it asked for. What
    Python would do next is tearing down torch's modules (about a second of interpreter finalization on 2
    busy cores, after the run is already complete): skip that, as the ranks do, once the launcher's threads
    ended, its exit handlers ran (logging's files, multiprocessing's finalizers) and its streams are flushed.
    A KeyboardInterrupt leaves as Python's default does."""
    import atexit
    import os
    import threading

    try:
        entry()
        code = 0
    except SystemExit as stop:
        code = stop.code
    except Exception:  # noqa: BLE001 - reported as Python would, then the same exit status
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave_when_done(main)
