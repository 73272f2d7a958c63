"""Sweeps: check a multirun's input before any job starts, and account for every job at the end.

``SweepCallback.on_multirun_start`` refuses what Hydra's composition lets through (exit 2, nothing
launched): an empty list for a config group, a value listed twice. Combinations that compose but
cannot run (``sharding=ddp offload=params``, a batch the ranks do not divide, a model the fit check
says does not fit) are not refused, since a grid naturally holds some: they are announced, then each
is recorded as a failed run with its reason. ``interleave_repeats`` gives the interleaved sweeper (the
default) its order: every configuration's repeat 0, then every repeat 1, so a slow spell of the
machine does not fall on the repeats of one configuration. ``on_multirun_end`` reads every job back
from its ``run.json`` (the single source of truth, locally and on SLURM), prints the outcomes and
exits 1 naming the failed jobs. The user's view: the docs pages sweeps.md and reports.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fsdp_exp.config.aliases import fix_text, meant
from fsdp_exp.errors import did_you_mean
from fsdp_exp.identity import REPEAT_KEY

EXIT_BAD_SWEEP = 2
EXIT_JOB_FAILED = 1
# Sweepers that make the cartesian product of the overrides (fsdp_exp's orders its jobs differently).
PRODUCT_SWEEPERS = ("BasicSweeper", "InterleavedSweeper")


def sweep_problems(overrides: list[str]) -> list[str]:
    """What is wrong with a multirun's overrides that Hydra would let through (empty = nothing)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    problems = []
    for override in parser.parse_overrides(overrides):
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                continue  # ranges/intervals: a sweeper plugin's business
            values = list(override.sweep_string_iterator())
            if not values:
                problems.append(f"{key}: the sweep lists no value; give at least one ({key}=a,b)")
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                hint = (
                    f" (to measure each configuration {len(values)} times: {key}="
                    f"{','.join(map(str, range(len(values))))})"
                    if key == REPEAT_KEY
                    else ""
                )
                problems.append(
                    f"{key}: {', '.join(duplicates)} listed twice; every job would run twice. "
                    f"List each value once{hint}"
                )
            chosen = values
        elif override.value() == [] and _group_options(key):
            problems.append(f"{key}=[] selects no option of the group; pick one of: {', '.join(_group_options(key))}")
            continue
        else:
            chosen = [override.get_value_element_as_str()]
        options = _group_options(key)
        if not options and not key.lstrip("+~").startswith("hydra."):
            problems.extend(_unknown_key(key.lstrip("+~").split("@")[0]))
        for value in chosen if options and not override.is_delete() else []:
            if value not in options and value != "null":
                alias = meant(
                    key.split("@")[0].lstrip("+~"), value, list(options)
                )  # spelling checked against what was meant
                hint = did_you_mean(fix_text(alias) if alias else None, after=" ")
                problems.append(f"{key}={value}: no such option; {hint}options: {', '.join(options)}")
    return problems


def _unknown_key(key: str) -> list[str]:
    """A key the schema does not declare (one that ``+key=`` or ``++key=`` would add), with the closest."""
    from fsdp_exp.config import ConfigError, RunConfig
    from fsdp_exp.config.strict import check_keys

    node: dict = {}
    for part in reversed(key.split(".")):
        node = {part: node or None}
    try:
        check_keys(node, RunConfig)
    except ConfigError as err:
        return [str(err).splitlines()[0].removeprefix("unknown key: ")]
    return []


