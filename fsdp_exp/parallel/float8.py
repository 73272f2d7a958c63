"""Float8 training (torchao), a recipe step applied before activation checkpointing, compile and sharding.

``precision=float8`` (or ``precision.float8_recipe=...`` on any precision) swaps the model's ``nn.Linear``
layers for torchao's ``Float8Linear``: their matmuls run in float8 with dynamic scales, while the
parameters, gradients and optimizer state keep the run's dtypes, so checkpoints and exports stay high
precision. Layers kept high precision follow torchao's documented filter: the family's output modules
(or ``precision.float8_filter_fqns``) and every linear whose features are not a multiple of 16.
``precision.float8_all_gather`` (FSDP2, tensorwise) all-gathers the weights in float8, with the scales
precomputed after each optimizer step (``precompute_scales``); gloo carries float8, so it runs on a CPU
too. Recipes, refusals and measurements: the docs page float8.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_exp import packages
from fsdp_exp.errors import fail

if TYPE_CHECKING:
    from torch import nn

    from fsdp_exp.config import RunConfig

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
MXFP8 = "mxfp8"
FLOAT8_MATMUL_MULTIPLE = 16  # torch._scaled_mm needs both dims of each operand to be multiples of 16
INSTALL = 'pip install "fsdp_exp[float8]" (torchao)'


def enabled(cfg: "RunConfig") -> bool:
    return cfg.precision.float8_recipe is not None


def check(cfg: "RunConfig", device_type: str) -> None:
    """Refuse what float8 training cannot do here, each by the override that fixes it (preflight)."""
    from fsdp_exp.parallel.backend import backend_for

    p = cfg.precision
    if not enabled(cfg):
        if p.float8_all_gather:
            fail(
                "precision.float8_all_gather=true all-gathers float8 weights, but float8 training is off.",
                "pass precision=float8 (or precision.float8_recipe=tensorwise), or precision.float8_all_gather=false",
            )
        return
    if p.float8_recipe == MXFP8:
        fail(
            f"precision.float8_recipe=mxfp8: torchao's MXFP8 training needs a CUDA device of compute capability "
            f"10.0 or more (Blackwell), and fsdp_exp does not build it yet; this run is on {device_type}.",
            "pass precision.float8_recipe=tensorwise or rowwise",
        )
    if p.float8_recipe not in RECIPES:
        fail(
            f"precision.float8_recipe={p.float8_recipe!r} is not one of torchao's float8 recipes "
            f"({', '.join(RECIPES)}).",
            "pass precision.float8_recipe=tensorwise (or null: no float8)",
        )
    packages.require(
        "torchao",
        "precision.float8_recipe",
        f"precision.float8_recipe={p.float8_recipe} needs torchao, which is not installed.",
        INSTALL,
    )
    backend = backend_for(cfg)
    if backend.float8_refusal:
        backend.refuse(
            f"precision.float8_recipe={p.float8_recipe}",
            backend.float8_refusal,
            "pass sharding.backend=fsdp2 (or sharding=ddp), or precision=bf16",
        )
    if cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel and tensor_parallel_styles(cfg) and device_type == "cpu":
        # torchao's PrepareFloat8ModuleInput casts the sequence shard to float8 before gathering it, and gloo
        # refuses float8 tensors in its collectives ("Invalid scalar type"; FSDP2 gathers float8 weights in
        # a byte buffer, so its float8 all-gather runs). NCCL carries them: benchmarks/gpu_check.py runs it.
        fail(
            f"precision.float8_recipe={p.float8_recipe} with parallel.tp={cfg.parallel.tp} and "
            "parallel.sequence_parallel=true all-gathers the sequence in float8, and gloo (this CPU run's "
            "backend) cannot carry float8 tensors.",
            "pass parallel.sequence_parallel=false, or precision.float8_recipe=rowwise (its activations travel "
            "high precision), or run on CUDA",
        )
    if p.float8_all_gather and not backend.float8_all_gather:
        backend.refuse(
            "precision.float8_all_gather=true",
            "only FSDP2 all-gathers float8 weights (torchao's fsdp_pre_all_gather extension of fully_shard).",
            "pass precision.float8_all_gather=false, or sharding.backend=fsdp2",
        )
    if p.float8_all_gather and p.float8_recipe != "tensorwise":
        fail(
            f"precision.float8_all_gather=true with precision.float8_recipe={p.float8_recipe}: torchao all-gathers "
            "float8 weights under tensorwise scaling only.",
            "pass precision.float8_recipe=tensorwise, or precision.float8_all_gather=false",
        )
    if p.float8_all_gather and cfg.offload.params:
        fail(
            "precision.float8_all_gather=true with offload=params: the float8 cast of the offloaded shards would "
            "run on the host every step.",
            "pass offload=none, or precision.float8_all_gather=false",
        )

    if p.float8_filter_fqns:
        _refuse_filters_that_match_nothing(cfg)


def _refuse_filters_that_match_nothing(cfg: "RunConfig") -> None:
    """A name in precision.float8_filter_fqns that matches no linear layer keeps nothing high precision:
    most likely a typo, whose layers would then run in float8 unnoticed."""
    from torch import nn

    from fsdp_exp.models import build_meta

    linears = [name for name, m in build_meta(cfg.model).named_modules() if isinstance(m, nn.Linear)]
    unmatched = [fqn for fqn in cfg.precision.float8_filter_fqns if not any(_names(fqn, name) for name in linears)]
    if unmatched:
        fail(
            f"precision.float8_filter_fqns names {', '.join(map(repr, unmatched))}, which match no linear layer of "
            f"the model (its linear layers include {', '.join(linears[:4])}, ...); the filter would keep nothing "
            "high precision.",
            "pass whole parts of the layers' names, e.g. precision.float8_filter_fqns=[output] "
            "(or null: the model's output projection)",
        )


def _names(fqn: str, name: str) -> bool:
    """Whether filter entry ``fqn`` names module ``name`` (whole name parts: "feed_forward", "layers.0")."""
    return f".{fqn}." in f".{name}."


def device_refusal(
    recipe: "str | None", emulate: bool, device: str, fp8_peak: "float | None", gpu: bool
) -> "tuple[str, str] | None":
    """Why float8 training cannot run on ``device`` (problem, fix), or None: the one rule that tune, the planner
    and the ranks share. torch._scaled_mm's float8 matmuls need FP8 tensor cores (compute capability 8.9: Ada,
    Hopper, Blackwell); a GPU without an FP8 peak in the device tables (an A100) has none, and only torchao's
    emulation (``precision.float8_emulate``) runs there, no faster than bf16. A CPU (``gpu`` false) runs float8
    through its own _scaled_mm kernel: not refused. ``fp8_peak``: the device's FP8 TFLOPS from the caller's
    table (plan/devices.py's DevicePerf, or metrics/flops.py's by CUDA name), None when it has none."""
    if recipe is None or emulate or not gpu or fp8_peak:
        return None
    return (
        f"precision.float8_recipe={recipe}: {device} has no FP8 tensor cores (no fp8 peak in fsdp_exp's device tables; "
        "torch._scaled_mm needs compute capability 8.9 or more), so its float8 matmuls cannot run.",
        "pass precision=bf16, or precision.float8_emulate=true (torchao's emulation: the casts without the speed)",
    )


def check_gpu_name(cfg: "RunConfig", name: str) -> None:
    """Refuse float8 on the GPU CUDA names ``name`` ("NVIDIA A100-SXM4-80GB") when it has no FP8 tensor cores; a
    name no table knows is let through (torchao then says what it can do). Testable without a GPU."""
    from fsdp_exp.metrics.flops import lookup_peak_tflops

    p = cfg.precision
    refused = device_refusal(p.float8_recipe, p.float8_emulate, name, lookup_peak_tflops(name, "fp8"), gpu=True)
    known = lookup_peak_tflops(name, "bf16") is not None
    if refused and known:
        fail(*refused)


def check_rank_device(cfg: "RunConfig", device) -> None:
    """In each rank, before the model is built: a CUDA rank's GPU must run float8 (``check_gpu_name``). The
    launcher does not ask, to hold no CUDA context of its own while the ranks run."""
    if not enabled(cfg) or device.type != "cuda":
        return
    import torch

    check_gpu_name(cfg, torch.cuda.get_device_name(device))


def tensor_parallel_styles(cfg: "RunConfig") -> bool:
    """Whether tensor parallel shards the converted layers with torchao's float8 styles (parallel/tp.py), as
    torchtitan does: under the tensorwise recipe, the one they are written for (their input casts take one
    scale per tensor). Under the rowwise recipes torch's styles shard the converted layers, and the
    activations travel high precision."""
    return cfg.precision.float8_recipe == "tensorwise"


def skipped_fqns(cfg: "RunConfig") -> tuple[str, ...]:
    """The modules kept high precision by name: the setting, else the model's output projection."""
    from fsdp_exp.models import spec_for

    if cfg.precision.float8_filter_fqns is not None:
        return tuple(cfg.precision.float8_filter_fqns)
    return tuple(spec_for(cfg.model).output_modules_of(cfg.model))


