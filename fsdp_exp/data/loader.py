"""One rank's micro-batches at a step, from any source of numbered token rows.

Every source answers "the row at global position p" (``rows(first, count)``), each row ``seq_len + 1``
tokens. The global batch of step ``s`` is positions ``s * global_batch_size ...`` and data-parallel rank
``r`` takes its contiguous slice of it, so a batch is a function of (step, rank, config) alone: resuming
at step ``k`` needs nothing but ``k``, which ``state_dict()`` / ``load_state_dict()`` record and check.
With ``data.num_workers > 0`` a ``torch.utils.data.DataLoader`` over the step-indexed micro-batches (its
sampler starting at the current step) keeps ``prefetch_factor`` micro-batches per worker in flight.
``last_wait_s`` is how long the last step waited for its data; the trainer logs it as
``perf/data_time_s``. Why: the docs page design.md ("Data").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from fsdp_exp.config import RunConfig, Topology


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq_len) token ids
    targets: torch.Tensor  # inputs shifted by one
    # (micro_batch, seq_len) int32: each input position's document number in its block (0 = the block's first)
    documents: Optional[torch.Tensor] = None


def make_batch(tokens: torch.Tensor, documents: torch.Tensor) -> Batch:
    """A batch of rows of ``seq_len + 1`` tokens (and their document numbers)."""
    return Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:], documents=documents[:, :-1])


@dataclass(frozen=True)
class Layout:
    """Where a rank's micro-batch ``k`` (counted over the run) sits in the global order."""

    global_batch: int
    per_rank: int
    micro: int
    dp_rank: int

    @property
    def accum(self) -> int:
        return self.per_rank // self.micro

    def first_position(self, k: int) -> int:
        step, i = divmod(k, self.accum)
        return step * self.global_batch + self.dp_rank * self.per_rank + i * self.micro


class _MicroBatches(Dataset):
    """Map-style view for the DataLoader: item ``k`` is the rank's ``k``-th micro-batch of the run."""

    def __init__(self, source, layout: Layout, end: int):
        self.source, self.layout, self.end = source, layout, end

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.layout.first_position(k)
        return self.source.rows(first, self.layout.micro), self.source.documents(first, self.layout.micro)


class StepData:
    """The trainer's data object: ``micro_batches(step)`` yields this rank's ``Batch``es of the step."""

    def __init__(
        self,
        source,
        cfg: RunConfig,
        topology: Topology,
        dp_rank: int,
        device: torch.device,
        val_source=None,
        val_batches: int = 0,
    ):
        self.source, self.val_source, self.device = source, val_source, device
        per_rank = topology.layout.local_batch(cfg.trainer.global_batch_size)
        self.layout = Layout(cfg.trainer.global_batch_size, per_rank, topology.micro_batch_size, dp_rank)
        self.total_steps = cfg.trainer.steps
        self.num_workers = cfg.data.num_workers
        self.prefetch_factor = cfg.data.prefetch_factor
        self.val_batches = val_batches
        self.next_step = 0  # the step micro_batches expects next; what a checkpoint saves
        self.last_wait_s = 0.0
        self._iter: Optional[Iterator[torch.Tensor]] = None
        self._next_k = self._end_k = 0
        self._val_cache: Optional[list[Batch]] = None

    # ----------------------------------------------------------------------------------- train
    def micro_batches(self, step: int) -> Iterator[Batch]:
        """The micro-batches this rank trains on at ``step`` (0-based), in order."""
        accum = self.layout.accum
        if self._iter is None or self._next_k != step * accum:
            self._start(step)
        wait = 0.0
        for _ in range(accum):
            t0 = time.perf_counter()
            tokens, documents = (t.to(self.device, non_blocking=True) for t in next(self._iter))
            wait += time.perf_counter() - t0
            self._next_k += 1
            if self._next_k == self._end_k:
                self.close()
            yield make_batch(tokens, documents)
        self.last_wait_s = wait
        self.next_step = step + 1

    def _start(self, step: int) -> None:
        self.close()
        accum = self.layout.accum
        self._next_k = step * accum
        self._end_k = max(self.total_steps, step + 1) * accum
        dataset = _MicroBatches(self.source, self.layout, self._end_k)
        if self.num_workers == 0:
            self._iter = (dataset[k] for k in range(self._next_k, self._end_k))
        else:
            loader = DataLoader(
                dataset,
                batch_size=None,
                sampler=range(self._next_k, self._end_k),
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                pin_memory=self.device.type == "cuda",
            )
            self._iter = iter(loader)

    def close(self) -> None:
        """Stop the loader's workers (they are also stopped after the run's last step)."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    # --------------------------------------------------------------------------------- position
    def state_dict(self) -> dict:
        """Where the data stands: the next step, and what identifies the data it indexes."""
        samples = self.next_step * self.layout.global_batch
        state = {
            "step": self.next_step,
            "samples_seen": samples,
            "global_batch_size": self.layout.global_batch,
            "fingerprint": self.source.fingerprint,
        }
        if self.source.num_rows is not None:
            state.update(
                epoch=samples // self.source.num_rows,
                position_in_epoch=samples % self.source.num_rows,
                num_blocks=self.source.num_rows,
            )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; refuses a position saved on other data or another batch size."""
        for key, mine in (("fingerprint", self.source.fingerprint), ("global_batch_size", self.layout.global_batch)):
            if state.get(key) != mine:
                raise ValueError(
                    f"the data position was saved with {key}={state.get(key)!r}, this run has {mine!r}: "
                    "resuming would not continue the same sequence of batches"
                )
        self.close()
        self.next_step = int(state["step"])
        self._start(self.next_step)  # workers start prefetching the resumed step now

    # ------------------------------------------------------------------------------ validation
    def val_micro_batches(self) -> Iterator[Batch]:
        """The rank's share of the first ``data.val_batches`` global batches of the validation data,
        in file order (the same tokens at every evaluation); kept on the device after the first call."""
        if self.val_source is None:
            return iter(())
        if self._val_cache is None:
            lay = self.layout
            self._val_cache = []
            for v in range(self.val_batches):
                for i in range(lay.accum):
                    first = v * lay.global_batch + lay.dp_rank * lay.per_rank + i * lay.micro
                    tokens = self.val_source.rows(first, lay.micro).to(self.device)
                    documents = self.val_source.documents(first, lay.micro).to(self.device)
                    self._val_cache.append(make_batch(tokens, documents))
        return iter(self._val_cache)
