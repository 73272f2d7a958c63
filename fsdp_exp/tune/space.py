"""The search space: the system knobs a configuration can change without changing what is trained.

The dimensions (``tune.space.<name>=[...]`` narrows or widens each):

- ``backend``: every registered backend (``fsdp_exp.parallel.backend.BACKEND_MODULES``); fixed by
  ``sharding=..`` or ``sharding.backend=..``;
- ``sharding``: every strategy of those backends, each backend paired only with its own ``strategies``;
  fixed by ``sharding=..`` or ``sharding.strategy=..``;
- ``shard_size``: hybrid's shard group, every divisor of the data-parallel ranks but 1 and all of them;
  fixed by ``sharding.shard_size`` / ``sharding.replicate_size``;
- ``ac``, ``precision``, ``offload``, ``prefetch``: every option of the config group (yours in Hydra's
  search path too); fixed by ``<group>=..`` or ``<group>.<key>=..``. Precisions that need a loss scaler
  (fp16) are left out by default where the device computes bf16 as fast (``search``), and float8 ones where
  it has no FP8 tensor cores (``leave_out_float8``);
- ``micro_batch_size``: the divisors of each rank's batch that are powers of two, and the batch itself;
  fixed by ``trainer.micro_batch_size=..``;
- ``grad_sync``: when accumulated micro-batches reduce their gradients, every_micro_batch and
  last_micro_batch (memory against collectives), only for candidates that accumulate (one micro-batch
  per step: the first value alone); fixed by ``trainer.grad_sync=..``. A backend that cannot honour a
  value (DeepSpeed's engine has its own rule) refuses it in preflight;
- ``pp``: pipeline stages (``parallel.pp``), every divisor of the data-parallel ranks up to the model's
  blocks, 1 (no pipeline) first; fixed by ``parallel.pp=..``. Under pp > 1 ``micro_batch_size`` is the
  pipeline's micro-batch, so its values are the schedule's micro-batch counts (``global / dp / micro``), and
  ``grad_sync`` is neither searched nor named in its candidates (the stages reduce at the last micro-batch), nor
  ``prefetch`` beyond its default (stages gather each unit once a step);
- ``pp_schedule``: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (with ``parallel.pp_stages_per_rank=2``), only for
  pp > 1; fixed by ``parallel.pp_schedule=..`` or ``parallel.pp_stages_per_rank=..``. A sharding the stages do
  not run (``parallel.pipeline.check_sharding``: FSDP2 full and DDP are searched; HSDP stages run but are not
  searched, the shard sizes here splitting the run's dp ranks, not a stage's) gets no pp > 1 candidates; every ``ac``
  option runs inside stages and is searched with them; what else stages cannot compose with (compile, too
  few micro-batches) preflight refuses, as for every dimension;
- ``cp``: context parallel (``parallel.cp``), 1 and every divisor of the data-parallel ranks, searched only
  when the sequence is long (``trainer.seq_len`` >= ``CP_FROM_SEQ_LEN``: below it activations rarely decide
  the layout); fixed by ``parallel.cp=..``. Whether a model's heads divide is preflight's to say;
- ``cp_method``: ``all_to_all`` and ``ring``, only for cp > 1; fixed by ``parallel.cp_method=..``;
- ``ep``: expert parallel (``parallel.ep``), only for a mixture of experts whose family splits its experts
  (``ModelSpec.expert_modules``): 1 and every divisor of the data-parallel ranks the family accepts (it divides
  the experts); each sharding gets the values that divide its shard ranks and that expert parallel composes with
  (``parallel.expert.check``, asked once per sharding: the refusals hold for every value of the dimensions below
  it, so those candidates are left out, not weighed one by one, and said in a note); not with cp > 1 (refused
  by the same check). A dense model's space does not grow. Fixed by ``parallel.ep=..``.

A dimension the run's overrides already set is the user's choice and is not searched. The model, the
global batch and the sequence length are training choices: they stay as given. A backend or a model
family registered later joins the space by itself: the backends come from the registry with their
strategies, and whether a combination can run is asked of preflight (``validate``: each backend's
``check``), never decided here.

Deriving a candidate's config is cheap: the run's config is composed by Hydra once, each config group's
options once (a few compositions in all), and every candidate is the base with its groups swapped in
(``dataclasses.replace``), which is what Hydra composes from the same overrides (tested).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

from fsdp_exp.config.layout import data_parallel_ranks, divisors as _divisors, ep_values
from fsdp_exp.config.schema import CP_METHODS as CP_METHOD_VALUES, STRATEGIES
from fsdp_exp.errors import closest, did_you_mean, fail
from fsdp_exp.tune.options import SPACE_DIMENSIONS

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.plan.devices import DevicePerf

GROUPS = ("ac", "precision", "offload", "prefetch")
HYBRID = "hybrid"  # the strategy whose mesh takes a shard group size (the config's vocabulary)
# The override keys that fix each dimension (a group override, or a key inside it).
FIXED_BY = {
    "backend": ("sharding", "sharding.backend"),
    "sharding": ("sharding", "sharding.strategy"),
    "shard_size": ("sharding.shard_size", "sharding.replicate_size"),
    "ac": ("ac",),
    "precision": ("precision",),
    "offload": ("offload",),
    "prefetch": ("prefetch",),
    "micro_batch_size": ("trainer.micro_batch_size",),
    "grad_sync": ("trainer.grad_sync",),
    "pp": ("parallel.pp",),
    "pp_schedule": ("parallel.pp_schedule", "parallel.pp_stages_per_rank"),
    "cp": ("parallel.cp",),
    "cp_method": ("parallel.cp_method",),
    "ep": ("parallel.ep",),
}
CP_FROM_SEQ_LEN = 16384  # context parallel is searched from this sequence length on
CP_METHODS = [m for m in CP_METHOD_VALUES if m != "auto"]  # the methods searched (auto picks one of them)
GRAD_SYNC_VALUES = ["every_micro_batch", "last_micro_batch"]
# pp_schedule's values -> (parallel.pp_schedule, parallel.pp_stages_per_rank)
PP_SCHEDULES = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "interleaved_1f1b": ("interleaved_1f1b", 2)}


@dataclass
class Space:
    values: dict[str, list[str]]  # searched dimension -> its values
    fixed: dict[str, str] = field(default_factory=dict)  # dimension -> the user's override that fixes it
    notes: list[str] = field(default_factory=list)
    dp: int = 1

    def describe(self) -> str:
        parts = [f"{d}: {', '.join(v) or '(none)'}" for d, v in self.values.items()]
        parts += [f"{d}: fixed by {o}" for d, o in self.fixed.items()]
        return "; ".join(parts)


@dataclass
class Candidate:
    id: str
    choices: list[str]  # the tuner's overrides (on top of the run's)
    cfg: "RunConfig"


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def fixed_dimensions(overrides: list[str]) -> dict[str, str]:
    """Dimension -> the run override that sets it."""
    fixed = {}
    for override in overrides:
        key = _key(override)
        for dim, keys in FIXED_BY.items():
            if dim not in fixed and any(key == k or (k in GROUPS and key.startswith(k + ".")) for k in keys):
                fixed[dim] = override
    return fixed


def pipeline_sizes(base: "RunConfig", dp: int) -> list[str]:
    """``parallel.pp`` values: 1 and every divisor of the data-parallel ranks with at most as many stages as the
    model has blocks. The family checks its config first (as preflight does), so that a model it refuses is
    refused by its own message rather than by an error of building it for the inventory."""
    from fsdp_exp.models import spec_for

    from fsdp_exp.errors import ConfigError

    spec = spec_for(base.model)
    spec.check(base.model)
    try:  # a model the family cannot cut into stages (a mixture of experts today): no stage count runs
        spec.check_pipeline(base.model)
    except ConfigError:
        return ["1"]
    blocks = len(spec.inventory(base.model).blocks)
    return [str(d) for d in _divisors(dp) if d <= blocks]


def context_sizes(base: "RunConfig", dp: int) -> list[str]:
    """``parallel.cp`` values: 1, and every divisor of the data-parallel ranks when the sequence is long."""
    if base.trainer.seq_len < CP_FROM_SEQ_LEN:
        return ["1"]
    return [str(d) for d in _divisors(dp)]


def expert_sizes(base: "RunConfig", dp: int) -> list[str]:
    """``parallel.ep`` values: 1, and for a mixture of experts whose family splits its experts over ranks every
    divisor of the data-parallel ranks that the family accepts (``check_expert_parallel``: it divides the experts)."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.models import spec_for

    spec = spec_for(base.model)
    if not spec.expert_modules(spec.meta_model(base.model)):
        return ["1"]
    sizes = ["1"]
    for d in ep_values(dp)[1:]:
        try:
            spec.check_expert_parallel(base.model, d)
        except ConfigError:
            continue
        sizes.append(str(d))
    return sizes


