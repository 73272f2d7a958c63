"""Which layouts compose: every pair of the run's dimensions, asked of preflight itself.

A dimension is a set of named values, each a few overrides (``DIMENSIONS``: sharding backend and strategy,
tensor (with and without sequence parallel), pipeline, context and expert parallel, float8, compile, activation checkpointing, offload, precision, prefetch).
``outcome`` runs preflight (``fsdp_exp.preflight.validate``, no rank) on a tiny run with those overrides:
accepted, or refused with preflight's own message. Two uses:

- ``covering_runs``: a pairwise covering set, runs in which every pair of values that preflight accepts
  appears at least once (far fewer runs than the full product); the every-pair test trains each of them
  and fails on any crash preflight did not refuse (tests/integration/test_compose.py).
- ``render_markdown``: the composability table of the docs page vocabulary.md, each pair of dimensions
  read from these outcomes (``python -m fsdp_exp.composability > docs/vocabulary.md`` writes the whole
  page, the knob vocabulary first; a unit test keeps the page equal).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from typing import Optional

from fsdp_exp.config.schema import RunConfig

# The run every outcome starts from: the tiny Llama on 2 CPU ranks, a few steps.
TINY = (
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=256",
    "trainer.seq_len=32",
    "trainer.global_batch_size=8",
    "trainer.steps=3",
    "trainer.warmup_steps=2",  # TP x AC x compile crashed here with 2 warm-up steps of 3, not with 1 of 2
    "trainer.nproc_per_node=2",
    "trainer.peak_tflops=1.0",
    "trainer.digest_shards=false",
    "logger.wandb.mode=disabled",
    "checkpoint.on_signal=false",
)

MOE = "model=moe_tiny"  # TINY's sizes with 4 routed experts a block (conf/model/moe_tiny.yaml)
# dimension -> value -> overrides; each dimension's first value is the default run's.
DIMENSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "sharding": {
        "fsdp2 full": (),
        "fsdp2 grad_op": ("sharding=grad_op",),
        "fsdp2 hybrid": ("sharding=hybrid",),
        "fsdp2 no_shard": ("sharding=no_shard",),
        "fsdp1 full": ("sharding.backend=fsdp1",),
        "fsdp1 grad_op": ("sharding=grad_op", "sharding.backend=fsdp1"),
        "fsdp1 no_shard": ("sharding=no_shard", "sharding.backend=fsdp1"),
        "ddp": ("sharding=ddp",),
        "ddp optimizer": ("sharding=optimizer",),
        "deepspeed zero1": ("sharding=zero1",),
        "deepspeed zero2": ("sharding=zero2",),
        "deepspeed zero3": ("sharding=zero3",),
    },
    "tp": {"1": (), "2": ("parallel.tp=2",), "2 sp": ("parallel.tp=2", "parallel.sequence_parallel=true")},
    "pp": {"1": (), "2": ("parallel.pp=2",)},
    "cp": {"1": (), "2": ("parallel.cp=2",)},
    "ep": {"1": (), "2": ("model=moe_tiny", "parallel.ep=2")},  # the tiny mixture of experts, its 4 experts on 2 ranks
    "float8": {"off": (), "tensorwise": ("precision=float8",)},
    "compile": {"false": (), "true": ("compile=true",)},
    "ac": {"none": (), "full": ("ac=full",), "selective": ("ac=selective",), "selective_op": ("ac=selective_op",)},
    "offload": {"none": (), "params": ("offload=params",), "optimizer": ("offload=optimizer",)},
    "precision": {
        "fp32": (),
        "bf16": ("precision=bf16",),
        "bf16_pure": ("precision=bf16_pure",),
        "fp16": ("precision=fp16",),
        "float8": ("precision=float8",),
        "float8_all_gather": ("precision=float8_all_gather",),
    },
    "prefetch": {"default": (), "none": ("prefetch=none",), "deep": ("prefetch=deep",)},
    "wrap": {"block": (), "none": ("wrap=none",), "size": ("wrap=size",), "experts": (MOE, "wrap=experts")},
    # The mixture of experts' own options, each on the tiny MoE: its 4 experts, top-2. The load-balancing loss at
    # 10x Mixtral's coefficient and the bias at 10x DeepSeek-V3's rate, so that 3 steps show them.
    "aux": {"0": (), "0.2": (MOE, "model.aux_loss_coef=0.2")},
    "bias": {"0": (), "0.01": (MOE, "model.expert_bias_rate=0.01")},
    "capacity": {"dropless": (), "1.0": (MOE, "model.capacity_factor=1.0")},
    "shared": {"0": (), "1": (MOE, "model.n_shared_experts=1")},
    # DeepSeek-V3's router: sigmoid scores, a token's experts from its best group of two, routed scaling.
    "router": {
        "softmax": (),
        "grouped": (MOE, "model.router_score=sigmoid", "model.expert_groups=2", "model.routed_scaling=2.5"),
    },
    # Packed documents kept apart: each attends within its own, rotary positions restarting at its first token.
    "mask": {"causal": (), "block_causal": ("model.attention_mask=block_causal", "data.positions=document")},
}
# The table's dimensions (the layout's), and the values its cells try against each other.
TABLE = ("sharding", "tp", "pp", "cp", "ep", "float8", "compile", "ac", "offload")
TABLE_VALUES = {
    "sharding": ("fsdp2 full", "fsdp1 full", "ddp", "deepspeed zero3"),
    "ac": ("none", "full", "selective_op"),
    "offload": ("none", "params"),
}
TOP_LEVEL = ("compile",)  # keys of the run config itself, not of a group


@functools.cache
def _base() -> RunConfig:
    from hydra import compose, initialize_config_module

    from fsdp_exp.config import to_run_config

    with initialize_config_module(config_module="fsdp_exp.conf", version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(TINY)))


@functools.cache
def _section(group: str, option: str):
    """A group's option as a command line selecting it composes it (the group's schema under its file)."""
    from fsdp_exp.config.variants import apply_changes

    return getattr(apply_changes(_base(), (f"{group}={option}",)), group)


def _value(section, name: str, text: str):
    """An override's value typed as the schema declares the key (the simple types the walks set)."""
    declared = str(next(f.type for f in dataclasses.fields(section) if f.name == name))
    if text == "null":
        return None
    if declared.startswith(("bool", "Optional[bool]")):
        return text == "true"
    if declared.startswith(("int", "Optional[int]")):
        return int(text)
    if declared.startswith(("float", "Optional[float]")):
        return float(text)
    return text


