"""tune on a mixture of experts, a real narrow search in-process (no process group: an H100 node is planned, so
no CPU probe runs): expert parallel searched where it runs, named where it is chosen, and the pruned search ranking
as the exhaustive one. Two weighings of a few hundred candidates: a few seconds, hence this tier."""

from __future__ import annotations

from fsdp_exp.tune.space import label


def test_tune_weighs_ep_for_moe_tiny_with_fsdp2_only_and_names_it_in_labels_and_commands():
    """A narrow real search (no process group: an H100 node is planned): ep=1, 2, 4 on 4 ranks with FSDP2's
    shardings, ep=1 alone with the others (one note says so); the pruned search ranks as the exhaustive one does."""
    from fsdp_exp.tune.options import split_argv
    from fsdp_exp.tune.recommend import changes, recommend, run_command
    from fsdp_exp.tune.search import weigh

    argv = [
        "model=moe_tiny",
        "trainer.nproc_per_node=4",
        "trainer.global_batch_size=8",
        "plan.device=h100_80gb",
        "tune.space.backend=[fsdp2,ddp]",
        "tune.space.sharding=[full,no_shard]",
        "tune.space.ac=[none]",
        "tune.space.precision=[bf16]",
        "tune.space.offload=[none]",
        "tune.space.prefetch=[default]",
        "tune.space.micro_batch_size=[2]",
    ]
    opts, overrides = split_argv(argv)
    tuning = weigh(overrides, opts)
    ep = {(w.candidate.cfg.sharding.backend, w.candidate.cfg.parallel.ep) for w in tuning.candidates}
    assert ep == {("fsdp2", 1), ("fsdp2", 2), ("fsdp2", 4), ("ddp", 1)}
    assert any(n.startswith("parallel.ep>1 left out with fsdp2 no_shard, ddp no_shard") for n in tuning.space.notes)
    split = [w for w in tuning.ranked if w.candidate.cfg.parallel.ep > 1]
    assert split and all(f"parallel.ep={w.candidate.cfg.parallel.ep}" in w.candidate.choices for w in split)
    assert all(
        not any(c.startswith("parallel.ep") for c in w.candidate.choices)
        for w in tuning.candidates
        if w.candidate.cfg.parallel.ep == 1
    )
    for w in split:  # the label and the command to run name the ep
        assert f"ep={w.candidate.cfg.parallel.ep}" in label(changes(tuning, w)).split(" · ")
        assert f"parallel.ep={w.candidate.cfg.parallel.ep}" in run_command(tuning, w).split()
    assert recommend(tuning, argv)["command"] == run_command(tuning, tuning.ranked[0])
    exhaustive = weigh(overrides, opts, prune=False)
    assert [w.candidate.id for w in exhaustive.ranked] == [w.candidate.id for w in tuning.ranked]
    # plan.expert_imbalance reaches the step-time model as it reaches the plans: under EP the busiest rank sets
    # the pace, so every ep > 1 candidate is predicted slower; at ep=1 each rank runs every expert, unchanged.
    skewed_opts, _ = split_argv([*argv, "plan.expert_imbalance=3"])
    skewed = {w.candidate.id: w for w in weigh(overrides, skewed_opts).candidates}
    timed = [w for w in tuning.candidates if w.prediction and skewed[w.candidate.id].prediction]
    assert {w.candidate.cfg.parallel.ep for w in timed} == {1, 2, 4}
    for w in timed:
        before, after = w.prediction.tokens_per_s, skewed[w.candidate.id].prediction.tokens_per_s
        assert after < before if w.candidate.cfg.parallel.ep > 1 else after == before, w.candidate.choices
