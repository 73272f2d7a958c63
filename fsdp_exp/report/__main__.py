"""``python -m fsdp_exp.report <sweep folder | run folders...>``: rank the runs, plot, write the report files.

    python -m fsdp_exp.report outputs/sweeps/2026-11-29_12-00-00
    python -m fsdp_exp.report outputs/runs/a outputs/runs/b --out reports/ab --metric tflops_per_rank
    python -m fsdp_exp.report --wandb my-team/fsdp_exp/my-sweep --out reports/my-sweep
    python -m fsdp_exp.report outputs/sweeps/2026-11-29_12-00-00 --wandb-workspace my-team/fsdp_exp

``--wandb-workspace [ENTITY/PROJECT]`` also builds a W&B workspace for the sweep's group
(``fsdp_exp.report.wandb_workspace``). Exit codes: 0 done; 2 nothing to report (no runs under the
paths, a path that does not exist), a bad option, or runs that are not one W&B group
(``--wandb-workspace``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from fsdp_exp.errors import ConfigError
from fsdp_exp.report.load import NoRuns, load_runs
from fsdp_exp.report.plots import plot_report
from fsdp_exp.report.table import METRICS, build_report, print_report
from fsdp_exp.report.write import write_outputs

EXIT_NO_RUNS = 2


def default_out_dir(paths: list[str]) -> Path:
    """Next to the runs: the one folder given (a sweep's, or a run's), else the folders' common parent."""
    if len(paths) == 1:
        return Path(paths[0])
    return Path(os.path.commonpath([str(Path(p).resolve()) for p in paths]))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_exp.report",
        description="Rank fsdp_exp runs by throughput, flag duplicates, list failures; write report.png, "
        "report.html, report.json and report.csv.",
    )
    parser.add_argument("paths", nargs="*", help="a sweep folder (outputs/sweeps/<time>) or run folders")
    parser.add_argument(
        "--out", help="where the report files go (default: the folder given, or the runs' common parent)"
    )
    parser.add_argument(
        "--metric",
        choices=list(METRICS),
        default="tokens_per_s",
        help="what ranks the runs and goes on the plots' y axis (default: tokens_per_s)",
    )
    parser.add_argument(
        "--wandb",
        metavar="ENTITY/PROJECT[/GROUP]",
        help="read the runs from W&B instead (needs network and `wandb login`); requires --out",
    )
    parser.add_argument("--no-files", action="store_true", help="print the table only")
    parser.add_argument(
        "--wandb-workspace",
        nargs="?",
        const="",
        metavar="ENTITY/PROJECT",
        help="also build a W&B workspace comparing the sweep's runs (its W&B group) and save it "
        "(default entity/project: the runs'); offline, write its spec to the report folder",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="with --wandb-workspace: write the workspace spec, do not save it in W&B"
    )
    args = parser.parse_args(argv)
    if args.dry_run and args.wandb_workspace is None:
        parser.error("--dry-run goes with --wandb-workspace")
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run or sweep folders, or --wandb ENTITY/PROJECT[/GROUP], not both or neither")
    if args.wandb and not args.out and not args.no_files:
        parser.error("--wandb needs --out DIR for the report files (or --no-files)")
    if args.wandb and not args.out and args.wandb_workspace is not None:
        parser.error("--wandb with --wandb-workspace needs --out DIR for the workspace spec")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    from rich.console import Console

    from fsdp_exp.narrow import terminal_width

    args = parse_args(argv)
    try:
        if args.wandb:
            from fsdp_exp.report.wandb_source import load_wandb

            runs, sources = load_wandb(args.wandb), [f"wandb:{args.wandb}"]
        else:
            runs, sources = load_runs(args.paths), [str(Path(p).resolve()) for p in args.paths]
    except NoRuns as err:
        print(f"fsdp_exp.report: {err}", file=sys.stderr)
        return EXIT_NO_RUNS
    report = build_report(runs, metric=args.metric, sources=sources)
    # Piped into a file or CI log: 100 columns, the ranking dropping its least needed columns (table.DROP_ORDER).
    console = Console(width=terminal_width())
    print_report(report, console)
    if not args.no_files:
        fig, _ = plot_report(report)
        paths = write_outputs(report, fig, Path(args.out) if args.out else default_out_dir(args.paths))
        console.print(f"wrote {', '.join(p.name for p in paths.values())} in {paths['html'].parent}")
    if args.wandb_workspace is not None:
        return wandb_workspace(runs, args, console)
    return 0


def wandb_workspace(runs, args: argparse.Namespace, console) -> int:
    """Build the sweep's W&B workspace; save it when the W&B server answers, else write its spec and say how
    to publish it. The spec is written in either case: it is what was (or will be) saved."""
    from fsdp_exp.report import wandb_workspace as workspaces
    from fsdp_exp.sync import wandb_unreachable

    try:
        view = workspaces.sweep_view(runs, args.wandb_workspace or None)
    except ConfigError as err:
        print(f"fsdp_exp.report: no W&B workspace: {err}", file=sys.stderr)
        return EXIT_NO_RUNS
    workspace = workspaces.build_workspace(view)
    out = Path(args.out) if args.out else default_out_dir(args.paths)
    out.mkdir(parents=True, exist_ok=True)
    workspaces.keep_saved_view(workspace, out / workspaces.SPEC_FILE)  # run again: update the view, not a copy
    spec = workspaces.write_spec(workspace, out)
    why = "--dry-run" if args.dry_run else wandb_unreachable()
    if why is None:
        try:
            address = workspaces.save_and_record(workspace, spec)
            console.print(f"saved the W&B workspace of group {view.group}: {address}", markup=False, soft_wrap=True)
            return 0
        except Exception as err:  # noqa: BLE001 - not logged in, no such entity, a server error: say it, keep the spec
            why = f"saving it failed: {type(err).__name__}: {err}"
    upload = f"python -m fsdp_exp.sync {' '.join(args.paths)}\n  " if args.paths else ""
    console.print(
        f"wrote the W&B workspace spec {spec} (not saved: {why}); once online, upload the runs and "
        f"publish it:\n  {upload}{workspaces.publish_command(spec)}",
        markup=False,
        highlight=False,
        soft_wrap=True,  # the commands stay whole on their lines, to be copied (piped: 100 columns)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