def config_of(overrides: tuple[str, ...]) -> RunConfig:
    """The tiny run with ``overrides``: ``group=option`` as a command line selects it (the option's whole
    node), then ``a.b=x`` one key, ``compile=true`` a key of the run itself. Built from cached pieces, not
    composed again: the walks here ask for hundreds."""
    cfg = _base()
    changes = [change.partition("=")[::2] for change in overrides]
    for key, value in changes:  # group options first: a key set after its group's option
        if "." not in key and key not in TOP_LEVEL:
            cfg = dataclasses.replace(cfg, **{key: copy.deepcopy(_section(key, value))})
    for key, value in changes:
        if key in TOP_LEVEL:
            cfg = dataclasses.replace(cfg, **{key: _value(cfg, key, value)})
        elif "." in key:
            section, _, name = key.partition(".")
            current = getattr(cfg, section)
            updated = dataclasses.replace(current, **{name: _value(current, name, value)})
            cfg = dataclasses.replace(cfg, **{section: updated})
    return cfg


@functools.cache
def outcome(overrides: tuple[str, ...]) -> Optional[str]:
    """None when preflight accepts the tiny run with ``overrides`` on a CPU; else its refusal's message."""
    from fsdp_exp.errors import ConfigError
    from fsdp_exp.parallel.backend import backend_for
    from fsdp_exp.preflight import validate

    cfg = config_of(overrides)
    missing = backend_for(cfg).missing_dependency()
    if missing:
        return f"needs {missing}"
    try:
        validate(cfg, cuda_devices=0)
    except ConfigError as err:
        return str(err)
    return None


def overrides_of(choice: dict[str, str]) -> tuple[str, ...]:
    """The overrides of these values; 4 ranks where two of tensor, pipeline, context and expert parallel take 2
    each (2 otherwise)."""
    overrides = tuple(o for dim, value in choice.items() for o in DIMENSIONS[dim][value])
    if len(set(MULTIPLIED) & set(overrides)) >= 2:
        overrides += ("trainer.nproc_per_node=4",)
    return overrides


# The layout's dimensions that multiply the ranks a run needs (expert parallel borrows them from shard x cp, so
# beside pipeline or tensor parallel it needs the data-parallel ranks those leave; beside cp, cp's ranks suffice).
MULTIPLIED = ("parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.ep=2")


