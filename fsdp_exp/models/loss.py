"""The training loss: mean cross-entropy per token, with the output projection computed in chunks of the
sequence so that no moment of the step holds every logit in fp32 (``trainer.loss_chunks``).

``loss_chunks=1`` is the plain way: the model returns the logits, the loss is taken on their fp32 copy.
With more chunks the model's own forward (``forward(tokens, targets=..., loss_chunks=k)``, every family
takes these) ends with ``chunked_cross_entropy``: each slice of the final hidden states is projected,
cast and scored under ``torch.utils.checkpoint``, so its logits live only while its loss and gradient
are made (one more matmul of the head, for 1/k of the logits). The loss is computed inside the root
module's forward on purpose: every backend's hooks see the head being called. Under sequence parallel
the hidden states arrive sharded over the sequence and are sliced over the batch instead; under loss
parallel the logits stay sharded over the vocabulary and ``mean_cross_entropy`` hands back the
replicated loss's local value. More: the docs page models.md ("The loss").
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def mean_cross_entropy(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, chunks: int, **packed
) -> torch.Tensor:
    """Mean cross-entropy per token of ``model`` (any family, wrapped by any backend) on one batch. ``packed``:
    the batch's documents and positions where the run keeps packed documents apart (attention_mask.packed_inputs)."""
    if chunks <= 1:
        logits = model(inputs, **packed)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    else:
        loss = model(inputs, targets=targets, loss_chunks=chunks, **packed) / targets.numel()
    return _local(loss)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean cross-entropy per token of logits already made (a pipeline's last stage hands them to its loss), in
    ``chunks`` slices of the sequence: each slice's fp32 copy and log-softmax live only while its loss is taken
    (recomputed in backward), instead of the whole micro-batch's at once."""
    if chunks <= 1:
        return _local(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))
    return _local(chunked_cross_entropy(logits, nn.Identity(), targets, chunks) / targets.numel())


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunks: int,
    logits_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` (hidden: batch x sequence x width) against ``targets``
    (batch x sequence), in ``chunks`` slices of the sequence (of the batch under sequence parallel). ``logits_transform``: what the
    family does to the logits before the loss (e.g. a soft cap)."""
    # Hidden states sharded over the sequence (tensor parallel's sequence parallel, a DTensor) are sliced
    # over the batch instead: a slice of the sharded dim would gather all of them first.
    dim = 0 if _sharded_over(hidden, 1) else 1
    n = min(chunks, hidden.shape[dim])
    total = None
    for h, t in zip(hidden.tensor_split(n, dim=dim), targets.tensor_split(n, dim=dim)):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss, h, t, head, logits_transform, use_reentrant=False)
        else:  # evaluation: nothing is kept for a backward
            part = _chunk_loss(h, t, head, logits_transform)
        total = part if total is None else total + part
    return total


def _chunk_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module,
    logits_transform: Optional[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    logits = head(hidden)
    if logits_transform is not None:
        logits = logits_transform(logits)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def _sharded_over(tensor: torch.Tensor, dim: int) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) and p.dim == dim for p in tensor.placements)


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A loss taken on vocabulary-sharded logits is a replicated DTensor: its value as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss
