"""The step-time model's mixture-of-experts terms: what a model's routed experts add to one step of one rank,
counted for ``fsdp_exp.tune.perf.step_costs`` and timed for its ``timing``.

- **the routed experts** (``expert_costs``): their grouped matmuls by tokens per expert (T x k / E, ep times that
  under EP), the most loaded EP rank's share of the copies (``rank_load`` of ``expert_imbalance``).
- **expert parallel** (``parallel.ep``, fsdp_exp/parallel/expert.py): per MoE layer and micro-batch two all-to-alls
  of the routed copies in forward (dispatch, combine), two in backward and two more per block activation
  checkpointing recomputes, on the critical path, over the ep consecutive ranks (NVLink while ep <=
  nproc_per_node; ``all_to_all_traffic``); the experts' all-gathers and reduce-scatters over efsdp = shard / ep
  ranks, 1/ep of the experts each (``expert_traffic``; the dense units keep the shard group).
- **timing**: the experts' grouped matmuls at m / (m + h) of the rate with m tokens per expert
  (``grouped_seconds``, by kernel class on a GPU; ``grouped_extra_flops`` on a CPU, as FLOPs at the step's rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_exp.config.layout import efsdp_size
from fsdp_exp.tune.traffic import Traffic, group_nodes

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.plan.devices import DevicePerf


@dataclass(frozen=True)
class ExpertCosts:
    """A mixture of experts' routed experts in one step of one rank (``expert_costs``)."""

    ep: int
    tokens_per_expert: float  # rows each of this rank's experts gets in one micro-batch's grouped matmul (mean)
    load: float  # the most loaded EP rank's routed copies over the mean (1 at ep=1): it sets the pace
    # (M = tokens_per_expert, K, N, forward FLOPs on this rank, the load included) of each grouped matmul shape
    grouped: tuple[tuple[float, float, float, float], ...]
    balanced_flops: float  # the same FLOPs at an even load: what the model FLOPs (compute) already count


_EXPERT_LAYERS: dict[tuple, tuple[int, int]] = {}


