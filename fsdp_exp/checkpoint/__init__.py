"""Sharded checkpoints, exact resume, and the faults around them (signals, NaN/inf loss).

- ``layout``: folders, names, completeness, the meta file, pruning (no torch);
- ``manager``: the ``Checkpointer``, saving and resuming ``Stateful`` objects through
  torch.distributed.checkpoint, and the per-step stop / NaN agreement;
- ``states``: the model and optimizer as one ``Stateful``; ``rng``: every RNG of a rank as another;
- ``signals``: stop signals and the per-step flag agreement; ``faults``: fault injection;
- ``init_check``: the identical-initialization check; ``checks``: the group's preflight check.

Importing the package loads the torch-free parts only; import ``manager`` (and the others) by name.
"""

from fsdp_exp.checkpoint.init_check import compare_init_digests
from fsdp_exp.checkpoint.layout import (META_FILE, TMP_SUFFIX, CheckpointError, checkpoint_root, complete_checkpoints,
                                        latest_checkpoint, read_meta, resolve_resume)

__all__ = ["META_FILE", "TMP_SUFFIX", "CheckpointError", "checkpoint_root", "compare_init_digests",
           "complete_checkpoints", "latest_checkpoint", "read_meta", "resolve_resume"]
