"""The step-time model's float8 terms: what torchao's float8 training (``precision.float8_recipe``,
fsdp_exp/parallel/float8.py) adds to and changes in one step of one rank, counted for
``fsdp_exp.tune.perf.step_costs`` (``float8_costs``) and timed for its ``timing`` (``float8_seconds``).

Under ``precision=float8`` the linears torchao converts run at the FP8 peak x ``fp8_efficiency`` (operands 1 byte)
and their casts add memory-bound bytes (``float8_costs``; a GPU without an FP8 peak refuses, unless emulated:
``float8_refusal``).

torchao casts each operand of a converted matmul to float8 with a dynamic scale: the amax (max |x|) of the
high-precision tensor, then the scaled cast. A converted linear casts its input and its weight in forward; in
backward its output's gradient twice (once per backward matmul, each in its own layout), its weight and its input
(torchao 0.18's matmul_with_hp_or_float8_args). Under ``rowwise_with_gw_hp`` the weight's gradient matmul stays
high precision: no casts for it. Under float8 all-gather the gathered weight is float8 already: no weight casts,
but each all-gather casts the rank's fp32 shard first (the scale precomputed: read 4, write 1 byte an element) and
after each optimizer step the amax of every shard is taken (read 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fsdp_exp.tune.gemm import gemm_seconds

if TYPE_CHECKING:
    from fsdp_exp.config.schema import RunConfig
    from fsdp_exp.plan.devices import DevicePerf

FLOAT8_HP_TO_FP32 = 4  # the cast scales in fp32


@dataclass(frozen=True)
class Float8Costs:
    """What torchao's float8 training adds to and changes in a step of one rank (``float8_costs``)."""

    recipe: str
    emulate: bool  # torchao's emulated matmul: the casts, then a high-precision matmul
    gemms: tuple[tuple[float, float, float, float], ...]  # (M, K, N, FLOPs) of the converted matmuls, forward
    backward_fp8_matmuls: int  # of a converted layer's two backward matmuls, those in float8 (1 under _gw_hp)
    cast_bytes_forward: float  # the memory-bound amax and cast kernels' reads and writes, the step's forwards
    cast_bytes_backward: float
    optimizer_bytes: float = 0.0  # float8 all-gather: the scales precomputed from the updated weights


def cast_bytes_per_element(e: int, compiled: bool) -> float:
    """Bytes one float8 cast of a tensor of ``e``-byte elements reads and writes, per element. Compiled
    (``compile=true``, as torchao needs for speed): inductor fuses it into two memory-bound kernels, the amax
    reduction (reads the tensor) and the scale-and-cast (reads it, writes 1 byte). Eager: every operator of
    torchao's cast its own kernel: abs (read, write), max (read), the fp32 upcast (read, write 4; none from fp32),
    the scale's multiply and the clamp (read 4, write 4 each) and the float8 cast (read 4, write 1)."""
    if compiled:
        return 2 * e + 1
    upcast = 0 if e == FLOAT8_HP_TO_FP32 else e + 4
    return 3 * e + upcast + 8 + 8 + 5


def float8_on(cfg: "RunConfig") -> bool:
    return cfg.precision.float8_recipe is not None


def _converted_shapes(cfg: "RunConfig") -> dict[tuple[int, int], int]:
    """(in, out) features -> how many linears of that shape torchao converts (fsdp_exp.parallel.float8's filter)."""
    from fsdp_exp.models import spec_for
    from fsdp_exp.parallel.float8 import planned_matmuls

    shapes: dict[tuple[int, int], int] = {}
    for block in planned_matmuls(cfg, spec_for(cfg.model).inventory(cfg.model).blocks):
        for shape in block:
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def float8_all_gathered_numel(cfg: "RunConfig", tp: int = 1) -> float:
    """The converted weights' elements one tensor-parallel rank holds (the blocks' linears are split over tp),
    which a float8 all-gather moves at 1 byte each (0 without it)."""
    if not (float8_on(cfg) and cfg.precision.float8_all_gather):
        return 0.0
    return float(sum(k * n * count for (k, n), count in _converted_shapes(cfg).items())) / tp


