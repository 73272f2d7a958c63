"""The answer at the end of ``python -m fsdp_exp.tune``: one configuration to run, as one command, and why.

The ranking alone leaves the user to read it; the recommendation reads it for them, by rules a user can check:

- the choice is the best-predicted candidate that leaves ``KEEP_FREE`` of the device's memory free (docs/choosing.md's
  decision rule; a candidate within ``search.BORDERLINE`` of the limit, where the planner's error could decide
  whether it fits, never does); faster ones that leave less are named, to measure;
  unless a baseline (DDP, the full shard) ties with it: the model cannot order the two, and a baseline has the
  fewest moving parts (``prefer_baseline``; on this CPU the default tiny Llama's best-predicted, DeepSpeed ZeRO-2,
  ran 18% slower than the DDP it tied with: 38,446 against 45,493 tokens/s);
- the candidates predicted within ``TIE`` of it are ties: the step-time model cannot order them, a measurement
  can, and the command that measures them is given (``tune.run=true tune.extra=[...]``);
- the runner-up is the best candidate outside the ties: what it gives up is the gap the model can tell;
- what the search left out (preflight's most frequent refusals, the space's notes, packages this machine lacks
  but the target does not need them to be planned) is said, so that an empty corner of the space is explained.

A candidate's command names only what differs from the run as given (``differences``), so it reads as a choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from fsdp_exp.parallel.context import resolve_method
from fsdp_exp.tune.search import BASELINES
from fsdp_exp.units import GIB

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.tune.search import Tuning, Weighed

TIE = 0.02  # predicted within 2% of each other: inside the step-time model's error, so not ordered by it
# The memory a recommendation leaves free, a share of the limit: activation spikes, fragmentation and a longer
# sequence later all need room. docs/choosing.md's decision rule (step 5) quotes it; test_choosing_doc reads it here.
KEEP_FREE = 0.10
SHOWN_TIES = 3  # ties named in the console lines (tune.json lists them all)


def _value(cfg: "RunConfig", key: str):
    """The config's value an override key sets: ``ac`` -> the ac group node, ``trainer.grad_sync`` -> the field."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


def differences(choices: list[str], cfg: "RunConfig", base: "RunConfig", dp: int) -> list[str]:
    """The candidate's overrides that change the run as given (the others restate its own values or change
    nothing in it: ``space.idle_choice``)."""
    from fsdp_exp.tune.space import idle_choice

    keys = [c.lstrip("+~").partition("=")[0] for c in choices]
    return [
        c for c, key in zip(choices, keys) if _value(cfg, key) != _value(base, key) and not idle_choice(key, cfg, dp)
    ]


def changes(tuning: "Tuning", w: "Weighed") -> list[str]:
    """What the candidate changes in the run as given."""
    return differences(w.candidate.choices, w.candidate.cfg, tuning.base, tuning.space.dp)


def run_command(tuning: "Tuning", w: "Weighed") -> str:
    return "python -m fsdp_exp " + " ".join(tuning.overrides + changes(tuning, w))


def _pct(x: float) -> str:
    if 0 < abs(x) < 0.001:  # a near-tie said as such, not as 0.0%
        return f"{x:.2%}"
    return f"{x:.0%}" if abs(x) >= 0.095 else f"{x:.1%}"


def prefer_baseline(best, ties: list, baseline_ids: set) -> tuple:
    """(the choice, its ties): a baseline among ``best``'s ties is chosen over it (the model cannot order them, and
    the baseline is the simpler run), ``best`` then one of the ties; else ``best`` and ``ties`` as they are."""
    if best.candidate.id in baseline_ids:
        return best, ties
    tied = next((w for w in ties if w.candidate.id in baseline_ids), None)
    if tied is None:
        return best, ties
    return tied, [best] + [w for w in ties if w is not tied]


def keeps_room(w: "Weighed") -> bool:
    """Leaves ``KEEP_FREE`` of the memory limit free (the rule a recommendation keeps)."""
    return w.headroom is not None and w.headroom >= KEEP_FREE


def eligible(tuning: "Tuning") -> list["Weighed"]:
    """The ranked candidates a recommendation may be, best predicted first: those that keep ``KEEP_FREE`` free;
    where none does, those that are not borderline; where every one is, all (the reasons then say so)."""
    ranked = tuning.ranked
    return [w for w in ranked if keeps_room(w)] or [w for w in ranked if not w.borderline] or ranked


# Paths of the space that no run has taken (they need CUDA, and no GPU has run fsdp_exp yet), with what to say of
# a recommendation resting on one. Each entry: a test of the candidate's config, and the sentence.
def _ring(cfg, device_kind: str) -> bool:
    return cfg.parallel.cp > 1 and resolve_method(cfg.parallel.cp_method, device_kind) == "ring"


def _float8_tp(cfg, device_kind: str) -> bool:
    # float8 under tensor parallel with sequence parallel: gloo cannot carry its float8 activations, so the CPU
    # refuses it (docs/float8.md); without sequence parallel it has run on CPU ranks
    p = cfg.parallel
    return p.tp > 1 and bool(getattr(p, "sequence_parallel", False)) and bool(cfg.precision.float8_recipe)


