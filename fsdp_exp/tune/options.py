"""The tuner's own options (``tune.*``, and the planner's ``plan.device`` / ``plan.margin`` /
``plan.expert_imbalance``), taken off the
command line before Hydra composes the run config, which therefore stays what ``python -m fsdp_exp``
would compose from the rest.

Every refusal is a ``ConfigError`` naming the option that fixes it (exit 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdp_exp.errors import closest, did_you_mean, fail

# The search space's dimensions, in the order a candidate's overrides list them (fsdp_exp.tune.space).
SPACE_DIMENSIONS = (
    "backend",
    "sharding",
    "shard_size",
    "ac",
    "precision",
    "offload",
    "prefetch",
    "micro_batch_size",
    "grad_sync",
    "pp",
    "pp_schedule",
    "cp",
    "cp_method",
    "ep",
)

OPTIONS = {
    "tune.out": "folder for tune.json, the candidates' config group, the sweep and the report "
    "(default outputs/tune/<time>)",
    "tune.top_k": "how many of the best predicted candidates that keep the recommendation's memory margin the measurement runs (default 3)",
    "tune.budget_gib": "memory per rank a candidate may need (default: the device's)",
    "tune.run": "true: measure the top candidates and the baselines now, with repeats (default false)",
    "tune.repeats": "runs per measured candidate (default 3)",
    "tune.spread": "also measure this many fitting candidates spread over the predicted ranking (default 0)",
    "tune.extra": "also measure these candidates, by id (e.g. tune.extra=[c0012,c0040]), even ones over budget",
    "tune.calibrate_from": "a measured sweep folder: fit the model's efficiency, latencies and bandwidths to it "
    "and cache them for this device; or a published table (benchmarks/published, a CSV): "
    "fit its devices' matmul and attention efficiencies",
    "tune.format": "table | json (default table)",
    "tune.show": "rows of the printed table (default 15)",
    **{f"tune.space.{d}": f"the values of '{d}' to search, e.g. tune.space.{d}=[a,b]" for d in SPACE_DIMENSIONS},
    "plan.device": "the device to plan and time for (default: this machine)",
    "plan.margin": "the allocator margin as a fraction of the peak",
    "plan.expert_imbalance": "a mixture of experts' max / mean routed copies per expert (default 1, balanced): "
    "what the busiest rank's experts receive under expert parallel; or a MoE run's folder, for the load it "
    "measured; default: what tune.calibrate_from's MoE sweep measured, where one did",
    "plan.network": "the network between nodes, a whole node's (fsdp_exp/plan/devices.py NETWORKS, e.g. "
    "ib_ndr_8x400g, roce_8x200g, efa_3200g; default: the device's)",
    "plan.device_power_w": "a board power limit in watts: the peak FLOPS scale by (limit / rated)^(1/3)",
}


@dataclass
class TuneOptions:
    out: Optional[Path] = None
    top_k: int = 3
    budget_gib: Optional[float] = None
    run: bool = False
    repeats: int = 3
    spread: int = 0
    extra: list[str] = field(default_factory=list)
    calibrate_from: Optional[Path] = None
    format: str = "table"
    show: int = 15
    space: dict[str, list[str]] = field(default_factory=dict)  # dimension -> values the user gave
    device: Optional[str] = None
    margin: Optional[float] = None
    expert_imbalance: float = 1.0  # plan.expert_imbalance, for the plans and the step-time model alike
    expert_imbalance_given: bool = False  # passed: a calibration's measured imbalance does not replace it
    network: Optional[str] = None
    power_w: Optional[float] = None

    def out_dir(self) -> Path:
        return self.out or Path("outputs/tune") / time.strftime("%Y-%m-%d_%H-%M-%S")


def _list(key: str, value: str) -> list[str]:
    """``[a,b]`` or ``a,b`` (or one value) as a list of strings."""
    text = value.strip()
    if text.startswith("[") != text.endswith("]"):
        fail(f"{key}={value!r} is not a list.", f"pass {key}=[a,b]")
    text = text.strip("[]")
    return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]


def _int(key: str, value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        fail(f"{key}={value!r} is not a whole number of at least {least}.", f"pass e.g. {key}={max(least, 3)}")
    return number


def _positive(key: str, value: str, unit: str, example: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        fail(f"{key}={value!r} is not a positive number of {unit}.", f"pass e.g. {key}={example}")
    return number


def _bool(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        fail(f"{key}={value!r} is neither true nor false.", f"pass {key}=true")
    return value.lower() == "true"


def split_argv(argv: list[str]) -> tuple[TuneOptions, list[str]]:
    """(the tuner's options, the run's overrides)."""
    opts, overrides = TuneOptions(), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not key.startswith(("tune.", "plan.")):
            overrides.append(arg)
            continue
        if key not in OPTIONS or not sep:
            hint = did_you_mean(closest(key, OPTIONS), "{}=...", after=" ")
            fail(
                f"{arg!r} is not an option of the tuner.",
                f"{hint}options: {', '.join(OPTIONS)} (python -m fsdp_exp.tune --help)",
            )
        if key.startswith("tune.space."):
            values = _list(key, value)
            if not values:
                fail(
                    f"{key}={value} leaves nothing to search: the space would be empty.",
                    f"list at least one value ({key}=[a,b]) or drop {key} to search its default values",
                )
            opts.space[key.removeprefix("tune.space.")] = values
        elif key == "tune.out":
            opts.out = Path(value)
        elif key == "tune.top_k":
            opts.top_k = _int(key, value, 1)
        elif key == "tune.repeats":
            opts.repeats = _int(key, value, 1)
        elif key == "tune.spread":
            opts.spread = _int(key, value, 0)
        elif key == "tune.show":
            opts.show = _int(key, value, 1)
        elif key == "tune.run":
            opts.run = _bool(key, value)
        elif key == "tune.extra":
            opts.extra = _list(key, value)
        elif key == "tune.calibrate_from":
            opts.calibrate_from = Path(value)
            if not (
                opts.calibrate_from.is_dir() or opts.calibrate_from.suffix == ".csv" and opts.calibrate_from.is_file()
            ):
                fail(
                    f"tune.calibrate_from={value}: no such folder or published table.",
                    "pass the folder of a measured sweep (tune.run=true writes <tune.out>/sweep), or a published "
                    "table (benchmarks/published or one of its CSV files)",
                )
        elif key == "tune.format":
            if value not in ("table", "json"):
                fail(f"tune.format={value!r} is not one of table, json.", "pass tune.format=json")
            opts.format = value
        elif key == "tune.budget_gib":
            opts.budget_gib = _positive(key, value, "GiB", "70")
        elif key == "plan.device":
            opts.device = value
        elif key == "plan.network":
            opts.network = value
        elif key == "plan.device_power_w":
            opts.power_w = _positive(key, value, "watts", "500")
        elif key == "plan.expert_imbalance":
            from fsdp_exp.plan.cli import PlanOptionError, expert_imbalance

            try:
                opts.expert_imbalance = expert_imbalance(value)
                opts.expert_imbalance_given = True
            except PlanOptionError:
                fail(
                    f"plan.expert_imbalance={value!r} is not a max/mean ratio of at least 1.",
                    "pass plan.expert_imbalance=1 (balanced), the run's moe/load_imbalance_max (e.g. 1.3), or the "
                    "folder of a completed MoE run",
                )
        elif key == "plan.margin":
            try:
                opts.margin = float(value)
            except ValueError:
                opts.margin = -1.0
            if not 0 <= opts.margin < 10:
                fail(f"plan.margin={value!r} is not a fraction.", "pass e.g. plan.margin=0.1")
    return opts, overrides
