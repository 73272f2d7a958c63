"""The answer at the end of ``python -m fsdp_exp.tune``: one configuration to run, as one command, and why.

The ranking alone leaves the user to read it; the recommendation reads it for them, by rules a user can check:

- the choice is the best-predicted candidate that is not borderline (within ``search.BORDERLINE`` of the memory
  limit, where the planner's error could decide whether it fits); faster borderline ones are named, to measure;
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

from fsdp_exp.units import GIB

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.tune.search import Tuning, Weighed

TIE = 0.02  # predicted within 2% of each other: inside the step-time model's error, so not ordered by it
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


def recommend(tuning: "Tuning", argv: list[str]) -> Optional[dict]:
    """The recommendation as data (``tune.json``'s ``recommendation``); None when nothing is ranked."""
    from fsdp_exp.tune.space import label

    ranked = tuning.ranked
    if not ranked:
        return None
    safe = [w for w in ranked if not w.borderline] or ranked
    best = safe[0]
    speed = best.prediction.tokens_per_s
    ties = [w for w in safe[1:] if w.prediction.tokens_per_s >= (1 - TIE) * speed]
    runner = next((w for w in safe[1:] if w not in ties), None)
    top = best
    best, ties = prefer_baseline(best, ties, {cid for cid in tuning.baselines.values() if cid})
    speed = best.prediction.tokens_per_s
    faster_borderline = [w for w in ranked if w.borderline and w.rank < best.rank]

    def name(w: "Weighed") -> str:
        return f"{w.candidate.id} ({label(changes(tuning, w))})"

    why = [
        f"predicted {speed:,.0f} tokens/s"
        + (f", MFU {best.prediction.mfu:.0%}" if best.prediction.mfu is not None else "")
        + f"; needs {best.need_bytes / GIB:.1f} of {tuning.limit_bytes / GIB:.1f} GiB per rank "
        f"({_pct(best.headroom)} left)"
    ]
    if best is not top:
        why.append(
            f"a baseline tied with the best-predicted {name(top)} ({_pct(top.prediction.tokens_per_s / speed - 1)} "
            f"faster, within the model's {TIE:.0%}): the simpler run where the model cannot tell them apart"
        )
    for base_name, cid in tuning.baselines.items():
        if cid is None or cid == best.candidate.id:
            continue
        baseline = tuning.by_id(cid)
        other = baseline.prediction.tokens_per_s
        if speed >= other:
            why.append(f"{_pct(speed / other - 1)} more tokens/s than the {base_name} baseline, {name(baseline)}")
        else:  # a faster baseline is borderline (else it would be the choice): say what it risks
            why.append(
                f"{_pct(1 - speed / other)} fewer tokens/s than the {base_name} baseline, {name(baseline)}, which "
                f"leaves {_pct(baseline.headroom)} of the memory (borderline)"
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
    measure_ids = [w.candidate.id for w in ([best] + ties[: SHOWN_TIES - 1] + faster_borderline[:1])]
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
