"""The layout of a run's ranks: the one owner of the parallel degrees and of every size derived from them.

Built once (``Layout.from_config``, by preflight) from the config and the world, frozen, torch-free. Everything
that needs a data-parallel size, a shard group, the experts' efsdp group, the replicas, the split of a stage's
data-parallel ranks or a rank's share of the batch asks it; ``fsdp_exp.parallel.mesh.build_meshes`` turns it
into DeviceMeshes. It lives in ``config`` (a leaf the parallel package imports) so that ``Topology`` can hold it.

The degrees multiply to the world: world = pp x dp_replicate x dp_shard x cp x tp. ``ep`` is no degree of
its own: expert parallel borrows its ranks from the dense shard x cp ranks, cutting them into efsdp x ep.
Ranks are laid out outermost first (torchtitan's order) pp, the data-parallel dims, cp, tp:
rank = ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i, so a TP group is consecutive ranks (one node's NVLink).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from fsdp_exp.errors import fail

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig

# The names the backends give their data-parallel dims (``Backend.data_parallel_mesh``); under pipeline
# parallel a stage's data-parallel ranks are one ``dp`` dim, cut into (replicate, shard) by the stage's wrap.
DP_DIMS = ("replicate", "shard", "dp")
# The powers of two searched for expert parallel (tune, the fit search, the planner's options): at most 64,
# the largest EP group published for a mixture of experts (FSDP2 x PP x EP 64).
EP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)


@dataclass(frozen=True)
class Layout:
    """The degrees of a run and the backend's names for its data-parallel dims (``dp_dims``: (name, size)
    outermost first, whose sizes multiply to dp)."""

    world: int
    pp: int = 1
    dp_replicate: int = 1  # whole copies of the dense weights (DDP, HSDP's replicas, no_shard)
    dp_shard: int = 1  # the data-parallel ranks one dense weight is sharded over (FSDP, ZeRO)
    cp: int = 1  # context-parallel ranks per sequence
    tp: int = 1  # tensor-parallel ranks
    ep: int = 1  # expert-parallel ranks, borrowed from dp_shard x cp
    dp_dims: tuple[tuple[str, int], ...] = (("shard", 1),)

    def __post_init__(self):
        product = self.pp * self.dp * self.cp * self.tp
        if product != self.world:
            raise ValueError(f"pp x dp x cp x tp = {product} is not the world of {self.world} ranks: {self}")
        sizes = 1
        for _, size in self.dp_dims:
            sizes *= size
        if sizes != self.dp:
            raise ValueError(f"the data-parallel dims {self.dp_dims} do not hold the {self.dp} data-parallel ranks")

    # ------------------------------------------------------------------------------------------ derived
    @property
    def dp(self) -> int:
        """Data-parallel ranks: the batch's shards (each reads its own sequences)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_cp(self) -> int:
        """The ranks one dense weight is sharded over by FSDP: shard x cp (CP ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The ranks a routed expert's weights are FSDP-sharded over once EP has taken its ranks: shard x cp / ep."""
        return efsdp_size(self.shard_cp, self.ep)

    @property
    def replicas(self) -> int:
        """Whole copies of each dense weight shard: the data-parallel ranks over the shard group."""
        return self.dp_replicate

    def replicas_of(self, shard_group: int) -> int:
        """Copies of a weight's shard among the dp x cp ranks when the backend shards it over ``shard_group``
        ranks (1: each rank holds it whole, as DDP; dp: ZeRO over every data-parallel rank)."""
        return max(1, self.dp * self.cp // max(shard_group, 1))

    def without_pipeline(self) -> "Layout":
        """One stage's ranks as an unpipelined layout (the step-time model prices a stage's work on it): its dp
        ranks one shard dim, as a stage's wrap shards them."""
        return Layout(self.world // self.pp, 1, 1, self.dp, self.cp, self.tp, self.ep, (("shard", self.dp),))

    @property
    def ranks_per_stage(self) -> int:
        return self.world // self.pp

    @property
    def batch_shards(self) -> int:
        """Ranks that read different sequences: dp (CP and TP ranks read the same ones)."""
        return self.dp

    @property
    def tokens_shards(self) -> int:
        """Ranks over which a step's tokens are computed: dp x cp (a CP rank computes its share of a sequence)."""
        return self.dp * self.cp

    def local_batch(self, global_batch: int) -> int:
        """The sequences each data-parallel rank trains on per step."""
        return global_batch // self.dp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index (which share of the batch) of global ``rank``."""
        return rank // (self.tp * self.cp) % self.dp

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each mesh dim."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(self.mesh_dim_names, self.mesh_shape))):
            out[name], rest = rest % size, rest // size
        return dict(reversed(list(out.items())))

    # ------------------------------------------------------------------------------------------ the mesh
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._mesh()[0]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self._mesh()[1]

    def _mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Outermost first: [pp,] the data-parallel dims, [cp,] [tp,]."""
        names = tuple(n for n, _ in self.dp_dims)
        shape = tuple(s for _, s in self.dp_dims)
        if self.pp > 1:
            shape, names = (self.pp, *shape), ("pp", *names)
        if self.cp > 1:
            shape, names = (*shape, self.cp), (*names, "cp")
        if self.tp > 1:
            shape, names = (*shape, self.tp), (*names, "tp")
        return shape, names

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def of(
        cls,
        world: int,
        *,
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        replicate: int = 1,
        shard: Optional[int] = None,
        dp_names: Optional[tuple[str, ...]] = None,
    ) -> "Layout":
        """The layout with these degrees; dp is what pp x cp x tp leave of the world, split into ``replicate``
        x ``shard`` (shard defaults to the rest). ``dp_names``: the backend's names for the dims of
        (replicate, shard) (``("shard",)``: one dim of them all; ``("replicate", "shard")``: both)."""
        dp = world // (pp * cp * tp)
        shard = dp // replicate if shard is None else shard
        names = dp_names or (("dp",) if pp > 1 else ("shard",))
        if len(names) == 2:
            dims = ((names[0], replicate), (names[1], shard))
        else:
            dims = ((names[0], dp),)
        return cls(world, pp, replicate, shard, cp, tp, ep, dims)

    @classmethod
    def from_config(
        cls, cfg: "RunConfig", world: int, nproc: int, data_parallel_mesh: Callable[..., tuple[tuple, tuple]]
    ) -> "Layout":
        """The run's layout: preflight's call, once the degrees are known to divide the world (their owners'
        checks). ``data_parallel_mesh`` is the backend's (``Backend.data_parallel_mesh``): it names the
        data-parallel dims of an unpipelined run."""
        p, s = cfg.parallel, cfg.sharding
        dp = world // (p.pp * p.tp * p.cp)
        replicate, shard = dp_split(cfg, dp, nproc)
        if p.pp > 1:
            dims: tuple = (("dp", dp),)
        else:
            shape, names = data_parallel_mesh(s.strategy, dp, replicate, shard)
            dims = tuple(zip(names, shape))
        return cls(world, p.pp, replicate, shard, p.cp, p.tp, p.ep, dims)

    @classmethod
    def for_stages(cls, cfg: "RunConfig", dp: int) -> "Layout":
        """The layout of a pipeline run whose stages have ``dp`` data-parallel ranks (the planner's and the
        step-time model's view of one stage's sub-groups: its dp split, cp, tp and ep)."""
        p = cfg.parallel
        replicate, shard = dp_split(cfg, dp)
        return cls(p.pp * dp * p.cp * p.tp, p.pp, replicate, shard, p.cp, p.tp, p.ep, (("dp", dp),))

    def with_degrees(self, **degrees) -> "Layout":
        return dataclasses.replace(self, **degrees)

    # ------------------------------------------------------------------------------------------ record
    def as_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        fields["dp_dims"] = [list(d) for d in self.dp_dims]
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> "Layout":
        return cls(**{**fields, "dp_dims": tuple(tuple(d) for d in fields["dp_dims"])})

    @classmethod
    def from_mesh(cls, shape, names, ep: int = 1) -> "Layout":
        """The layout a mesh describes (run.json's topology before it recorded its layout)."""
        sizes = dict(zip(names, shape))
        dims = tuple((n, sizes[n]) for n in names if n in DP_DIMS)
        dp = 1
        for _, s in dims:
            dp *= s
        replicate = sizes.get("replicate", 1)
        world = 1
        for s in shape:
            world *= s
        return cls(
            world, sizes.get("pp", 1), replicate, dp // replicate, sizes.get("cp", 1), sizes.get("tp", 1), ep, dims
        )


def efsdp_size(shard_cp: int, ep: int) -> int:
    """The ranks a routed expert's weights are FSDP-sharded over: the shard x cp ranks EP leaves."""
    return shard_cp // max(ep, 1)


# ------------------------------------------------------------------------------------------ the dp split
def dp_split(cfg: "RunConfig", dp: int, nproc: int = 0) -> tuple[int, int]:
    """(replicate, shard) of the ``dp`` data-parallel ranks (of each stage under pipeline parallel):
    (1, dp) fully sharded, (dp, 1) replicated (no_shard, DDP), and under sharding=hybrid the sizes the config
    names, else (unpipelined) one shard group per node's ranks. A stage's dp ranks are not laid out by node, so
    there a hybrid run must name one of the sizes."""
    s, p = cfg.sharding, cfg.parallel
    if s.strategy == "no_shard":
        return dp, 1
    if s.strategy != "hybrid":
        if s.replicate_size is not None or s.shard_size is not None:
            fail(
                f"sharding.replicate_size/shard_size only apply to sharding=hybrid, not {s.strategy}.",
                "drop them, or pass sharding=hybrid",
            )
        return 1, dp
    if p.pp > 1:
        if s.replicate_size is None and s.shard_size is None:
            fail(
                f"sharding=hybrid with parallel.pp={p.pp} needs the split of each stage's {dp} "
                "data-parallel ranks into replicas and shards.",
                f"pass sharding.replicate_size (or sharding.shard_size) dividing {dp}",
            )
        shard = s.shard_size if s.shard_size is not None else dp // max(s.replicate_size, 1)
        replicate = s.replicate_size if s.replicate_size is not None else dp // max(shard, 1)
        if shard < 1 or replicate < 1 or replicate * shard != dp:
            fail(
                f"sharding=hybrid needs replicate_size x shard_size = {dp} data-parallel ranks of each stage, "
                f"got {replicate} x {shard}.",
                f"pass sharding.replicate_size and sharding.shard_size whose product is {dp}",
            )
        return replicate, shard
    tp = p.tp
    local_dp = max(1, min(nproc // tp, dp)) if nproc >= tp else 1
    shard = s.shard_size if s.shard_size is not None else (dp // s.replicate_size if s.replicate_size else local_dp)
    replicate = s.replicate_size if s.replicate_size is not None else max(1, dp // max(shard, 1))
    if shard < 1 or replicate < 1 or replicate * shard != dp:
        good = largest_divisor_at_most(dp, local_dp)
        fail(
            f"sharding=hybrid needs replicate_size x shard_size = {dp} data-parallel ranks, got {replicate} x {shard}.",
            f"pass sharding.shard_size and sharding.replicate_size whose product is {dp}, "
            f"e.g. sharding.replicate_size={dp // good} sharding.shard_size={good}",
        )
    return replicate, shard


# ------------------------------------------------------------------------------------------ valid values
def data_parallel_ranks(world: int, pp: int = 1, cp: int = 1, tp: int = 1) -> int:
    """The ranks pp, cp and tp leave of ``world`` (at least 1; preflight refuses degrees that do not divide it)."""
    return max(1, world // (max(pp, 1) * max(cp, 1) * max(tp, 1)))


def degree_values(ranks: int) -> list[int]:
    """The values a degree can take over ``ranks`` ranks: its divisors."""
    return divisors(ranks)


def ep_values(shard_cp: Optional[int] = None) -> list[int]:
    """The expert-parallel degrees to try (tune's space, the fit search, the planner's options): over
    ``shard_cp`` dense shard x cp ranks its divisors up to the largest candidate (ep must divide them); with no
    ranks known, the candidates (powers of two). The model's family says which of them split its experts."""
    if shard_cp is None:
        return list(EP_CANDIDATES)
    return [d for d in divisors(shard_cp) if d <= max(EP_CANDIDATES)]
