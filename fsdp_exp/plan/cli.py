"""The memory planner: each rank's memory for a configuration, by arithmetic, before anything runs.

    python -m fsdp_exp.plan model=llama7b precision=bf16 trainer.nproc_per_node=8 plan.device=h100_80gb
    python -m fsdp_exp.plan sharding=grad_op ac=full plan.format=json

It takes the same overrides as a run, composes the same config, resolves the same ``Topology``
(``fsdp_exp.preflight.validate``) and builds the model on the meta device only. Three options are the
planner's own and never reach the run config: ``plan.format=table|json``, ``plan.device=<name>`` (a row
of ``DEVICES``; default: this machine) and ``plan.margin=<fraction>`` (the allocator margin; default 0
on a CPU, 10% of the peak plus 1 GiB on CUDA). It prints the largest rank's model states at rest, the
peak of one step walked phase by phase (``stage_peaks`` per tracker stage), the verdict for the device,
and each memory option priced by planning again with it. More: docs pages planning.md, design.md.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.layout import ep_values
from fsdp_exp.errors import EXIT_BAD_CONFIG, fail
from fsdp_exp.plan.devices import device_table, fits, local_cuda_device
from fsdp_exp.plan.fit import MORE_NODES
from fsdp_exp.units import GIB
from fsdp_exp.plan.loss_chunks import CHUNKS
from fsdp_exp.plan.predict import Plan, loss_chunks_for, plan

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig

EXIT_BAD_INPUT = EXIT_BAD_CONFIG

PLAN_OPTIONS = ("plan.format", "plan.device", "plan.margin", "plan.expert_imbalance")


class PlanOptionError(ValueError):
    """A bad ``plan.*`` option (the planner's own, not the run's)."""


def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Take the planner's own ``plan.*`` options off the command line; the rest are run overrides."""
    options, overrides = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key.startswith("plan."):
            if key not in PLAN_OPTIONS or not sep:
                known = ", ".join(o + "=..." for o in PLAN_OPTIONS)
                raise PlanOptionError(
                    f"{arg!r} is not a planner option ({known}).\n"
                    "  fix: pass plan.format=table|json, plan.device=<name>, plan.margin=<fraction>, "
                    "plan.expert_imbalance=<max/mean or a MoE run's folder>"
                )
            options[key.removeprefix("plan.")] = value
        else:
            overrides.append(arg)
    return options, overrides


def compose(overrides: list[str]) -> "RunConfig":
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from fsdp_exp.config import to_run_config

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        return to_run_config(hydra_compose(config_name="config", overrides=overrides))


# The memory options the table prices, each asked of the planner as a variant of the configuration (as the
# fit check does for its offers): a change that the configuration already has, or that cannot apply, is left out.
MEMORY_OPTIONS = (
    "ac=full",
    "ac=selective_op",
    "precision=bf16",
    "sharding=full",
    "offload=params",
    "trainer.micro_batch_size=1",
)


def memory_options(cfg: "RunConfig", loss_chunks: int) -> list[str]:
    """The changes to price for ``cfg`` (whose loss is taken in ``loss_chunks`` slices, ``auto`` resolved): the
    loss's and tensor parallel's options either way (what they save, or what turning them off would cost), how
    accumulated gradients are kept, then the others."""
    from fsdp_exp.config.schema import EVERY_MICRO_BATCH, LAST_MICRO_BATCH

    t = cfg.trainer
    changes = ["trainer.loss_chunks=1" if loss_chunks > 1 else f"trainer.loss_chunks={CHUNKS}"]
    if cfg.parallel.tp > 1:
        changes.append(f"parallel.loss_parallel={str(not cfg.parallel.loss_parallel).lower()}")
    if t.micro_batch_size is not None:  # micro-batches may accumulate: the rule the backend does not apply now
        from fsdp_exp.parallel.backend import backend_for

        resolved = backend_for(cfg).grad_sync(cfg)
        changes += [f"trainer.grad_sync={rule}" for rule in (EVERY_MICRO_BATCH, LAST_MICRO_BATCH) if rule != resolved]
    return changes + list(MEMORY_OPTIONS) + expert_parallel_options(cfg)


