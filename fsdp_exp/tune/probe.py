"""A CPU's figures for the step-time model, measured once and cached: no data sheet describes a CPU
host running several ranks over gloo.

The probe starts as many ranks as a run puts on the node (gloo on 127.0.0.1, each with the threads a
rank gets), and all of them measure at once, so that each figure is what one rank gets while its peers
work too:

- the matmul peak per dtype: the trainer's own measurement and cache (``fsdp_exp.metrics.flops``: a
  figure the runs already cached is used as it is, so that predicted and reported MFU share a peak);
- what a training step's work reaches in each dtype against fp32: one Llama block (the family's own code) forward
  and backward at the run's own shapes (``block_shape``: the model's width, 2 sequences of its length; capped at
  width 1024 and 512 tokens so that the probe stays short), timed per dtype. A CPU's bf16 matmul peak (AMX,
  AVX-512 BF16) is several times its fp32 one, but a bf16 step also runs the casts around the fp32 norms, rotary
  and the loss, and elementwise kernels that are no faster, if not slower, than fp32's, and small matmuls never
  reach the peak: the step-like ratio, not the peaks', is what a bf16 candidate gains (``step_scale``: per dtype,
  the block's rate over fp32's, divided by the peaks' ratio; the model's rate for that dtype is its peak x
  efficiency x this). The ratio depends on the shape: on the development machine (2 cores, 1 thread a rank) a
  bf16 block ran 1.07x fp32's rate at width 128, 2.0x at 256, 2.4x at 512 and 3.1x at 1024 (the matmul peaks'
  ratio 3.7-12x), so a probe at one fixed width priced bf16 runs of a width-128 model at twice what they reach
  (issue #34 item 7);
- the cost of one operator as a training step dispatches it (eager CPU: it adds to the work): a Llama block of
  width 64 at 2 tokens (its arithmetic negligible) forward and backward in fp32, over three times the aten operators
  its forward dispatches (the step-time model's count: a backward dispatches about twice a forward's). A bare
  ``torch.add`` on 8 elements, what the probe timed before, costs a few times less than an operator recorded
  by autograd with its backward, so runs of many small micro-batches were priced too fast; the bare figure is
  kept in the entry (``bare_dispatch_us``) and the larger of the two is used;
- memory bandwidth: a 64 MiB copy (read + write traffic), which also stands for offload's copies
  between "host" and "device", here the same memory;
- gloo's all-gather and reduce-scatter at 1 KiB to 8 MiB: a least-squares line through
  ``time = (n-1) x latency + (n-1)/n x bytes / bandwidth`` gives the latency per ring step and the
  bandwidth (the same ring model ``fsdp_exp.tune.perf`` uses), fitted on relative errors so that the small
  sizes, which alone tell the latency, count as much as the large ones;
- FSDP's own cost per gathered unit and collective (``unit_us``, FSDP2's and FSDP1's, ``_unit_us``): hooks,
  copies in and out, the wait on gloo's thread, what a sharded step pays beyond the collectives themselves. On
  a CPU it is of the order of the collectives (0.5 ms each here), where on a GPU the device's work hides it.

The entry is cached in ``$XDG_CACHE_HOME/fsdp_exp/cpu_probe.json`` (default ``~/.cache``) per (CPU model,
ranks per node, threads per rank, torch version, the block's shape), with the share of its cores' time the ranks got: a
probe during which other programs ran is cached too (its figures are pessimistic; ``tune.calibrate_from``
corrects the model from real runs) and says so. Delete the file to measure again. Between nodes a CPU
cluster's network is not this machine's loopback: the probe's figures stand for both links until a
calibration on a multi-node sweep says otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

from fsdp_exp.cache import read_entry, read_table, write_entry

SIZES = (1024, 32 * 1024, 1024**2, 8 * 1024**2)
REPEATS = 5
CPU_OVERLAP = 0.5  # gloo's threads share the rank's cores with compute: half of what could overlap is hidden
CPU_EFFICIENCY = 0.5
CPU_STEP_OVERHEAD_MS = 2.0


def cache_path() -> Path:
    from fsdp_exp.metrics.flops import cache_path as peak_cache

    return peak_cache().with_name("cpu_probe.json")


def probe_key(ranks_per_node: int, threads: int) -> str:
    """The layout's key: what a calibration of this CPU is cached under (``fsdp_exp.tune.calibrate``)."""
    import torch

    from fsdp_exp.metrics.flops import cpu_model

    return f"{cpu_model()} | {ranks_per_node} ranks/node | {threads} threads/rank | torch {torch.__version__}"


