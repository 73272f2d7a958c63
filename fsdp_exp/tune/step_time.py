"""The step-time model's front: what one step of a configuration does and how long it takes on a device.

A one-stage run is counted and timed by ``fsdp_exp.tune.perf`` (``StepCosts``); a pipeline run
(``parallel.pp > 1``) by ``fsdp_exp.tune.pipeline_perf`` (``PipelineCosts``), which builds on perf's
primitives. Callers (tune's search, the calibration, the published record) come here, so neither model
imports the other's caller and the two stay one-way: perf < pipeline_perf < step_time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_exp.tune.experts_perf import OWN_DISPATCH
from fsdp_exp.tune.perf import StepCosts, StepPrediction, step_costs, timing
from fsdp_exp.tune.pipeline_perf import pipeline_costs, pipeline_timing

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.config.topology import Topology
    from fsdp_exp.plan.devices import DevicePerf


def costs_for(cfg: "RunConfig", topology: "Topology", expert_imbalance: float = 1.0, dispatch=OWN_DISPATCH):
    """What one step of ``cfg`` does: ``StepCosts``, or for a pipeline run (parallel.pp > 1: stages, a schedule,
    sends between them) ``fsdp_exp.tune.pipeline_perf.PipelineCosts``; ``time_costs`` times either.
    ``expert_imbalance``: a mixture of experts' max / mean routed copies per expert (1.0: balanced); ``dispatch``:
    how its routed copies travel (``fsdp_exp.tune.experts_perf.ExpertDispatch``, fsdp_exp's own by default)."""
    if cfg.parallel.pp > 1:
        return pipeline_costs(cfg, topology)
    return step_costs(cfg, topology, expert_imbalance, dispatch)


def time_costs(costs, perf: "DevicePerf") -> StepPrediction:
    if isinstance(costs, StepCosts):
        return timing(costs, perf)
    return pipeline_timing(costs, perf)


def predict(
    cfg: "RunConfig", topology: "Topology", perf: "DevicePerf", expert_imbalance: float = 1.0, dispatch=OWN_DISPATCH
) -> StepPrediction:
    return time_costs(costs_for(cfg, topology, expert_imbalance, dispatch), perf)


__all__ = ["costs_for", "predict", "time_costs"]