def expert_parallel_options(cfg: "RunConfig") -> list[str]:
    """A mixture of experts: every other ``parallel.ep`` (powers of two; those the run cannot take, by preflight's
    checks, drop out when they are planned), so that the table shows what expert parallel saves or costs."""
    if not getattr(cfg.model, "n_experts", 0):
        return []
    return [f"parallel.ep={ep}" for ep in ep_values() if ep != cfg.parallel.ep]


def price_options(
    cfg: "RunConfig",
    result: Plan,
    cuda_devices: int,
    device_kind: Optional[str],
    margin: Optional[float],
    imbalance: float = 1.0,
) -> list[dict]:
    """What each memory option would change of the per-rank need (peak + margin), by planning the variant:
    [{"change", "saves_bytes" (negative: costs; 0: the peak lies elsewhere), "total_bytes", "peak_phase"}],
    the largest saving first."""
    from fsdp_exp.config.variants import variant_of
    from fsdp_exp.preflight import validate

    priced = []
    topology = validate(cfg, cuda_devices=cuda_devices)
    for change in memory_options(cfg, loss_chunks_for(cfg, topology, device_kind or topology.device_type).chunks):
        variant = variant_of(cfg, (change,))
        if variant is None:
            continue
        try:
            other = plan(
                variant,
                validate(variant, cuda_devices=cuda_devices),
                device_kind=device_kind,
                margin=margin,
                expert_imbalance=imbalance,
            )
        except Exception:  # noqa: BLE001 - a change this configuration cannot take is not an option here
            continue
        priced.append(
            {
                "change": change,
                "saves_bytes": result.per_rank_bytes["total"] - other.per_rank_bytes["total"],
                "total_bytes": other.per_rank_bytes["total"],
                "peak_phase": other.peak["phase"],
                "stage_peak_bytes": {stage: ph["total"] for stage, ph in other.stage_peaks.items()},
            }
        )
    return sorted(priced, key=lambda o: -o["saves_bytes"])


def expert_imbalance(value: str) -> float:
    """``plan.expert_imbalance``: a mixture of experts' max / mean routed copies per expert (1 = balanced; a run
    logs its own as ``moe/load_imbalance_max``). Under expert parallel it sizes what the busiest rank's experts
    receive; below 1 it is no ratio of a maximum to a mean. A run's folder (or its run.json) instead of a number
    takes the load that run measured (``summary/moe_load_imbalance_median``)."""
    try:
        number = float(value)
    except ValueError:
        number = measured_imbalance(value)
    if not 1 <= number < float("inf"):
        raise PlanOptionError(
            f"plan.expert_imbalance={value!r} is not a max/mean ratio of at least 1.\n"
            "  fix: pass plan.expert_imbalance=1 (balanced), the run's moe/load_imbalance_max (e.g. 1.3), or the folder "
            "of a completed MoE run (its run.json's summary/moe_load_imbalance_median)"
        )
    return number


def measured_imbalance(path: str) -> float:
    """The expert load a run measured (its run.json's summary/moe_load_imbalance_median); 0 where there is none."""
    import json
    from pathlib import Path

    from fsdp_exp.record.run_record import RUN_RECORD  # inside: only a run folder's load needs the record module

    record = Path(path) / RUN_RECORD if Path(path).is_dir() else Path(path)
    if not record.is_file():
        return 0.0
    try:
        measured = json.loads(record.read_text()).get("summary", {}).get("summary/moe_load_imbalance_median")
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(measured) if isinstance(measured, (int, float)) else 0.0


