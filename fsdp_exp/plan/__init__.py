"""The memory planner: each rank's memory for a configuration, by arithmetic, before anything runs
(``python -m fsdp_exp.plan <run overrides>``; what it predicts and how: ``fsdp_exp.plan.cli``).

- ``states``: every parameter's per-rank size under the backend's layout, the model states at rest;
- ``step``: the training step walked phase by phase, each phase's live bytes;
- ``predict``: ``plan()`` puts them together (the ``Plan``), ``plan_for_run`` is what a run records;
- ``devices``: the device table, the allocator margin, whether a plan fits;
- ``cli``: the command line (``__main__``).

The planner reads the model family's spec (``fsdp_exp.models.spec``: the inventory, the activation
profile, the tensor-parallel plan) and the backend's ``PlannerRules``; it knows no parameter's name
and asks no backend its name.
"""

from fsdp_exp.plan.cli import PlanOptionError, compose, main, plan_from_argv, split_argv  # noqa: F401
from fsdp_exp.plan.devices import DEVICES, Device, allocator_margin, device_table, fits  # noqa: F401
from fsdp_exp.plan.predict import (  # noqa: F401
    PREDICTED_METRICS,
    PREDICTED_STAGE_METRICS,
    Plan,
    loss_chunks_for,
    peak_and_need,
    peak_floor,
    plan,
    plan_for_run,
)
