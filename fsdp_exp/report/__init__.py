"""Compare runs: a ranked table, plots, duplicates and files for other tools (``python -m fsdp_exp.report``).

    from fsdp_exp.report import load_runs, build_report, plot_report
    report = build_report(load_runs(["outputs/sweeps/2026-11-29_12-00-00"]))
    fig, shown = plot_report(report)

Modules, one concern each: ``load`` (find run folders, read damaged ones), ``wandb_source`` (the same
from a W&B project), ``duplicates`` (runs with the same applied settings), ``repeats`` (runs that repeat
one configuration: ``trainer.repeat``), ``intervals`` (the bootstrap interval of a median, ties),
``table`` (configuration rows, ranking, ties, Pareto front, per-option means, the console table),
``plots`` (the figure, with error bars), ``html`` (the self-contained page), ``write`` (report.png /
.html / .json / .csv), ``wandb_workspace`` (a W&B workspace comparing a sweep's runs, ``--wandb-workspace``).
"""

from fsdp_exp.report.duplicates import configuration_key, find_duplicates, settings_key
from fsdp_exp.report.load import NoRuns, Run, find_run_dirs, load_runs, read_run
from fsdp_exp.report.plots import plot_report, plotted_intervals, plotted_point_count, png_bytes
from fsdp_exp.report.table import METRICS, Report, Row, build_report, print_report

__all__ = [
    "METRICS",
    "NoRuns",
    "Report",
    "Row",
    "Run",
    "build_report",
    "configuration_key",
    "find_duplicates",
    "find_run_dirs",
    "load_runs",
    "plot_report",
    "plotted_intervals",
    "plotted_point_count",
    "png_bytes",
    "print_report",
    "read_run",
    "settings_key",
]
