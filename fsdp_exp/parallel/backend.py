"""The interface every data-parallel backend implements, and the registry that names them.

A backend owns everything about itself, in seven roles, each a small class here that ``Backend``
combines and each caller needs one of: ``BackendChecks`` (what it is and refuses: preflight),
``BackendBuild`` (the mesh, the wrapped model, the optimizer: ``fsdp_exp.parallel.parallelize``),
``BackendStep`` (the training step, through ``Parallelized``), ``BackendInspection`` (what torch holds,
memory tracking, init digests), ``BackendCheckpointing`` (checkpoint I/O, the export),
``BackendPlanning`` (the planner's rules) and ``BackendDocs`` (its column of the vocabulary page).
Outside ``fsdp_exp.parallel`` no code compares a backend's name: it asks ``backend_for(cfg)``. The
step's defaults are the torch-optimizer path FSDP2, FSDP1 and DDP share; DeepSpeed's engine overrides
them. A new backend is one module in this package with a ``Backend`` subclass, one line in
``BACKEND_MODULES`` and, optionally, a preset in the ``sharding`` config group (design.md, "Backends").
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from fsdp_exp.config.schema import EVERY_MICRO_BATCH
from fsdp_exp.errors import closest, did_you_mean, fail

if TYPE_CHECKING:  # the schema is a leaf; torch is imported by the backends themselves
    import torch
    from torch import nn

    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.config.topology import Topology

# name -> module that defines ``BACKEND`` (an instance of a Backend subclass). Imported on first use.
BACKEND_MODULES: dict[str, str] = {
    "fsdp2": "fsdp_exp.parallel.fsdp2",
    "fsdp1": "fsdp_exp.parallel.fsdp1",
    "ddp": "fsdp_exp.parallel.ddp",
    "deepspeed": "fsdp_exp.parallel.deepspeed",  # optional dependency: pip install fsdp_exp[deepspeed]
}


def backend_names() -> list[str]:
    return list(BACKEND_MODULES)


def check_backend_name(name: str) -> None:
    """Refuse an unknown ``sharding.backend`` with a "did you mean"."""
    if name in BACKEND_MODULES:
        return
    presets = "(or a preset: sharding=full|grad_op|hybrid|no_shard|ddp|optimizer|zero1|zero2|zero3)"
    fail(
        f"sharding.backend={name!r} is not one of {', '.join(BACKEND_MODULES)}.",
        did_you_mean(closest(name, BACKEND_MODULES), "sharding.backend={}", after=f" {presets}")
        or f"pass sharding.backend=fsdp2 {presets}",
    )


def get_backend(name: str) -> "Backend":
    check_backend_name(name)
    return importlib.import_module(BACKEND_MODULES[name]).BACKEND


def backend_for(cfg: "RunConfig") -> "Backend":
    return get_backend(cfg.sharding.backend)


@dataclass(frozen=True)
class PlannerRules:
    """How a backend lays out memory, as the planner (``fsdp_exp.plan``) needs to know it.

    ``param_layout``: ``dim0`` (each parameter's dim 0 is chunked over the shard group, padded as
    ``torch.chunk`` does, but a stacked weight's whose dim 0 the group does not divide, sharded on a dim it
    divides: ``fsdp_exp.parallel.placement``; FSDP2), ``flat`` (one flat parameter per unit, padded to a multiple of the
    shard group: FSDP1) or ``replicated`` (whole parameters on every rank: DDP).
    ``gathers_units``: compute all-gathers each unit's unsharded parameters (FSDP); False: the
    parameters are used in place (DDP). ``autocast``: compute runs under ``torch.autocast`` (DDP's
    mixed precision), so weights are cast per use and the residual stream stays fp32.
    ``root_output_dtype``: the dtype the root's output is cast to (FSDP2's ``output_dtype``), or None.
    ``reshard_after_forward``: whether a unit's unsharded copy is freed after its forward.
    ``gradient_buckets``: gradients are reduced through full-size buckets (DDP).
    ``offloads``: ``offload=params`` moves the states to the host under this backend.
    ``notes``: assumptions the planner states for this backend (e.g. a schedule it borrows).
    ``zero_stage``: DeepSpeed's layout of the states at rest (0-3: low-precision parameters, fp32 master
    partitions, gradients, AdamW moments, each partitioned from its ZeRO stage on), or None (FSDP's and
    DDP's: fp32 parameters, gradients and moments, laid out by ``param_layout``).
    """

    param_layout: str
    gathers_units: bool
    autocast: bool
    root_output_dtype: Optional[str]
    reshard_after_forward: Union[bool, int]
    gradient_buckets: bool
    offloads: bool
    notes: tuple[str, ...] = ()
    zero_stage: Optional[int] = None
    shards_optimizer: bool = False  # the optimizer state is split over the data-parallel ranks (ZeRO-1 on DDP)


class BackendChecks(ABC):
    """Role: what the backend is and what it refuses, asked by preflight before any rank starts."""

    name: str = ""
    api: str = ""  # what users see torch call it, e.g. torch.distributed.fsdp.fully_shard
    strategies: tuple[str, ...] = ()  # the sharding strategies it can run
    # compile=true: the backend compiles the wrapped model itself (DeepSpeed's engine.compile), instead of
    # the recipe compiling each block before it (``fsdp_exp.parallel.compile``)
    compiles_itself: bool = False
    # ac != none: the checkpointed region must lie inside the backend's unit (FSDP1 casts a unit's inputs to
    # param_dtype in its pre-forward but skips that during the recomputation, so a checkpoint wrapped around
    # the unit would recompute in fp32 what it saved in bf16): the recipe then checkpoints the blocks after
    # the backend wrapped them. False: before, as FSDP2 needs (fully_shard on the checkpoint wrapper).
    checkpoints_inside_units: bool = False
    # precision.float8_recipe (``fsdp_exp.parallel.float8``): why this backend cannot train torchao's float8
    # linear layers (None: it can), and whether it all-gathers float8 weights (precision.float8_all_gather)
    float8_refusal: Optional[str] = "fsdp_exp has not checked torchao's float8 training with it."
    float8_all_gather: bool = False
    # trainer.grad_sync=auto: when this backend reduces accumulated micro-batches' gradients by nature. A
    # sharding backend reduces every micro-batch into the sharded gradient, so that no unsharded gradient
    # outlives its unit's backward.
    natural_grad_sync: str = EVERY_MICRO_BATCH
    # parallel.pp > 1: the strategies this backend runs inside pipeline stages (its ``apply`` as the stages'
    # recipe calls it, parallel/__init__.py's apply_recipe), () where it runs no stages
    stage_strategies: tuple[str, ...] = ()

    def missing_dependency(self) -> Optional[str]:
        """What to install for this backend when a package it needs is missing (None: nothing)."""
        return None

    def refuse(self, knob: str, why: str, fix: str) -> None:
        """Refuse a knob this backend cannot honour (the one message shape every backend uses)."""
        fail(f"{knob} cannot be honoured by sharding.backend={self.name}: {why}", fix)

    def check(self, cfg: "RunConfig", device_type: str) -> None:
        """Refuse (``fail``) every knob this backend cannot honour, naming the equivalent."""

    def grad_sync(self, cfg: "RunConfig") -> str:
        """``trainer.grad_sync`` resolved for this backend: every_micro_batch | last_micro_batch (``check``
        refuses a value the backend cannot honour)."""
        value = cfg.trainer.grad_sync
        return self.natural_grad_sync if value == "auto" else value


class BackendBuild(ABC):
    """Role: the data-parallel mesh, and the wrapped, materialized model and its optimizer
    (``fsdp_exp.parallel.parallelize``)."""

    def data_parallel_mesh(self, strategy: str, dp: int, replicate: int, shard: int) -> tuple[tuple, tuple]:
        """(shape, dim names) of the data-parallel mesh for a strategy; ``replicate`` x ``shard`` is
        hybrid's resolved split of ``dp`` ranks."""
        if strategy == "hybrid":
            return (replicate, shard), ("replicate", "shard")
        if strategy == "no_shard":
            return (dp, 1), ("replicate", "shard")
        return (dp,), ("shard",)

    @abstractmethod
    def apply(self, model: "nn.Module", cfg: "RunConfig", mesh, device: "torch.device") -> tuple["nn.Module", dict]:
        """Shard / wrap ``model`` (on meta), materialize this rank's part and initialize it from the
        seed. Returns the model to train and the applied settings (JSON-ready)."""

    def unwrap(self, model: "nn.Module") -> "nn.Module":
        """The plain model inside the wrapper (itself for in-place backends)."""
        return getattr(model, "module", model)

    def build_optimizer(self, model: "nn.Module", cfg: "RunConfig", decay_names: set[str]):
        """The run's optimizer over the wrapped model (``decay_names``: the parameters weight decay applies to)."""
        from fsdp_exp.optim import build_optimizer

        return build_optimizer(model, cfg.optim, decay_names)


class BackendStep(ABC):
    """Role: the training step's pieces, bound to one run by ``fsdp_exp.parallel.Parallelized``. The defaults
    are the torch-optimizer path FSDP2, FSDP1 and DDP share; an engine that owns the step overrides them."""

    def zero_grad(self, model: "nn.Module", optimizer) -> None:
        """At the start of a step: drop the previous step's gradients."""
        optimizer.zero_grad(set_to_none=True)

    def gradient_sync(self, model: "nn.Module", reduce: bool, last: bool):
        """A context for one micro-batch's backward: reduce its gradients when ``reduce`` (every micro-batch
        under grad_sync=every_micro_batch, else only the last), accumulate them locally otherwise; ``last``:
        the step's last micro-batch."""
        return contextlib.nullcontext() if reduce else model.no_sync()

    def autocast(self, cfg: "RunConfig", device: "torch.device"):
        """A context for the forward: how compute runs in ``precision.param_dtype`` (nothing to do when
        the backend casts the parameters themselves)."""
        return contextlib.nullcontext()

    def backward(self, model: "nn.Module", loss: "torch.Tensor", scaler) -> None:
        """Backpropagate one micro-batch's loss (scaled when a loss scaler is in use)."""
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def loss_scale(self, model: "nn.Module", scaler) -> float:
        """What ``backward`` multiplies the loss by this step (fp16's loss scale; 1 otherwise): a gradient added
        inside the backward, a mixture of experts' aux loss's, is multiplied by it too (fsdp_exp.models.moe)."""
        return scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0

    @abstractmethod
    def clip_grad_norm(self, model: "nn.Module", max_norm: float) -> "torch.Tensor":
        """Clip the gradients to a global norm of ``max_norm`` (inf: never); returns the norm before clipping."""

    def grad_scaler(self, device: "torch.device"):
        """The loss scaler for ``precision.loss_scaler=dynamic``."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)  # all-reduces inf checks over the shards

    def optimizer_step(self, model: "nn.Module", optimizer, scaler, max_norm: float) -> "torch.Tensor":
        """After the last micro-batch: unscale, clip to ``max_norm`` (inf = never), step the optimizer
        (skipped by the scaler on inf/NaN gradients). Returns the global gradient norm before clipping."""
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = self.clip_grad_norm(model, max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return grad_norm


class BackendInspection(ABC):
    """Role: what torch holds and how it changes, read back for the record, the memory metrics and the
    identical-init check."""

    tracks_memory: bool = True  # torch's memory trackers can follow this backend's parameters

    @abstractmethod
    def inspect(self, model: "nn.Module") -> list[dict]:
        """What torch holds, read back from the wrapped model: one entry per sharding unit."""

    def model_state_counter(self, model: "nn.Module", optimizer):
        """A callable returning this rank's model-state bytes now ({params, grads, optim_state,
        model_states}), cheap enough for every step (``fsdp_exp.metrics.memory.ModelStateBytes``)."""
        from fsdp_exp.metrics.memory import ModelStateBytes

        return ModelStateBytes(model, optimizer)

    def memory_tracker(self, model: "nn.Module", optimizer: "torch.optim.Optimizer"):
        """A torch memory tracker (a context manager) that follows one step of ``model`` (when
        ``tracks_memory``): the generic ``MemTracker`` unless the backend has a better one."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        return tracker

    def init_digests(self, model: "nn.Module", seed: int) -> list[dict]:
        """This rank's view of its initial parameters, for the identical-init check
        (``debug.check_identical_init``): per tensor its name, which slice this rank holds, the hash of
        that slice and the hash the seeded initialization says it must have. The default reads each
        parameter as the module ``unwrap`` gives holds it: whole, or this rank's DTensor shard."""
        from fsdp_exp.parallel.digests import parameter_digests

        return parameter_digests(self.unwrap(model), seed)


