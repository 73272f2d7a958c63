"""How the experts' grouped matmul (``torch._grouped_mm``, fsdp_exp/models/moe.py) slows down when each expert gets
few tokens: the shape of the fall that the step-time model's ``grouped_gemm_half_tokens`` carries
(fsdp_exp/plan/devices.py, fsdp_exp/tune/experts_perf.py).

One grouped matmul of ``experts`` groups, each (tokens, K) x (K, N), for tokens per expert from 1 to 1024, timed
(the median of repeats) and turned into a rate (FLOPs per second) relative to the largest size's. The fit is the
curve the model uses, ``rate(m) = m / (m + m_half)`` of the large-group rate, least squares on the log of the rate.

    python benchmarks/grouped_mm.py              # fp32, K=512, N=256, 16 experts: prints each size and the fit
    python benchmarks/grouped_mm.py --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch


def rate(m: int, k: int, n: int, experts: int, dtype, repeats: int) -> float:
    """FLOPs per second of one grouped matmul with ``m`` tokens for each of ``experts`` groups."""
    x = torch.randn(m * experts, k, dtype=dtype)
    w = torch.randn(experts, n, k, dtype=dtype).transpose(-2, -1)
    offs = torch.arange(1, experts + 1, dtype=torch.int32) * m
    torch._grouped_mm(x, w, offs=offs)  # warm
    calls = max(1, int(2**20 // (m * k)))  # ~a million multiply-adds per timed sample at least
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch._grouped_mm(x, w, offs=offs)
        times.append((time.perf_counter() - start) / calls)
    return 2.0 * m * experts * k * n / statistics.median(times)


def fit_half(sizes: list[int], shares: list[float]) -> float:
    """m_half minimizing the squared log error of ``m / (m + m_half)`` against the measured shares (a scan)."""
    best, best_err = 0.0, math.inf
    for step in range(0, 2001):
        half = step * 0.25
        err = sum((math.log(s) - math.log(m / (m + half))) ** 2 for m, s in zip(sizes, shares))
        if err < best_err:
            best, best_err = half, err
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    sizes = [2**i for i in range(11)]
    rates = [rate(m, args.k, args.n, args.experts, dtype, args.repeats) for m in sizes]
    shares = [r / rates[-1] for r in rates]
    half = fit_half(sizes, shares)
    out = {
        "dtype": args.dtype,
        "k": args.k,
        "n": args.n,
        "experts": args.experts,
        "tokens_per_expert": sizes,
        "gflops": [r / 1e9 for r in rates],
        "share_of_largest": shares,
        "fit_half_tokens": half,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for m, r, s in zip(sizes, rates, shares):
        print(f"{m:5d} tokens/expert  {r / 1e9:8.2f} GFLOP/s  {s:6.3f} of the largest  fit {m / (m + half):6.3f}")
    print(f"fit: rate(m) = m / (m + {half:g}) of the large-group rate ({args.dtype}, K={args.k}, N={args.n})")


if __name__ == "__main__":
    main()
