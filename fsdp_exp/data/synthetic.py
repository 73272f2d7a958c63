"""``synthetic``: uniform random tokens, in documents of random lengths.

Sample ``i`` of the run (counted over all ranks and steps) is drawn from a generator seeded by
(trainer.seed, i), so a batch depends only on the step, the rank's slice and the seed: the same
tokens reach a 1-rank and an N-rank run, and resuming at step k needs nothing but k. Its documents
(``documents``: lengths uniform in [1, 2 x data.synthetic_doc_len - 1], the mean ``data.synthetic_doc_len``)
come from a second generator of (seed, i), so the tokens are those of a run that never asked for them.
"""

from __future__ import annotations

import torch

from fsdp_exp.config import RunConfig, Topology
from fsdp_exp.data.loader import StepData


DOCUMENT_SEED_OFFSET = 1 << 48  # the documents' generators: seeds no token generator of a run takes


class SyntheticSource:
    num_rows = None  # endless
    fingerprint = "synthetic"

    def __init__(self, seed: int, vocab_size: int, seq_len: int, doc_len: int = 0):
        self.seed, self.vocab_size, self.seq_len = seed, vocab_size, seq_len
        self.doc_len = doc_len or max(1, seq_len // 4)
        self.fingerprint = f"synthetic-seed{seed}-vocab{vocab_size}-len{seq_len}-docs{self.doc_len}"

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)

    def rows(self, first: int, count: int) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in range(first, first + count)])

    def sample_documents(self, index: int) -> torch.Tensor:
        """Sample ``index``'s document numbers (``seq_len + 1``, from 0)."""
        gen = torch.Generator().manual_seed(DOCUMENT_SEED_OFFSET + self.seed * 1_000_003 + index)
        lengths = torch.randint(1, 2 * self.doc_len, (self.seq_len + 1,), generator=gen)  # enough to fill a row
        return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths)[: self.seq_len + 1]

    def documents(self, first: int, count: int) -> torch.Tensor:
        return torch.stack([self.sample_documents(i) for i in range(first, first + count)])


class SyntheticTokens(StepData):
    def __init__(self, cfg: RunConfig, topology: Topology, dp_rank: int, device: torch.device):
        from fsdp_exp.data import model_vocab_size

        source = SyntheticSource(
            cfg.trainer.seed, model_vocab_size(cfg), cfg.trainer.seq_len, cfg.data.synthetic_doc_len or 0
        )
        super().__init__(source, cfg, topology, dp_rank, device)

    def sample(self, index: int) -> torch.Tensor:
        return self.source.sample(index)
