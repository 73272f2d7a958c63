"""The model's and the optimizer's state as torch.distributed.checkpoint ``Stateful`` objects.

``get_model_state_dict`` / ``get_optimizer_state_dict`` speak canonical parameter names for FSDP2,
FSDP1 and DDP alike, and DCP stores each tensor by its global shape and offsets, so a checkpoint loads
at another world size, mesh or backend (resharding). The model and its optimizer are one object: the
optimizer's state is keyed by the model's parameters, and ``set_state_dict`` loads both together.
"""

from __future__ import annotations

import torch
from torch import nn


class ModelAndOptimizer:
    """``state_dict()`` is ``{"model": ..., "optim": ...}``; every rank holds (and saves) its shards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, options: dict, backend=None):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optimizer = model, optimizer
        # Who writes and reads these shards (Backend.save_checkpoint / load_checkpoint / checkpoint_format):
        # torch.distributed.checkpoint by default, the engine's own format for DeepSpeed.
        self.backend = backend
        # The backend's StateDictOptions (Backend.state_dict_options); none by default.
        self.options = StateDictOptions(**options) if options else None

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, backend) -> ModelAndOptimizer:
    """What a checkpoint shards (every rank its part), read and written as ``backend`` says."""
    # Some backends' state dicts warn on every tensor at save and load (FSDP1's ShardedTensor).
    backend.quiet_checkpoint_warnings()
    return ModelAndOptimizer(model, optimizer, backend.state_dict_options(), backend)
