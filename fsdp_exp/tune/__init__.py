"""Choose how to shard a model: predict, prune, measure what can win, and say how good the prediction was
(``python -m fsdp_exp.tune <the run's overrides>``; the command and its options: ``fsdp_exp.tune.cli``).

- ``options``: the tuner's own ``tune.*`` options, taken off the command line before Hydra composes;
- ``space``: the search space (backends and their strategies from the registry, hybrid shard sizes, the
  ac / precision / offload / prefetch groups' options, micro-batch sizes) and its candidates;
- ``work``: what a step computes (FLOPs, recompute, operators), counted on the meta model;
- ``perf``: the step-time model (compute, alpha-beta collectives per strategy, overlap, offload);
- ``probe``: a CPU host's figures, measured once and cached (matmul peak, gloo latency and bandwidth);
- ``search``: every candidate through preflight, the memory planner and the step-time model, ranked;
- ``measure``: the top candidates and the baselines as a config group, swept with repeats, read back;
- ``calibrate``: the model's figures fitted to a measured sweep, cached per device;
- ``output``: the table, ``tune.json``, the predicted-vs-measured figure and page.
"""