DEFAULT_SHAPE = (256, 256)  # (width, tokens) of the probe's block where no run says


def block_shape(cfg) -> tuple[int, int]:
    """(width, tokens) of the block the probe times for ``cfg``'s model: its width (the input of the output
    projection, from the step-time model's count of the matmuls) and two of its sequences, capped at 1024 and 512
    (rounded to multiples of 32) so that the probe stays short; the default shape where the count has no head."""
    from fsdp_exp.tune.work import work

    w = work(cfg)
    widths = [k for k, n, _ in w.gemms if n == w.logits_per_token]
    return bounded_shape(widths[0], 2 * cfg.trainer.seq_len) if widths else DEFAULT_SHAPE


def bounded_shape(width: int, tokens: int) -> tuple[int, int]:
    """(width, tokens) within the probe's bounds: 64-1024 wide, 64-512 tokens, multiples of 32."""
    return min(1024, max(64, 32 * round(width / 32))), min(512, max(64, 32 * round(tokens / 32)))


def _layout_prefix(ranks_per_node: int, threads: int) -> str:
    # "step v5": entries of a fixed-shape block (v2), of a bare operator's cost (v3) or without FSDP's cost per
    # collective and with an unweighted latency fit (v4) are measured again
    return f"{probe_key(ranks_per_node, threads)} | step v5 | "


def _entry_key(ranks_per_node: int, threads: int, shape: tuple[int, int]) -> str:
    return f"{_layout_prefix(ranks_per_node, threads)}block {shape[0]} x {shape[1]} tokens"


def _read(key: str) -> Optional[dict]:
    return read_entry(cache_path(), key)


def _write(key: str, entry: dict) -> None:
    write_entry(cache_path(), key, entry)


def has_cpu_probe(ranks_per_node: int, threads: int) -> bool:
    """Whether any block shape of this layout is cached: read before ``block_shape``, whose count of the model's
    work runs torch's dispatch modes (their first use imports torch._dynamo and sympy, ~1.7 s of a launch)."""
    prefix = _layout_prefix(ranks_per_node, threads)
    return any(key.startswith(prefix) for key in read_table(cache_path()))


def cpu_probe(
    ranks_per_node: int, threads: int, shape: tuple[int, int] = DEFAULT_SHAPE, measure_now: bool = True
) -> Optional[dict]:
    """The cached entry for this layout and block shape (``block_shape``), measured now if there is none (None
    instead where ``measure_now`` is false: a reader, such as the report, that must not start ranks)."""
    key = _entry_key(ranks_per_node, threads, shape)
    entry = _read(key)
    if entry is None and not measure_now:
        return None
    if entry is None:
        entry = measure(ranks_per_node, threads, shape)
        entry["key"] = key
        _write(key, entry)
        entry["how"] = "measured now"
    else:
        entry["how"] = "cached"
    return entry


