"""A saved W&B workspace for one sweep (``python -m fsdp_exp.report <sweep> --wandb-workspace``), built with
W&B's own ``wandb-workspaces`` models.

The runset selects the sweep's W&B group and groups its runs by the choices the sweep varied (repeats of
one configuration fall into one group); the sections and the runs table are listed on the docs page
reports.md ("Comparing sweeps in W&B"). Every name comes from the metric schema or the run's W&B config,
and a summary value is named as W&B keeps it: ``summary/*`` as logged, a per-step metric as
``<name>.<rule>`` (its ``define_metric`` summary rule). Offline (or with ``--dry-run``) the spec is written
next to the runs (``wandb_workspace.json``) and published later, once the runs are uploaded, with
``python -m fsdp_exp.report.wandb_workspace <sweep>/wandb_workspace.json [--entity ENTITY]``. Saving needs
the network and a W&B login; the tests build, write and read back the spec only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdp_exp.errors import ConfigError, fail
from fsdp_exp.metrics.schema import ALL_METRICS, PHASES
from fsdp_exp.record import TAGGED_GROUPS
from fsdp_exp.report.load import Run
from fsdp_exp.report.table import option_values

SPEC_FILE = "wandb_workspace.json"
# What the comparison plots against the varied choices: throughput, MFU and the peak the report ranks by.
TOKENS, TOKENS_P10, TOKENS_P90 = "summary/tokens_per_s_median", "summary/tokens_per_s_p10", "summary/tokens_per_s_p90"
COMPARED = (TOKENS, "summary/mfu_median", "summary/peak_gib")
# The tracked kinds a phase's bar chart splits its peak into (the parts that add up; fsdp_exp.metrics.schema).
PHASE_KINDS = ("params", "grads", "optim_state", "activations", "temp", "comm_buffers", "buffers", "inputs", "other")
TABLE_SUMMARY = (
    TOKENS,
    TOKENS_P10,
    TOKENS_P90,
    "summary/mfu_median",
    "summary/step_time_s_median",
    "summary/peak_gib",
    "summary/peak_source",
    "summary/model_states_gib_max",
    "summary/final_loss",
    "summary/steps_measured",
)


def summary_name(metric: str) -> str:
    """The key W&B's summary holds for a schema metric: a ``summary/*`` key as set, a per-step metric as
    ``<name>.<rule>`` (fsdp_exp.record.wandb_sink declares the rule)."""
    declared = ALL_METRICS[metric]
    if declared.window == "run":
        return declared.name
    if declared.wandb_summary == "none":
        raise ValueError(f"{metric} has no W&B summary value (its rule is 'none'); use its summary/* key")
    return f"{declared.name}.{declared.wandb_summary}"


def _history(metric: str) -> str:
    if ALL_METRICS[metric].window == "run":
        raise ValueError(f"{metric} is set once in the summary; it has no history to plot")
    return metric


@dataclass
class SweepView:
    """What the workspace needs to know about the sweep: where its runs live in W&B and what it varied."""

    entity: str  # "" = whoever publishes it: their default entity
    project: str
    group: str
    varied: dict[str, str] = field(default_factory=dict)  # the report's option key -> W&B config path
    cuda: bool = False  # some run has the CUDA allocator's metrics

    @property
    def name(self) -> str:
        return f"fsdp_exp sweep {self.group}"


def _wandb_logger(run: Run) -> dict:
    logger = run.config_value("logger.wandb")
    return logger if isinstance(logger, dict) else {}


def wandb_config_path(option_key: str) -> str:
    """The W&B config path of a report option: a config group's choice is logged under ``choices``, an
    override key (``trainer.micro_batch_size``) is the resolved config's own path."""
    return option_key if "." in option_key else f"choices.{option_key}"


