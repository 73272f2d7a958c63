"""Sharded checkpoints and exact resume.

- ``layout``: folders, names, completeness, the meta file, pruning (no torch);
- ``manager``: the ``Checkpointer``, saving and resuming ``Stateful`` objects through
  torch.distributed.checkpoint;
- ``states``: the model and optimizer as one ``Stateful``; ``rng``: every RNG of a rank as another;
- ``signals``: stop signals and the per-step flag agreement (which the training loop's stop guard,
  fsdp_exp.guard, polls); ``checks``: the group's preflight check.

Fault injection and the identical-init check are the ``debug`` group's (fsdp_exp.debug).

Importing the package loads the torch-free parts only; import ``manager`` (and the others) by name.
"""

from fsdp_exp.checkpoint.layout import (
    META_FILE,
    TMP_SUFFIX,
    CheckpointError,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
    resolve_resume,
)

__all__ = [
    "META_FILE",
    "TMP_SUFFIX",
    "CheckpointError",
    "checkpoint_root",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_meta",
    "resolve_resume",
]
