"""Every pair composes or is refused: a pairwise covering set of runs over sharding backend and strategy,
tensor parallel, compile, activation checkpointing, offload, precision and prefetch (fsdp_exp.composability),
each trained 3 steps on the tiny Llama at 2 ranks; and one over the layout's dimensions (pipeline, context,
expert and tensor parallel with and without sequence parallel) at 4 ranks. Every pair of values preflight accepts appears in some
run that preflight accepts, and every such run must train: a crash that preflight did not refuse fails here.
The runs share one spawned process group (test_deepspeed.run_cases: each rank trains them in turn)."""

from __future__ import annotations

import json

import pytest

from fsdp_exp import composability

from test_deepspeed import run_cases

DIMENSIONS = ("sharding", "tp", "compile", "ac", "offload", "precision", "prefetch")
# DeepSpeed's ZeRO stages with compile, AC, offload and prefetch train in test_deepspeed's shared group
# (its compiled engine alone hits dynamo's recompile limit for minutes here); FSDP1's no_shard is its
# full_shard's code path with a shard group of one.
# Sequence parallel ("2 sp") trains in the layout test below, at 4 ranks, with the dimensions it is about.
LEFT_OUT = ("deepspeed zero3", "fsdp1 no_shard", "2 sp")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 30 runs, 10 of them compiled (a cold inductor cache)
def test_every_pair_of_options_trains_or_is_refused_by_preflight(tmp_path):
    runs, refused = composability.covering_runs(DIMENSIONS, LEFT_OUT)
    # Each refused pair is refused by preflight by name (a message with its fix), never by a crash.
    assert all("\n  fix: " in message or message.startswith("needs ") for message in refused.values()), refused
    cases = {
        "-".join(v.replace(" ", "_") for v in run.values()): [*composability.TINY, *composability.overrides_of(run)]
        for run in runs
    }
    try:
        dirs = run_cases(cases, tmp_path)
    except Exception as err:  # the group died: name the run it died in (the first one not completed)
        unfinished = [name for name in cases if not _completed(tmp_path / name)]
        raise AssertionError(f"{unfinished[:1]} crashed: {err}") from err
    assert [name for name, run_dir in dirs.items() if not _completed(run_dir)] == []


# The layout's dimensions against each other (pipeline, context, expert and tensor parallel, the last with and
# without sequence parallel), on 4 ranks: every product of two runs stages, experts and sequence shards through
# one recipe (fsdp_exp/parallel/__init__.py's apply_recipe), or is refused by name.
LAYOUT = ("pp", "cp", "ep", "tp")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_pair_of_layout_dimensions_trains_or_is_refused_by_preflight(tmp_path):
    runs, refused = composability.covering_runs(LAYOUT)
    assert all("\n  fix: " in message for message in refused.values()), refused
    # the products of issue #40, each in some run
    for pair in (("pp", "cp"), ("pp", "ep"), ("pp", "tp"), ("cp", "ep")):
        assert any(run[pair[0]] != "1" and run[pair[1]] != "1" for run in runs), pair
    assert any(run["pp"] == "2" and run["tp"] == "2 sp" for run in runs)
    cases = {
        "-".join(f"{dim}{value.replace(' ', '_')}" for dim, value in run.items()): [
            *composability.TINY,
            *composability.overrides_of(run),
        ]
        for run in runs
    }
    try:
        dirs = run_cases(cases, tmp_path, nprocs=4)
    except Exception as err:
        unfinished = [name for name in cases if not _completed(tmp_path / name)]
        raise AssertionError(f"{unfinished[:1]} crashed: {err}") from err
    assert [name for name, run_dir in dirs.items() if not _completed(run_dir)] == []


def _completed(run_dir) -> bool:
    record = run_dir / "run.json"
    return record.exists() and json.loads(record.read_text()).get("status") == "completed"