def why_kept(name: str, module: "nn.Module", by_name: tuple[str, ...]) -> str | None:
    """Why a linear layer stays high precision (None: it is converted)."""
    from torch import nn

    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    if any(_names(fqn, name) for fqn in by_name):
        return "precision.float8_filter_fqns"
    if module.in_features % FLOAT8_MATMUL_MULTIPLE or module.out_features % FLOAT8_MATMUL_MULTIPLE:
        return f"dims {module.in_features}x{module.out_features} not multiples of {FLOAT8_MATMUL_MULTIPLE}"
    return None


def torchao_config(cfg: "RunConfig"):
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    p = cfg.precision
    config = Float8LinearConfig.from_recipe_name(p.float8_recipe)
    return dataclasses.replace(config, emulate=p.float8_emulate, enable_fsdp_float8_all_gather=p.float8_all_gather)


def apply(model: "nn.Module", cfg: "RunConfig") -> dict:
    """Convert ``model``'s eligible linear layers in place (on meta, before sharding); the applied settings."""
    from torch import nn
    from torchao.float8 import convert_to_float8_training

    by_name = skipped_fqns(cfg)
    kept = {
        name: why
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        if (why := why_kept(name, module, by_name))
    }
    config = torchao_config(cfg)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name not in kept)
    from torchao.float8.float8_linear import Float8Linear

    converted = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    return {
        "api": "torchao.float8.convert_to_float8_training",
        "recipe": cfg.precision.float8_recipe,
        "emulate": config.emulate,
        "enable_fsdp_float8_all_gather": config.enable_fsdp_float8_all_gather,
        "precompute_float8_dynamic_scale_for_fsdp": config.enable_fsdp_float8_all_gather,
        "filter_fqns": list(by_name),
        "converted": converted,
        "kept_high_precision": kept,
    }