class BackendCheckpointing(ABC):
    """Role: checkpoint I/O (for ``fsdp_exp.checkpoint``) and the consolidated export."""

    # What a checkpoint's shards are written in (recorded in its fsdp_exp_checkpoint.json; resume refuses
    # another format).
    checkpoint_format: str = "torch.distributed.checkpoint"

    def save_checkpoint(
        self, sharded, folder, *, writer, step: int, rank: int, debug, process_group=None, async_save: bool = False
    ):
        """Write this rank's share of the model and optimizer into ``folder``.

        Args:
            sharded: the model and optimizer as one ``Stateful`` (``fsdp_exp.checkpoint.states.ModelAndOptimizer``).
            folder: the checkpoint's temporary folder (``step_<N>.tmp``), renamed by the checkpointer once
                every rank has written.
            writer: DCP's storage writer for ``folder``; it injects ``debug``'s save faults.
            step: the step being saved (a save fault names its step).
            rank: this process's global rank (a save fault names its rank).
            debug: the run's ``debug`` config (which save fault strikes, on which rank and step).
            process_group: the group an asynchronous save communicates over (not the training group).
            async_save: save in the background (``checkpoint.async_save``).

        Returns:
            DCP's future when ``async_save``, else None.
        """
        import torch.distributed.checkpoint as dcp

        state = sharded.state_dict()
        if async_save:
            return dcp.async_save(state, storage_writer=writer, process_group=process_group)
        dcp.save(state, storage_writer=writer)
        return None

    def load_checkpoint(self, sharded, folder, meta: dict, world_size: int) -> None:
        """Load ``folder`` (saved by a run ``meta`` describes) into ``sharded``; a conversion torch refuses
        raises (the checkpoint manager says from what to what)."""
        import torch.distributed.checkpoint as dcp

        state = sharded.state_dict()
        dcp.load(state, checkpoint_id=str(folder))
        sharded.load_state_dict(state)

    def full_state_dict(self, model: "nn.Module") -> dict:
        """The whole model on rank 0 (canonical names, fp32 on the CPU; other ranks get ``{}``): the export."""
        from fsdp_exp.export import full_state_dict

        return full_state_dict(model)

    def state_dict_options(self) -> dict:
        """Extra keyword arguments for torch.distributed.checkpoint.state_dict's ``StateDictOptions``."""
        return {}

    def quiet_checkpoint_warnings(self) -> None:
        """Silence warnings torch raises on every tensor of this backend's state dicts (if any)."""


