"""The ``debug`` config group's code: what a run does on purpose to be checked.

- ``faults``: fault injection: a rank that raises, is signalled or turns its parameters NaN at the start
  of a step, or fails inside a save after writing its shards;
- ``init_check``: the identical-initialization check (``debug.check_identical_init``).

Importing the package loads the torch-free part only; import ``faults`` by name.
"""

from fsdp_exp.debug.init_check import compare_init_digests

__all__ = ["check", "compare_init_digests"]


def check(cfg, world: int) -> None:
    """Preflight's checks of the debug group: the failing rank is one of the world's, the favoured expert one of
    the model's."""
    from fsdp_exp.errors import fail

    d = cfg.debug
    if (d.fail_at_step is not None or d.nan_at_step is not None) and not 0 <= d.fail_rank < world:
        fail(
            f"debug.fail_rank={d.fail_rank} is not a rank of a world of {world}.",
            f"pass debug.fail_rank between 0 and {world - 1}",
        )
    if d.step_sleep_s < 0:
        fail(f"debug.step_sleep_s={d.step_sleep_s} is negative.", "pass debug.step_sleep_s=0 (no sleep)")
    experts = getattr(cfg.model, "n_experts", 0) or 0
    if d.favour_expert is not None and not 0 <= d.favour_expert < experts:
        fail(
            f"debug.favour_expert={d.favour_expert} names no expert of this model ({experts} experts): it "
            "routes every token's first pick to one expert of a mixture of experts.",
            "pass debug.favour_expert=null, or an expert between 0 and model.n_experts - 1 (e.g. model=moe_tiny)",
        )
