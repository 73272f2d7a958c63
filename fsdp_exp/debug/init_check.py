"""``debug.check_identical_init``: did every rank build the initial parameters the seed says?

Each backend hashes the shards it holds (``Backend.init_digests``: per tensor its name, which slice
this rank holds, the hash of that slice and the hash the seeded initialization says it must have);
here every rank's rows are gathered and compared: ranks holding the same slice must agree (replicas),
and each slice must be the slice of the seeded full tensor.
"""

from __future__ import annotations


def compare_init_digests(per_rank: list[list[dict]]) -> list[str]:
    """What differs in every rank's init digests: ranks holding the same slice of a tensor with
    different values (replicas), and shards that are not the slice of the seeded initialization."""
    problems = []
    groups: dict[tuple, dict[int, str]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            groups.setdefault((row["name"], row["slice"]), {})[rank] = row["hash"]
    for (name, where), hashes in sorted(groups.items()):
        if len(set(hashes.values())) > 1:
            by_hash: dict[str, list[int]] = {}
            for rank, h in sorted(hashes.items()):
                by_hash.setdefault(h, []).append(rank)
            split = " vs ".join(f"ranks {ranks}" for ranks in by_hash.values())
            problems.append(f"{name} ({where}): replicas differ between {split}")
    for rank, rows in enumerate(per_rank):
        for row in rows:
            if row["hash"] != row["expected"]:
                problems.append(f"rank {rank}: {row['name']} ({row['slice']}) is not the seeded initial value")
    return problems


def check_identical_init(backend, model, seed: int, world_size: int) -> dict:
    """Gather every rank's digests of ``model`` (sharded by ``backend``, initialized from ``seed``);
    raise naming ranks and tensors on a mismatch, else return what was checked (for run.json)."""
    import torch.distributed as dist

    rows = backend.init_digests(model, seed)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rows)
    problems = compare_init_digests(gathered)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise RuntimeError(
            f"debug.check_identical_init: the ranks did not build identical initial parameters:\n  {shown}"
        )
    return {
        "result": "identical",
        "ranks": world_size,
        "shards_checked": sum(len(r) for r in gathered),
        "distinct_slices": len({(r["name"], r["slice"]) for rows in gathered for r in rows}),
    }