def precompute_scales(model: "nn.Module") -> None:
    """After the optimizer step, under float8 all-gather: every weight's scale for the next all-gather in
    one all-reduce, instead of one per weight as each unit gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def planned_matmuls(cfg: "RunConfig", blocks: tuple[str, ...], tp: int = 1) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For the planner: (in_features, out_features) of each linear that ``apply`` converts, per block (of
    ``blocks``, the inventory's names), as one rank holds it under tensor parallel ``tp`` (a colwise layer's
    output features, a rowwise one's input features split over tp, as the family's plan says); () when float8
    is off. Read from the shared meta model by the same filter, without torchao. Converted linears outside
    the blocks (an unfiltered output projection) are not counted."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.models.spec import COLWISE

    if not enabled(cfg):
        return ()
    spec = spec_for(cfg.model)
    model = spec.meta_model(cfg.model)
    # tune asks this for thousands of candidates of one model: remembered per (shared meta model, blocks,
    # filter); the entry holds the model, so its id cannot be reused by another while the entry lives
    key = (id(model), tuple(blocks), skipped_fqns(cfg))
    entry = _PLANNED_MATMULS.get(key)
    if entry is None or entry[0] is not model:
        if len(_PLANNED_MATMULS) >= 64:
            _PLANNED_MATMULS.clear()
        entry = _PLANNED_MATMULS[key] = (model, _converted_per_block(model, key[1], key[2]))
    if tp == 1:
        return tuple(tuple((i, o) for i, o, _ in block) for block in entry[1])
    styles = spec.tensor_parallel_plan(cfg.model).block
    return tuple(
        tuple(
            (i, o // tp) if styles.get(name) == COLWISE else (i // tp, o) if name in styles else (i, o)
            for i, o, name in block
        )
        for block in entry[1]
    )


_PLANNED_MATMULS: dict = {}


def _converted_per_block(model: "nn.Module", blocks: tuple[str, ...], by_name: tuple[str, ...]):
    """Per block: (in_features, out_features, name in the block) of each linear ``apply`` converts."""
    from torch import nn

    index = {block: j for j, block in enumerate(blocks)}
    per_block: list[list[tuple[int, int, str]]] = [[] for _ in blocks]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and why_kept(name, module, by_name) is None:
            parts = name.split(".")
            prefixes = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
            block = next((p for p in prefixes if p in index), None)
            if block is not None:
                per_block[index[block]].append((module.in_features, module.out_features, name[len(block) + 1 :]))
    return tuple(tuple(shapes) for shapes in per_block)