def expert_sizes_for(cfg: "RunConfig", values: list[str], shard_ranks: int, notes: list[str]) -> list[str]:
    """Of the space's ep ``values``, those this sharding runs: ep > 1 must divide its shard ranks and compose with
    it (``parallel.expert.check``, asked once, with the smallest: its refusals of a backend or a strategy hold for
    every ep and every value of the dimensions below the sharding). One note says which shardings were left out."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.parallel import expert

    split = [v for v in values if int(v) > 1 and shard_ranks % int(v) == 0]
    if split:
        try:
            expert.check(cfg, int(split[0]))
        except ConfigError:
            _note_expert_refusal(notes, f"{cfg.sharding.backend} {cfg.sharding.strategy}")
            split = []
    return [v for v in values if int(v) == 1] + split


EP_NOTE = "parallel.ep>1 left out with "


def _note_expert_refusal(notes: list[str], sharding: str) -> None:
    """One note for every sharding expert parallel does not run with (its reasons: parallel.expert.check)."""
    for i, note in enumerate(notes):
        if note.startswith(EP_NOTE):
            shardings = note[len(EP_NOTE) :].partition(":")[0].split(", ")
            if sharding not in shardings:
                notes[i] = note.replace(": ", f", {sharding}: ", 1)
            return
    notes.append(f"{EP_NOTE}{sharding}: expert parallel runs on FSDP2's shard dim (docs/moe.md)")


def micro_batches(per_rank: int) -> list[str]:
    return [str(d) for d in _divisors(per_rank) if d & (d - 1) == 0 or d == per_rank]


def _check_values(dim: str, values: list[str], allowed: list[str]) -> None:
    for value in values:
        if value not in allowed:
            hint = did_you_mean(closest(value, allowed), after=" ")
            fail(
                f"tune.space.{dim} lists {value!r}, which is not one of {', '.join(allowed)}.",
                f"{hint}pass tune.space.{dim}=[{','.join(allowed[:3])}]",
            )


def _positive(dim: str, values: list[str]) -> None:
    for value in values:
        if not value.isdigit() or int(value) < 1:
            fail(
                f"tune.space.{dim} lists {value!r}, not a positive whole number.", f"pass e.g. tune.space.{dim}=[1,2,4]"
            )


def build_space(
    base: "RunConfig",
    overrides: list[str],
    requested: dict[str, list[str]],
    group_options: dict[str, list[str]],
    world: int,
) -> Space:
    """The space for this run: ``requested`` (``tune.space.*``) where given, else the defaults of the table above,
    less the dimensions ``overrides`` fix."""
    from fsdp_exp.parallel.backend import backend_names, get_backend

    fixed = fixed_dimensions(overrides)
    for dim in requested:
        if dim in fixed:
            fail(
                f"tune.space.{dim} searches what {fixed[dim]} fixes.",
                f"drop {fixed[dim]} to search it, or drop tune.space.{dim} to keep it",
            )
    dp = data_parallel_ranks(world, tp=base.parallel.tp)  # the space's pp, cp and ep divide these
    values: dict[str, list[str]] = {}
    notes: list[str] = []
    names = backend_names()
    values["backend"] = requested.get("backend", names)
    _check_values("backend", values["backend"], names)
    backends = values["backend"] if "backend" not in fixed else [base.sharding.backend]
    strategies = [s for s in STRATEGIES if any(s in get_backend(b).strategies for b in backends)]
    values["sharding"] = requested.get("sharding", strategies)
    _check_values("sharding", values["sharding"], list(STRATEGIES))
    sizes = [str(d) for d in _divisors(dp) if 1 < d < dp]
    values["shard_size"] = requested.get("shard_size", sizes)
    _positive("shard_size", values["shard_size"])
    for group in GROUPS:
        values[group] = requested.get(group, group_options[group])
        _check_values(group, values[group], group_options[group])
    per_rank = base.trainer.global_batch_size // dp if base.trainer.global_batch_size % dp == 0 else 0
    values["micro_batch_size"] = requested.get("micro_batch_size", micro_batches(per_rank) if per_rank else ["1"])
    _positive("micro_batch_size", values["micro_batch_size"])
    values["grad_sync"] = requested.get("grad_sync", GRAD_SYNC_VALUES)
    _check_values("grad_sync", values["grad_sync"], GRAD_SYNC_VALUES)
    values["pp"] = requested.get("pp", pipeline_sizes(base, dp))
    _positive("pp", values["pp"])
    values["pp_schedule"] = requested.get("pp_schedule", list(PP_SCHEDULES))
    _check_values("pp_schedule", values["pp_schedule"], list(PP_SCHEDULES))
    values["cp"] = requested.get("cp", context_sizes(base, dp))
    _positive("cp", values["cp"])
    values["cp_method"] = requested.get("cp_method", list(CP_METHODS))
    _check_values("cp_method", values["cp_method"], list(CP_METHODS))
    values["ep"] = requested.get("ep", expert_sizes(base, dp) if "ep" not in fixed else ["1"])
    _positive("ep", values["ep"])
    searched_strategies = values["sharding"] if "sharding" not in fixed else [base.sharding.strategy]
    if HYBRID in searched_strategies and "shard_size" not in fixed and not values["shard_size"]:
        notes.append(
            f"sharding={HYBRID}: no shard group size divides {dp} data-parallel ranks into more than one "
            "group of more than one rank"
        )
    for dim in fixed:
        values.pop(dim, None)
    if HYBRID not in searched_strategies:
        values.pop("shard_size", None)
    if values.get("pp", [str(base.parallel.pp)]) == ["1"] and base.parallel.pp == 1:
        values.pop("pp_schedule", None)  # no pipeline anywhere in the space: no schedule to choose
    if values.get("cp", [str(base.parallel.cp)]) == ["1"] and base.parallel.cp == 1:
        values.pop("cp", None)
        values.pop("cp_method", None)  # no context parallel anywhere in the space
    if values.get("ep") == ["1"] and base.parallel.ep == 1:
        values.pop("ep", None)  # a dense model (or one whose experts do not split): nothing to search
    return Space(values={d: values[d] for d in SPACE_DIMENSIONS if d in values}, fixed=fixed, notes=notes, dp=dp)


def leave_out_float8(space: Space, nodes: dict, perf: "DevicePerf", device: str) -> None:
    """Leave the float8 precisions (``precision.float8_recipe`` set) out of the default space where the device has no
    FP8 tensor cores (no fp8 peak: an A100, a CPU): their matmuls run no faster there (on an A100 only emulated), so
    they would add casts for nothing. Where it has them (Ada, Hopper, Blackwell) they are searched."""
    if perf.peak_tflops.get("fp8"):
        return
    dropped = [o for o in space.values["precision"] if nodes[("precision", o)].float8_recipe is not None]
    if dropped and len(dropped) < len(space.values["precision"]):
        space.values["precision"] = [o for o in space.values["precision"] if o not in dropped]
        space.notes.append(
            f"precision={','.join(dropped)} left out: {device} has no FP8 tensor cores, so float8 "
            f"matmuls are no faster (tune.space.precision=[...,{dropped[0]}] searches it anyway)"
        )


# ------------------------------------------------------------------------------------------ the candidates
def group_nodes(overrides: list[str], space: Space, compose) -> dict[tuple[str, str], object]:
    """Each searched group option's config node, composed with the run's overrides: one composition per
    round, every group taking its i-th option in round i."""
    groups = [g for g in GROUPS if g in space.values]
    nodes: dict[tuple[str, str], object] = {}
    rounds = max((len(space.values[g]) for g in groups), default=0)
    for i in range(rounds):
        picks = {g: space.values[g][i] for g in groups if i < len(space.values[g])}
        cfg = compose(overrides + [f"{g}={o}" for g, o in picks.items()])
        for g, option in picks.items():
            nodes[(g, option)] = getattr(cfg, g)
    return nodes


def enumerate_candidates(base: "RunConfig", space: Space, nodes: dict) -> Iterator[Candidate]:
    """Every combination of the space's values, in a stable order (ids ``c0000``... follow it)."""
    from fsdp_exp.parallel.backend import get_backend

    v = space.values
    index = 0
    for name in v.get("backend", [None]):
        runnable = get_backend(name if name else base.sharding.backend).strategies
        for strategy in v.get("sharding", [None]):
            if strategy is not None and strategy not in runnable:
                continue  # the backend cannot run this strategy at all
            chosen = strategy if strategy is not None else base.sharding.strategy
            shard_sizes = v.get("shard_size", [None]) if chosen == HYBRID else [None]
            for size in shard_sizes:
                sharding, sharding_choices = base.sharding, []
                if name is not None:
                    sharding = dataclasses.replace(sharding, backend=name)
                    sharding_choices.append(f"sharding.backend={name}")
                if strategy is not None:
                    sharding = dataclasses.replace(sharding, strategy=strategy)
                    sharding_choices.append(f"sharding.strategy={strategy}")
                if size is not None:
                    shard, replicate = int(size), space.dp // int(size)
                    sharding = dataclasses.replace(sharding, shard_size=shard, replicate_size=replicate)
                    sharding_choices += [f"sharding.shard_size={shard}", f"sharding.replicate_size={replicate}"]
                stages_compose = _stages_compose(dataclasses.replace(base, sharding=sharding))
                dims = [(g, v[g]) for g in GROUPS if g in v]
                for dim in ("micro_batch_size", "grad_sync", "pp", "pp_schedule", "cp", "cp_method"):
                    if dim in v:
                        dims.append((dim, v[dim]))
                if "ep" in v:
                    shard_ranks = int(size) if size is not None else space.dp
                    with_sharding = dataclasses.replace(base, sharding=sharding)
                    dims.append(("ep", expert_sizes_for(with_sharding, v["ep"], shard_ranks, space.notes)))
                for rest in _product(dims):
                    if _idle_duplicate(dict(rest), base, v, space.dp, stages_compose):
                        continue
                    if _idle_in_stages(dict(rest), base, v, nodes):
                        continue
                    changes: dict = {"sharding": sharding}
                    choices = list(sharding_choices)
                    for dim, option in rest:
                        if dim in ("micro_batch_size", "grad_sync"):
                            value = int(option) if dim == "micro_batch_size" else option
                            changes["trainer"] = dataclasses.replace(
                                changes.get("trainer", base.trainer), **{dim: value}
                            )
                            choices.append(f"trainer.{dim}={option}")
                        elif dim in ("pp", "pp_schedule"):
                            parallel, added = _pipeline_change(changes.get("parallel", base.parallel), dim, option)
                            changes["parallel"] = parallel
                            choices += added
                        elif dim in ("cp", "cp_method", "ep"):
                            value = option if dim == "cp_method" else int(option)
                            parallel = changes.get("parallel", base.parallel)
                            changes["parallel"] = dataclasses.replace(parallel, **{dim: value})
                            choices.append(f"parallel.{dim}={option}")
                        else:
                            changes[dim] = nodes[(dim, option)]
                            choices.append(f"{dim}={option}")
                    pipelined = changes.get("parallel", base.parallel).pp > 1
                    if not pipelined and "parallel" in changes:  # no stages: the run's own pipeline keys
                        parallel = changes["parallel"]
                        changes["parallel"] = dataclasses.replace(
                            base.parallel, cp=parallel.cp, cp_method=parallel.cp_method, ep=parallel.ep
                        )
                    if pipelined and "trainer" in changes:  # stages reduce at the last micro-batch: no label
                        changes["trainer"] = dataclasses.replace(changes["trainer"], grad_sync=base.trainer.grad_sync)
                        choices = [c for c in choices if not c.startswith("trainer.grad_sync=")]
                    split = changes.get("parallel", base.parallel).cp > 1
                    if "ep" in v and changes.get("parallel", base.parallel).ep == 1:
                        choices = [c for c in choices if c != "parallel.ep=1"]  # no experts split: nothing to name
                    yield Candidate(
                        f"c{index:04d}",
                        _without_idle_context(_without_idle_schedule(choices, pipelined), split),
                        dataclasses.replace(base, **changes),
                    )
                    index += 1


