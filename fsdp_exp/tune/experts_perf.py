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
- **the dispatcher** (``ExpertDispatch``): fsdp_exp's own layer (the default) sends every routed copy of a token over
  the all-to-all and permutes the copies with eager operators (gathered, masked, weighted, scattered back: what
  ``fsdp_exp.tune.work`` counts in its forward). A fused dispatcher (DeepEP's, with the fused permutation of
  TransformerEngine / Megatron-Core, as NeMo AutoModel's published MoE runs have it) sends each token once to each
  EP rank that holds one of its experts, expands it to its copies there and sums them back there before the
  combine, the routing weights applied inside the fused SwiGLU: fewer bytes on the all-to-all
  (``destination_ranks`` per token, not k) and the permutation's memory traffic as one read and one write of each
  tensor (``moe_memory_elements``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

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


@dataclass(frozen=True)
class ExpertDispatch:
    """How a mixture of experts' routed copies travel and are permuted (see the module docstring). ``fused=False``
    is fsdp_exp's own layer (``fsdp_exp.parallel.expert``): every copy on the all-to-all, the permutation as its eager
    operators move it. ``fused=True``: a deduplicating dispatcher with fused permutation kernels (DeepEP's);
    ``ranks_per_token`` the EP ranks each token is sent to, None for what a router spreading its top k uniformly
    at random over the experts gives (``destination_ranks``)."""

    fused: bool = False
    ranks_per_token: Optional[float] = None
    source: str = "fsdp_exp's dispatcher"


OWN_DISPATCH = ExpertDispatch()


def destination_ranks(k: int, experts: int, ep: int, consecutive: bool = False) -> float:
    """The EP ranks a token's k routed copies land on (each rank holds experts / ep consecutive experts), on average.
    A router picking k of the experts uniformly at random: ep x (1 - C(E - E/ep, k) / C(E, k)), the chance that a rank
    holds none of them taken from each. ``consecutive``: a router that hands token i the k experts from i x k on
    (modulo E: the force-balanced "fake" gate of NeMo AutoModel's benchmarks), which span few ranks: every start the
    tokens take, the ranks its k experts cross."""
    if ep <= 1 or experts <= 0:
        return 1.0
    per_rank = experts // ep
    if consecutive:
        starts = [(i * k) % experts for i in range(experts // math.gcd(k, experts))]
        spans = [((s + k - 1) % experts) // per_rank - s // per_rank for s in starts]
        return sum(span % ep + 1 for span in spans) / len(spans)
    return ep * (1 - math.comb(experts - per_rank, k) / math.comb(experts, k))


def moe_memory_elements(w, ranks_per_token: float) -> float:
    """Per token, every MoE layer of a forward: the elements a fused layer's memory-bound kernels read and write (the
    router's top k of its scores; the permutation reading each token once per EP rank it reached and writing its k
    copies; the SwiGLU reading both projections' outputs and writing the product, the routing weight applied there;
    the unpermutation reading the k outputs and writing one sum per rank), each tensor once: 2 (k + r) d + 3 k h +
    E + 2 k with r = ``ranks_per_token`` (1 without expert parallel), d the model's width, h the experts' width and E
    the experts. What the eager layer moves instead is ``Work.moe_memory_elements_per_token``."""
    if not w.grouped_gemms:
        return 0.0
    d, h, experts, _ = w.grouped_gemms[0]  # the first projection: (d, h) per expert
    k = w.routed_copies_per_token
    per_layer = 2 * (k + ranks_per_token) * d + 3 * k * h + experts + 2 * k
    return per_layer * w.moe_layers


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


def all_to_all_traffic(
    cfg, topology, layers: int, ep: int, G: int, e: int, load: float, recomputed: float, dispatch=OWN_DISPATCH
) -> list:
    """Expert parallel's dispatch and combine (fsdp_exp/parallel/expert.py): per MoE layer and micro-batch, two
    all-to-alls of every routed copy's hidden state (k per token, ``param_dtype``) over the EP group (ep
    consecutive ranks: inside a node while ep <= nproc_per_node, else over the network) in forward, two in
    backward (the gradients the other way), and more in backward for every block activation checkpointing
    recomputes (``recomputed``: their share): two through fsdp_exp's layer, whose routing weights multiply the
    combined outputs (their gradient needs them, so the recompute runs the combine too), one through a fused
    dispatcher, which applies the weights inside the SwiGLU: the recompute stops (non-reentrant checkpointing's early
    stop) once the down projection's input is back, before the combine. On the critical path: the layer waits for its
    tokens. The most loaded rank receives ``load`` x the mean. (The counts' exchange before each dispatch is latency
    only: left to the latency of the dispatch itself.)"""
    from fsdp_exp.plan.activations import profile_for

    copies = sent_per_token(cfg, ep, dispatch)
    stream = profile_for(cfg.model, topology.micro_batch_size, cfg.trainer.seq_len, 1, False).residual(1)
    moved = (
        stream * copies * e * load
    )  # one all-to-all's bytes: this rank's routed copies (a fused dispatcher's tokens)
    nodes = group_nodes(topology.tp_size, ep, topology.nproc_per_node)
    again = 1 if dispatch.fused else 2  # all-to-alls a recomputed layer runs again
    out = []
    for phase, per_layer in (("forward", 2), ("backward", 2 + again * recomputed)):
        count = G * layers * per_layer
        out.append(
            Traffic(f"expert all-to-all ({phase})", "all-to-all", ep, nodes, round(count), count * moved, phase, False)
        )
    return out


def work_copies(cfg: "RunConfig") -> float:
    from fsdp_exp.tune.work import work

    return work(cfg).routed_copies_per_token


def sent_per_token(cfg: "RunConfig", ep: int, dispatch: ExpertDispatch = OWN_DISPATCH) -> float:
    """Rows of the model's width each token puts on the all-to-all: its k routed copies (fsdp_exp's dispatcher), or
    one per EP rank it reaches (a fused dispatcher: ``dispatch.ranks_per_token``, else ``destination_ranks``)."""
    k = work_copies(cfg)
    if not dispatch.fused:
        return k
    if dispatch.ranks_per_token is not None:
        return dispatch.ranks_per_token
    return destination_ranks(int(k), cfg.model.n_experts, ep)


def memory_elements(w, cfg: "RunConfig", ep: int, dispatch: ExpertDispatch = OWN_DISPATCH) -> float:
    """The forward's memory-bound elements per token (``Work.memory_elements_per_token``), its mixture-of-experts
    layers' part as the dispatcher moves it: counted from the eager layer, or a fused layer's
    (``moe_memory_elements``)."""
    if not dispatch.fused or not w.moe_layers:
        return w.memory_elements_per_token
    ranks = sent_per_token(cfg, ep, dispatch) if ep > 1 else 1.0
    return w.memory_elements_per_token - w.moe_memory_elements_per_token + moe_memory_elements(w, ranks)


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