def plan_from_argv(argv: list[str]) -> tuple[Plan, dict[str, str]]:
    from fsdp_exp.preflight import validate

    options, overrides = split_argv(argv)
    fmt = options.get("format", "table")
    if fmt not in ("table", "json"):
        raise PlanOptionError(f"plan.format={fmt!r} is not one of table, json.\n  fix: pass plan.format=json")
    table = device_table()
    device = None
    if "device" in options:
        device = table.get(options["device"])
        if device is None:
            from fsdp_exp.errors import did_you_mean
            from fsdp_exp.plan.devices import nearest_device

            hint = did_you_mean(nearest_device(options["device"]), "plan.device={}", after=" Or ")
            raise PlanOptionError(
                f"plan.device={options['device']!r} is not a known device.\n  fix: {hint}pass one of {', '.join(table)}"
            )
    margin = None
    if "margin" in options:
        try:
            margin = float(options["margin"])
        except ValueError:
            margin = -1.0
        if not 0 <= margin < 10:
            raise PlanOptionError(
                f"plan.margin={options['margin']!r} is not a fraction.\n  fix: pass e.g. plan.margin=0.1"
            )
    imbalance = expert_imbalance(options.get("expert_imbalance", "1"))
    cfg = compose(overrides)
    from fsdp_exp.models import fetch_model_files

    fetch_model_files(cfg.model)  # a hub name's config into the local cache (the planner reads local files only)
    if device is not None and device.kind == "cuda":
        # Plan for that GPU: as many GPUs per node as the run asks for (auto = 8).
        n = cfg.trainer.nproc_per_node
        gpus = int(n) if n.isdigit() else 8
    else:
        from fsdp_exp.env import cuda_device_count

        gpus = cuda_device_count()
    topology = validate(cfg, cuda_devices=gpus)
    if device is not None:
        _refuse_float8(cfg, device)
    kind = device.kind if device else None
    result = plan(cfg, topology, device_kind=kind, margin=margin, expert_imbalance=imbalance)
    if device is None:
        device = table["cpu_host"] if result.device_kind == "cpu" else local_cuda_device()
    if device is not None:
        _refuse_float8(cfg, device)  # the local GPU's (plan.device's was asked before planning)
        result.device = fits(result, device)
    found = None
    if result.device and not result.device["fits"]:
        from fsdp_exp.plan.fit import find_fit

        found = find_fit(cfg, topology.dp_size, device, gpus, margin, imbalance)
    return result, {
        "format": fmt,
        "options": price_options(cfg, result, gpus, kind, margin, imbalance),
        "fit": found,
        "header": header(cfg, result, options.get("device"), overrides),
        "ep": cfg.parallel.ep,
    }


def header(cfg: "RunConfig", result: Plan, device_name: Optional[str], overrides: list[str]) -> str:
    """What was planned, in the words of the overrides that set it: a plan of the tiny defaults reads as one."""
    t = cfg.trainer
    micro = f", micro-batch {t.micro_batch_size}" if t.micro_batch_size else ""
    where = device_name or ("this machine's " + result.device_kind.upper())
    model = next((o.partition("=")[2] for o in overrides if o.startswith("model=")), "the default")
    return (
        f"model={model} ({_count(result.num_params)} parameters), "
        f"sequence {t.seq_len}, global batch {t.global_batch_size}{micro}, {result.world_size} ranks "
        f"({t.nnodes} node{'s' * (t.nnodes > 1)}), on {where}"
    )


def fit_lines(found: Optional[dict], result: Plan, overrides: list[str], argv: list[str]) -> list[str]:
    """The cheapest combination that fits (``fit.find_fit``), as the command to run and the one to check it."""
    dv = result.device
    if not dv or dv["fits"]:
        return []
    if found is None:
        return [
            f"no combination of the memory options (ac, precision, sharding, offload, micro-batch, context parallel, "
            f"pipeline stages, expert parallel for a mixture of experts, up to {max(MORE_NODES)}x the nodes) fits "
            f"{dv['name']}: try a larger device (plan.device=...) or a smaller model"
        ]
    planner = [a for a in argv if a.startswith("plan.")]
    run = " ".join(overrides + found["changes"])
    return [
        f"fits with {' '.join(found['changes'])}: needs {found['needed_bytes'] / GIB:.1f} of "
        f"{found['device_bytes'] / GIB:.1f} GiB (the cheapest of {found['tried']} combinations planned; the order of "
        "cost: fsdp_exp/plan/fit.py PRICES)",
        f"  run it:   python -m fsdp_exp {run}",
        f"  check it: python -m fsdp_exp.plan {' '.join([run, *planner])}",
        f"  rank what fits by predicted speed: python -m fsdp_exp.tune {' '.join([*overrides, *planner])}",
    ]


