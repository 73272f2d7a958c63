"""Collectives in the step-time model: ``Traffic``, the collectives of one purpose in one step of one rank (what
``fsdp_exp.tune.perf.step_costs``, the experts' counts in ``fsdp_exp.tune.experts_perf`` and the pipeline's in
``fsdp_exp.tune.pipeline_perf`` build), and their seconds on a device's links (``DevicePerf.intra`` / ``inter``):

- a collective over a ring of n ranks (the alpha-beta model): an all-gather or a reduce-scatter takes
  ``(n-1) x latency + (n-1)/n x bytes / bandwidth``, an all-reduce twice that; the link is the node's
  (``intra``) when the group stays in one node, else the network's (``inter``): a network given per node
  (a GPU's) carries the group's traffic over all of the node's cards, shared with the node's other groups
  (``traffic_seconds``); an all-to-all across nodes is no ring: each rank's off-node share crosses the network at
  once with the node's other ranks' (``all_to_all_seconds``).

How long a phase's collectives stay exposed behind its compute is the step's business (``fsdp_exp.tune.perf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_exp.plan.devices import DevicePerf


@dataclass(frozen=True)
class Traffic:
    """Collectives of one purpose in one step of one rank."""

    purpose: str  # e.g. "forward all-gather"
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | ring pass
    ranks: int  # the group's size
    nodes: int  # nodes the group spans
    count: int  # collectives per step
    bytes: float  # the full (unsharded) tensors' bytes, summed over the count
    phase: str  # forward | backward
    overlappable: bool
    behind_attention: bool = False  # ring attention's key/value passes: hidden behind attention's compute only


def group_nodes(stride: int, size: int, ranks_per_node: int) -> int:
    """Nodes spanned by rank 0's group of ``size`` ranks ``stride`` apart."""
    return len({(i * stride) // ranks_per_node for i in range(size)})


def collective_seconds(kind: str, ranks: int, nbytes: float, count: int, latency_us: float, gbps: float) -> float:
    """The alpha-beta time of ``count`` ring collectives moving ``nbytes`` (full tensors) in all."""
    if ranks <= 1:
        return 0.0
    rounds = 2 if kind == "all-reduce" else 1
    return rounds * (count * (ranks - 1) * latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / (gbps * 1e9))


def link_for(perf: "DevicePerf", nodes: int):
    """The link a group spanning ``nodes`` nodes runs on: the node's within one, else the network's."""
    return perf.intra if nodes <= 1 else perf.inter


def traffic_seconds(t: Traffic, perf: "DevicePerf", ranks_per_node: int) -> float:
    """One purpose's collectives. Within a node (or on a network given per rank): the ring of
    ``collective_seconds``. Across nodes on a network given per node: NCCL runs a ring per network card, so the
    node's cards carry the group's traffic together; a group holding r of a node's ranks shares them with the
    node's other groups (r / ranks-per-node of the node's rate), and no rank moves faster than its NVLink. The
    ring's latency: a step per rank within the nodes and a network hop per node."""
    if t.kind == "all-to-all" and t.nodes > 1:
        return all_to_all_seconds(t, perf, ranks_per_node)
    if t.nodes <= 1 or not perf.inter.per_node:
        link = link_for(perf, t.nodes)
        return collective_seconds(t.kind, t.ranks, t.bytes, t.count, link.latency_us, link.gbps)
    if t.ranks <= 1:
        return 0.0
    local = max(1, t.ranks // t.nodes)
    gbps = perf.inter.gbps * local / max(ranks_per_node, local)
    if local > 1:
        gbps = min(gbps, perf.intra.gbps)
    rounds = 2 if t.kind == "all-reduce" else 1
    latency = (t.ranks - t.nodes) * perf.intra.latency_us + t.nodes * perf.inter.latency_us
    return rounds * (t.count * latency * 1e-6 + (t.ranks - 1) / t.ranks * t.bytes / (gbps * 1e9))


def all_to_all_seconds(t: Traffic, perf: "DevicePerf", ranks_per_node: int) -> float:
    """An all-to-all over several nodes is no ring: each rank sends 1/n of its bytes to every other rank at once,
    (local - 1)/n of them over the node's links and (n - local)/n over the network, where every rank of the node
    sends its share at the same time (the node's other groups too): a network given per node gives each rank
    1/ranks-per-node of it. The two parts run at once; the latency is a step per peer, over the node's links or
    the network as the peer sits. (Inside one node it is the ring formula's (n-1) x latency + (n-1)/n x bytes /
    bandwidth, which ``collective_seconds`` gives.)"""
    n, nodes = t.ranks, t.nodes
    local = max(1, n // nodes)
    network = perf.inter.gbps / ranks_per_node if perf.inter.per_node else perf.inter.gbps
    inside = (local - 1) / n * t.bytes / (perf.intra.gbps * 1e9)
    outside = (n - local) / n * t.bytes / (network * 1e9)
    latency = (local - 1) * perf.intra.latency_us + (n - local) * perf.inter.latency_us
    return t.count * latency * 1e-6 + max(inside, outside)