class BackendPlanning(ABC):
    """Role: the planner's rules (for ``fsdp_exp.plan`` and ``fsdp_exp.tune``): how this backend lays out memory."""

    @abstractmethod
    def planner_rules(self, cfg: "RunConfig") -> PlannerRules:
        """How this backend lays out the states and runs a step under ``cfg`` (``PlannerRules``)."""

    def shard_group(self, topology: "Topology") -> int:
        """Ranks one parameter is sharded over (1 when it is replicated)."""
        return topology.layout.shard_cp  # CP's ranks hold the same weights: FSDP shards over them too


class BackendDocs(ABC):
    """Role: this backend's column of the vocabulary page (``fsdp_exp.parallel.vocabulary`` writes it)."""

    column_title: str = ""  # the heading of this backend's column on the vocabulary page

    def vocabulary(self) -> dict[str, str]:
        """This backend's cell for each row of the vocabulary page: row key (the config knob, as
        ``fsdp_exp.parallel.vocabulary.ROWS`` names it) -> text. Rows it leaves out read "refused at
        validation", and ``check`` must refuse them (the backend interface test tries each)."""
        return {}


class Backend(
    BackendChecks, BackendBuild, BackendStep, BackendInspection, BackendCheckpointing, BackendPlanning, BackendDocs
):
    """A data-parallel backend: every role above. The defaults are shared by the torch-optimizer backends
    (see the module docstring); a subclass implements each role's abstract methods."""


# The roles in the order a run meets them; the backend interface test keeps each one small.
BACKEND_ROLES: tuple[type, ...] = Backend.__bases__
