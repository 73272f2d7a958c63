"""Training data, one rank's share at a time.

``synthetic``: uniform random tokens. Sample ``i`` of the run (counted over all ranks and steps) is
drawn from a generator seeded by (trainer.seed, i), so a batch depends only on the step, the rank's
slice and the seed: the same tokens reach a 1-rank and an N-rank run, and resuming at step k needs
nothing but k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from fsdp_exp.config import RunConfig, Topology


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq_len) token ids
    targets: torch.Tensor  # inputs shifted by one


class SyntheticTokens:
    def __init__(self, cfg: RunConfig, topology: Topology, dp_rank: int, device: torch.device):
        self.seed = cfg.trainer.seed
        self.vocab_size = cfg.model.vocab_size
        self.seq_len = cfg.trainer.seq_len
        self.global_batch = cfg.trainer.global_batch_size
        self.per_rank = self.global_batch // topology.dp_size
        self.micro = topology.micro_batch_size
        self.dp_rank = dp_rank
        self.device = device

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)

    def micro_batches(self, step: int) -> Iterator[Batch]:
        """The micro-batches this rank trains on at ``step`` (0-based), in order."""
        first = step * self.global_batch + self.dp_rank * self.per_rank
        for start in range(first, first + self.per_rank, self.micro):
            tokens = torch.stack([self.sample(i) for i in range(start, start + self.micro)]).to(self.device)
            yield Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:])


def build_data(cfg: RunConfig, topology: Topology, dp_rank: int, device: torch.device) -> SyntheticTokens:
    return SyntheticTokens(cfg, topology, dp_rank, device)
