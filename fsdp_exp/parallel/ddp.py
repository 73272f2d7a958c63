"""DDP (``DistributedDataParallel``): the baseline every sweep compares against.

Every rank holds the whole model; gradients are all-reduced in buckets during backward. Mixed
precision is DDP's usual kind: ``torch.autocast`` to ``precision.param_dtype`` for compute, and a
communication hook that compresses gradients to ``precision.reduce_dtype`` when it is bf16/fp16.

``sharding=optimizer`` (ZeRO-1) keeps DDP and shards the optimizer state with torch's
``ZeroRedundancyOptimizer``: each rank steps AdamW for its share of the parameters, then broadcasts
them. Its checkpoints keep the model in torch.distributed.checkpoint and the optimizer state
consolidated on rank 0 (``zero_optimizer.pt``), which loads at any world size.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from fsdp_exp.config import LAST_MICRO_BATCH, PrefetchConfig, RunConfig, Topology, WrapConfig
from fsdp_exp.errors import fail
from fsdp_exp.models import init_weights
from fsdp_exp.parallel.backend import Backend, PlannerRules
from fsdp_exp.parallel.common import describe, dtype_of, refuse_bf16_storage, refuse_fsdp2_only_knobs

ZERO_OPTIMIZER_FILE = "zero_optimizer.pt"  # sharding=optimizer: the consolidated optimizer state (rank 0)
COMM_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


class DDP(Backend):
    name = "ddp"
    api = "torch.nn.parallel.DistributedDataParallel"
    float8_refusal = None  # torchao's float8 linears hold plain parameters: DDP reduces their gradients as any
    strategies = ("no_shard", "optimizer")
    column_title = "DDP"
    # Replicated gradients are whole either way: reducing only the last micro-batch (no_sync) saves the
    # earlier all-reduces and costs no memory.
    natural_grad_sync = LAST_MICRO_BATCH
    # Inside pipeline stages the replicas are torch's replicate (FSDP2's machinery on a replicate-only mesh,
    # which the pipeline schedule drives as it drives fully_shard), as torchtitan replicates stages
    stage_strategies = ("no_shard",)

    # -------------------------------------------------------------------------------- BackendChecks
    def check(self, cfg: RunConfig, device_type: str) -> None:
        s, p, pf, w = cfg.sharding, cfg.precision, cfg.prefetch, cfg.wrap
        refuse_bf16_storage(self, cfg)
        if s.strategy not in self.strategies:
            fail(
                f"DDP replicates the model; it cannot do sharding.strategy={s.strategy}.",
                "pass sharding=ddp (or sharding=optimizer: ZeroRedundancyOptimizer), or sharding.backend=fsdp2 "
                "for a sharded strategy",
            )
        refuse_fsdp2_only_knobs(self, cfg)
        if pf != PrefetchConfig():
            self.refuse(
                "a prefetch setting",
                "DDP has no all-gathers to prefetch.",
                "leave the prefetch group at its default (drop prefetch=...)",
            )
        if w != WrapConfig():
            self.refuse(
                f"wrap={w.policy}",
                "DDP has no wrapped units (it buckets gradients).",
                "leave the wrap group at its default (drop wrap=...)",
            )
        for knob in ("use_orig_params", "sync_module_states"):  # FSDP1's: the vocabulary page says refused
            if getattr(s, knob) is not None:
                self.refuse(
                    f"sharding.{knob}",
                    "DDP trains the original parameters, and fsdp_exp initializes every replica identically by seed.",
                    f"drop sharding.{knob}",
                )
        if cfg.offload.params or cfg.offload.optimizer:
            self.refuse(
                "offload=params" if cfg.offload.params else "offload=optimizer",
                "DDP keeps full replicas (and ZeroRedundancyOptimizer its shard) on the device.",
                "pass offload=none, or sharding=no_shard (FSDP2 replication with offload=params), or "
                "sharding=zero1 offload=optimizer (DeepSpeed)",
            )
        if p.reduce_dtype == "bf16" and device_type == "cpu":
            self.refuse(
                "precision.reduce_dtype=bf16 on CPU",
                "torch's bf16 gradient-compression hook for DDP needs NCCL (CUDA) or XCCL.",
                "pass precision.reduce_dtype=fp32 (e.g. precision=bf16)",
            )
        if p.param_dtype != p.reduce_dtype and p.reduce_dtype != "fp32":
            self.refuse(
                f"precision.reduce_dtype={p.reduce_dtype} with param_dtype={p.param_dtype}",
                "DDP compresses gradients to the reduce dtype with a communication hook; only fp32 or "
                "the compute dtype are offered.",
                "pass precision.reduce_dtype=fp32",
            )
        if p.buffer_dtype is not None or not p.cast_forward_inputs:
            self.refuse(
                "precision.buffer_dtype / cast_forward_inputs", "DDP runs mixed precision by autocast.", "drop them"
            )

    # --------------------------------------------------------------------------------- BackendBuild
    def data_parallel_mesh(self, strategy: str, dp: int, replicate: int, shard: int) -> tuple[tuple, tuple]:
        return (dp,), ("replicate",)  # one group of whole replicas

    def apply(self, model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
        """Materialize and seed the whole model on this rank, then wrap it (and hook fp16/bf16 reduction)."""
        if cfg.parallel.pp > 1:
            return self._replicate_stage(model, cfg, mesh, device)
        model.to_empty(device=device)
        init_weights(model, cfg.trainer.seed, device)
        kwargs = dict(
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh.get_group(),
            forward_sync_buffers=False,
        )  # buffers are derived (rotary tables), identical everywhere
        wrapped = DistributedDataParallel(model, **kwargs)
        hook = COMM_HOOKS.get(cfg.precision.reduce_dtype)
        if hook is not None:
            wrapped.register_comm_hook(mesh.get_group(), hook)
        return wrapped, {
            "backend": self.name,
            "api": self.api,
            "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
            "num_units": 1,
            "units": [{"module": "<root>"}],
            "DistributedDataParallel": describe({**kwargs, "process_group": f"{mesh.size()} ranks"}),
            "comm_hook": hook.__name__ if hook else None,
            "autocast": None if cfg.precision.param_dtype == "fp32" else describe(dtype_of(cfg.precision.param_dtype)),
        }

    def _replicate_stage(self, model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
        """A pipeline stage's replicas: torch's ``replicate`` (FSDP2's machinery on a replicate-only mesh, which
        the pipeline schedule drives as it drives ``fully_shard``; torchtitan replicates stages so) on each unit of
        the wrap policy, then the stage's root; then this rank's copy materialized and seeded."""
        from torch.distributed._composable.replicate_with_fsdp import replicate

        from fsdp_exp.parallel.fsdp2 import mp_policy
        from fsdp_exp.parallel.wrap import unit_names

        units = []
        for name in [*unit_names(model, cfg), ""]:
            kwargs = dict(mesh=mesh, mp_policy=mp_policy(cfg, root=not name))
            replicate(model.get_submodule(name), **kwargs)
            units.append({"module": name or "<root>", "replicate": describe(kwargs)})
        model.to_empty(device=device)
        init_weights(model, cfg.trainer.seed, device)
        return model, {
            "backend": self.name,
            "api": "torch.distributed._composable.replicate_with_fsdp.replicate",
            "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
            "num_units": len(units),
            "units": units,
        }

    def build_optimizer(self, model: nn.Module, cfg: RunConfig, decay_names: set[str]):
        """AdamW; under sharding=optimizer wrapped by ``ZeroRedundancyOptimizer`` (same groups, same steps)."""
        from fsdp_exp.optim import build_optimizer

        optimizer = build_optimizer(model, cfg.optim, decay_names)
        if cfg.sharding.strategy != "optimizer":
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(
            [{k: v for k, v in group.items() if k in ("params", "weight_decay")} for group in optimizer.param_groups],
            optimizer_class=torch.optim.AdamW,
            process_group=model.process_group,
            **{k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps")},
        )
        return zero

    # ---------------------------------------------------------------------------------- BackendStep
    def autocast(self, cfg: RunConfig, device: torch.device):
        if cfg.precision.param_dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype_of(cfg.precision.param_dtype))

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # gradients are already whole

    def grad_scaler(self, device: torch.device):
        return torch.amp.GradScaler(device.type)  # every rank sees the same all-reduced gradients

    # ---------------------------------------------------------------------------- BackendInspection
    def inspect(self, model: nn.Module) -> list[dict]:
        hooks = [hook.__name__ for hook, _state in getattr(model, "_comm_hooks", [])]
        return [
            {
                "module": "<root>",
                "class": type(model).__name__,
                "comm_hooks": hooks,
                "process_group_size": model.process_group.size(),
                "num_params": len(list(model.parameters())),
            }
        ]

    def model_state_counter(self, model: nn.Module, optimizer):
        from fsdp_exp.metrics.memory import ModelStateBytes

        return ModelStateBytes(model, getattr(optimizer, "optim", optimizer))  # ZeRO-1: this rank's AdamW

    # ------------------------------------------------------------------------- BackendCheckpointing
    def save_checkpoint(
        self, sharded, folder, *, writer, step: int, rank: int, debug, process_group=None, async_save: bool = False
    ):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(sharded.optimizer, ZeroRedundancyOptimizer):
            return super().save_checkpoint(
                sharded,
                folder,
                writer=writer,
                step=step,
                rank=rank,
                debug=debug,
                process_group=process_group,
                async_save=async_save,
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sharded.optimizer.consolidate_state_dict(to=0)  # a collective: every rank sends its share to rank 0
        if rank == 0:
            torch.save(sharded.optimizer.state_dict(), Path(folder) / ZERO_OPTIMIZER_FILE)
        dcp.save({"model": get_model_state_dict(sharded.model)}, storage_writer=writer)
        return None

    def load_checkpoint(self, sharded, folder, meta: dict, world_size: int) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if not isinstance(sharded.optimizer, ZeroRedundancyOptimizer):
            return super().load_checkpoint(sharded, folder, meta, world_size)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        file = Path(folder) / ZERO_OPTIMIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file}: the checkpoint holds no consolidated ZeroRedundancyOptimizer state "
                "(it was saved with another sharding strategy)"
            )
        state = {"model": get_model_state_dict(sharded.model)}
        dcp.load(state, checkpoint_id=str(folder))
        set_model_state_dict(sharded.model, state["model"])
        sharded.optimizer.load_state_dict(torch.load(file, weights_only=True))  # each rank keeps its share

    # ------------------------------------------------------------------------------ BackendPlanning
    def planner_rules(self, cfg: RunConfig) -> PlannerRules:
        return PlannerRules(
            param_layout="replicated",
            gathers_units=False,
            autocast=cfg.precision.param_dtype != "fp32",
            root_output_dtype=None,
            reshard_after_forward=False,
            gradient_buckets=True,
            offloads=False,
            shards_optimizer=cfg.sharding.strategy == "optimizer",
        )

    def shard_group(self, topology: Topology) -> int:
        return 1  # every rank holds whole parameters

    # ---------------------------------------------------------------------------------- BackendDocs
    def vocabulary(self) -> dict[str, str]:
        return {
            "sharding=no_shard": "`DistributedDataParallel` (`sharding=ddp`)",
            "sharding=optimizer": "`DistributedDataParallel` + `ZeroRedundancyOptimizer(AdamW)` (`sharding=optimizer`)",
            "precision.param_dtype": "`torch.autocast(dtype)`",
            "precision.reduce_dtype": "`bf16_compress_hook` / `fp16_compress_hook` (bf16 needs NCCL)",
            "precision.cast_forward_inputs": "must stay true",
            "precision.loss_scaler=dynamic": "`torch.amp.GradScaler`",
            "prefetch.forward=k": "must stay default",
            "prefetch.backward=k": "must stay default",
            "prefetch.backward_timing": "must stay default",
            "prefetch.limit_all_gathers": "must stay default",
            "wrap=block": "must stay default",
            "ac=full / selective / selective_op": "`checkpoint_wrapper` on blocks",
            "trainer.grad_sync=every_micro_batch": "no `no_sync()`: each backward all-reduces",
            "trainer.grad_sync=last_micro_batch": "`no_sync()` until the last micro-batch (auto)",
            "compile=true": "same",
            "parallel.pp=N": "`replicate` (torch's FSDP2-based replication) over dp inside each `PipelineStage` "
            "(`sharding=ddp` only; docs/pipeline.md)",
        }


BACKEND = DDP()
