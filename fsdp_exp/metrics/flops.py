"""FLOPs per token, the recompute that activation checkpointing adds, peak FLOPS, MFU and HFU.

- **Model FLOPs** (MFU's numerator): the model family's per-token count (``fsdp_exp.models``), forward
  and backward, no recompute; ``trainer.flops_convention`` names other projects' conventions.
- **Hardware FLOPs** (HFU's numerator) add what activation checkpointing recomputes, and the output projection
  a chunked loss (``trainer.loss_chunks`` > 1) runs again in backward, counted by torch's
  ``FlopCounterMode`` on the meta model with and without the run's checkpointing, not by a formula
  (non-reentrant checkpointing does not recompute a whole block).
- **Peak FLOPS**: data-sheet figures for known GPUs (dense, no sparsity); on a CPU the rank measures it
  (matmuls in the compute dtype, every local rank at once), cached in
  ``$XDG_CACHE_HOME/fsdp_exp/cpu_peak.json`` unless other programs disturbed it (``MIN_CORE_SHARE``).
What is recomputed under each ``ac`` policy and when a CPU measurement is cached: the docs pages
running.md ("What a run writes") and design.md ("Metrics").
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Callable, Optional

from fsdp_exp.cache import cache_file, read_entry, write_entry

# "fp8": the dense FP8 tensor-core peak (Hopper, Ada, Blackwell; A100 and older have none), the second MFU
# denominator of a precision=float8 run (perf/mfu_fp8).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},  # SXM
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0, "fp8": 1671.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0, "fp8": 4500.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6, "fp8": 733.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3, "fp8": 242.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def lookup_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """Peak TFLOPS for a device name as CUDA reports it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    matches = [key for key in PEAK_TFLOPS if key.lower() in device_name.lower()]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(dtype)


# ------------------------------------------------------------------------------ MFU conventions
# Per token, forward and backward, no recompute. N: every parameter (tied ones once, position tables too);
# N_in: the input embeddings (token and position lookups); A: 12 L w S, attention's score and value products
# over the whole sequence (w: heads x head dim; L blocks; S the sequence); N_mm: the parameters of matmuls
# (N less N_in and the 1-D norms and biases; the output projection counted even when tied to the input).
DEFAULT_CONVENTION = "fsdp_exp"
CONVENTIONS = {
    "fsdp_exp": "6 (N - N_in + tied output) + 12 L w S: the model family's own (ModelSpec.flops_per_token)",
    "llmfoundry": "6 N + 12 L d S: llm-foundry's MFU (embeddings and the position table counted; attention not causal)",
    "torchtitan_2024_04": "6 N + 12 L H Q T: torchtitan's until 2024-05 (embeddings counted; not causal)",
    "torchtitan": "6 (N - N_in) + 12 L H Q T: torchtitan's since 2024-05 (PaLM's appendix B, the input "
    "embedding left out)",
    "megatron": "6 N_mm + 6 L w S: Megatron-LM's num_floating_point_operations (matmul weights and the logits; "
    "attention causal)",
}


def check_convention(convention: str) -> None:
    """Preflight's check of ``trainer.flops_convention`` (its values are this module's)."""
    from fsdp_exp.errors import fail

    if convention not in CONVENTIONS:
        fail(
            f"trainer.flops_convention={convention!r} is not a FLOPs convention MFU knows.",
            f"pass one of {', '.join(CONVENTIONS)} (docs/metrics.md defines each)",
        )


def convention_flops_per_token(convention: str, model_cfg, seq_len: int) -> float:
    """Training FLOPs per token under ``convention`` (``CONVENTIONS``), from the model family's inventory and
    formula: A = flops_per_token(S) - flops_per_token(0), and 6 x (N - N_in + tied output) = flops_per_token(0)."""
    from fsdp_exp.models import spec_for

    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOPs convention {convention!r}: one of {', '.join(CONVENTIONS)}")
    spec = spec_for(model_cfg)
    own = float(spec.flops_per_token(model_cfg, seq_len))
    if convention == "fsdp_exp":
        return own
    matmul_and_more = float(spec.flops_per_token(model_cfg, 0))
    attention = own - matmul_and_more
    inventory = spec.inventory(model_cfg)
    n_all = sum(p.numel for p in inventory.params)
    n_in = sum(p.numel for p in inventory.params if p.name in inventory.input_params)
    if convention in ("llmfoundry", "torchtitan_2024_04"):
        return 6.0 * n_all + attention
    if convention == "torchtitan":
        return 6.0 * (n_all - n_in) + attention
    vectors = sum(p.numel for p in inventory.params if len(p.shape) == 1 and p.name not in inventory.input_params)
    return matmul_and_more - 6.0 * vectors + attention / 2


