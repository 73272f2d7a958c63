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
        return pipeline_costs(cfg, topology, expert_imbalance, dispatch)
    return step_costs(cfg, topology, expert_imbalance, dispatch)


def time_costs(costs, perf: "DevicePerf") -> StepPrediction:
    if isinstance(costs, StepCosts):
        return timing(costs, perf)
    return pipeline_timing(costs, perf)


def predict(
    cfg: "RunConfig", topology: "Topology", perf: "DevicePerf", expert_imbalance: float = 1.0, dispatch=OWN_DISPATCH
) -> StepPrediction:
    return time_costs(costs_for(cfg, topology, expert_imbalance, dispatch), perf)


def run_prediction(cfg: "RunConfig", topology: "Topology") -> dict:
    """What a run records of the step-time model (``run.json["plan"]["step_time"]``), so that its report can set
    each part of the measured step beside the predicted one: the step's seconds in parts (compute, exposed
    collectives by kind, pipeline bubble, optimizer, the rest) on the device it runs on: a GPU of the device
    table, or this CPU host from its cached probe (a run starts no probe: ``python -m fsdp_exp.tune`` measures one).
    Never raises: ``{"error": why}`` where there is no prediction."""
    from fsdp_exp.env import default_threads
    from fsdp_exp.metrics.comm import COMM_KINDS
    from fsdp_exp.plan.devices import table_device
    from fsdp_exp.tune.probe import block_shape, cpu_perf, has_cpu_probe

    try:
        if topology.device_type == "cuda":
            import torch

            device = table_device(torch.cuda.get_device_name(0))
            if device is None or device.perf is None:
                return {"error": f"{torch.cuda.get_device_name(0)} has no entry in the device table"}
            perf, source = device.perf, device.name
        else:
            nproc = topology.nproc_per_node
            threads = cfg.trainer.threads_per_rank or default_threads(nproc)
            found = (
                cpu_perf(nproc, threads, block_shape(cfg), measure_now=False) if has_cpu_probe(nproc, threads) else None
            )
            if found is None:
                return {
                    "error": f"no probe of this CPU at {nproc} ranks x {threads} threads is cached (python -m "
                    "fsdp_exp.tune with the run's overrides measures one)"
                }
            perf, source = found[0], "this CPU's cached probe"
        prediction = predict(cfg, topology, perf)
    except Exception as err:  # noqa: BLE001 - the prediction is an aside to the run
        return {"error": f"{type(err).__name__}: {err}"}
    b = prediction.breakdown
    exposed = prediction.exposed_by_kind()
    parts = {"compute": b.get("compute", 0.0)}
    parts.update({f"exposed {k.replace('_', '-')}": exposed.get(k, 0.0) for k in COMM_KINDS})
    parts.update(
        bubble=b.get("bubble", 0.0), optimizer=b.get("optimizer", 0.0), other=b.get("offload", 0.0) + b["overhead"]
    )
    return {
        "step_time_s": prediction.step_time_s,
        "tokens_per_s": prediction.tokens_per_s,
        "parts": parts,
        "perf": source,
    }


__all__ = ["costs_for", "predict", "run_prediction", "time_costs"]