def _refuse_float8(cfg: "RunConfig", device) -> None:
    """float8 on a GPU without FP8 tensor cores is refused as tune and the ranks refuse it (one rule,
    fsdp_exp.parallel.float8.device_refusal): its plan would describe a run that cannot start."""
    from fsdp_exp.parallel.float8 import device_refusal
    from fsdp_exp.plan.devices import table_device

    entry = device if device.perf is not None else table_device(device.description, device.bytes)
    if entry is None or entry.perf is None:  # a GPU no table knows: nothing to say
        return
    p = cfg.precision
    fp8 = entry.perf.peak_tflops.get("fp8")
    refused = device_refusal(p.float8_recipe, p.float8_emulate, entry.name, fp8, gpu=bool(entry.perf.kernels))
    if refused:
        fail(*refused)


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


STAGE_WORDS = {"forward": "forward stage", "backward": "backward stage", "optimizer": "optimizer stage"}


def render_table(result: Plan, overrides: list[str], options: Optional[list[dict]] = None):
    from rich.table import Table

    ms, per, pk = result.model_states, result.per_rank_bytes, result.peak
    unit, scale = ("GiB", GIB) if per["total"] >= GIB else ("MiB", 2**20)

    def fmt(n: float) -> str:
        return f"{n / scale:.3f}" if abs(n) < 10 * scale else f"{n / scale:.1f}"  # the same digits either sign

    title = (
        f"Memory plan per rank: {_count(result.num_params)} parameters, {result.world_size} ranks, {result.device_kind}"
    )
    table = Table(title=title, caption=" ".join(overrides) or "(the default config)")
    table.add_column("what")
    table.add_column(unit, justify="right")
    table.add_column("notes")
    table.add_row("parameters", fmt(ms["device"]["params"]), ms["described"]["params"])
    table.add_row("gradients", fmt(ms["device"]["grads"]), ms["described"]["grads"])
    table.add_row("optimizer state", fmt(ms["device"]["optimizer"]), ms["described"]["optimizer"])
    table.add_row(
        "model states", fmt(ms["device"]["total"]), "at rest, on the device", end_section=not ms["host"]["total"]
    )
    if ms["host"]["total"]:
        table.add_row("model states on host", fmt(ms["host"]["total"]), "offload=params", end_section=True)
    stage = next(ph["stage"] for ph in result.phases if ph["name"] == pk["phase"])
    # per_rank_bytes["activations"] sums three pieces that hold different things: each is its own row
    table.add_row("activations", fmt(pk["activations"]), "saved for backward, alive at the peak")
    table.add_row(
        "temporaries",
        fmt(pk["temporaries"]),
        "the optimizer step's working tensors"
        if stage == "optimizer"
        else "activations' gradients and working tensors at the peak",
    )
    if pk["inputs"]:
        table.add_row("inputs", fmt(pk["inputs"]), "token ids and targets")
    table.add_row(
        "buffers",
        fmt(per["buffers"]),
        f"at the peak: unsharded params {fmt(pk['unsharded'])}, "
        f"comm {fmt(pk['comm'])}, module {fmt(pk['module_buffers'])}",
    )
    table.add_row(
        "peak", fmt(pk["total"]), f"at {pk['phase']} ({STAGE_WORDS[stage]}); gradients alive then {fmt(pk['grads'])}"
    )
    table.add_row("allocator margin", fmt(result.margin_bytes), result.margin_rule)
    table.add_row("total", fmt(per["total"]), "peak + margin", end_section=True)
    if result.device:
        dv = result.device
        shared = f" ({dv['ranks_sharing']} ranks share it)" if dv["ranks_sharing"] > 1 else ""
        verdict = "fits" if dv["fits"] else "does NOT fit"
        table.add_row(
            dv["name"],
            fmt(dv["bytes"]),
            f"{verdict}{shared}: needs {fmt(dv['needed_bytes'])}, headroom {fmt(dv['headroom_bytes'])}",
        )
    for i, option in enumerate(options or []):
        saves = option["saves_bytes"]
        table.add_row(
            "with " + option["change"],
            f"{'-' if saves > 0 else '+' if saves else ''}{fmt(abs(saves))}",
            f"needs {fmt(option['total_bytes'])}; peak then at {option['peak_phase']}",
            end_section=i == len(options) - 1,
        )
    for note in result.assumptions:
        table.add_row("note", "", note)
    return table


