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