UNRUN_PATHS = (
    (
        _ring,
        "ring attention (parallel.cp_method=ring) runs on CUDA's kernels only and no GPU has run it yet: its time is "
        "the model's, not a measurement (parallel.cp_method=all_to_all has run, on CPU ranks)",
    ),
    (
        _float8_tp,
        "float8 under tensor and sequence parallel has not run yet (a CPU cannot, and no GPU has run "
        "benchmarks/gpu_check.py's float8_tp_sp): its time is the model's, not a measurement",
    ),
)


def unrun_paths(cfg, device_kind: str) -> list[str]:
    """What a candidate rests on that no run has taken (``UNRUN_PATHS``), on a device of ``device_kind``."""
    return [say for rests_on, say in UNRUN_PATHS if rests_on(cfg, device_kind)]


# The parallel degrees whose standing an answer states when the space searches them, as the baselines': where the
# best layout of the other kind ranks (expert parallel for a mixture of experts, context parallel for a long
# sequence). Each: the space's dimension, the config field, its name in words.
STANDINGS = (("ep", "ep", "expert parallel"), ("cp", "cp", "context parallel"))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def standings(tuning: "Tuning", best: "Weighed", name) -> list[str]:
    """For each of ``STANDINGS`` the space searches: the best-ranked candidate of the other kind (split where the
    choice is not, unsplit where it is), its rank, its predicted tokens/s against the choice's and its memory; or
    why none ranks."""
    out = []
    speed = best.prediction.tokens_per_s
    total = len(tuning.ranked)
    for dim, field_name, words in STANDINGS:
        if len(tuning.space.values.get(dim, [])) < 2:
            continue
        chosen = getattr(best.candidate.cfg.parallel, field_name)
        other = (
            (lambda w: getattr(w.candidate.cfg.parallel, field_name) > 1)
            if chosen == 1
            else (lambda w: getattr(w.candidate.cfg.parallel, field_name) == 1)
        )
        kind = f"{dim}>1" if chosen == 1 else f"{dim}=1"
        rival = next((w for w in tuning.ranked if other(w)), None)
        if rival is None:
            weighed = [w for w in tuning.candidates if other(w)]
            refused = sum(1 for w in weighed if w.refused)
            over = sum(1 for w in weighed if not w.refused and w.fits is False)
            out.append(
                f"{words}: no candidate with {kind} ranks ({len(weighed):,} weighed: {refused:,} refused by "
                f"preflight, {over:,} over the memory)"
            )
            continue
        rivals = [rival]
        if not keeps_room(rival):  # and the best of that kind a recommendation could be
            rivals += [w for w in tuning.ranked if other(w) and keeps_room(w)][:1]
        said = []
        for w in rivals:
            gap = w.prediction.tokens_per_s / speed - 1
            room = "borderline" if w.borderline else f"under the {KEEP_FREE:.0%} the rule keeps"
            said.append(
                f"{name(w)} ranks {_ordinal(w.rank)} of {total:,}: {_pct(abs(gap))} "
                f"{'fewer' if gap < 0 else 'more'} tokens/s, {_pct(w.headroom)} of the memory left"
                + ("" if keeps_room(w) else f" ({room})")
            )
        if len(said) > 1:
            tail = f"; the best with {kind} that keeps {KEEP_FREE:.0%}, " + said[1]
        else:
            tail = "" if keeps_room(rival) else f"; none with {kind} keeps {KEEP_FREE:.0%}"
        out.append(f"{words}: the best with {kind}, " + said[0] + tail)
    return out