def expert_parallel_lines(result: Plan, options: list[dict], ep: int) -> list[str]:
    """A mixture of experts: the per-rank need (peak + margin) at each ``parallel.ep`` the run could take, one
    line each (the option rows' plans), with where each one peaks: what EP saves or costs here."""
    priced = {int(o["change"].partition("=")[2]): o for o in options if o["change"].startswith("parallel.ep=")}
    if not priced:
        return []
    priced[ep] = {
        "total_bytes": result.per_rank_bytes["total"],
        "peak_phase": result.peak["phase"],
        "stage_peak_bytes": {stage: ph["total"] for stage, ph in result.stage_peaks.items()},
    }
    unit, scale = ("GiB", GIB) if result.per_rank_bytes["total"] >= GIB else ("MiB", 2**20)
    lines = [f"expert parallel by parallel.ep, {unit} per rank: the need (peak + margin), the stages' peaks"]
    for n in sorted(priced):
        o, stages = priced[n], priced[n]["stage_peak_bytes"]
        lines.append(
            f"  ep={n:<3} need {o['total_bytes'] / scale:7.2f} at {o['peak_phase']:<18}"
            + " ".join(f"{stage} {stages[stage] / scale:.2f}" for stage in ("forward", "backward"))
            + ("  (this plan)" if n == ep else "")
        )
    return lines


def verdict_line(result: Plan) -> Optional[str]:
    dv = result.device
    if not dv:
        return None
    word = "fits" if dv["fits"] else "does not fit"
    unit, scale = ("GiB", GIB) if dv["needed_bytes"] >= GIB else ("MiB", 2**20)
    return (
        f"{word} on {dv['name']} ({dv['description']}): needs {dv['needed_bytes'] / scale:.2f} {unit} of "
        f"{dv['bytes'] / GIB:.2f} GiB"
    )


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("devices: " + ", ".join(f"{d.name} ({d.bytes / GIB:.1f} GiB)" for d in device_table().values()))
        return 0
    from fsdp_exp.config.strict import refusal

    try:
        result, opts = plan_from_argv(argv)
    except PlanOptionError as err:
        print(f"fsdp_exp.plan: invalid planner option: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as err:  # noqa: BLE001 - bad input is refused; anything else is raised on
        refused = refusal(err)
        if refused is None:
            raise
        print(f"fsdp_exp.plan: {refused}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if opts["format"] == "json":
        print(json.dumps({**result.to_dict(), "options": opts["options"], "fit": opts["fit"]}, indent=1))
    else:
        from rich.console import Console

        from fsdp_exp.narrow import console_lines, terminal_width

        console = Console(width=terminal_width())

        def say(text: str) -> None:  # prose wrapped at the width, commands broken with continuations
            for part in console_lines(text, console.width):
                console.print(part, highlight=False, markup=False, soft_wrap=True)

        overrides = split_argv(argv)[1]
        say(opts["header"])
        # the ep variants have their own lines below the table (``expert_parallel_lines``)
        rows = [o for o in opts["options"] if not o["change"].startswith("parallel.ep=")]
        console.print(render_table(result, overrides, rows))
        line = verdict_line(result)
        if line:
            say(line)
        for line in expert_parallel_lines(result, opts["options"], opts["ep"]):
            console.print(line, highlight=False, markup=False)
        for line in fit_lines(opts["fit"], result, overrides, argv):
            say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