def expert_layers(cfg: "RunConfig") -> tuple[int, int]:
    """(MoE layers, the routed experts' parameter elements over all of them), from the family's own answer
    (``ModelSpec.expert_modules``: a family without routed experts fsdp_exp can split names none)."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.models.spec import config_key

    key = config_key(cfg.model)
    if key not in _EXPERT_LAYERS:
        spec = spec_for(cfg.model)
        modules = spec.expert_modules(spec.meta_model(cfg.model))
        prefixes = tuple(m + "." for m in modules)
        numel = sum(p.numel for p in spec.inventory(cfg.model).params if p.name.startswith(prefixes))
        _EXPERT_LAYERS[key] = (len(modules), numel)
    return _EXPERT_LAYERS[key]


def rank_load(imbalance: float, experts: int, ep: int) -> float:
    """The most loaded EP rank's routed copies over the mean, from the experts' max / mean (``imbalance``): the
    hottest expert on one rank, the rank's other experts sharing what the rest of the experts get evenly. At ep=1
    every rank holds every expert (1: its total is its tokens x k whatever the split); at ep = experts it is the
    expert's own imbalance; between, the rank's other experts dilute it. A lower bound: hot experts that share a
    rank weigh more (pass that rank's figure as the imbalance then)."""
    if ep <= 1 or imbalance <= 1 or experts <= 1:
        return 1.0
    per_rank = experts / ep
    others = (experts - imbalance) / (experts - 1)  # each other expert's load, over the mean
    return (imbalance + (per_rank - 1) * others) / per_rank


def expert_costs(w, tokens: float, micro_tokens: float, ep: int, imbalance: float) -> ExpertCosts:
    """The routed experts' grouped matmuls on this rank: each (M, K, N) with M the copies each of its experts gets
    in one micro-batch: ``micro_tokens x k / E`` at ep=1, ep times that under EP (each rank runs E / ep experts on
    the copies every rank of its group sends them); the step's FLOPs (``tokens`` on this rank) times the load."""
    groups = max(g for _, _, g, _ in w.grouped_gemms)
    k = w.routed_copies_per_token
    m = max(ep * micro_tokens * k / groups, 1e-9)
    load = rank_load(imbalance, groups, ep)
    grouped = tuple((m, float(kk), float(n), tokens * f * load) for kk, n, _, f in w.grouped_gemms)
    return ExpertCosts(ep, m, load, grouped, tokens * sum(f for *_, f in w.grouped_gemms))


def expert_traffic(moe, ep, shard, tp, nproc, G, R, regather, cfg, e_p, e_r) -> list[Traffic]:
    """FSDP2's collectives of the routed experts under expert parallel (fsdp_exp/parallel/fsdp2.py shards each
    layer's experts as its own unit over efsdp, the shard ranks EP leaves): each rank gathers its E / ep experts
    over shard / ep ranks (ep apart), 1/ep of what ep=1 gathers over all the shard ranks; reduce-scatters the same.
    None where efsdp is one rank (ep = shard: each rank holds its experts whole)."""
    layers, numel = moe
    efsdp = efsdp_size(shard, ep)
    if efsdp <= 1 or not layers:
        return []
    nodes = group_nodes(tp * ep, efsdp, nproc)
    local = numel / ep  # the experts one EP rank holds, gathered
    out = [
        Traffic(
            "experts' all-gather (efsdp)",
            "all-gather",
            efsdp,
            nodes,
            G * layers,
            G * e_p * local,
            "forward",
            cfg.prefetch.forward > 0,
        )
    ]
    if regather:
        out.append(
            Traffic(
                "experts' re-gather (efsdp)",
                "all-gather",
                efsdp,
                nodes,
                G * layers,
                G * e_p * local,
                "backward",
                cfg.prefetch.backward != 0,
            )
        )
    out.append(
        Traffic(
            "experts' reduce-scatter (efsdp)",
            "reduce-scatter",
            efsdp,
            nodes,
            R * layers,
            R * e_r * local,
            "backward",
            True,
        )
    )
    return out


def all_to_all_traffic(cfg, topology, layers: int, ep: int, G: int, e: int, load: float, recomputed: float) -> list:
    """Expert parallel's dispatch and combine (fsdp_exp/parallel/expert.py): per MoE layer and micro-batch, two
    all-to-alls of every routed copy's hidden state (k per token, ``param_dtype``) over the EP group (ep
    consecutive ranks: inside a node while ep <= nproc_per_node, else over the network) in forward, two in
    backward (the gradients the other way), and two more in backward for every block activation checkpointing
    recomputes (``recomputed``: their share). On the critical path: the layer waits for its tokens. The most
    loaded rank receives ``load`` x the mean. (The counts' exchange before each dispatch is latency only: left
    to the latency of the dispatch itself.)"""
    from fsdp_exp.plan.activations import profile_for

    w_k = work_copies(cfg)
    stream = profile_for(cfg.model, topology.micro_batch_size, cfg.trainer.seq_len, 1, False).residual(1)
    moved = stream * w_k * e * load  # one all-to-all's bytes: this rank's routed copies
    nodes = group_nodes(topology.tp_size, ep, topology.nproc_per_node)
    out = []
    for phase, per_layer in (("forward", 2), ("backward", 2 + 2 * recomputed)):
        count = G * layers * per_layer
        out.append(
            Traffic(f"expert all-to-all ({phase})", "all-to-all", ep, nodes, round(count), count * moved, phase, False)
        )
    return out


def work_copies(cfg: "RunConfig") -> float:
    from fsdp_exp.tune.work import work

    return work(cfg).routed_copies_per_token


def grouped_seconds(x: ExpertCosts, perf: "DevicePerf", rate: float, operand_bytes: int) -> float:
    """The routed experts' grouped matmuls (forward): each expert's (M, K, N) at the large-shape rate, slowed by
    few rows per expert (``DevicePerf.grouped_gemm_half_tokens``: M of them halve the rate; on a GPU the 128-row
    tiles' padding, on a CPU measured: benchmarks/grouped_mm.py), and never faster than reading each expert's
    weight and its rows once (the roofline: few tokens per expert make the experts memory-bound)."""
    bandwidth = perf.memory_gbps * 1e9 * perf.memory_efficiency
    total = 0.0
    for m, k, n, flops in x.grouped:
        calls = flops / (2 * m * k * n)  # one per expert and micro-batch
        compute = flops / rate * (1 + perf.grouped_gemm_half_tokens / m)
        total += max(compute, calls * operand_bytes * (m * k + k * n + m * n) / bandwidth)
    return total


def grouped_extra_flops(x: ExpertCosts, perf: "DevicePerf") -> float:
    """The experts' grouped matmuls beyond their balanced FLOPs at the full rate (few rows, the load), where compute
    is timed as FLOPs (no kernel classes, as on a CPU): what ``compute_seconds`` adds to the forward (twice to backward)."""
    return sum(f * (1 + perf.grouped_gemm_half_tokens / m) for m, _, _, f in x.grouped) - x.balanced_flops
