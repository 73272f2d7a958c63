"""Runs that measured the same thing under different labels, and runs that repeat one configuration.

A ranking that counted ``sharding=ddp`` and ``sharding=no_shard sharding.backend=ddp`` both would show
one setting twice, and a sweep's per-option means would credit one option with another's run. So runs
are compared by what they ran (fsdp_exp.identity): the same settings, repeat included, is a duplicate,
counted once; the same settings with another ``trainer.repeat`` is a repeat of one configuration, which
the report groups (fsdp_exp.report.repeats).
"""

from __future__ import annotations

from typing import Optional

from fsdp_exp import identity
from fsdp_exp.report.load import Run


def settings(run: Run) -> Optional[dict]:
    """What the run ran, as a plain dict; None when the record lacks what the key needs."""
    return identity.settings(run.config, run.applied, run.topology, run.env)


def settings_key(run: Run) -> Optional[str]:
    return identity.digest(settings(run))


def configuration_key(run: Run) -> Optional[str]:
    """The settings key less ``trainer.repeat``: shared by every repeat of one configuration."""
    return identity.digest(identity.configuration(run.config, run.applied, run.topology, run.env))


def configuration_id(run: Run) -> Optional[str]:
    """The short form W&B gets as the run's job type (``cfg-<12 hex digits>``)."""
    return identity.configuration_id(run.config, run.applied, run.topology, run.env)


def find_duplicates(runs: list[Run]) -> dict[int, int]:
    """Index of each duplicate run -> index of the first run (in the given order) with its settings.

    The first of a group is the one counted: in a Hydra sweep that is the lowest job number, a choice
    that does not depend on the measured numbers (keeping the faster copy would favour noise).
    """
    first: dict[str, int] = {}
    same_as: dict[int, int] = {}
    for index, run in enumerate(runs):
        key = settings_key(run)
        if key is None:
            continue
        if key in first:
            same_as[index] = first[key]
        else:
            first[key] = index
    return same_as