def mfu(tflops_achieved: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Utilization: achieved TFLOPS per rank / the peak of one rank's device. Used for both MFU
    (model FLOPs) and HFU (hardware FLOPs: model FLOPs + recompute)."""
    return tflops_achieved / peak_tflops if peak_tflops else None


# -------------------------------------------------------------------------------------- recompute
def counted_flops_per_token(cfg, seq_len: int, apply_ac: Optional[Callable] = None, loss_chunks: int = 1) -> float:
    """Matmul + attention FLOPs of one forward and backward per token, as torch's FlopCounterMode
    counts them on a meta-device copy of the model (batch 1, ``seq_len`` tokens). ``apply_ac``
    (``fsdp_exp.parallel.ac.apply``, the same code the run uses; passed in, since metrics sit below
    parallel) applies the run's activation checkpointing first; None counts the model without it.
    ``loss_chunks`` > 1: the loss as the run takes it then (``fsdp_exp.models.loss``: the model's own forward,
    each slice's output projection checkpointed), whose backward runs the projection again."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_exp.models import build_meta, spec_for
    from fsdp_exp.ops import EXTRA_FLOP_FORMULAS

    model = build_meta(cfg.model)
    if apply_ac is not None and cfg.ac.mode != "none":
        apply_ac(model, cfg)
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    # The counter innermost: it sees a grouped matmul before the family's shapes-only mode makes its result.
    with (
        spec_for(cfg.model).shapes_only(),
        FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter,
    ):
        if loss_chunks > 1:
            model(tokens, targets=tokens, loss_chunks=loss_chunks).float().sum().backward()
        else:
            model(tokens).float().sum().backward()
    return counter.get_total_flops() / seq_len


def recompute_flops_per_token(cfg, seq_len: int, apply_ac: Callable, loss_chunks: int = 1) -> float:
    """FLOPs per token that a step runs again in backward (HFU's addition to the model FLOPs): what activation
    checkpointing (applied by ``apply_ac``: ``fsdp_exp.parallel.ac.apply``) recomputes, and under a chunked loss
    (``loss_chunks`` > 1) the output projection run again per slice. 0 with neither."""
    if cfg.ac.mode == "none" and loss_chunks <= 1:
        return 0.0
    return counted_flops_per_token(cfg, seq_len, apply_ac, loss_chunks) - counted_flops_per_token(cfg, seq_len)


# ------------------------------------------------------------------------------------ CPU peak
def cache_path() -> Path:
    return cache_file("cpu_peak.json")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_key(threads: int, ranks_per_node: int, dtype: str) -> str:
    import torch

    return f"{cpu_model()} | {threads} threads/rank | {ranks_per_node} ranks/node | {dtype} | torch {torch.__version__}"


def read_cached_peak(key: str) -> Optional[dict]:
    return read_entry(cache_path(), key)


def write_cached_peak(key: str, entry: dict) -> None:
    write_entry(cache_path(), key, entry)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MIN_CORE_SHARE = 0.9


def measure_matmul_tflops(dtype: str, seconds: float = 1.0, batches: int = 5) -> dict:
    """This process's matmul peak in TFLOPS on the threads torch has (``torch.get_num_threads()``).

    The size doubles from 512 until one n x n matmul takes at least 20 ms (large enough that the
    call's overhead is noise and every thread has whole tiles; at most 8192), then ``batches`` timed
    batches of about ``seconds / batches`` each run back to back. The peak is the rate over all of
    them (FLOPs / seconds), not the best batch: when ranks outnumber cores the scheduler time-slices
    them, and one batch can catch a whole core that a rank does not get on average (4 ranks on this
    2-core machine: best batches 62 GFLOPS a rank, sustained about half of one rank alone)."""
    import torch

    dt = getattr(torch, DTYPES[dtype])
    n = 512
    while True:
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        out = torch.empty(n, n, dtype=dt)
        torch.mm(a, b, out=out)  # first call: kernel selection, page faults
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        once = time.perf_counter() - start
        if once >= 0.02 or n >= 8192:
            break
        n *= 2
    rates, total = [], 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        count, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / batches:
                break
        rates.append(2 * n**3 * count / elapsed / 1e12)
        total += count
    wall = time.perf_counter() - wall0
    threads = torch.get_num_threads()
    # The CPU time this process got over the wall time, per thread: about 1 when every thread had a core
    # to itself; less when other programs (or more ranks than cores) took turns on them.
    core_share = (time.process_time() - cpu0) / (wall * threads)
    return {
        "tflops": 2 * n**3 * total / wall / 1e12,
        "batches_tflops": rates,
        "n": n,
        "dtype": dtype,
        "threads": threads,
        "core_share": core_share,
    }
