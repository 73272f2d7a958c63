"""Expert parallel (``parallel.ep=N``): the routed experts of every MoE layer split over N ranks, tokens sent to
the ranks holding their experts and their outputs sent back, by all-to-all.

The ranks come from the data-parallel shard ranks (``fsdp_exp.parallel.mesh.expert_meshes``): an EP group is N
consecutive ones. Each expert weight becomes a DTensor sharded by expert (``Shard(0)``) over the EP group, and
FSDP2 then shards each rank's experts over the ranks left (``efsdp``), while the dense weights stay sharded over
every data-parallel rank. The layer itself (``fsdp_exp.models.moe``) does not change: it routes every token of
this rank and calls its experts with the routed copies sorted by expert; here that call

1. exchanges the counts first (each rank learns how many copies every other rank sends each of its experts),
2. sends each rank the copies for its experts (an all-to-all with uneven splits),
   (only the kept copies: those a capacity factor dropped stay home and come back as zeros),
3. regroups what arrived by local expert (it arrives by source rank) and runs the grouped matmuls,
4. undoes the regrouping and sends the outputs back (the all-to-all with the splits swapped).

Backward runs the two all-to-alls the other way (``AllToAll``). Gloo and NCCL both carry uneven splits.

    python -m fsdp_exp model=moe_tiny trainer.nproc_per_node=4 parallel.ep=2
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_exp.errors import fail
from fsdp_exp.models.moe import GroupedExperts, grouped_swiglu

# What expert parallel composes with today; everything else is refused by name before any rank starts.
BACKENDS = ("fsdp2",)


def check(cfg, ep: int) -> None:
    """Preflight's part (``_check_ep``, after ep is known to divide the shard x cp ranks): the backend, the
    model (its family says whether its experts split over ``ep`` ranks) and what does not compose yet."""
    from fsdp_exp.models import spec_for

    if ep == 1:
        return
    if cfg.sharding.backend not in BACKENDS:
        fail(
            f"parallel.ep={ep} with sharding.backend={cfg.sharding.backend}: expert parallel is built on FSDP2 "
            "(the experts' weights are DTensors sharded over the EP group, FSDP2-sharded over the ranks left).",
            "pass sharding.backend=fsdp2, or parallel.ep=1",
        )
    if cfg.sharding.strategy == "no_shard":
        fail(
            f"parallel.ep={ep} with sharding=no_shard: expert parallel borrows its ranks from the shard dim.",
            "pass sharding=full (or hybrid), or parallel.ep=1",
        )
    if cfg.compile:
        # The split sizes are read from the counts each step (data-dependent): every MoE layer breaks the graph.
        fail(
            f"parallel.ep={ep} with compile=true is not built yet: the dispatch reads each step's token counts.",
            "pass compile=false",
        )
    spec_for(cfg.model).check_expert_parallel(cfg.model, ep)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: the gradient goes back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(GroupedExperts):
    """A ``GroupedExperts`` whose weights hold this EP rank's experts (a DTensor ``Shard(0)`` over the EP group):
    ``forward`` takes every routed copy of this rank, sorted by (global) expert, and returns their outputs.

    An expert's gradient sums the copies of every rank of the EP group, and FSDP2 then averages it over the
    efsdp ranks only: 1/ep here makes it the mean over every data-parallel rank, as a dense weight's is
    (FSDP2's own divide factor would do it, but needs a pre-multiplied sum gloo lacks)."""

    ep_group: dist.ProcessGroup
    efsdp_mesh: object  # what FSDP2 shards these weights over (fsdp_exp.parallel.fsdp2 reads it)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        ep = dist.get_world_size(self.ep_group)
        w1, w3, w2 = (
            ScaleGradient.apply(w.to_local() if isinstance(w, DTensor) else w, 1 / ep)
            for w in (self.w1, self.w3, self.w2)
        )
        local = w1.shape[0]
        # 1. counts[e] per global expert -> got[s, j]: copies rank s sends this rank's expert j.
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts.contiguous(), group=self.ep_group)
        got = got.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        # 2. the copies to the ranks holding their experts (x is sorted by expert, so by destination rank). The
        # rows past the counts' sum are copies a capacity factor dropped (models.moe): never sent, zeros back.
        routed = x.shape[0]
        x = x[: sum(send)]
        arrived = AllToAll.apply(x, send, recv, self.ep_group)
        # 3. they arrive by source rank, then expert: regroup by expert for the grouped matmul.
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), got.flatten(), output_size=arrived.shape[0]
        )
        order = expert_of.argsort(stable=True)
        out = grouped_swiglu(arrived[order], got.sum(0), w1, w3, w2, self.recompute_activation)
        # 4. back into arrival order (a gather by the inverse permutation: its backward needs the indices only,
        # where index_copy's keeps its whole source, the experts' output, alive until backward), and home.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = AllToAll.apply(out[inverse], recv, send, self.ep_group)
        return F.pad(out, (0, 0, 0, routed - out.shape[0])) if routed > out.shape[0] else out


def apply(model: torch.nn.Module, expert_modules: list[str], ep_mesh, efsdp_mesh) -> dict:
    """Make each routed-experts module of ``model`` (on meta) expert parallel over ``ep_mesh``: its weights this
    rank's share of the experts (DTensor ``Shard(0)``), its forward the dispatch and combine above; FSDP2 shards
    it over ``efsdp_mesh``. Returns what it applied, for the run record."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    for name in expert_modules:
        module = model.get_submodule(name)
        for attr in ("w1", "w3", "w2"):
            full = getattr(module, attr)
            local = torch.empty((full.shape[0] // ep, *full.shape[1:]), dtype=full.dtype, device=full.device)
            shard = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(module, attr, nn.Parameter(shard, requires_grad=full.requires_grad))
        module.__class__ = ExpertParallelExperts
        module.ep_group, module.efsdp_mesh = ep_mesh.get_group(), efsdp_mesh
    return {
        "ep": ep,
        "modules": list(expert_modules),
        "placement": "Shard(0) over the ep group; all-to-all dispatch and combine",
        "efsdp_mesh": {"shape": list(efsdp_mesh.mesh.shape), "dim_names": list(efsdp_mesh.mesh_dim_names or ())},
    }