def _idle_duplicate(options: dict, base: "RunConfig", v: dict, dp: int, stages_compose: bool) -> bool:
    """Whether a combination is not weighed, read from its options before any config is built (tune's space
    multiplies every dimension, so most pipeline and grad_sync combinations are skipped here): stages with a
    sharding they do not run (``parallel.pipeline.check_sharding``); a grad_sync other than the first where it
    changes nothing (one micro-batch per step, or stages); a schedule other than the first without stages."""
    pp = int(options["pp"]) if "pp" in options else base.parallel.pp
    pipelined = pp > 1
    if pipelined and not stages_compose:
        return True
    if "grad_sync" in options and options["grad_sync"] != v["grad_sync"][0]:
        micro = int(options["micro_batch_size"]) if "micro_batch_size" in options else base.trainer.micro_batch_size
        if pipelined or not _accumulates(base.trainer.global_batch_size, micro, dp):
            return True
    if "pp_schedule" in options and not pipelined:
        schedule = options["pp_schedule"]
        if schedule != v["pp_schedule"][0]:
            return True
    cp = int(options["cp"]) if "cp" in options else base.parallel.cp
    if "cp_method" in options and cp == 1 and options["cp_method"] != v["cp_method"][0]:
        return True  # no sequence split: the method changes nothing
    return False


