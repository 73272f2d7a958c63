"""tune's recommendation rule between candidates the step-time model cannot order (fsdp_exp.tune.recommend)."""

from __future__ import annotations

from types import SimpleNamespace

from fsdp_exp.tune.recommend import prefer_baseline


def _weighed(cid: str, tokens_per_s: float):
    # what the rule reads of a weighed candidate: its id and its predicted tokens/s
    return SimpleNamespace(candidate=SimpleNamespace(id=cid), prediction=SimpleNamespace(tokens_per_s=tokens_per_s))


def test_a_baseline_that_ties_with_the_best_predicted_is_chosen_and_the_best_becomes_a_tie():
    best, zero2_like, ddp, fsdp = (
        _weighed("c1", 100.0),
        _weighed("c2", 99.5),
        _weighed("c3", 99.0),
        _weighed("c4", 98.5),
    )
    chosen, ties = prefer_baseline(best, [zero2_like, ddp, fsdp], {"c3", "c4"})
    assert chosen is ddp  # the first baseline among the ties, in the ranking's order
    assert ties == [best, zero2_like, fsdp]


def test_without_a_tied_baseline_or_when_the_best_is_one_the_choice_stands():
    best, other = _weighed("c1", 100.0), _weighed("c2", 99.0)
    assert prefer_baseline(best, [other], {"c9"}) == (best, [other])  # the baseline is not among the ties
    assert prefer_baseline(best, [other], {"c1", "c2"}) == (best, [other])  # the best is a baseline already
    assert prefer_baseline(best, [], {"c2"}) == (best, [])


def _sized(cid: str, rank: int, headroom: float, borderline: bool = False):
    # what the margin rule reads: the memory left and whether the planner's error could decide the fit
    return SimpleNamespace(
        candidate=SimpleNamespace(id=cid), rank=rank, headroom=headroom, borderline=borderline, prediction=None
    )


def test_the_recommendation_keeps_the_margin_the_guide_asks_and_falls_back_only_when_none_does():
    """Issue #43 item 4: at 128K the best-predicted (7.4% left) was recommended though docs/choosing.md keeps 10%."""
    from fsdp_exp.tune.recommend import KEEP_FREE, eligible, keeps_room

    assert KEEP_FREE == 0.10
    tight, roomy, over = _sized("c1", 1, 0.074), _sized("c2", 2, 0.25), _sized("c3", 3, -0.01, borderline=True)
    assert not keeps_room(tight) and keeps_room(roomy)
    assert eligible(SimpleNamespace(ranked=[tight, roomy, over])) == [roomy]
    assert eligible(SimpleNamespace(ranked=[tight, over])) == [tight]  # none keeps 10%: the not-borderline
    assert eligible(SimpleNamespace(ranked=[over])) == [over]


def test_a_recommendation_on_a_path_no_gpu_has_run_says_so():
    from fsdp_exp.tune.recommend import unrun_paths

    def cfg(cp=1, method="auto", tp=1, sp=False, recipe=None):
        return SimpleNamespace(
            parallel=SimpleNamespace(cp=cp, cp_method=method, tp=tp, sequence_parallel=sp),
            precision=SimpleNamespace(float8_recipe=recipe),
        )

    assert unrun_paths(cfg(), "cuda") == []
    assert "ring attention" in unrun_paths(cfg(cp=8, method="ring"), "cuda")[0]
    assert "ring attention" in unrun_paths(cfg(cp=8), "cuda")[0]  # auto is ring on CUDA
    assert unrun_paths(cfg(cp=8, method="all_to_all"), "cuda") == []
    assert (
        "float8 under tensor and sequence parallel" in unrun_paths(cfg(tp=2, sp=True, recipe="tensorwise"), "cuda")[0]
    )
    assert unrun_paths(cfg(tp=2, recipe="tensorwise"), "cuda") == []  # ran on CPU ranks without sequence parallel
    assert unrun_paths(cfg(recipe="tensorwise"), "cuda") == []