def recommend(tuning: "Tuning", argv: list[str]) -> Optional[dict]:
    """The recommendation as data (``tune.json``'s ``recommendation``); None when nothing is ranked."""
    from fsdp_exp.tune.space import label

    ranked = tuning.ranked
    if not ranked:
        return None
    safe = eligible(tuning)
    best = safe[0]
    speed = best.prediction.tokens_per_s
    ties = [w for w in safe[1:] if w.prediction.tokens_per_s >= (1 - TIE) * speed]
    runner = next((w for w in safe[1:] if w not in ties), None)
    top = best
    best, ties = prefer_baseline(best, ties, {cid for cid in tuning.baselines.values() if cid})
    speed = best.prediction.tokens_per_s
    faster_borderline = [w for w in ranked if w.borderline and w.rank < best.rank]
    # faster, not borderline, but leaving less than the rule keeps: the recommendation passed them over
    faster_tight = [w for w in ranked if not w.borderline and not keeps_room(w) and w.rank < best.rank]

    def name(w: "Weighed") -> str:
        return f"{w.candidate.id} ({label(changes(tuning, w))})"

    why = [
        f"predicted {speed:,.0f} tokens/s"
        + (f", MFU {best.prediction.mfu:.0%}" if best.prediction.mfu is not None else "")
        + f"; needs {best.need_bytes / GIB:.1f} of {tuning.limit_bytes / GIB:.1f} GiB per rank "
        f"({_pct(best.headroom)} left"
        + (
            f"; the rule keeps {KEEP_FREE:.0%})"
            if keeps_room(best)
            else f": no candidate keeps the {KEEP_FREE:.0%} the rule asks, so this is the best with the most room)"
        )
    ]
    if best is not top:
        why.append(
            f"a baseline tied with the best-predicted {name(top)} ({_pct(top.prediction.tokens_per_s / speed - 1)} "
            f"faster, within the model's {TIE:.0%}): the simpler run where the model cannot tell them apart"
        )
    for base_name, cid in tuning.baselines.items():
        if cid == best.candidate.id:
            why.append(f"it is the {base_name} baseline ({BASELINES[base_name]})")
        if cid is None or cid == best.candidate.id:
            continue
        baseline = tuning.by_id(cid)
        other = baseline.prediction.tokens_per_s
        if speed >= other:
            why.append(f"{_pct(speed / other - 1)} more tokens/s than the {base_name} baseline, {name(baseline)}")
        else:  # a faster baseline leaves too little room (else it would be the choice): say what it risks
            why.append(
                f"{_pct(1 - speed / other)} fewer tokens/s than the {base_name} baseline, {name(baseline)}, which "
                f"leaves {_pct(baseline.headroom)} of the memory "
                + ("(borderline)" if baseline.borderline else f"(under the {KEEP_FREE:.0%} the rule keeps)")
            )
    if runner is not None:
        gap = 1 - runner.prediction.tokens_per_s / speed
        memory = (runner.need_bytes - best.need_bytes) / GIB
        held = f" to hold {-memory:.1f} GiB less" if memory < -0.05 else f" and holds {memory:.1f} GiB more"
        why.append(
            f"the runner-up, {name(runner)}, gives up {_pct(gap)} of the tokens/s"
            + (held if abs(memory) >= 0.05 else "")
        )
    for w in faster_borderline[:1]:
        why.append(
            f"{name(w)} is predicted {_pct(w.prediction.tokens_per_s / speed - 1)} faster but leaves "
            f"{_pct(w.headroom)} of the memory (borderline: the planner's error could decide it); measure it first"
        )
    for w in faster_tight[:1]:
        why.append(
            f"{name(w)} is predicted {_pct(w.prediction.tokens_per_s / speed - 1)} faster but leaves "
            f"{_pct(w.headroom)} of the memory, under the {KEEP_FREE:.0%} the rule keeps (docs/choosing.md, step 5)"
        )
    why += standings(tuning, best, name)
    why += unrun_paths(best.candidate.cfg, tuning.device.kind)
    measure_ids = [w.candidate.id for w in ([best] + ties[: SHOWN_TIES - 1] + faster_borderline[:1] + faster_tight[:1])]
    measure = (
        "python -m fsdp_exp.tune "
        + " ".join(a for a in argv if not a.startswith(("tune.run=", "tune.extra=")))
        + f" tune.run=true tune.extra=[{','.join(measure_ids)}]"
    )
    left_out = [f"refused by preflight ({n:,}): {reason}" for reason, n in tuning.refusals(3)]
    left_out += list(tuning.space.notes)
    for module, (needed_by, fix) in sorted(tuning.missing_packages.items()):
        left_out.append(
            f"{module} is not installed on this machine: the {needed_by} candidates were weighed anyway (their "
            f"FLOPs and memory need no package); running them on {tuning.device.name} needs {fix}"
        )
    return {
        "id": best.candidate.id,
        "label": label(changes(tuning, best)),
        "command": run_command(tuning, best),
        "why": why,
        "ties": [w.candidate.id for w in ties],
        "runner_up": runner.candidate.id if runner is not None else None,
        "borderline_faster": [w.candidate.id for w in faster_borderline],
        "measure_command": measure,
        "left_out": left_out,
    }


def lines(rec: Optional[dict], tuning: "Tuning") -> list[str]:
    """The recommendation as the console's last lines."""
    from fsdp_exp.tune.space import label

    if rec is None:
        return []
    out = [f"recommended: {rec['id']} ({rec['label']})", f"  {rec['command']}"]
    out += [f"  why: {line}" for line in rec["why"]]
    if rec["ties"]:
        shown = [
            f"{cid} ({label(changes(tuning, w))})" for cid in rec["ties"][:SHOWN_TIES] for w in [tuning.by_id(cid)]
        ]
        more = len(rec["ties"]) - len(shown)
        out.append(
            f"  ties: {len(rec['ties'])} more within {TIE:.0%} (the model cannot tell them apart): "
            + "; ".join(shown)
            + (f"; and {more} more (tune.json)" if more > 0 else "")
        )
    if rec["ties"] or rec["borderline_faster"]:
        out.append(f"  measure them: {rec['measure_command']}")
    out += [f"  left out: {line}" for line in rec["left_out"]]
    return out