def cpu_perf(ranks_per_node: int, threads: int, shape: tuple[int, int] = DEFAULT_SHAPE, measure_now: bool = True):
    """(``DevicePerf`` of this CPU host for that layout, its bf16/fp16 priced at a block of ``shape``; the probe's
    entry); None where nothing is cached and ``measure_now`` is false."""
    from fsdp_exp.plan.devices import GROUPED_HALF_TOKENS_CPU, DevicePerf, Link

    entry = cpu_probe(ranks_per_node, threads, shape, measure_now)
    if entry is None:
        return None
    where = f"{entry['how']}, {cache_path()} [{entry.get('key', '')}]"
    busy = (
        ""
        if entry["core_share"] >= 0.9
        else f"; ranks got {entry['core_share']:.0%} of their cores' time: other programs ran, figures pessimistic"
    )
    gloo = Link(entry["gloo_gbps"], entry["gloo_latency_us"], f"gloo probe, {ranks_per_node} ranks ({where}{busy})")
    copy = Link(entry["copy_gbps"], 0.0, f"64 MiB copy per rank ({where})")
    perf = DevicePerf(
        peak_tflops=entry["peak_tflops"],
        memory_gbps=2 * entry["copy_gbps"],
        intra=gloo,
        inter=gloo,
        host=copy,
        host_memory_gbps=2 * entry["copy_gbps"] * ranks_per_node,
        efficiency=CPU_EFFICIENCY,
        overlap=CPU_OVERLAP,
        dispatch_us=entry["dispatch_us"],
        unit_us=entry.get("unit_us", {}),
        dtype_scale=entry.get("step_scale", {}),
        async_dispatch=False,
        step_overhead_ms=CPU_STEP_OVERHEAD_MS,
        grouped_gemm_half_tokens=GROUPED_HALF_TOKENS_CPU,
        source=f"matmul peak per rank, all ranks at once ({entry['peak_source']}); bf16/fp16 at a Llama block's "
        f"rate, width {shape[0]}, {shape[1]} tokens (x{entry['step_scale'].get('bf16', 1):.2f} of the bf16 peak); "
        f"memory: 64 MiB copies ({where})",
    )
    return perf, entry


