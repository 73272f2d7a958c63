"""Packed blocks as a source of rows: a deterministic per-epoch permutation over the cached blocks.

Global position ``p`` lies in epoch ``p // n`` (``n`` blocks) and reads block
``perm(seed, epoch)[p % n]``. Epochs follow each other without a gap: a global batch may end one
epoch and begin the next, and every block is read exactly once per epoch whatever the batch size,
the number of ranks or where a run was resumed.
"""

from __future__ import annotations

import numpy as np
import torch

from fsdp_exp.data.packing import Packed


class PackedBlocks:
    def __init__(self, packed: Packed, seed: int, shuffle: bool):
        self.packed, self.seed, self.shuffle = packed, seed, shuffle
        self.num_rows = packed.num_blocks
        self.fingerprint = packed.fingerprint
        self._blocks = self._starts = None  # memory-mapped on first use, in each process that reads
        self._perms: dict[int, np.ndarray] = {}

    def __getstate__(self):  # DataLoader workers started by spawn/forkserver map the file themselves
        return {**self.__dict__, "_blocks": None, "_starts": None, "_perms": {}}

    @property
    def blocks(self) -> np.ndarray:
        if self._blocks is None:
            self._blocks = self.packed.open_blocks()
        return self._blocks

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the blocks in ``epoch``: a function of (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_rows, generator=gen).numpy()
        return self._perms[epoch]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Block indices at global positions ``first .. first + count - 1``."""
        positions = np.arange(first, first + count)
        epochs, offsets = np.divmod(positions, self.num_rows)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[offsets[mask]]
        return out

    def rows(self, first: int, count: int) -> torch.Tensor:
        return torch.from_numpy(self.blocks[self.indices(first, count)].astype(np.int64))

    def documents(self, first: int, count: int) -> torch.Tensor:
        """The rows' document numbers (``rows``' shape): 0 for each block's first token's document, +1 at every
        document that starts inside the block, from the starts the packing recorded."""
        if self._starts is None:
            self._starts = np.asarray(self.packed.open_starts())
        seq_len = self.packed.meta["seq_len"]
        offsets = self.indices(first, count)[:, None] * seq_len + np.arange(seq_len + 1)
        numbers = np.searchsorted(self._starts, offsets, side="right") - 1
        return torch.from_numpy((numbers - numbers[:, :1]).astype(np.int32))
