"""Weigh every candidate of the space: preflight prunes what cannot run, the planner what does not fit, the
step-time model ranks the rest.

For each candidate: ``validate`` (the same preflight a run passes: each backend's and model family's
checks) refuses what cannot run, with its reason; the memory planner (``fsdp_exp.plan``) predicts the
peak per rank with its allocator margin, checked against ``tune.budget_gib`` or the device; the
step-time model (``fsdp_exp.tune.perf``) predicts tokens/s. No process group starts (on a CPU the probe
may, once: ``fsdp_exp.tune.probe``).

The planner reuses the model built on the meta device and its inventory across candidates (cached per
model config), so after the first candidate each costs milliseconds; ``Tuning.timing`` says how many a
second this machine weighed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from fsdp_exp.errors import ConfigError, did_you_mean, fail
from fsdp_exp.units import GIB
from fsdp_exp.tune.space import Candidate, Space, build_space, enumerate_candidates, group_nodes, leave_out_float8

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.plan.devices import Device, DevicePerf
    from fsdp_exp.tune.options import TuneOptions
    from fsdp_exp.tune.perf import StepPrediction

BORDERLINE = 0.05  # within 5% of the memory limit either way: the planner's error could decide it
# The baselines a measurement always includes: the run as given, with each of these shipped presets.
BASELINES = {"DDP": "sharding=ddp", "full shard": "sharding=full"}


def memory_verdict(need: int, limit: int, kind: str, budgeted: bool) -> str:
    """fits | borderline | refused, as the launcher's fit check judges it (``fsdp_exp.fit_check.error_band``): on a
    GPU, a need over the device within the planner's error band on the published record still starts. A CPU host's
    RAM and a ``tune.budget_gib`` (the user's own limit) are held as they are."""
    from fsdp_exp.fit_check import error_band

    if kind != "cuda" or budgeted:
        return "fits" if need <= limit else "refused"
    return error_band().verdict(need, limit)


@dataclass
class Weighed:
    candidate: Candidate
    refused: Optional[str] = None  # preflight's reason (its first line)
    refused_fix: Optional[str] = None  # the override preflight's refusal names
    peak_bytes: Optional[int] = None  # the planner's peak, before the allocator margin
    floor_bytes: Optional[int] = None  # a lower bound of the need, over the limit alone (not walked through the step)
    floor_of: Optional[str] = None  # what that bound counts
    topology: Optional[object] = None
    need_bytes: Optional[int] = None  # peak + margin: what must fit
    limit_bytes: Optional[int] = None
    fits: Optional[bool] = None
    prediction: Optional["StepPrediction"] = None
    no_prediction: Optional[str] = None
    tracks_memory: bool = True  # torch's tracker can measure this backend's peak
    rank: Optional[int] = None
    roles: list[str] = field(default_factory=list)
    measured: Optional[dict] = None

    @property
    def headroom(self) -> Optional[float]:
        """(limit - need) / limit: negative when over."""
        need = self.need_bytes if self.need_bytes is not None else self.floor_bytes
        if need is None or not self.limit_bytes:
            return None
        return (self.limit_bytes - need) / self.limit_bytes

    @property
    def borderline(self) -> bool:
        """Within 5% of the limit either way, or over it within the planner's error band (the launcher starts
        such a run with a warning: ``fsdp_exp.fit_check.ErrorBand``)."""
        if self.headroom is None:
            return False
        return abs(self.headroom) < BORDERLINE or (bool(self.fits) and self.headroom < 0)

    @property
    def ranked(self) -> bool:
        return bool(self.fits) and self.prediction is not None

    def why_not(self, limit_name: str) -> str:
        if self.refused:
            return f"refused: {self.refused}"
        if self.floor_bytes is not None:
            return f"over {limit_name}: {self.floor_of} alone need {self.floor_bytes / GIB:.3g} GiB"
        if self.fits is False:
            return f"over {limit_name} by {-self.headroom:.0%}"
        if self.no_prediction:
            return f"no time: {self.no_prediction}"
        return ""


@dataclass
class Tuning:
    overrides: list[str]  # the run's
    base: "RunConfig"
    space: Space
    device: "Device"
    perf: "DevicePerf"
    perf_note: str
    calibration: Optional[dict]
    limit_name: str
    limit_bytes: int
    candidates: list[Weighed]
    timing: dict
    baselines: dict[str, Optional[str]]  # name -> candidate id (None: not in the space / refused)
    device_key: str
    # packages this machine lacks that only running needs (fsdp_exp.packages): module -> (what, install command)
    missing_packages: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def ranked(self) -> list[Weighed]:
        return sorted((w for w in self.candidates if w.rank is not None), key=lambda w: w.rank)

    def by_id(self, cid: str) -> Weighed:
        for w in self.candidates:
            if w.candidate.id == cid:
                return w
        raise KeyError(cid)

    def counts(self) -> dict:
        return {
            "weighed": len(self.candidates),
            "refused": sum(w.refused is not None for w in self.candidates),
            "over": sum(w.fits is False for w in self.candidates),
            "fit": sum(bool(w.fits) for w in self.candidates),
            "ranked": sum(w.rank is not None for w in self.candidates),
            "borderline": sum(w.borderline for w in self.candidates),
        }

    def refusals(self, top: int = 3) -> list[tuple[str, int]]:
        return Counter(w.refused for w in self.candidates if w.refused).most_common(top)


def resolve_device(name: Optional[str], base: "RunConfig") -> tuple["Device", int]:
    """(the device to plan and time for, CUDA devices per node to validate against)."""
    from fsdp_exp.env import cuda_device_count
    from fsdp_exp.plan.devices import device_table, local_cuda_device, nearest_device, table_device

    table = device_table()
    if name is not None:
        if name not in table:
            hint = did_you_mean(nearest_device(name), "plan.device={}", after=" Or ")
            fail(f"plan.device={name!r} is not a known device.", f"{hint}pass one of {', '.join(table)}")
        device = table[name]
        if device.kind == "cuda":
            n = base.trainer.nproc_per_node
            return device, int(n) if n.isdigit() else 8
        return device, 0
    count = cuda_device_count()
    if count == 0 or base.trainer.device == "cpu":
        return table["cpu_host"], 0
    local = local_cuda_device()
    known = table_device(local.description, local.bytes)  # the table's entry for this GPU
    if known is None:
        fail(
            f"this machine's GPU ({local.description}) has no entry with peak FLOPS and bandwidths.",
            f"pass plan.device=<the closest of {', '.join(n for n, d in table.items() if d.perf)}>",
        )
    return known, count


def device_perf(device: "Device", base: "RunConfig", nproc: int) -> tuple["DevicePerf", str, str]:
    """(the device's figures, where they come from, the key its calibration is cached under)."""
    if device.perf is not None:
        return device.perf, f"{device.name}: {device.perf.source}", device.name
    from fsdp_exp.env import default_threads
    from fsdp_exp.tune.probe import block_shape, cpu_perf, probe_key

    threads = base.trainer.threads_per_rank or default_threads(nproc)
    perf, entry = cpu_perf(nproc, threads, block_shape(base))  # bf16 priced at this model's shapes
    return (
        perf,
        f"this CPU, {nproc} ranks x {threads} threads: {perf.source}; gloo: {perf.intra.source}",
        probe_key(nproc, threads),
    )


def weigh(overrides: list[str], opts: "TuneOptions", prune: bool = True) -> Tuning:
    """Weigh the space (``_weigh``). For a GPU of the table (``plan.device``), another machine than this one, a
    package that only running needs (torchao for float8) need not be installed here: its candidates are weighed,
    and the package is named (``Tuning.missing_packages``). ``prune=False`` walks every candidate that passes
    preflight through the step (the exhaustive search the pruned one is tested against)."""
    from fsdp_exp.packages import planning_elsewhere
    from fsdp_exp.plan.devices import device_table

    target = device_table().get(opts.device) if opts.device is not None else None
    if target is None or target.kind != "cuda":
        return _weigh(overrides, opts, prune)
    with planning_elsewhere() as missing:
        tuning = _weigh(overrides, opts, prune)
    tuning.missing_packages = dict(missing)
    return tuning


def _weigh(overrides: list[str], opts: "TuneOptions", prune: bool = True) -> Tuning:
    from fsdp_exp.preflight import validate
    from fsdp_exp.config.topology import resolve_nproc
    from fsdp_exp.models import fetch_model_files
    from fsdp_exp.parallel.backend import backend_for
    from fsdp_exp.plan import peak_and_need, plan
    from fsdp_exp.tune import calibrate
    from fsdp_exp.tune.compose import hydra_session

    started, cpu_started = time.perf_counter(), time.process_time()
    with hydra_session() as (compose, options):
        base = compose(overrides)
        fetch_model_files(base.model)  # a hub name's config into the local cache: the rest reads local files
        device, cuda_devices = resolve_device(opts.device, base)
        nproc = resolve_nproc(base.trainer.nproc_per_node, cuda_devices)
        world = nproc * base.trainer.nnodes
        groups = {g: options(g, overrides) for g in ("ac", "precision", "offload", "prefetch")}
        space = build_space(base, overrides, opts.space, groups, world)
        nodes = group_nodes(overrides, space, compose)
        presets = {}
        if "backend" in space.values and "sharding" in space.values:
            presets = {name: compose(overrides + [preset]).sharding for name, preset in BASELINES.items()}
    composed = time.perf_counter()
    perf, perf_note, device_key = device_perf(device, base, nproc)
    calibration = calibrate.load(device_key)
    if calibration is not None:
        perf = calibrate.apply(perf, calibration["params"])
        measured = calibration.get("expert_imbalance")
        if measured and not opts.expert_imbalance_given and getattr(base.model, "n_experts", 0):
            # Published MoE runs are force-balanced; real routing is not: the calibrating sweep's measured load
            # plans and times this search, unless plan.expert_imbalance says otherwise.
            opts.expert_imbalance = max(1.0, float(measured))
            perf_note += (
                f"; expert load max/mean {opts.expert_imbalance:.2f} as measured by the calibrating sweep "
                "(plan.expert_imbalance=<ratio> overrides it)"
            )
    perf, perf_note = _cluster(perf, perf_note, opts)
    if "precision" in space.values and "precision" not in opts.space:
        leave_out_scaled_precisions(space, nodes, perf, device.name)
        leave_out_float8(space, nodes, perf, device.name)
    probed = time.perf_counter()

    capacity = device.bytes // (nproc if device.kind == "cpu" else 1)
    limit, limit_name = capacity, device.name + (f" / {nproc} ranks" if device.kind == "cpu" else "")
    if opts.budget_gib is not None and opts.budget_gib * GIB < capacity:
        limit, limit_name = int(opts.budget_gib * GIB), f"tune.budget_gib={opts.budget_gib:g}"
    elif opts.budget_gib is not None:  # a budget cannot give a rank more memory than its device has: say so
        space.notes.append(
            f"tune.budget_gib={opts.budget_gib:g} is above what {limit_name} has "
            f"({capacity / GIB:.3g} GiB per rank): the device's memory is the limit"
        )

    budgeted = limit < capacity

    def over_limit(need: int) -> bool:
        return memory_verdict(need, limit, device.kind, budgeted) == "refused"

    weighed: list[Weighed] = []
    first_done = first_cpu = None
    for candidate in enumerate_candidates(base, space, nodes):
        w = Weighed(candidate)
        weighed.append(w)
        try:
            topology = validate(candidate.cfg, cuda_devices=cuda_devices)
        except ConfigError as err:
            w.refused = str(err).splitlines()[0]
            w.refused_fix = str(err).partition("\n  fix: ")[2] or None
            continue
        w.topology, w.limit_bytes = topology, limit
        w.tracks_memory = backend_for(candidate.cfg).tracks_memory
        # A candidate asked for by id (tune.extra) is measured against its whole plan: never cut short.
        cut = prune and candidate.id not in opts.extra
        floor = floor_need(candidate.cfg, topology, device.kind, opts.margin) if cut else 0
        if floor and over_limit(floor):  # certain without the walk
            w.floor_bytes, w.floor_of, w.fits = floor, "its parameters and optimizer state", False
            continue
        if cut:  # the same figures, the pipeline's shared; a need over the limit by the forward alone stops there
            peak, need, whole = peak_and_need(
                candidate.cfg,
                topology,
                device_kind=device.kind,
                margin=opts.margin,
                over=over_limit,
                expert_imbalance=opts.expert_imbalance,
            )
            if not whole:
                w.floor_bytes, w.floor_of, w.fits = need, "its forward's phases", False
                continue
            w.peak_bytes, w.need_bytes = peak, need
        else:
            result = plan(
                candidate.cfg,
                topology,
                device_kind=device.kind,
                margin=opts.margin,
                expert_imbalance=opts.expert_imbalance,
            )
            w.peak_bytes, w.need_bytes = result.peak["total"], result.per_rank_bytes["total"]
        w.fits = memory_verdict(w.need_bytes, limit, device.kind, budgeted) != "refused"
        if w.fits or candidate.id in opts.extra:  # what cannot run here is timed only when asked for (tune.extra)
            time_candidate(w, perf, opts.expert_imbalance)
        if first_done is None:
            first_done, first_cpu = time.perf_counter(), time.process_time()
    finished, finished_cpu = time.perf_counter(), time.process_time()
    if not weighed:
        # A fixed run whose every combination is left out before weighing (pipeline stages with a sharding they
        # do not run): preflight's own refusal of the run as given says which setting and why
        try:
            validate(base, cuda_devices=cuda_devices)
        except ConfigError as err:
            problem, _, fix = str(err).partition("\n  fix: ")
            fail(
                "the search space holds no candidate: "
                + (space.describe() or "every dimension is fixed")
                + f"; the run as given is refused: {problem}",
                fix or "widen it: drop a tune.space.<dimension>, or an override that fixes one",
            )
        fail(
            "the search space holds no candidate: " + (space.describe() or "every dimension is fixed"),
            "widen it: drop a tune.space.<dimension>, or an override that fixes one",
        )

    ranked = sorted((w for w in weighed if w.ranked), key=lambda w: (-w.prediction.tokens_per_s, w.need_bytes))
    for position, w in enumerate(ranked, start=1):
        w.rank = position
    planned = [w for w in weighed if w.need_bytes is not None]
    if not ranked:
        _nothing_ranked(weighed, limit, limit_name, budget_is_limit=limit < capacity)
    n_after = len(weighed) - 1
    rest = finished - (first_done or finished)
    rest_cpu = finished_cpu - (first_cpu or finished_cpu)  # what this process got of a busy machine
    timing = {
        "compose_s": composed - started,
        "device_s": probed - composed,
        "first_candidate_s": (first_done or finished) - probed,
        "weigh_s": finished - probed,
        "candidates_per_s_after_first": n_after / rest if rest > 0 else None,
        # walked through the planner (refusals and parameter floors cost less): a conservative rate
        "planned_per_s_after_first": (len(planned) - 1) / rest if rest > 0 else None,
        "candidates_per_cpu_s_after_first": n_after / rest_cpu if rest_cpu > 0 else None,
        "planned_per_cpu_s_after_first": (len(planned) - 1) / rest_cpu if rest_cpu > 0 else None,
        "total_s": finished - started,
        "cpu_s": time.process_time() - cpu_started,
    }
    best_layout = ranked[0].candidate.cfg.parallel  # the parallel layout of the best-predicted candidate
    baselines = {name: _baseline(weighed, base, node, space, best_layout) for name, node in presets.items()}
    return Tuning(
        overrides=overrides,
        base=base,
        space=space,
        device=device,
        perf=perf,
        perf_note=perf_note,
        calibration=calibration,
        limit_name=limit_name,
        limit_bytes=limit,
        candidates=weighed,
        timing=timing,
        baselines=baselines,
        device_key=device_key,
    )


def _cluster(perf: "DevicePerf", note: str, opts: "TuneOptions") -> tuple["DevicePerf", str]:
    """The device's figures on the cluster the options describe: its network between nodes (``plan.network``)
    and a power limit (``plan.device_power_w``)."""
    from fsdp_exp.plan.devices import with_network, with_power

    if opts.network:
        perf = with_network(perf, opts.network)
        note += f"; between nodes: {perf.inter.source}"
    if opts.power_w:
        if not perf.tdp_w:
            fail(
                f"plan.device_power_w={opts.power_w:g}: this device has no rated power to scale from.",
                "drop plan.device_power_w, or pass a plan.device=<a GPU of the table>",
            )
        perf = with_power(perf, opts.power_w)
        note += f"; power-limited to {opts.power_w:g} W"
    return perf, note


def _nothing_ranked(weighed: list[Weighed], limit: int, limit_name: str, budget_is_limit: bool = True) -> None:
    """Refuse a search that ranks nothing, saying why: nothing fits, nothing can run, or nothing can be timed.
    Raising tune.budget_gib is offered only where the budget, not the device, is the limit."""
    from fsdp_exp.tune.space import label

    sized = [w for w in weighed if w.need_bytes is not None or w.floor_bytes is not None]
    if sized and not any(w.fits for w in sized):
        least = min(sized, key=lambda w: w.need_bytes if w.need_bytes is not None else w.floor_bytes)
        need = least.need_bytes if least.need_bytes is not None else least.floor_bytes
        smallest = "the only candidate" if len(sized) == 1 else "the smallest"
        room = (
            f"raise tune.budget_gib to at least {need / GIB:.3g}"
            if budget_is_limit
            else f"a device with at least {need / GIB:.3g} GiB per rank (plan.device=...)"
        )
        fail(
            f"no candidate fits {limit_name} ({limit / GIB:.3g} GiB per rank): {smallest}, "
            f"{label(least.candidate.choices)}, needs {need / GIB:.3g} GiB.",
            f"{room}, or add ranks (trainer.nnodes / trainer.nproc_per_node), or a smaller trainer.global_batch_size",
        )
    untimed = [w for w in weighed if w.no_prediction]
    if untimed:  # a reason that names its own fix (float8 on a GPU without FP8 tensor cores) gives that one
        reason, _, fix = untimed[0].no_prediction.partition("; pass ")
        fail(
            f"no candidate that fits can be timed: {reason}",
            f"pass {fix}" if fix else "pass a tune.space.precision the device has a peak for, or another plan.device",
        )
    reasons = Counter(w.refused for w in weighed if w.refused).most_common(1)
    if reasons[0][1] == len(weighed) and weighed[0].refused_fix:
        # One reason for every candidate: no dimension of the search changes it (a model the run cannot
        # build, say), so the fix is preflight's own, not a wider space.
        fail(
            f"every one of the {len(weighed)} candidates is refused by preflight for one reason, which no "
            f"dimension of the search changes: {reasons[0][0]}",
            weighed[0].refused_fix,
        )
    fail(
        f"every one of the {len(weighed)} candidates is refused by preflight, most often: {reasons[0][0]}",
        "fix the run's overrides so that the run itself passes (python -m fsdp_exp.plan <overrides>), "
        "or widen the space (tune.space.<dimension>)",
    )


def leave_out_scaled_precisions(space: Space, nodes: dict, perf: "DevicePerf", device: str) -> None:
    """Leave out of the default space the precisions that need a loss scaler (fp16) where bf16 computes as fast:
    they cannot be faster and add the scaler's work and its risk of skipped steps."""
    bf16 = perf.peak_tflops.get("bf16") or 0
    dropped = [
        o
        for o in space.values["precision"]
        if nodes[("precision", o)].loss_scaler != "none"
        and bf16 >= (perf.peak_tflops.get(nodes[("precision", o)].param_dtype) or 0)
    ]
    if dropped and len(dropped) < len(space.values["precision"]):
        space.values["precision"] = [o for o in space.values["precision"] if o not in dropped]
        space.notes.append(
            f"precision={','.join(dropped)} left out: {device} computes bf16 as fast, without a loss "
            f"scaler (tune.space.precision=[...,{dropped[0]}] searches it anyway)"
        )


def floor_need(cfg: "RunConfig", topology, kind: str, margin: Optional[float]) -> int:
    """A lower bound of what a candidate must fit (peak + allocator margin) without walking the step: the planner's
    own floor (``fsdp_exp.plan.peak_floor``: the parameters and optimizer state every phase holds) with the margin
    it would add. Read from the planner's model states, it covers every dimension the states depend on (the
    layout, the shard group, offload, stages) without naming one: a candidate whose floor is over the limit is
    over, and its walk through the step (most of a search's time) is skipped."""
    from fsdp_exp.plan import allocator_margin, peak_floor

    floor = peak_floor(cfg, topology, device_kind=kind)
    return floor + allocator_margin(kind, floor, margin)[0]


def time_candidate(w: Weighed, perf: "DevicePerf", expert_imbalance: float = 1.0) -> None:
    """Predict ``w``'s step time (once); ``expert_imbalance``: ``plan.expert_imbalance``, as its plan had it."""
    from fsdp_exp.tune.step_time import predict

    if w.prediction is not None or w.no_prediction is not None or w.topology is None:
        return
    try:
        w.prediction = predict(w.candidate.cfg, w.topology, perf, expert_imbalance)
    except ValueError as err:
        w.no_prediction = str(err)


def _baseline(weighed: list[Weighed], base: "RunConfig", sharding, space: Space, best_layout=None) -> Optional[str]:
    """The candidate that is the run as given with a preset's sharding; if that one cannot run or fit, the best
    ranked candidate with that sharding and the run's parallel layout; if none fits with it (a long sequence that
    only fits split over context-parallel ranks), the best ranked with that sharding in ``best_layout``, the
    parallel layout of the search's best-predicted candidate. None: no candidate has it."""
    sharded = [w for w in weighed if w.candidate.cfg.sharding == sharding]
    same = [w for w in sharded if w.candidate.cfg.parallel == base.parallel]
    exact = [
        w
        for w in same
        if all(getattr(w.candidate.cfg, g) == getattr(base, g) for g in ("ac", "precision", "offload", "prefetch"))
        and w.candidate.cfg.trainer.micro_batch_size
        in (base.trainer.micro_batch_size, base.trainer.global_batch_size // space.dp)
    ]
    for w in exact:
        if w.rank is not None:
            return w.candidate.id
    best = [w for w in same if w.rank is not None] or [
        w for w in sharded if w.rank is not None and w.candidate.cfg.parallel == best_layout
    ]
    return min(best, key=lambda w: w.rank).candidate.id if best else None