def _group_options(key: str) -> list[str]:
    """The options of the config group this override key names (empty: not a group)."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return []
    group = key.split("@")[0].lstrip("+~")
    return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def _combinations(overrides: list[str]) -> list[list[str]]:
    """The jobs a sweep makes of these overrides, in the order they run (Hydra's own expansion, repeats
    interleaved as fsdp_exp's sweeper runs them)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return interleave_repeats(batch)


def interleave_repeats(jobs: list[list[str]]) -> list[list[str]]:
    """The jobs reordered so that every configuration's first repeat runs before any second one, and so on.

    A stable sort by the job's ``trainer.repeat`` value, ranked by where that value first appears (the
    order it was listed in): within one repeat the configurations keep Hydra's order. A sweep without
    ``trainer.repeat`` keeps Hydra's order.
    """

    def value(job: list[str]) -> Optional[str]:
        return next((o.partition("=")[2] for o in job if o.lstrip("+~").partition("=")[0] == REPEAT_KEY), None)

    order: dict[Optional[str], int] = {}
    for job in jobs:
        order.setdefault(value(job), len(order))
    return sorted(jobs, key=lambda job: order[value(job)])


def invalid_combinations(overrides: list[str], config_name: str = "config") -> list[tuple[str, str]]:
    """(job label, reason) for each combination that composes but that fsdp_exp would refuse to run."""
    from hydra import compose

    from fsdp_exp.config import ConfigError, to_run_config
    from fsdp_exp.launch import prepare

    refused = []
    jobs = _combinations(overrides)
    shared = set.intersection(*map(set, jobs)) if len(jobs) > 1 else set()
    for job in jobs:
        label = " ".join(o for o in job if o not in shared)
        try:
            cfg = compose(config_name=config_name, overrides=[o for o in job if not o.startswith("hydra")])
            prepare(to_run_config(cfg))
        except ConfigError as err:
            refused.append((label, str(err).splitlines()[0]))
        except Exception:  # noqa: BLE001 - not ours to judge here; the job itself will say
            continue
    return refused


def sweep_records(sweep_dir: Path, since: float = 0.0) -> list:
    """The runs (fsdp_exp.report's ``Run``) of the jobs under a sweep folder whose run.json was written at
    or after ``since`` (a time stamp), in job order. Read by the report's loader, which tolerates damaged
    records (an unreadable run.json is a run of status "unknown")."""
    from fsdp_exp.report.load import read_run

    paths = sorted(Path(sweep_dir).glob("*/run.json"), key=_job_number)
    # an older sweep's job in a reused folder is left out
    return [read_run(path.parent) for path in paths if path.stat().st_mtime + 1.0 >= since]


def _job_number(path: Path) -> tuple[int, str]:
    head = path.parent.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, path.parent.name)


class SweepCallback(Callback):
    """Installed by the primary config (``hydra.callbacks.sweep``)."""

    def __init__(self) -> None:
        self.started: Optional[float] = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse(sweep_problems(list(config.hydra.overrides.task)), "invalid overrides, nothing was started")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        overrides = sweep_arguments(config)
        _refuse(sweep_problems(overrides), "invalid sweep, nothing was started")
        self.started = time.time()
        # Judged here only when the jobs run on this machine (local launcher, basic sweeper): a SLURM
        # node may resolve `auto` against GPUs this machine does not have.
        if config.hydra.sweeper._target_.endswith(PRODUCT_SWEEPERS) and config.hydra.launcher._target_.endswith(
            "BasicLauncher"
        ):
            refused = invalid_combinations(overrides, kwargs.get("config_name") or "config")
            if refused:
                too_big = sum(reason.startswith("does not fit") for _, reason in refused)
                memory = f" ({too_big} of them do not fit this machine's memory)" if too_big else ""
                print(
                    f"fsdp_exp: {len(refused)} combination(s) of this sweep cannot run{memory}; each will be "
                    f"recorded as a failed run and the sweep goes on:",
                    file=sys.stderr,
                )
                for label, reason in refused:
                    print(f"  {label}: {reason}", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = sweep_records(sweep_dir, self.started or 0.0)
        failed = [run for run in runs if run.status not in ("completed", "interrupted")]
        _print_outcomes(sweep_dir, runs)
        if failed:
            names = ", ".join(Path(run.path).name for run in failed)
            print(f"fsdp_exp: {len(failed)} of {len(runs)} jobs failed: {names}", file=sys.stderr)
            raise SystemExit(EXIT_JOB_FAILED)


def sweep_arguments(config: DictConfig) -> list[str]:
    """A multirun's sweep: a preset's ``hydra.sweeper.params`` first, then the command line (as the
    basic sweeper combines them)."""
    params = config.hydra.sweeper.get("params") or {}
    return [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)


def _refuse(problems: list[str], headline: str) -> None:
    if problems:
        print(f"fsdp_exp: {headline}:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        raise SystemExit(EXIT_BAD_SWEEP)


def _print_outcomes(sweep_dir: Path, runs: list) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from fsdp_exp.report.table import common_overrides, labels

    table = Table(title=f"sweep {sweep_dir}: {len(runs)} jobs", header_style="bold")
    for column in ("job", "overrides", "status", "tokens/s", "error"):
        table.add_column(column, justify="right" if column == "tokens/s" else "left", overflow="fold")
    # labels: each job's overrides less those every job shares, i.e. what tells the jobs apart
    for run, label in zip(runs, labels(runs, common_overrides(runs))):
        tokens = run.summary.get("summary/tokens_per_s_median")
        error = (run.error or "").splitlines()[0] if run.status != "completed" and run.error else ""
        # escape: errors quote paths such as gloo's "[/pytorch/...]", which rich would read as markup
        table.add_row(
            Path(run.path).name.split("_", 1)[0],
            escape(label),
            run.status,
            f"{tokens:.0f}" if tokens else "",
            escape(error),
        )
    console = Console(stderr=True)
    console.print(table)
    console.print(f"compare them: python -m fsdp_exp.report {sweep_dir}")