def _idle_in_stages(options: dict, base: "RunConfig", v: dict, nodes: dict) -> bool:
    """A pp > 1 combination whose prefetch option is not the default, where the space holds the default: stages
    gather each unit once a step, so every prefetch option would be the same candidate (preflight refuses the
    others under pp, ``parallel.pipeline.check_stage_settings``)."""
    from fsdp_exp.config.schema import PrefetchConfig

    pp = int(options["pp"]) if "pp" in options else base.parallel.pp
    if pp == 1 or "prefetch" not in options:
        return False
    default = [o for o in v["prefetch"] if nodes[("prefetch", o)] == PrefetchConfig()]
    return bool(default) and options["prefetch"] != default[0]


def _stages_compose(cfg: "RunConfig") -> bool:
    """Whether pipeline stages run this sharding (the engine's own rule, ``parallel.pipeline.check_sharding``):
    the others are left out of the pp > 1 candidates rather than each weighed and refused."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.parallel.pipeline import check_sharding

    try:
        check_sharding(cfg)
    except ConfigError:
        return False
    # HSDP inside stages runs, but the space's shard sizes split the run's dp ranks, not a stage's: left out
    return cfg.sharding.strategy != HYBRID


def _pipeline_change(parallel, dim: str, option: str) -> tuple[object, list[str]]:
    """(the parallel config with ``dim`` (pp or pp_schedule) set, the overrides that set it)."""
    if dim == "pp":
        return dataclasses.replace(parallel, pp=int(option)), [f"parallel.pp={option}"]
    schedule, per_rank = PP_SCHEDULES[option]
    return (
        dataclasses.replace(parallel, pp_schedule=schedule, pp_stages_per_rank=per_rank),
        [f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={per_rank}"],
    )


def _without_idle_schedule(choices: list[str], pipelined: bool) -> list[str]:
    """A candidate without stages names neither pp=1 (the default) nor a schedule: its overrides stay what the run
    would be without the pipeline dimensions."""
    if pipelined:
        return choices
    idle = ("parallel.pp=", "parallel.pp_schedule=", "parallel.pp_stages_per_rank=")
    return [c for c in choices if not c.startswith(idle)]


def _without_idle_context(choices: list[str], split: bool) -> list[str]:
    """A candidate without context parallel names neither cp=1 nor a method."""
    if split:
        return choices
    return [c for c in choices if not c.startswith(("parallel.cp=", "parallel.cp_method="))]


def idle_choice(key: str, cfg: "RunConfig", dp: int) -> bool:
    """Whether the override ``key`` changes nothing in this candidate: the gradients' sync without micro-batches
    to accumulate (a label or a command can leave it out)."""
    if key == "trainer.grad_sync":
        return not _accumulates(cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, dp)
    return False


def _accumulates(global_batch_size: int, micro_batch_size: int, dp: int) -> bool:
    """More than one micro-batch per optimizer step on each rank."""
    return bool(micro_batch_size) and micro_batch_size < global_batch_size // dp


def _product(dims: list[tuple[str, list[str]]]) -> Iterator[list[tuple[str, str]]]:
    if not dims:
        yield []
        return
    (dim, options), rest = dims[0], dims[1:]
    for option in options:
        for tail in _product(rest):
            yield [(dim, option), *tail]


def size(space: Space) -> int:
    """An upper bound on the candidates: the product of the dimensions' sizes."""
    total = 1
    for values in space.values.values():
        total *= max(1, len(values))
    return total