def covering_runs(
    dimensions: tuple[str, ...] = tuple(DIMENSIONS), leave_out: tuple = ()
) -> tuple[list[dict[str, str]], dict]:
    """(runs, refused): runs (dimension -> value) that preflight accepts, in which every pair of values
    of two dimensions that preflight accepts together appears at least once; refused: each pair it
    refuses on its own -> the message. ``leave_out``: values (of any dimension) not tried, and pairs of values
    ``("dim=value", "dim=value")`` not tried together (in no run, neither covered nor refused). Greedy: each run
    starts from an uncovered pair and takes, dimension by dimension, the value that covers most new pairs while
    preflight still accepts the run."""
    values = {dim: [v for v in DIMENSIONS[dim] if v not in leave_out] for dim in dimensions}
    apart = {frozenset(pair) for pair in leave_out if not isinstance(pair, str)}

    def together(run: dict[str, str]) -> bool:
        named = [f"{d}={v}" for d, v in run.items()]
        return not any(frozenset(pair) in apart for pair in itertools.combinations(named, 2))

    pairs = {}
    for a, b in itertools.combinations(dimensions, 2):
        for va, vb in itertools.product(values[a], values[b]):
            if together({a: va, b: vb}):
                pairs[((a, va), (b, vb))] = outcome(overrides_of({a: va, b: vb}))
    uncovered = {pair for pair, refusal in pairs.items() if refusal is None}
    refused = {pair: refusal for pair, refusal in pairs.items() if refusal is not None}
    runs: list[dict[str, str]] = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered)
        run = {a: va, b: vb}
        for dim in dimensions:
            if dim in run:
                continue
            scored = []
            for value in values[dim]:
                trial = {**run, dim: value}
                gain = sum(
                    ((d, v), (dim, value)) in uncovered or ((dim, value), (d, v)) in uncovered for d, v in run.items()
                )
                scored.append((-gain, list(DIMENSIONS[dim]).index(value), value, trial))
            for _, _, _, trial in sorted(scored, key=lambda s: s[:2]):
                if together(trial) and outcome(overrides_of(trial)) is None:
                    run = trial
                    break
        if outcome(overrides_of(run)) is not None:  # the pair alone composes, but nothing completes it
            refused[((a, va), (b, vb))] = outcome(overrides_of(run))
            uncovered.discard(((a, va), (b, vb)))
            continue
        ordered = {dim: run[dim] for dim in dimensions}
        uncovered -= {((d1, ordered[d1]), (d2, ordered[d2])) for d1, d2 in itertools.combinations(dimensions, 2)}
        runs.append(ordered)
    return runs, refused


def _reason(message: str) -> str:
    """A refusal's problem, without its fix line and without the config's echo: one table cell."""
    return message.splitlines()[0].strip().rstrip(".").replace("|", "/")


def cell(a: str, b: str) -> str:
    """How dimensions ``a`` and ``b`` compose: each non-default value of one against each of the other."""
    values = {dim: [v for v in TABLE_VALUES.get(dim, DIMENSIONS[dim])][1:] for dim in (a, b)}
    refusals = {}
    for va, vb in itertools.product(values[a], values[b]):
        message = outcome(overrides_of({a: va, b: vb}))
        if message is not None:
            refusals[f"{a}={va} + {b}={vb}"] = _reason(message)
    if not refusals:
        return "composes"
    total = len(values[a]) * len(values[b])
    listed = "; ".join(f"{pair}: {why}" for pair, why in refusals.items())
    return ("refused: " if len(refusals) == total else "composes, except ") + listed


def render_markdown() -> str:
    rows = [f"| {a} | {b} | {cell(a, b)} |" for a, b in itertools.combinations(TABLE, 2)]
    values = "; ".join(f"{dim}: {', '.join(TABLE_VALUES.get(dim, DIMENSIONS[dim]))}" for dim in TABLE)
    return (
        "## Which layouts compose\n\n"
        "Generated by `python -m fsdp_exp.composability`; do not edit by hand. Each pair of dimensions, each "
        "value other than the default of one against each of the other's, on the tiny Llama (moe_tiny under ep) at 2 CPU ranks (4 for two of tp, pp, cp and ep), "
        "as preflight answers it before any rank starts (a refusal's message names its fix). The values tried: "
        f"{values}.\n\n| dimension | dimension | composes? |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def page() -> str:
    """The docs page vocabulary.md: the knob vocabulary (``fsdp_exp.parallel.vocabulary``), then this table."""
    from fsdp_exp.parallel import vocabulary

    return vocabulary.render_markdown() + "\n" + render_markdown()


if __name__ == "__main__":
    print(page(), end="")
