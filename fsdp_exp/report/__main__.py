"""``python -m fsdp_exp.report <sweep folder | run folders...>``: rank the runs, plot, write the report files.

    python -m fsdp_exp.report outputs/sweeps/2026-11-29_12-00-00
    python -m fsdp_exp.report outputs/runs/a outputs/runs/b --out reports/ab --metric tflops_per_rank
    python -m fsdp_exp.report --wandb my-team/fsdp_exp/my-sweep --out reports/my-sweep

Exit codes: 0 done; 2 nothing to report (no runs under the paths, a path that does not exist) or a bad option.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

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
                    "report.html, report.json and report.csv.")
    parser.add_argument("paths", nargs="*", help="a sweep folder (outputs/sweeps/<time>) or run folders")
    parser.add_argument("--out", help="where the report files go (default: the folder given, or the runs' "
                                      "common parent)")
    parser.add_argument("--metric", choices=list(METRICS), default="tokens_per_s",
                        help="what ranks the runs and goes on the plots' y axis (default: tokens_per_s)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT[/GROUP]",
                        help="read the runs from W&B instead (needs network and `wandb login`); requires --out")
    parser.add_argument("--no-files", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run or sweep folders, or --wandb ENTITY/PROJECT[/GROUP], not both or neither")
    if args.wandb and not args.out and not args.no_files:
        parser.error("--wandb needs --out DIR for the report files (or --no-files)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    from rich.console import Console

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
    # Piped into a file or CI log, rich would wrap at 80 columns; a report row is wider than that.
    console = Console(width=None if sys.stdout.isatty() else 160)
    print_report(report, console)
    if not args.no_files:
        fig, _ = plot_report(report)
        paths = write_outputs(report, fig, Path(args.out) if args.out else default_out_dir(args.paths))
        console.print(f"wrote {', '.join(p.name for p in paths.values())} in {paths['html'].parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