def float8_costs(
    cfg: "RunConfig", gemms: tuple, tokens: float, e: int, shard: int, gathers: tuple[float, float], tp: int = 1
) -> tuple[tuple, Float8Costs]:
    """(the matmuls left high precision, what float8 adds and changes): of each linear-layer matmul shape, the share
    of its linears (per token, ``tokens`` of the step on this rank) that torchao converts; the casts' bytes over
    the step. ``gathers``: how many times the step gathers all the weights in forward and in backward (a float8
    all-gather casts the rank's shard of each converted weight first). ``tp``: the gemms' N is this rank's share
    of the linear's output features, the converted shapes are the whole linears'."""
    p = cfg.precision
    converted = _converted_shapes(cfg)
    cast = cast_bytes_per_element(e, cfg.compile)
    weight_casts = 0 if p.float8_all_gather else 1
    gw_hp = p.float8_recipe.endswith("_gw_hp")
    kept, fp8 = [], []
    forward = backward = 0.0
    for m, k, n, flops in gemms:
        whole_n = int(round(n * tp))
        share = min(1.0, converted.get((int(k), whole_n), 0) * 2 * k * whole_n * tokens / flops) if flops else 0.0
        if share < 1.0:
            kept.append((m, k, n, flops * (1 - share)))
        if share <= 0.0:
            continue
        fp8.append((m, k, n, flops * share))
        calls = flops * share / (2 * m * k * n)  # converted matmuls of this shape in the step's forwards
        forward += calls * cast * (m * k + weight_casts * k * n)  # input, weight
        grads = 1 if gw_hp else 2  # the output's gradient, once per float8 backward matmul
        backward += calls * cast * (grads * m * n + weight_casts * k * n + (0 if gw_hp else m * k))
    gathered = float8_all_gathered_numel(cfg, tp) / max(shard, 1)  # this rank's shard of the converted weights
    shard_cast = FLOAT8_HP_TO_FP32 + 1
    return tuple(kept), Float8Costs(
        p.float8_recipe,
        p.float8_emulate,
        tuple(fp8),
        1 if gw_hp else 2,
        cast_bytes_forward=forward + gathers[0] * shard_cast * gathered,
        cast_bytes_backward=backward + gathers[1] * shard_cast * gathered,
        optimizer_bytes=FLOAT8_HP_TO_FP32 * gathered,
    )


def float8_refusal(f8: Optional[Float8Costs], perf: "DevicePerf") -> Optional[str]:
    """Why a float8 step cannot be timed on this device (None: it can): fsdp_exp.parallel.float8's rule, the one
    the planner and the ranks apply too (a GPU without FP8 tensor cores runs only torchao's emulation). A CPU's is
    timed as its high-precision matmuls (the CPU kernel of _scaled_mm is no faster)."""
    from fsdp_exp.parallel.float8 import device_refusal

    if f8 is None:
        return None
    refused = device_refusal(f8.recipe, f8.emulate, "this GPU", perf.peak_tflops.get("fp8"), gpu=bool(perf.kernels))
    return f"{refused[0].rstrip('.')}; {refused[1]}" if refused else None


def float8_seconds(f8: "Float8Costs", perf: "DevicePerf", rate: float, e: int) -> tuple[float, float]:
    """(forward, backward) seconds of the converted matmuls and their casts: on FP8 tensor cores at the FP8 peak
    (operands 1 byte, the output in the compute dtype); emulated, at the high-precision rate; the casts by their
    bytes at the memory's rate."""
    high = gemm_seconds(f8.gemms, perf, rate, e, e)
    fp8 = (
        high if f8.emulate else gemm_seconds(f8.gemms, perf, perf.peak_tflops["fp8"] * 1e12 * perf.fp8_efficiency, 1, e)
    )
    bandwidth = perf.memory_gbps * 1e9 * perf.memory_efficiency
    backward = f8.backward_fp8_matmuls * fp8 + (2 - f8.backward_fp8_matmuls) * high
    return fp8 + f8.cast_bytes_forward / bandwidth, backward + f8.cast_bytes_backward / bandwidth