# ---------------------------------------------------------------------------------------------- measuring
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks_per_node: int, threads: int, shape: tuple[int, int] = DEFAULT_SHAPE) -> dict:
    """Start ``ranks_per_node`` gloo ranks that measure at once; rank 0's figures (collectives are
    collective; the peak is the mean over ranks)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        mp.start_processes(
            _rank,
            args=(ranks_per_node, threads, _free_port(), str(out), shape),
            nprocs=ranks_per_node,
            start_method="spawn",
            join=True,
        )
        entry = json.loads(out.read_text())
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return entry


def _timed(fn, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _block_rates(dtypes: tuple[str, ...], shape: tuple[int, int], rounds: int = REPEATS) -> dict[str, float]:
    """TFLOPS of ``_block_step`` per dtype, timed in turn (fp32, bf16, fp16, fp32, ...: a busy moment of the machine
    falls on every dtype alike, which their ratio, not their level, needs), the median round each."""
    steps = {dtype: _block_step(dtype, shape) for dtype in dtypes}
    times: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for step, _ in steps.values():
        step()  # warm-up
    for _ in range(rounds):
        for dtype, (step, _) in steps.items():
            start = time.perf_counter()
            step()
            times[dtype].append(time.perf_counter() - start)
    return {dtype: flops / sorted(times[dtype])[rounds // 2] / 1e12 for dtype, (_, flops) in steps.items()}


def _block_step(dtype: str, shape: tuple[int, int] = DEFAULT_SHAPE):
    """(one forward and backward of a Llama block, its FLOPs): fsdp_exp.models.llama, ``shape``: width, tokens as 2
    sequences, heads of 32, in ``dtype`` as FSDP's mixed precision runs it (weights and activations in that dtype,
    the norms in fp32)."""
    import torch

    from fsdp_exp.config.schema import ModelConfig
    from fsdp_exp.models import llama

    width, tokens = shape
    seq = max(1, tokens // 2)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    heads = max(1, width // 32)
    cfg = ModelConfig(dim=width, n_layers=1, n_heads=heads, n_kv_heads=heads, vocab_size=256, max_seq_len=seq)
    torch.manual_seed(0)
    block = llama.TransformerBlock(cfg).to(torch_dtype)
    cos, sin = llama.rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    x = torch.randn(2, seq, cfg.dim, dtype=torch_dtype, requires_grad=True)

    def step():
        block(x, cos, sin).float().sum().backward()

    matmul = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    flops = 6 * matmul * x.shape[0] * x.shape[1] + 3 * 4 * x.shape[0] * x.shape[1] ** 2 * cfg.dim  # + attention
    return step, flops


def _block_op_seconds(width: int = 64) -> float:
    """Seconds per operator of a training step (see the module docstring): a Llama block of ``width`` at 2 tokens,
    fp32, forward and backward, over 3 x its forward's aten operators. Narrow on purpose: wider weights add
    memory-bound work per weight (their gradients' allocation and accumulation: 44 us an operator at width 256,
    290 at 1024 here), which the model prices by the bytes, not per operator."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_exp.config.schema import ModelConfig
    from fsdp_exp.models import llama

    heads = max(1, width // 32)
    cfg = ModelConfig(dim=width, n_layers=1, n_heads=heads, n_kv_heads=heads, vocab_size=256, max_seq_len=2)
    torch.manual_seed(0)
    block = llama.TransformerBlock(cfg)
    cos, sin = llama.rope_tables(cfg.dim // cfg.n_heads, 2, cfg.rope_theta)
    x = torch.randn(1, 2, cfg.dim, requires_grad=True)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        block(x, cos, sin)

    def step():
        block(x, cos, sin).sum().backward()

    return _timed(step) / (3 * max(1, Count.ops))


UNIT_PROBE_UNITS = 8  # tiny linear layers, each its own FSDP unit: their arithmetic is negligible


def _unit_us(world: int) -> dict[str, float]:
    """FSDP's own host cost per gathered unit and collective, by parameter layout (``DevicePerf.unit_us``: FSDP2's
    ``dim0``, FSDP1's ``flat``): a stack of tiny linear layers, each its own unit, forward and backward sharded
    over the ranks, less the same stack unsharded and less the collectives' own time (the same all-gather and
    reduce-scatter timed bare); per collective, counting what the step-time model counts for it: an all-gather per
    unit in forward and again in backward (units are resharded after forward), a reduce-scatter per unit. On a CPU
    this is the hooks' and copies' Python and the wait on gloo's thread, which eager dispatch does not hide; on
    this 2-core machine about 0.5 ms a collective against the bare collective's 0.6-1.6 ms (2026-12-03), so
    without it FSDP was priced nearly as DDP (issue #34 item 7)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    width, units = 64, UNIT_PROBE_UNITS
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
    dim0 = copy.deepcopy(plain)
    for layer in dim0:
        fully_shard(layer)
    fully_shard(dim0)
    flat = FullyShardedDataParallel(
        copy.deepcopy(plain),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
    )
    x = torch.randn(2, width)

    def step(model):
        return lambda: model(x).sum().backward()

    shard = -(-width * (width + 1) // world)  # a unit's weight and bias, padded to a multiple of the ranks
    full, part = torch.zeros(shard * world), torch.zeros(shard)
    dist.barrier()
    gather = _timed(lambda: dist.all_gather_into_tensor(full, part))
    dist.barrier()
    scatter = _timed(lambda: dist.reduce_scatter_tensor(part, full))
    collectives = 2 * units * gather + units * scatter
    dist.barrier()
    bare = _timed(step(plain))
    out = {}
    for layout, model in (("dim0", dim0), ("flat", flat)):
        dist.barrier()
        sharded = _timed(step(model))
        out[layout] = max(0.0, (sharded - bare - collectives) / (3 * units)) * 1e6
    return out


def _rank(rank: int, world: int, threads: int, port: int, out: str, shape: tuple[int, int] = DEFAULT_SHAPE) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist

    from fsdp_exp.metrics import flops

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        peaks, sources, shares = {}, [], []
        for dtype in ("fp32", "bf16", "fp16"):
            cached = flops.read_cached_peak(flops.peak_key(threads, world, dtype))
            dist.barrier()  # start together: each rank measures while its peers compute too
            if cached is not None:
                peaks[dtype] = cached["tflops"]
                sources.append(f"{dtype}: the runs' cache")
                continue
            local = flops.measure_matmul_tflops(dtype, seconds=0.6, batches=3)
            both = torch.tensor([local["tflops"], local["core_share"]], dtype=torch.float64)
            dist.all_reduce(both)
            peaks[dtype] = both[0].item() / world
            shares.append(both[1].item() / world)
            sources.append(f"{dtype}: measured, {local['n']}x{local['n']} matmuls")

        dist.barrier()
        # fp32 and bf16 in turn (the ratio tune's precisions hinge on); fp16, tens of times slower on a CPU, alone
        block_rate = {**_block_rates(("fp32", "bf16"), tuple(shape), 2 * REPEATS + 1), **_block_rates(("fp16",), shape)}
        step_scale = {
            dtype: min(1.0, (block_rate[dtype] / block_rate["fp32"]) / (peaks[dtype] / peaks["fp32"]))
            for dtype in ("bf16", "fp16")
        }

        a, b, c = torch.ones(8), torch.ones(8), torch.empty(8)
        dist.barrier()
        bare = _timed(lambda: [torch.add(a, b, out=c) for _ in range(2000)]) / 2000
        dist.barrier()
        dispatch = max(bare, _block_op_seconds())

        src, dst = torch.ones(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB
        dist.barrier()
        copy_gbps = src.numel() * 4 / _timed(lambda: dst.copy_(src)) / 1e9

        latency_us, gbps = 0.0, float("inf")
        if world > 1:
            rows, seconds = [], []
            for size in SIZES:
                full = torch.zeros(size // 4)
                part = torch.zeros(size // 4 // world)
                dist.barrier()
                seconds.append(_timed(lambda: dist.all_gather_into_tensor(full, part)))
                rows.append([world - 1, (world - 1) / world * size])
                dist.barrier()
                seconds.append(_timed(lambda: dist.reduce_scatter_tensor(part, full)))
                rows.append([world - 1, (world - 1) / world * size])
            # Relative least squares (each row over its own time): every size weighs alike, so the 1 KiB points,
            # which alone tell the latency, are not drowned by the 8 MiB ones. Unweighted, a machine under load
            # gave a negative intercept (clamped to 1 us) and FSDP's collectives were priced at nothing.
            seconds_ = np.array(seconds)
            (alpha, inverse_beta), *_ = np.linalg.lstsq(
                np.array(rows) / seconds_[:, None], np.ones(len(rows)), rcond=None
            )
            latency_us = max(float(alpha) * 1e6, 1.0)
            gbps = 1.0 / max(float(inverse_beta), 1e-12) / 1e9
        unit_us = _unit_us(world) if world > 1 else {}
        if rank == 0:
            Path(out).write_text(
                json.dumps(
                    {
                        "peak_tflops": peaks,
                        "peak_source": "; ".join(sources),
                        "dispatch_us": dispatch * 1e6,
                        "bare_dispatch_us": bare * 1e6,
                        "step_scale": step_scale,
                        "block_tflops": block_rate,
                        "block_shape": list(shape),
                        "copy_gbps": copy_gbps,
                        "gloo_latency_us": latency_us,
                        "gloo_gbps": min(gbps, 1e4),
                        "unit_us": unit_us,
                        "core_share": min(shares) if shares else 1.0,
                        "ranks_per_node": world,
                        "threads_per_rank": threads,
                    }
                )
            )
    finally:
        dist.destroy_process_group()
