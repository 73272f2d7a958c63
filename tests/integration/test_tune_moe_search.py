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


def test_a_calibrating_sweep_of_moe_runs_carries_their_measured_expert_load_into_later_searches(tmp_path, monkeypatch):
    """Issue #41, routing as measured: published MoE runs are force-balanced, real routing is not. A sweep's runs
    record their load (summary/moe_load_imbalance_median); tune.calibrate_from keeps the sweep's median with the
    device's fit, and a later search on that device plans and times with it unless plan.expert_imbalance is given.
    The records are of two moe_tiny layouts on an 8-GPU H100 node (the device table's figures: no probe runs)."""
    import json

    from omegaconf import OmegaConf

    from conftest import compose_config
    from fsdp_exp.config import to_run_config
    from fsdp_exp.preflight import validate
    from fsdp_exp.tune.calibrate import calibrate_from, load
    from fsdp_exp.tune.options import split_argv
    from fsdp_exp.tune.search import weigh

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sweep = tmp_path / "sweep"
    for job, (ep, imbalance, tokens) in enumerate([(1, 1.4, 2.0e6), (2, 1.8, 1.6e6)]):
        composed = compose_config(["model=moe_tiny", "trainer.nproc_per_node=8", f"parallel.ep={ep}"])
        topology = validate(to_run_config(composed), cuda_devices=8)
        run = sweep / f"{job}_ep={ep}"
        run.mkdir(parents=True)
        record = {
            "status": "completed",
            "config": OmegaConf.to_container(composed, resolve=True),
            "topology": topology.as_dict(),
            "env": {"device_type": "cuda", "devices": ["NVIDIA H100 80GB HBM3"] * 8},
            "applied": {},
            "summary": {"summary/tokens_per_s_median": tokens, "summary/moe_load_imbalance_median": imbalance},
        }
        (run / "run.json").write_text(json.dumps(record))
    (key,) = calibrate_from(sweep)
    assert load(key)["expert_imbalance"] == 1.6  # the median of the two runs' measured loads
    argv = [
        "model=moe_tiny",
        "trainer.nproc_per_node=8",
        "plan.device=h100_80gb",
        "tune.space.ep=[1,2]",
        *(f"tune.space.{d}=[{v}]" for d, v in (("backend", "fsdp2"), ("sharding", "full"), ("ac", "none"))),
        *(f"tune.space.{d}=[{v}]" for d, v in (("precision", "bf16"), ("offload", "none"), ("prefetch", "default"))),
    ]
    opts, overrides = split_argv(argv)
    tuning = weigh(overrides, opts)
    assert opts.expert_imbalance == 1.6 and "expert load max/mean 1.60 as measured" in tuning.perf_note
    given, overrides = split_argv([*argv, "plan.expert_imbalance=1"])
    weigh(overrides, given)
    assert given.expert_imbalance == 1.0  # the user's own figure stands
