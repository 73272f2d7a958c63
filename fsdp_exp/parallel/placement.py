"""Which dim FSDP2 shards a parameter on: the one rule the backend (``fsdp_exp.parallel.fsdp2``, through
``fully_shard``'s ``shard_placement_fn``) and the planner (``fsdp_exp.plan.states``, the ``dim0`` layout) share.

FSDP2 chunks dim 0 over the shard group and pads it to a multiple of the group. A 2-D weight's dim 0 has
thousands of rows, so the padding is at most a row per rank. A stacked expert weight (3-D: experts, out, in)
has a dim 0 of a few experts: 8 experts over 16 ranks are padded to 16, twice their memory and their
all-gathers. Such a weight is sharded instead on its first other dim the group divides (torch's FSDP2 takes a
dim other than 0 only when it divides evenly); when none does, dim 0 and its padding stay.

Pure arithmetic on shapes: the planner asks it without torch's distributed modules or any process group.
"""

from __future__ import annotations

import math
from typing import Sequence


def shard_dim(shape: Sequence[int], group: int) -> int:
    """The dim a parameter of ``shape`` is sharded on over ``group`` ranks: 0, unless it is a stacked weight
    (3 dims or more) whose dim 0 ``group`` does not divide and a later dim it does divide (the first such)."""
    if len(shape) < 3 or group <= 1 or shape[0] % group == 0:
        return 0
    return next((dim for dim in range(1, len(shape)) if shape[dim] % group == 0), 0)


def shard_numel(shape: Sequence[int], group: int) -> int:
    """Elements of the largest rank's shard (rank 0's: ``torch.chunk``'s ceil chunk, padding included)."""
    if not shape:
        return 1
    dim = shard_dim(shape, group)
    return math.ceil(shape[dim] / group) * math.prod(shape) // shape[dim]
