"""What every family's activation model answers (``ActivationProfile``, the planner's step walk reads it)
and the token arithmetic they share (``TokenCounts``)."""

from __future__ import annotations

from typing import Protocol


class TokenCounts:
    """``tokens`` and ``logits`` of an activation profile from its ``b`` (micro-batch), ``s`` (sequence length)
    and ``vocab``: the same arithmetic for every model family."""

    b: int
    s: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def logits(self) -> int:
        return self.tokens * self.vocab


class ActivationProfile(Protocol):
    """Per-rank activation sizes of one micro-batch, as the planner's step walk uses them.

    ``e`` is the compute dtype's size in bytes. Sizes are bytes unless the name says elements.
    Under ``autocast`` (DDP's mixed precision) weights are cast per use and the residual stream
    stays fp32.
    """

    tokens: int  # sequences x sequence length of one micro-batch
    logits: int  # elements of the logits
    peak_weight_grad: int  # elements of the weight gradient made at a block's backward peak
    block_weight_grads: int  # elements of the weight gradients a block holds at that peak, unsharded

    def residual(self, e: int) -> int:
        """One tensor of the residual stream on this rank."""

    def block_saved(self, e: int, autocast: bool, math_attention: bool) -> dict[str, int]:
        """What one block keeps for backward, by piece, with ``total`` (its input included)."""

    def op_level_saved(self, e: int, ops: str) -> int:
        """What a block keeps under op-level selective checkpointing (``ac.ops``), beyond its input."""

    def checkpointed_forward_peak(self, e: int) -> int:
        """Alive at a checkpointed block's forward peak, beyond its input."""

    def op_level_forward_peak(self, e: int, ops: str) -> int:
        """Alive at an op-level checkpointed block's forward peak, beyond what it keeps and its output."""

    def backward_peak(self, e: int) -> int:
        """Activation gradients at a block's backward peak, beyond the one arriving from above."""

    def dispatch_forward_peak(self, e: int) -> int:
        """Expert parallel: what a block's dispatch and combine hold past its saved tensors while its experts
        run (0 without it)."""

    def head_saved(self, e: int, autocast: bool) -> int:
        """What the layers between the last block and the logits keep for backward (the final norm)."""

    def math_attention(self, device_kind: str, e: int) -> bool:
        """Whether attention runs a kernel that saves the whole score matrix here."""

    def notes(self, device_kind: str, e: int) -> list[str]:
        """Assumptions the planner states for this model on this device."""