def sweep_view(runs: list[Run], target: Optional[str] = None) -> SweepView:
    """The sweep's W&B group, entity and project (``target``: ``entity/project`` or ``project``, else as the
    runs logged them), and the choices that vary over its runs."""
    logged = [_wandb_logger(run) for run in runs if run.config]
    groups = sorted({str(w.get("group")) for w in logged if w.get("group")})
    if not logged or not groups:
        fail(
            "these runs have no W&B group: a workspace compares the runs of one sweep (python -m fsdp_exp -m "
            "... puts them in one group, named after the sweep folder)",
            "pass a sweep folder, or run with logger.wandb.group=<name>",
        )
    if len(groups) > 1 or len([w for w in logged if w.get("group")]) != len(logged):
        fail(
            f"these runs belong to more than one W&B group ({', '.join(groups)}, or none): a workspace shows one",
            "pass the folder of one sweep",
        )
    modes = {w.get("mode") for w in logged}
    if modes == {"disabled"}:
        fail(
            "these runs did not log to W&B (logger.wandb.mode=disabled)",
            "rerun with logger.wandb.mode=offline (then python -m fsdp_exp.sync) or online",
        )
    entity, project = "", ""
    if target:
        parts = target.strip("/").split("/")
        if len(parts) > 2 or not all(parts):
            raise ConfigError(f"--wandb-workspace {target!r}: expected entity/project or project")
        entity, project = parts if len(parts) == 2 else ["", parts[0]]
    projects = sorted({str(w.get("project")) for w in logged if w.get("project")})
    entities = sorted({str(w.get("entity")) for w in logged if w.get("entity")})
    if not project:
        if len(projects) != 1:
            fail(
                f"the runs logged to {len(projects)} W&B projects ({', '.join(projects)})",
                "name one: --wandb-workspace ENTITY/PROJECT",
            )
        project = projects[0]
    if not entity and len(entities) == 1:
        entity = entities[0]
    values = option_values(runs)
    varied_keys = [key for key, column in values.items() if len({v for v in column if v is not None}) > 1]
    # Config groups in the order of the run's tags (model, sharding, precision, ...), then override keys.
    order = {group: i for i, group in enumerate(TAGGED_GROUPS)}
    varied_keys.sort(key=lambda key: order.get(key, len(order)))
    varied = {key: wandb_config_path(key) for key in varied_keys}
    cuda = any(run.summary.get("summary/peak_allocated_gib_max") is not None for run in runs)
    return SweepView(entity=entity, project=project, group=groups[0], varied=varied, cuda=cuda)


def build_workspace(view: SweepView):
    """The workspace (a ``wandb_workspaces.workspaces.Workspace``); nothing is sent anywhere."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def summary(*metrics: str) -> list:
        return [wr.SummaryMetric(summary_name(m)) for m in metrics]

    def bars(title: str, *metrics: str) -> "wr.BarPlot":
        # A configuration's repeats form one group: its bar is their median, the whisker their range.
        return wr.BarPlot(title=title, metrics=summary(*metrics), groupby_aggfunc="median", groupby_rangefunc="minmax")

    def lines(title: str, *metrics: str) -> "wr.LinePlot":
        return wr.LinePlot(title=title, x="step", y=[_history(m) for m in metrics])

    compare = [
        wr.ScatterPlot(
            title="tokens/s (median over measured steps) vs peak memory per rank (GiB)",
            x=wr.SummaryMetric(summary_name("summary/peak_gib")),
            y=wr.SummaryMetric(summary_name(TOKENS)),
        ),
        wr.ParallelCoordinatesPlot(
            title="varied choices -> tokens/s, MFU, peak memory per rank",
            columns=[
                wr.ParallelCoordinatesPlotColumn(metric=wr.Config(path), display_name=key)
                for key, path in view.varied.items()
            ]
            + [wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(summary_name(m))) for m in COMPARED],
        ),
        bars("tokens/s per run: p10, median, p90 of its measured steps", TOKENS_P10, TOKENS, TOKENS_P90),
    ]
    throughput = [
        lines("tokens/s per step", "perf/tokens_per_s"),
        lines("step time (s)", "perf/step_time_s"),
        lines("MFU and HFU", "perf/mfu", "perf/hfu"),
        lines("TFLOPS per rank", "perf/tflops_per_rank"),
        lines("data wait per step (s)", "perf/data_time_s"),
        bars("step time: median and p90 (s)", "summary/step_time_s_median", "summary/step_time_s_p90"),
        bars("MFU and HFU (median)", "summary/mfu_median", "summary/hfu_median"),
    ]
    memory = [
        bars(
            "peak memory per rank (the report's; summary/peak_source says which) and model states (GiB)",
            "summary/peak_gib",
            "summary/model_states_gib_max",
            "summary/tracked_peak_gib_max",
        ),
        *[
            bars(
                f"{phase}: tracked peak vs the planner's (GiB)",
                f"mem/tracked_{phase}_total_gib_max",
                f"mem/predicted_{phase}_peak_gib",
            )
            for phase in PHASES
        ],
        *[
            bars(
                f"{phase}: what the peak holds (GiB, max over ranks)",
                *[f"mem/tracked_{phase}_{kind}_gib_max" for kind in PHASE_KINDS],
            )
            for phase in PHASES
        ],
        bars("planner's error on the peak (predicted / tracked - 1)", "summary/planner_peak_error"),
        lines("host RSS (GiB)", "mem/host_rss_gib_max", "mem/host_peak_rss_gib_max"),
    ]
    if view.cuda:
        memory += [
            bars(
                "CUDA allocator peaks (GiB)",
                "summary/peak_allocated_gib_max",
                "summary/peak_reserved_gib_max",
                "summary/peak_active_gib_max",
            ),
            bars("CUDA allocator retries and OOMs", "summary/alloc_retries_max", "summary/ooms_max"),
            lines("CUDA peak allocated per logging interval (GiB)", "mem/peak_allocated_gib_max"),
        ]
    communication = [
        bars(
            "collectives in flight, median over profiled steps (s)",
            "summary/comm_total_s_median",
            "summary/comm_exposed_s_median",
        ),
        bars(
            "by collective, mean over profiled steps (s)",
            "comm/all_gather_s",
            "comm/reduce_scatter_s",
            "comm/all_reduce_s",
            "comm/all_to_all_s",
            "comm/other_s",
        ),
        bars("exposed share of the profiled step", "comm/exposed_fraction"),
    ]
    loss = [
        lines("training loss", "train/loss"),
        lines("validation loss (trainer.eval_every)", "val/loss"),
        lines("gradient norm before clipping", "train/grad_norm"),
        lines("learning rate", "train/lr"),
        bars("final training loss", "summary/final_loss"),
    ]
    sections = [
        ws.Section(name="Compare configurations", panels=compare, is_open=True, pinned=True),
        ws.Section(name="Throughput", panels=throughput, is_open=True),
        ws.Section(name="Memory per rank, by phase", panels=memory, is_open=True),
        ws.Section(name="Communication (profiled steps: trainer.profile_steps)", panels=communication),
        ws.Section(name="Loss", panels=loss),
    ]
    columns = [
        "run:displayName",
        "run:state",
        *[f"config:{_column_path(path)}" for path in view.varied.values()],
        *[f"summary:{summary_name(m)}" for m in TABLE_SUMMARY],
    ]
    runset = ws.RunsetSettings(
        filters=ws.And(ws.Metric("Group") == view.group),
        groupby=[ws.Config(path) for path in view.varied.values()],
        order=[ws.Ordering(ws.Summary(TOKENS), ascending=False)],
        pinned_columns=columns,
    )
    return ws.Workspace(
        entity=view.entity,
        project=view.project,
        name=view.name,
        sections=sections,
        runset_settings=runset,
        # W&B's default draws the first 10 runs of the runset in each panel: a sweep has more
        settings=ws.WorkspaceSettings(max_runs=100),
    )


def _column_path(path: str) -> str:
    # W&B stores each top-level config key as {"value": ...}: a nested key's column is <top>.value.<rest>.
    top, _, rest = path.partition(".")
    return f"{top}.value.{rest}" if rest else f"{top}.value"


def write_spec(workspace, folder: Path) -> Path:
    """The workspace's spec as W&B saves it, in ``folder`` (written whole, then renamed into place)."""
    path = Path(folder) / SPEC_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(workspace._spec, indent=1) + "\n")
    tmp.replace(path)
    return path


def keep_saved_view(workspace, path: Path) -> None:
    """A view saved before from this spec (its W&B name and id are in it) is updated, not duplicated, when
    the report is run again for the same sweep."""
    if not Path(path).is_file():
        return
    old = json.loads(Path(path).read_text())
    same = (old.get("project"), old.get("displayName")) == (workspace.project, workspace.name) and (
        not workspace.entity or old.get("entity") in ("", workspace.entity)
    )
    if same and old.get("name"):
        if not workspace.entity:
            workspace.entity = old.get("entity") or ""
        workspace._internal_name, workspace._internal_id = old["name"], old.get("id") or ""


def read_spec(path: Path):
    """A written spec back as the library's Workspace (the same path it takes for a view it loads from W&B)."""
    from wandb_workspaces.workspaces import Workspace, internal

    return Workspace._from_model(internal.View.model_validate(json.loads(Path(path).read_text())))


def publish(workspace, entity: Optional[str] = None) -> str:
    """Save the view in W&B (network and login needed); returns its address."""
    import wandb

    if entity:
        workspace.entity = entity
    if not workspace.entity:
        workspace.entity = wandb.Api().default_entity
    workspace.save()
    return workspace.url


def save_and_record(workspace, spec: Path, entity: Optional[str] = None) -> str:
    """Publish, then rewrite the spec with the view's W&B name and id (a later publish updates that view)."""
    address = publish(workspace, entity)
    write_spec(workspace, spec.parent)
    return address


def publish_command(spec: Path) -> str:
    return f"python -m fsdp_exp.report.wandb_workspace {spec}"


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m fsdp_exp.report.wandb_workspace <spec> [--entity E]``: publish a written spec."""
    from fsdp_exp.sync import wandb_unreachable

    parser = argparse.ArgumentParser(
        prog="python -m fsdp_exp.report.wandb_workspace",
        description="Save a workspace spec written by python -m fsdp_exp.report --wandb-workspace as a view in W&B.",
    )
    parser.add_argument("spec", help=f"the {SPEC_FILE} a report wrote")
    parser.add_argument("--entity", help="the W&B entity to save it in (default: the spec's, else your default)")
    args = parser.parse_args(argv)
    workspace = read_spec(Path(args.spec))
    why = wandb_unreachable()
    if why:
        print(f"fsdp_exp: cannot publish the workspace: {why}; the spec stays in {args.spec}", file=sys.stderr)
        return 1
    print(f"saved the W&B workspace: {save_and_record(workspace, Path(args.spec), args.entity)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