def baseline_choices(space: Space) -> dict[str, Optional[list[str]]]:
    """The baselines every measurement includes: DDP and full sharding (the shipped presets), with everything
    else as the run's config has it."""
    return {"ddp": ["sharding=ddp"], "full shard": ["sharding=full"]}


def label(choices: list[str]) -> str:
    """A candidate's choices, short: ``fsdp2 hybrid 4x2 · ac=full · precision=bf16 · mb=2``."""
    sharding, rest = [], []
    values = {c.partition("=")[0]: c.partition("=")[2] for c in choices}
    for key in ("sharding.backend", "sharding.strategy"):
        if key in values:
            sharding.append(values[key])
    if "sharding.shard_size" in values:
        sharding.append(f"{values['sharding.replicate_size']}x{values['sharding.shard_size']}")
    for choice in choices:
        key, _, value = choice.partition("=")
        if key.startswith("sharding."):
            continue
        if key == "parallel.pp_stages_per_rank":
            continue  # said by the schedule (interleaved: 2)
        if key == "parallel.pp":
            rest.append(f"pp={value}")
        elif key == "parallel.cp":
            rest.append(f"cp={value}")
        elif key == "parallel.cp_method":
            rest.append(value)
        elif key == "parallel.ep":
            rest.append(f"ep={value}")
        elif key == "parallel.pp_schedule":
            rest.append(value)
        elif key == "trainer.micro_batch_size":
            rest.append(f"mb={value}")
        elif key == "trainer.grad_sync":  # every_micro_batch / last_micro_batch: the first word says it
            rest.append(f"grad_sync={value.partition('_')[0]}")
        else:
            rest.append(choice.removeprefix("trainer."))
    return " · ".join(([" ".join(sharding)] if sharding else []) + rest) or "(the run as given)"
