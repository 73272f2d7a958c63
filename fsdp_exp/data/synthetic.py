"""``synthetic``: uniform random tokens.

Sample ``i`` of the run (counted over all ranks and steps) is drawn from a generator seeded by
(trainer.seed, i), so a batch depends only on the step, the rank's slice and the seed: the same
tokens reach a 1-rank and an N-rank run, and resuming at step k needs nothing but k.
"""

from __future__ import annotations

import torch

from fsdp_exp.config import RunConfig, Topology
from fsdp_exp.data.loader import StepData


class SyntheticSource:
    num_rows = None  # endless
    fingerprint = "synthetic"

    def __init__(self, seed: int, vocab_size: int, seq_len: int):
        self.seed, self.vocab_size, self.seq_len = seed, vocab_size, seq_len
        self.fingerprint = f"synthetic-seed{seed}-vocab{vocab_size}-len{seq_len}"

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)

    def rows(self, first: int, count: int) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in range(first, first + count)])


class SyntheticTokens(StepData):
    def __init__(self, cfg: RunConfig, topology: Topology, dp_rank: int, device: torch.device):
        from fsdp_exp.data import model_vocab_size

        source = SyntheticSource(cfg.trainer.seed, model_vocab_size(cfg), cfg.trainer.seq_len)
        super().__init__(source, cfg, topology, dp_rank, device)

    def sample(self, index: int) -> torch.Tensor:
        return self.source.sample(index)
