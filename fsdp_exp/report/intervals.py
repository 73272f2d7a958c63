"""How sure a median is: a bootstrap interval, and which intervals count as tied.

A configuration measured by several repeats is summarized by the median of its runs' medians, and its
interval resamples those run medians: it covers run-to-run variation on the machine that ran them.
Measured once, the interval resamples that run's measured steps instead, covers only the jitter within
one run, and says so (``over="steps"``). Neither covers what every run of a sweep shares (the machine,
software, seed and data) nor a drift that lasts the whole sweep; with few values a percentile bootstrap
is coarse (up to 5 values its 95% interval is their range). The resampling uses a fixed seed, so the
same records give the same report. The reader's view: the docs page reports.md ("Comparing runs with
repeats").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A median, its interval (``low``..``high``, None when there is none) and what it resampled."""

    median: float
    low: Optional[float]
    high: Optional[float]
    over: Optional[str]  # "repeats" | "steps" | None (no interval)
    n: int  # how many values the interval resampled (repeats, or the one run's steps)
    note: Optional[str] = None  # why there is no interval

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None


def bootstrap_median(
    values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED
) -> Optional[tuple[float, float]]:
    """The percentile bootstrap interval of the median of ``values``; None for fewer than two values."""
    data = np.asarray(list(values), dtype=float)
    if data.size < 2:
        return None
    rng = np.random.default_rng(seed)
    medians = np.median(data[rng.integers(0, data.size, size=(resamples, data.size))], axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return float(low), float(high)


def estimate(run_medians: Sequence[float], steps: Optional[Sequence[float]] = None) -> Estimate:
    """The median over repeats of the runs' medians, with its interval: over the repeats when there are two
    or more, else over ``steps`` (the one run's per-step values of the same metric)."""
    medians = list(run_medians)
    if not medians:
        raise ValueError("no run to estimate from")
    centre = statistics.median(medians)
    if len(medians) >= 2:
        low, high = bootstrap_median(medians)
        return Estimate(centre, low, high, "repeats", len(medians))
    if steps is None:
        return Estimate(centre, None, None, None, 1, "one run, and its per-step values are not at hand")
    bounds = bootstrap_median(steps)
    if bounds is None:
        return Estimate(centre, None, None, None, 1, f"one run with {len(steps)} measured step(s)")
    return Estimate(centre, bounds[0], bounds[1], "steps", len(steps))


def overlap(a: Estimate, b: Estimate) -> Optional[bool]:
    """Whether two intervals share a value (closed intervals); None when either has none."""
    if not (a.has_interval and b.has_interval):
        return None
    return a.low <= b.high and b.low <= a.high
