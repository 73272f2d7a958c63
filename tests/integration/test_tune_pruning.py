"""tune's pruning (``fsdp_exp.tune.search``: the planner's floor, the pipeline's shared plans) against the exhaustive
search that walks every candidate through ``fsdp_exp.plan.plan``: the same verdicts, figures and ranking."""

from __future__ import annotations

import pytest

from fsdp_exp.plan import peak_floor, plan
from fsdp_exp.tune.options import split_argv
from fsdp_exp.tune.search import weigh

# A 7B on 16 H100 with pipelines, both offloads and two prefetch depths (which the stages do not plan), under a
# budget that leaves the replicas over by their model states alone.
CASE = [
    "model=llama7b",
    "trainer.nproc_per_node=8",
    "trainer.nnodes=2",
    "trainer.global_batch_size=64",
    "trainer.seq_len=2048",
    "plan.device=h100_80gb",
    "tune.budget_gib=40",
    "tune.space.ac=[none,full]",
    "tune.space.precision=[bf16]",
    "tune.space.offload=[none,params]",
    "tune.space.prefetch=[default,none]",
    "tune.space.micro_batch_size=[1,4]",
    "tune.space.pp=[1,2,4]",
    "tune.space.pp_schedule=[1f1b,gpipe]",
]


@pytest.fixture(scope="module")
def searches():
    opts, overrides = split_argv(CASE)
    return weigh(overrides, opts, prune=True), weigh(overrides, opts, prune=False)


def test_the_pruned_search_ranks_what_the_exhaustive_one_ranks_with_the_same_figures(searches):
    pruned, exhaustive = searches
    assert pruned.counts() == exhaustive.counts()
    assert [w.candidate.id for w in pruned.ranked[:10]] == [w.candidate.id for w in exhaustive.ranked[:10]]
    assert [w.candidate.id for w in pruned.ranked] == [w.candidate.id for w in exhaustive.ranked]
    for p, e in zip(pruned.candidates, exhaustive.candidates):
        assert (p.candidate.id, p.refused, p.fits, p.rank) == (e.candidate.id, e.refused, e.fits, e.rank)
        if p.need_bytes is not None:  # walked in both: the same peak and need to the byte
            assert (p.peak_bytes, p.need_bytes) == (e.peak_bytes, e.need_bytes)
        if p.prediction is not None:
            assert p.prediction.tokens_per_s == e.prediction.tokens_per_s


def test_the_floor_skips_walks_and_never_exceeds_the_planned_peak(searches):
    pruned, exhaustive = searches
    floored = [w for w in pruned.candidates if w.floor_bytes is not None]
    assert floored and all(w.need_bytes is None and w.fits is False for w in floored)
    kinds = {w.floor_of for w in floored}  # the model states' floor and the forward's walk both prune here
    assert kinds == {"its parameters and optimizer state", "its forward's phases"}, kinds
    assert any(w.candidate.cfg.parallel.pp > 1 for w in pruned.ranked)  # the stages' shared plans were ranked too
    for w in exhaustive.candidates:
        if w.need_bytes is not None:
            assert peak_floor(w.candidate.cfg, w.topology, device_kind="cuda") <= w.peak_bytes, w.candidate.id
    w = next(w for w in exhaustive.candidates if w.candidate.cfg.parallel.pp > 1 and w.need_bytes is not None)
    assert plan(w.candidate.cfg, w.topology, device_kind="cuda").peak["total"] == w.peak_bytes
