"""DeepSpeed ZeRO (``deepspeed.initialize``): the same vocabulary, translated to a DeepSpeed config.

``sharding=no_shard`` / ``optimizer`` / ``grad_op`` / ``full`` are ZeRO stages 0 / 1 / 2 / 3. The engine
owns the step: backward, gradient accumulation (its boundary set from the trainer's micro-batch loop),
clipping, fp16 loss scaling and the optimizer step; the optimizer is the project's own AdamW and the
trainer's LR schedule drives it, so the schedule is the other backends' exactly. Stages 0-2 replicate
the parameters; stage 3 materializes and partitions one module at a time (``deepspeed.zero.Init``), so
no rank ever holds the whole model. On a CPU-only torch its communication goes through torch's gloo
group, its shared-memory all-reduce switched off, so all backends are measured over one transport.
DeepSpeed is optional: importing this module does not import it, and ``check`` refuses the backend
when it is not installed. The translation table and what differs from DeepSpeed's defaults: the docs
page backends.md ("DeepSpeed ZeRO as a fourth backend").
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_exp.config import EVERY_MICRO_BATCH, LAST_MICRO_BATCH, PrefetchConfig, RunConfig, WrapConfig
from fsdp_exp.errors import fail
from fsdp_exp.models import canonical_name, full_param_init, init_weights, matrix_parameter_names, spec_of
from fsdp_exp.parallel.backend import Backend, PlannerRules
from fsdp_exp.parallel.common import dtype_of, refuse_bf16_storage, refuse_fsdp2_only_knobs

# sharding strategy -> ZeRO stage
STAGES = {"no_shard": 0, "optimizer": 1, "grad_op": 2, "full": 3}
# prefetch preset (the prefetch config group) -> factor on DeepSpeed's default stage3_prefetch_bucket_size and
# stage3_max_live_parameters (0: no prefetch bucket, and the default number of live parameters)
PREFETCH_PRESETS = {
    "none": (PrefetchConfig(forward=0, backward=None), 0),
    "default": (PrefetchConfig(), 1),
    "deep": (PrefetchConfig(forward=2, backward=2), 2),
}


def prefetch_preset(pf: PrefetchConfig) -> Optional[str]:
    """The preset the prefetch group equals, or None."""
    return next((name for name, (preset, _) in PREFETCH_PRESETS.items() if preset == pf), None)


# DeepSpeed's defaults for the two ZeRO-3 knobs the prefetch presets scale (its DeepSpeedZeroConfig).
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
CHECKPOINT_TAG = "zero"  # the sub-folder deepspeed's save_checkpoint writes inside a checkpoint folder


def installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _deepspeed():
    """Import deepspeed quietly, with its CPU shared-memory all-reduce switched off (see the docstring), and
    its communication bound to the process group this rank already joined."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # deepspeed keeps this dict for the process
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's own collectives call torch's older names, which warn on every call.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor)`")
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # wraps the existing group, starts none
    return deepspeed


def stage_of(cfg: RunConfig) -> int:
    return STAGES[cfg.sharding.strategy]


def ds_config(cfg: RunConfig, dp: int) -> dict:
    """The config handed to ``deepspeed.initialize`` (recorded verbatim in ``run.json["applied"]``)."""
    t, p, o = cfg.trainer, cfg.precision, cfg.offload
    per_rank = t.global_batch_size // dp
    micro = t.micro_batch_size or per_rank
    stage = stage_of(cfg)
    zero: dict = {"stage": stage}
    if stage == 3:
        _, factor = PREFETCH_PRESETS[prefetch_preset(cfg.prefetch)]
        zero["stage3_prefetch_bucket_size"] = factor * DEFAULT_PREFETCH_BUCKET
        zero["stage3_max_live_parameters"] = max(factor, 1) * DEFAULT_MAX_LIVE_PARAMETERS
        # sharding=full shards every parameter at rest, as FSDP does. DeepSpeed's default (1e5 elements)
        # keeps smaller parameters whole on every rank: at 7B only the norms, at tiny sizes almost all.
        zero["stage3_param_persistence_threshold"] = 0
    pin = bool(o.pin_memory) if o.pin_memory is not None else torch.cuda.is_available()
    if o.params:  # DeepSpeed offloads parameters only together with the optimizer
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if o.params or o.optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": per_rank // micro,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": p.param_dtype == "bf16"},
        # loss_scale 0 = DeepSpeed's dynamic loss scaler (its defaults: 2**16 to start, window 1000)
        "fp16": {"enabled": p.param_dtype == "fp16", "loss_scale": 0},
        "communication_data_type": p.reduce_dtype,
        # the project's torch AdamW steps the (host) partitions when the optimizer is offloaded
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return config


class DeepSpeed(Backend):
    name = "deepspeed"
    api = "deepspeed.initialize"
    float8_refusal = (
        "ZeRO partitions and casts the parameters itself, outside torchao's float8 weight wrapper; "
        "torchao supports float8 training under FSDP2."
    )
    strategies = ("full", "grad_op", "optimizer", "no_shard")
    tracks_memory = False  # torch's MemTracker cannot follow ZeRO's partitioned / flattened parameters
    compiles_itself = True  # compile=true: engine.compile() (torch.compile of the module, ZeRO's hooks kept)
    column_title = "DeepSpeed (`deepspeed.initialize`)"

    # -------------------------------------------------------------------------------- BackendChecks
    def missing_dependency(self) -> Optional[str]:
        return (
            None
            if installed()
            else "pip install 'fsdp_exp[deepspeed]' (pinned: pip install -c constraints.txt deepspeed)"
        )

    def check(self, cfg: RunConfig, device_type: str) -> None:
        s, p, o = cfg.sharding, cfg.precision, cfg.offload
        refuse_bf16_storage(self, cfg)
        if self.missing_dependency():
            fail(
                "sharding.backend=deepspeed needs DeepSpeed, which is not installed.",
                f"{self.missing_dependency()}, or pass sharding.backend=fsdp2",
            )
        if s.strategy not in self.strategies:
            fail(
                f"sharding.strategy={s.strategy} has no DeepSpeed equivalent wired here (MiCS / hpZ are not).",
                "pass sharding=full|grad_op|optimizer|no_shard with sharding.backend=deepspeed, or "
                "sharding.backend=fsdp2 for hybrid",
            )
        refuse_fsdp2_only_knobs(self, cfg)
        if cfg.trainer.grad_sync not in ("auto", self.grad_sync(cfg)):
            self.refuse(
                f"trainer.grad_sync={cfg.trainer.grad_sync}",
                f"DeepSpeed's engine reduces ZeRO-{stage_of(cfg)} gradients {self.grad_sync(cfg)} "
                "(ZeRO-2/3 at every micro-batch, ZeRO-0/1 at the accumulation boundary) and has no switch.",
                f"pass trainer.grad_sync=auto (here {self.grad_sync(cfg)}), or sharding.backend=fsdp2",
            )
        for knob in ("use_orig_params", "sync_module_states"):
            if getattr(s, knob) is not None:
                self.refuse(
                    f"sharding.{knob}",
                    "DeepSpeed trains the module's own parameters, and fsdp_exp "
                    "initializes every rank identically by seed.",
                    f"drop sharding.{knob}",
                )
        if p.param_dtype == "bf16" and p.reduce_dtype == "bf16":
            self.refuse(
                "precision=bf16_pure (bf16 gradient reduction)",
                "DeepSpeed's bf16 mode always keeps fp32 "
                "master weights and is configured here with fp32 gradient reduction.",
                "pass precision=bf16",
            )
        if p.reduce_dtype not in ("fp32", p.param_dtype):
            self.refuse(
                f"precision.reduce_dtype={p.reduce_dtype} with param_dtype={p.param_dtype}",
                "DeepSpeed communicates in fp32 or the compute dtype.",
                "pass precision.reduce_dtype=fp32",
            )
        if p.buffer_dtype is not None:
            self.refuse(
                "precision.buffer_dtype",
                "DeepSpeed casts parameters only; buffers keep their dtype.",
                "drop precision.buffer_dtype",
            )
        if not p.cast_forward_inputs:
            self.refuse(
                "precision.cast_forward_inputs=false",
                "the DeepSpeed engine does not cast inputs either way (the model's inputs are token ids).",
                "drop precision.cast_forward_inputs",
            )
        if p.param_dtype == "fp16" and device_type == "cpu":
            self.refuse(
                "precision=fp16 on the CPU",
                "DeepSpeed's CPU accelerator supports fp32 and bf16 only (its "
                "engine refuses fp16 there); on CUDA, fp16 runs with DeepSpeed's dynamic loss scaler.",
                "pass precision=bf16 (or run on CUDA)",
            )
        if p.loss_scaler == "dynamic" and p.param_dtype != "fp16":
            self.refuse(
                f"precision.loss_scaler=dynamic with param_dtype={p.param_dtype}",
                "DeepSpeed's dynamic loss scaler is part of its fp16 mode.",
                "pass precision=fp16, or precision.loss_scaler=none",
            )
        stage = STAGES.get(s.strategy, 0)
        if o.params and stage != 3:
            self.refuse(
                f"offload=params with sharding={s.strategy}",
                "DeepSpeed offloads parameters under ZeRO-3 only (offload_param).",
                "pass sharding=full, or offload=optimizer (offload_optimizer)",
            )
        if o.optimizer and stage == 0:
            self.refuse(
                "offload=optimizer with sharding=no_shard",
                "DeepSpeed offloads the optimizer under ZeRO stages 1-3 only (offload_optimizer).",
                "pass sharding=optimizer|grad_op|full",
            )
        pf = cfg.prefetch
        if prefetch_preset(pf) is None:
            self.refuse(
                f"prefetch forward={pf.forward} backward={pf.backward} timing={pf.backward_timing} "
                f"limit_all_gathers={pf.limit_all_gathers}",
                "DeepSpeed prefetches by bytes (stage3_prefetch_bucket_size), mapped from the presets only.",
                "pass prefetch=none|default|deep",
            )
        if stage != 3 and pf != PrefetchConfig():
            self.refuse(
                f"prefetch={prefetch_preset(pf)} with sharding={s.strategy}",
                "stages 0-2 keep whole parameters on every rank: there is nothing to prefetch.",
                "drop prefetch=..., or pass sharding=full",
            )
        if cfg.wrap != WrapConfig():
            self.refuse(
                f"wrap={cfg.wrap.policy}",
                "DeepSpeed has no wrapping units (ZeRO-3 gathers each module's parameters when it runs).",
                "leave the wrap group at its default (drop wrap=...)",
            )
        if cfg.checkpoint.async_save:
            self.refuse(
                "checkpoint.async_save=true",
                "DeepSpeed's save_checkpoint writes synchronously.",
                "pass checkpoint.async_save=false",
            )

    def grad_sync(self, cfg: RunConfig) -> str:
        """The engine's own rule, the only one it honours (``check``): ZeRO-2 and -3 reduce every micro-batch
        into the gradient partitions; stages 0 and 1 reduce at the accumulation boundary."""
        return EVERY_MICRO_BATCH if stage_of(cfg) >= 2 else LAST_MICRO_BATCH

    # --------------------------------------------------------------------------------- BackendBuild
    def data_parallel_mesh(self, strategy: str, dp: int, replicate: int, shard: int) -> tuple[tuple, tuple]:
        if strategy == "no_shard":
            return (dp,), ("replicate",)
        return (dp,), ("shard",)  # every stage partitions over all data-parallel ranks

    def apply(self, model: nn.Module, cfg: RunConfig, mesh: DeviceMesh, device: torch.device):
        """Materialize and seed ``model`` (partitioned at once under ZeRO-3), build the project's AdamW,
        and hand both to ``deepspeed.initialize``. Returns the engine."""
        from fsdp_exp.optim import build_optimizer

        started = time.perf_counter()
        deepspeed = _deepspeed()  # its first import costs seconds: inside perf/setup_time_s, and recorded apart
        import_s = time.perf_counter() - started
        config = ds_config(cfg, mesh.size())
        dtype = dtype_of(cfg.precision.param_dtype)
        # Which parameters are matrices (weight decay), read off the meta model: ZeRO-3 leaves each partitioned
        # parameter an empty 1-D tensor (its data lives in ds_tensor), so afterwards none would be one.
        decay_names = matrix_parameter_names(model)
        if stage_of(cfg) == 3:
            _materialize_partitioned(deepspeed, model, config, cfg.trainer.seed, device, dtype)
        else:
            model.to_empty(device=device)
            init_weights(model, cfg.trainer.seed, device)
        optimizer = build_optimizer(model, cfg.optim, decay_names)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=copy.deepcopy(config), dist_init_required=False
        )
        compiled = {}
        if cfg.compile:  # checked on the CPU (stages 2 and 3): inductor compiles on the first step
            engine.compile()
            compiled = {
                "compile": {
                    "api": "DeepSpeedEngine.compile",
                    "modules": ["<root>"],
                    "is_compiled": bool(engine.is_compiled),
                }
            }
        return engine, {
            **compiled,
            "backend": self.name,
            "api": self.api,
            "mesh": {"shape": list(mesh.mesh.shape), "dim_names": list(mesh.mesh_dim_names or ())},
            "num_units": 1,
            "units": [{"module": "<root>"}],
            "deepspeed_version": deepspeed.__version__,
            "deepspeed_import_s": round(import_s, 3),
            "deepspeed_config": config,
            "optimizer": "fsdp_exp.optim.build_optimizer (torch.optim.AdamW), handed to deepspeed.initialize",
            "init": "zero.Init(module=...) per module, seeded by name"
            if stage_of(cfg) == 3
            else "to_empty + seeded by name on every rank",
        }

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def build_optimizer(self, model: nn.Module, cfg: RunConfig, decay_names: set[str]):
        """The AdamW built in ``apply`` (the engine steps it): the trainer's LR schedule drives its groups."""
        return model.basic_optimizer

    # ---------------------------------------------------------------------------------- BackendStep
    def zero_grad(self, model: nn.Module, optimizer) -> None:
        """Nothing: the engine clears the gradients after each step, and the optimizer's own partitions
        (with their host buffers under offload) are not the trainer's to touch."""

    def gradient_sync(self, model: nn.Module, reduce: bool, last: bool):
        model.set_gradient_accumulation_boundary(last)  # the engine decides what it reduces; it steps at the last
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor, scaler) -> None:
        model.backward(loss, scale_wrt_gas=False)  # the trainer already divides by the accumulation steps

    def grad_scaler(self, device: torch.device):
        return None  # fp16: the engine's dynamic loss scaler

    def loss_scale(self, model: nn.Module, scaler) -> float:
        """fp16: the engine's own scaler's current scale (its ``backward`` multiplies the loss by it)."""
        optimizer = getattr(model, "optimizer", None)
        return float(getattr(optimizer, "cur_scale", 1.0)) if model.fp16_enabled() else 1.0

    def optimizer_step(self, model: nn.Module, optimizer, scaler, max_norm: float) -> torch.Tensor:
        """``engine.step()``: unscale, clip to ``gradient_clipping``, step (skipped on fp16 overflow)."""
        engine = model
        counter = getattr(engine, "fsdp_exp_state_counter", None)
        if counter is not None:
            counter.before_step()  # gradients as the step holds them (the engine frees them after it)
        norm = None
        if engine.optimizer is engine.basic_optimizer:  # stage 0 fp32: DeepSpeed clips but keeps no norm
            norm = self.clip_grad_norm(engine, float("inf"))
        engine.step()
        if norm is None:
            norm = engine.get_global_grad_norm()
        return torch.as_tensor(float(norm) if norm is not None else float("nan"))

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm; gradients are whole and reduced on every rank at stage 0 (the only
        stage where the engine does not report it), so this clips only when ``max_norm`` is finite."""
        return torch.nn.utils.clip_grad_norm_(model.module.parameters(), max_norm)

    # ---------------------------------------------------------------------------- BackendInspection
    def inspect(self, model: nn.Module) -> list[dict]:
        """What the engine holds: stage, offload devices, dtypes, partitioned parameter sizes, optimizer."""
        engine = model
        zero = engine.zero_optimization_stage()
        params = list(engine.module.parameters())
        local = sum(_local(p).numel() for p in params)
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        offload_param = engine.zero_offload_param()
        offload_optim = engine.zero_offload_optimizer()
        model_dtype, grad_dtype = engine.get_data_types()
        unit = {
            "module": "<root>",
            "class": type(engine).__name__,
            "zero_stage": zero,
            "optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(engine.basic_optimizer).__name__,
            "offload_param": _device_name(offload_param),
            "offload_optimizer": _device_name(offload_optim),
            "param_dtype": str(_local(params[0]).dtype).removeprefix("torch."),
            "model_dtype": str(model_dtype).removeprefix("torch."),
            "grad_accum_dtype": str(grad_dtype).removeprefix("torch."),
            "communication_data_type": str(engine.communication_data_type).removeprefix("torch."),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "gradient_clipping": engine.gradient_clipping(),
            "dp_world_size": engine.dp_world_size,
            "num_params": len(params),
            "param_elements_local": local,
            "param_elements_total": total,
        }
        if zero == 3:
            unit["stage3_prefetch_bucket_size"] = engine.zero_prefetch_bucket_size()
            unit["stage3_max_live_parameters"] = engine.zero_max_live_parameters()
        if engine.fp16_enabled():
            unit["loss_scale"] = float(engine.optimizer.cur_scale) if hasattr(engine.optimizer, "cur_scale") else None
        return [unit]

    def model_state_counter(self, model: nn.Module, optimizer):
        from fsdp_exp.parallel.deepspeed_memory import ZeroStateBytes

        return ZeroStateBytes(model)

    def init_digests(self, model: nn.Module, seed: int) -> list[dict]:
        """Stages 0-2: whole parameters. Stage 3: each parameter's flat partition ``[start, end)`` of the
        flattened tensor (the last rank's padded with zeros, as DeepSpeed pads it)."""
        from fsdp_exp.parallel.digests import parameter_digests, tensor_hash

        root = model.module
        if model.zero_optimization_stage() != 3:
            return parameter_digests(root, seed)
        rows = []
        for name, param in root.named_parameters():
            part = param.ds_tensor
            start = param.partition_numel() * _partition_rank(param)
            full = full_param_init(root, name, param.ds_shape, seed, part.device).flatten()
            expected = torch.zeros(part.numel(), dtype=full.dtype, device=full.device)
            piece = full[start : start + part.numel()]
            expected[: piece.numel()] = piece
            rows.append(
                {
                    "name": canonical_name(name),
                    "slice": f"flat [{start}, {start + part.numel()})",
                    "hash": tensor_hash(part),
                    "expected": tensor_hash(expected.to(part.dtype)),
                }
            )
        return rows

    # ------------------------------------------------------------------------- BackendCheckpointing
    checkpoint_format = "deepspeed"

    def save_checkpoint(
        self,
        sharded,
        folder: Path,
        *,
        writer,
        step: int,
        rank: int,
        debug,
        process_group=None,
        async_save: bool = False,
    ):
        """DeepSpeed's own format: ``save_checkpoint`` into the (temporary) checkpoint folder. ``debug``'s
        save faults strike after this rank's files are written, as DCP's failing writer does."""
        sharded.model.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False)
        if debug.fail_during == "save" and debug.fail_at_step == step and rank == debug.fail_rank:
            if debug.fail_signal:  # this rank's files are written; the checkpoint is not complete
                os.kill(os.getpid(), getattr(signal, debug.fail_signal))
                time.sleep(60)
            raise RuntimeError(f"debug.fail_during=save: injected failure while saving {folder}")

    def load_checkpoint(self, sharded, folder: Path, meta: dict, world_size: int) -> None:
        from fsdp_exp.checkpoint.layout import CheckpointError

        if meta.get("world_size") != world_size:
            raise CheckpointError(
                f"cannot resume {folder}: it was saved by DeepSpeed on {meta.get('world_size')} ranks and this run "
                f"has {world_size}; ZeRO's partitions are laid out per rank and fsdp_exp does not convert them "
                f"(DeepSpeed's universal checkpoints are not wired). Pass trainer.nproc_per_node="
                f"{meta.get('world_size')}, or checkpoint.resume=none"
            )
        path, _ = sharded.model.load_checkpoint(
            str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise CheckpointError(f"cannot resume {folder}: DeepSpeed found no checkpoint under {CHECKPOINT_TAG}/")

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The engine's 16-bit weights, cast back to fp32: gathered to rank 0 under ZeRO-3, rank 0's whole
        module below it."""
        import torch.distributed as dist

        engine = model
        if engine.zero_optimization_stage() == 3:
            state = engine._zero3_consolidated_16bit_state_dict()  # gathers module by module to rank 0
        else:
            state = engine.module.state_dict() if dist.get_rank() == 0 else {}
        params = {canonical_name(n) for n, _ in engine.module.named_parameters()}
        return {
            canonical_name(k): v.detach().float().cpu() for k, v in (state or {}).items() if canonical_name(k) in params
        }

    # ------------------------------------------------------------------------------ BackendPlanning
    def planner_rules(self, cfg: RunConfig) -> PlannerRules:
        stage = stage_of(cfg)
        notes = (
            f"DeepSpeed ZeRO-{stage}: its layout (low-precision parameters, fp32 master partitions, "
            "gradients, AdamW moments) at rest; its communication buckets are estimated as FSDP's or DDP's",
        )
        if stage == 3:
            return PlannerRules(
                param_layout="dim0",
                gathers_units=True,
                autocast=False,
                root_output_dtype=None,
                reshard_after_forward=True,
                gradient_buckets=False,
                offloads=True,
                notes=notes + ("ZeRO-3 gathers module by module; estimated as one unit per block",),
                zero_stage=stage,
            )
        return PlannerRules(
            param_layout="replicated",
            gathers_units=False,
            autocast=False,
            root_output_dtype=None,
            reshard_after_forward=False,
            gradient_buckets=True,
            offloads=True,
            notes=notes,
            zero_stage=stage,
        )

    def shard_group(self, topology) -> int:
        return topology.dp_size  # the states ZeRO partitions are split over every data-parallel rank

    # ---------------------------------------------------------------------------------- BackendDocs
    def vocabulary(self) -> dict[str, str]:
        rows = {f"sharding={strategy}": f"`zero_optimization.stage={stage}`" for strategy, stage in STAGES.items()}
        return {
            **rows,
            "precision.param_dtype": "`bf16.enabled` / `fp16.enabled` (fp32 master weights always)",
            "precision.reduce_dtype": "`communication_data_type` (bf16 refused: pass precision=bf16)",
            "precision.cast_forward_inputs": "must stay true",
            "precision.loss_scaler=dynamic": "`fp16.loss_scale=0` (DeepSpeed's dynamic loss scaler)",
            "offload=params": "`offload_param` + `offload_optimizer` (device cpu), ZeRO-3 only",
            "offload=optimizer": "`offload_optimizer` (device cpu), stages 1-3",
            "prefetch.forward=k": "presets only: none / default / deep = `stage3_prefetch_bucket_size` 0 / "
            "default / 2x (and `stage3_max_live_parameters`), ZeRO-3 only",
            "prefetch.backward=k": "as prefetch.forward (the same bucket serves both directions)",
            "wrap=block": "must stay default (no wrapping units)",
            "ac=full / selective / selective_op": "`checkpoint_wrapper` on blocks, before `deepspeed.initialize`",
            "trainer.grad_sync=every_micro_batch": "the engine's rule at ZeRO-2/3 (auto there); refused at ZeRO-0/1",
            "compile=true": "`engine.compile()` after `deepspeed.initialize` (the whole module; runs on the CPU)",
        }


def _local(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds: its ZeRO-3 partition, or the whole tensor."""
    return getattr(param, "ds_tensor", param)


def _partition_rank(param) -> int:
    import torch.distributed as dist

    return dist.get_rank(group=param.ds_process_group)


def _device_name(offload) -> Optional[str]:
    device = getattr(offload, "device", None)
    return None if device is None else str(getattr(device, "value", device))


def _materialize_partitioned(
    deepspeed, model: nn.Module, config: dict, seed: int, device: torch.device, dtype: torch.dtype
) -> None:
    """ZeRO-3 without a full copy: module by module (children first), materialize its own parameters,
    fill them from the seed in the compute dtype, and partition them at once (``zero.Init(module=...)``
    broadcasts each parameter from rank 0, then keeps this rank's partition only)."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied tensor: by its first name, as init_weights
    done: dict[int, nn.Parameter] = {}  # tied parameters are materialized once
    for module in reversed(list(model.modules())):
        own = [(attr, p) for attr, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        for attr, param in own:
            if id(param) in done:
                setattr(module, attr, done[id(param)])
                continue
            full = full_param_init(model, names[id(param)], param.shape, seed, device).to(dtype)
            new = nn.Parameter(full, requires_grad=param.requires_grad)
            setattr(module, attr, new)
            done[id(param)] = new
        deepspeed.zero.Init(module=module, config_dict_or_path=config, dtype=dtype)
    for module in model.modules():  # buffers (rotary tables) are small and derived: every rank holds them
        for attr, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[attr] = torch.empty_like(buf, device=device)
    spec_of(model).init_buffers(model, device)


BACKEND = DeepSpeed()
