"""What a Hugging Face model keeps for backward, measured on the model itself: the memory planner's
activation profile of ``model=hf`` (``fsdp_exp.plan.activations.ActivationProfile``).

Nothing here knows an architecture. The model (two of its blocks, the rest as it is) is built under
torch's ``FakeTensorMode`` (shapes and a CPU device, no memory: the CPU's kernels, and a 7B model costs
nothing), and one forward and backward of one micro-batch runs with ``saved_tensors_hooks`` (what
autograd keeps, by block, each storage once, parameters left out) and a dispatch mode that follows every
storage until it is freed (the largest moment of a block's backward, and of its forward under
``no_grad``). Sizes are per rank and micro-batch; tensor parallel is measured on a model divided by
``tp``. One measurement per (compute dtype, autocast) is cached in the process and on disk
(``$XDG_CACHE_HOME/fsdp_exp/hf_activations.json``, keyed by ``_disk_key``). How storages are told apart,
and mixtures of experts: the docs page models.md ("Hugging Face models").
"""

from __future__ import annotations

import copy
import itertools
import weakref
from dataclasses import dataclass
from typing import Optional

from fsdp_exp.errors import fail
from fsdp_exp.models.moe import grouped_mm_in_any_dtype
from fsdp_exp.plan.activations.profile import TokenCounts

DTYPES = {4: "float32", 2: "bfloat16"}
MEASURED_BLOCKS = 2  # blocks built for the measurement: the second one's input comes from a block


@dataclass(frozen=True)
class Measurement:
    block_saved: int  # bytes one block keeps for backward (its input when it keeps it)
    root_saved: int  # bytes the layers outside the blocks keep (embeddings, final norm, position tables)
    op_level_saved: dict  # ac.ops -> bytes of the op outputs one block saves under it (fsdp_exp.ops.OpSaver)
    forward_peak: int  # bytes a block holds at once in a forward without autograd, beyond its input
    backward_peak: int  # activation-gradient bytes at a block's backward peak, beyond the incoming one
    weight_grad_at_peak: int  # weight-gradient elements alive at that moment
    block_weight_grads: int  # weight-gradient elements of one block
    logits: int  # elements of the logits


class _Storages:
    """Follows every storage an op makes (a dispatch mode) until it is freed: bytes alive, the region
    (block or root) it was made in, and the bytes made since a window opened that are still alive."""

    def __init__(self, where: dict):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                import torch
                from torch.utils._pytree import tree_leaves

                tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                for t in tensors:
                    outer.made(t, func)
                if outer.on_op is not None:
                    outer.on_op(func, tensors)
                return out

        self.mode = Mode()
        self.where = where
        # A storage's key: a serial number given the first time it is seen, held while its Python object lives
        # (torch keeps one object per storage for the storage's lifetime). Never its address: a freed storage's
        # address is soon a new one's, and a key that outlived its storage then matched another (issue 24).
        self.serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.next_serial = itertools.count()
        self.on_op = None  # called with (op, its output tensors) for every op, if set
        self.alive: dict[int, int] = {}  # storage key -> bytes
        self.made_in: dict[int, str] = {}  # storage key -> the region it was made in
        self.made_by: dict[int, object] = {}  # storage key -> the op that made it
        self.watched: set[int] = set()  # storages whose bytes ``watched_bytes`` sums while they live
        self.watched_bytes = 0
        self.window: Optional[set[int]] = None  # storages made since the window opened
        self.window_bytes = 0
        self.samples: list[tuple[int, int, frozenset]] = []  # (window bytes, watched bytes, window keys)

    def key(self, t) -> int:
        """The key of ``t``'s storage: the same for every view of it while it lives, never another's."""
        storage = t.untyped_storage()
        if storage not in self.serials:
            self.serials[storage] = next(self.next_serial)
        return self.serials[storage]

    def made(self, t, func=None) -> None:
        storage = t.untyped_storage()
        key = self.key(t)
        if key in self.alive:
            return
        self.alive[key] = storage.nbytes()
        self.made_in[key] = self.where["region"]
        self.made_by[key] = func
        weakref.finalize(storage, self.freed, key)
        if self.window is not None:
            self.window.add(key)
            self.window_bytes += self.alive[key]
            self.samples.append((self.window_bytes, self.watched_bytes, frozenset(self.window)))

    def watch(self, t) -> None:
        key = self.key(t)
        if key in self.alive and key not in self.watched:
            self.watched.add(key)
            self.watched_bytes += self.alive[key]

    def freed(self, key: int) -> None:
        size = self.alive.pop(key, 0)
        if key in self.watched:
            self.watched.discard(key)
            self.watched_bytes -= size
        if self.window is not None and key in self.window:
            self.window.discard(key)
            self.window_bytes -= size

    def open(self) -> None:
        self.window, self.window_bytes, self.samples = set(), 0, []

    def close(self) -> list[tuple[int, int, frozenset]]:
        samples, self.window = self.samples, None
        return samples


def _scaled_config(config, tp: int):
    """The config of one tensor-parallel rank's share: heads and feed-forward width divided by ``tp``,
    the head dimension kept (where the config class can say it)."""
    import dataclasses

    small = copy.deepcopy(config)
    layers = min(getattr(small, "num_hidden_layers", MEASURED_BLOCKS), MEASURED_BLOCKS)
    small.num_hidden_layers = layers
    derived = isinstance(getattr(type(small), "layer_types", None), property)  # Jamba's: it follows the depth itself
    if isinstance(getattr(small, "layer_types", None), list) and not derived:
        small.layer_types = small.layer_types[:layers]
    if tp > 1:
        fields = {f.name for f in dataclasses.fields(type(small))} if dataclasses.is_dataclass(small) else set()
        head_dim = getattr(small, "head_dim", None) or small.hidden_size // small.num_attention_heads
        if "head_dim" in fields:
            small.head_dim = head_dim
            small.num_attention_heads //= tp
            if getattr(small, "num_key_value_heads", None):
                small.num_key_value_heads //= tp
        if getattr(small, "intermediate_size", None):
            small.intermediate_size //= tp
    return small


def measure(
    config,
    block_class_name: str,
    b: int,
    s: int,
    e: int,
    autocast: bool,
    tp: int,
    attn_implementation: str,
    shapes_only,
) -> Measurement:
    """One forward and backward of one micro-batch on fake tensors: what the model keeps and its peaks.

    Args:
        config: the transformers config of the model (its blocks scaled down to ``tp``'s share here).
        block_class_name: the class name of the model's blocks (the spec's ``block_class_of``).
        b: micro-batch size, in sequences.
        s: sequence length, in tokens.
        e: the compute dtype's bytes per element (``DTYPES[e]``); fp32 is used instead under ``autocast``.
        autocast: the parameters stay fp32 and compute runs under autocast (DDP's mixed precision).
        tp: tensor-parallel degree; heads and feed-forward width are divided by it.
        attn_implementation: transformers' attention implementation (``model.attn_implementation``).
        shapes_only: the family's context manager for building the model on fake tensors.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from fsdp_exp.config.schema import AC_OPS
    from fsdp_exp.ops import OpSaver

    compute = getattr(torch, DTYPES[e])
    config = _scaled_config(config, tp)
    config.use_cache = False
    where = {"region": "root", "inputs": {}, "outputs": {}}
    storages = _Storages(where)
    # Entered before the storages' mode, the grouped-matmul mode handles an op after it: the storages see its result.
    with FakeTensorMode(allow_non_fake_inputs=True), grouped_mm_in_any_dtype(), shapes_only:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if autocast else compute, attn_implementation=attn_implementation
        )
        model.train()
        blocks = [m for m in model.modules() if type(m).__name__ == block_class_name]
        j = len(blocks) - 1  # the measured block (its input comes from the block before it)
        kept = {storages.key(p) for p in model.parameters()}
        kept |= {storages.key(buf) for buf in model.buffers()}
        tokens = torch.zeros((b, s), dtype=torch.long)
        kept.add(storages.key(tokens))
        saved: dict[str, dict[int, int]] = {}  # region -> storage -> bytes

        def pre(i):
            def hook(module, args, kwargs) -> None:
                where["region"] = f"block {i}"
                where["inputs"][i] = args[0] if args else kwargs.get("hidden_states")

            return hook

        def post(i):
            def hook(module, args, kwargs, output) -> None:
                where["region"] = "root"
                where["outputs"][i] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = []
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post(i), with_kwargs=True))

        def pack(t):
            key = storages.key(t)
            if key not in kept:
                saved.setdefault(where["region"], {})[key] = t.untyped_storage().nbytes()
                if where["region"] == f"block {j}":
                    storages.watch(t)
            return t

        # What op-level checkpointing would save of block j: each policy's OpSaver asked op by op, as the run's.
        savers = {ops: OpSaver(ops) for ops in AC_OPS if ops != "none"}
        op_saved: dict[str, dict[int, int]] = {ops: {} for ops in savers}

        def on_op(func, tensors) -> None:
            if where["region"] == f"block {j}":
                for ops, saver in savers.items():
                    if saver.saves(func):
                        op_saved[ops].update((storages.key(t), t.untyped_storage().nbytes()) for t in tensors)

        storages.on_op = on_op
        amp = torch.autocast("cpu", dtype=compute) if autocast else torch.autocast("cpu", enabled=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), storages.mode, amp:
            logits = model(tokens).logits
        storages.on_op = None
        block_input = storages.key(where["inputs"][j])
        mine = {
            k: n
            for k, n in saved.get(f"block {j}", {}).items()
            if storages.made_in.get(k) == f"block {j}" or k == block_input
        }
        shared = {
            k: n
            for region, kv in saved.items()
            for k, n in kv.items()
            if not region.startswith("block") or storages.made_in.get(k) == "root"
        }

        # Block j's backward, from its output's gradient to its input's: at its largest moment, what it
        # made (activation and weight gradients) and what it still keeps of its saved activations.
        marks = {}

        def opened(grad):
            storages.open()
            return grad

        def closed(grad):
            marks["samples"] = storages.close()
            return grad

        where["outputs"][j].register_hook(opened)
        where["inputs"][j].register_hook(closed)
        with storages.mode:
            logits.float().sum().backward()
        grads = {
            storages.key(p.grad): (p.grad.numel(), p.grad.untyped_storage().nbytes())
            for p in blocks[j].parameters()
            if p.grad is not None
        }
        block_saved = sum(mine.values())
        best = max(marks.get("samples") or [(0, block_saved, frozenset())], key=lambda x: x[0] + x[1])
        grad_elements = sum(n for key, (n, _) in grads.items() if key in best[2])
        grad_bytes = sum(nbytes for key, (_, nbytes) in grads.items() if key in best[2])
        backward_peak = best[0] + best[1] - block_saved - grad_bytes

        # A checkpointed block's forward: no autograd, what it holds at once beyond its input.
        with torch.no_grad(), amp:
            found = {}

            def closing(module, args, output) -> None:
                found.setdefault("samples", storages.close())

            handle = blocks[j].register_forward_pre_hook(lambda module, args: storages.open())
            handle2 = blocks[j].register_forward_hook(closing)
            with storages.mode:
                model(tokens)
            handle.remove()
            handle2.remove()
        forward_peak = max((sample[0] for sample in found.get("samples", [])), default=0)
        for h in handles:
            h.remove()

    return Measurement(
        block_saved=block_saved,
        root_saved=sum(shared.values()),
        op_level_saved={ops: sum(kept.values()) for ops, kept in op_saved.items()},
        forward_peak=forward_peak,
        backward_peak=max(0, backward_peak),
        weight_grad_at_peak=grad_elements,
        block_weight_grads=sum(p.numel() for p in blocks[j].parameters()),
        logits=b * s * logits.shape[-1],
    )


class HfActivations(TokenCounts):
    """The planner's ``ActivationProfile`` of a Hugging Face model, measured (see the module docstring)."""

    def __init__(self, spec, m, micro_batch: int, seq_len: int, tp: int):
        config = spec.config(m)
        self._args = (config, spec.block_class_of(m).__name__, micro_batch, seq_len)
        self._spec = spec
        self._architecture = spec.architecture(m)
        self._tp, self._attn = tp, m.attn_implementation
        self.b, self.s = micro_batch, seq_len
        self.d = config.get_text_config().hidden_size
        self.vocab = config.get_text_config().vocab_size
        self._key = (config.to_json_string(use_diff=False), self._args[1:], tp, self._attn)

    def _measured(self, e: int, autocast: bool = False) -> Measurement:
        key = (*self._key, e, autocast)
        if key not in _CACHE:
            if len(_CACHE) >= 64:
                _CACHE.clear()
            _CACHE[key] = self._stored(key) or self._measure(e, autocast)
        return _CACHE[key]

    def _stored(self, key: tuple) -> Optional[Measurement]:
        """The measurement kept on disk under ``key`` (everything it depends on, ``_disk_key``), else None."""
        from fsdp_exp.cache import read_entry

        entry = read_entry(disk_cache_path(), _disk_key(key))
        return Measurement(**entry) if entry else None

    def _measure(self, e: int, autocast: bool) -> Measurement:
        """``measure``, or a refusal where the model's forward needs values fake tensors do not have."""
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        from dataclasses import asdict

        from fsdp_exp.cache import write_entry

        try:
            measured = measure(
                *self._args,
                e=e,
                autocast=autocast,
                tp=self._tp,
                attn_implementation=self._attn,
                shapes_only=self._spec.shapes_only(),
            )
            write_entry(disk_cache_path(), _disk_key((*self._key, e, autocast)), asdict(measured))
            return measured
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            fail(
                f"the planner measures {self._architecture}'s activations on fake tensors (shapes without values), "
                f"and its forward calls {exc.func}, whose result depends on the values (a mixture of experts that "
                "sizes each expert's batch by the tokens routed to it does so); it cannot predict this model.",
                "measure it in a run instead: python -m fsdp_exp with these overrides and trainer.steps=2 reports "
                "summary/tracked_peak_gib_max",
            )

    @property
    def peak_weight_grad(self) -> int:
        return self._measured(4).weight_grad_at_peak

    @property
    def block_weight_grads(self) -> int:
        return self._measured(4).block_weight_grads

    def residual(self, e: int) -> int:
        return e * self.tokens * self.d

    def block_saved(self, e: int, autocast: bool = False, math_attention: bool = False) -> dict[str, int]:
        total = self._measured(e, autocast).block_saved
        return {"measured": total, "total": total}

    def op_level_saved(self, e: int, ops: str) -> int:
        return self._measured(e).op_level_saved[ops]

    def checkpointed_forward_peak(self, e: int) -> int:
        return self._measured(e).forward_peak

    def op_level_forward_peak(self, e: int, ops: str) -> int:
        measured = self._measured(e)
        return max(0, measured.forward_peak - measured.op_level_saved[ops])

    def backward_peak(self, e: int) -> int:
        return self._measured(e).backward_peak

    def dispatch_forward_peak(self, e: int) -> int:
        return 0  # transformers' experts run on every rank's own tokens (expert parallel is refused for them)

    def head_saved(self, e: int, autocast: bool) -> int:
        return self._measured(e, autocast).root_saved

    def math_attention(self, device_kind: str, e: int) -> bool:
        return False  # measured with the CPU's kernels; see notes

    def notes(self, device_kind: str, e: int) -> list[str]:
        notes = ["activations measured on the model under FakeTensorMode with the CPU's kernels"]
        if device_kind == "cuda":
            notes.append("CUDA: SDPA assumed to save what the CPU's flash kernel saves (q, k, v, out, log-sum-exp)")
        return notes


_CACHE: dict[tuple, Measurement] = {}


def disk_cache_path():
    from fsdp_exp.cache import cache_file

    return cache_file("hf_activations.json")


def _disk_key(key: tuple) -> str:
    """A measurement's key between processes: the in-process key (the model's full transformers config, its block
    class, micro-batch, sequence, tensor parallel, attention implementation, dtype, autocast) with the versions of
    torch and transformers and the source of the code that measures (this module, the family's spec with its
    shapes-only context, the op-level checkpointing rule OpSaver): any change to one of them measures again."""
    import hashlib
    import json
    from pathlib import Path

    import torch
    import transformers

    from fsdp_exp import ops
    from fsdp_exp.models import hf as hf_spec

    sources = [Path(__file__).resolve(), Path(hf_spec.__file__).resolve(), Path(ops.__file__).resolve()]
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    text = json.dumps([list(map(str, key)), torch.__version__, transformers.__version__, code])
    return hashlib.sha256(text.encode()).hexdigest()


def profile(spec, m, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool, cp: int = 1) -> HfActivations:
    """A Hugging Face model's per-rank profile, measured on the model (sequence parallel has no plan here).

    Every family's ``profile`` in ``PROFILES`` has this signature.

    Args:
        spec: the model family's spec (``fsdp_exp.models.spec_for``).
        m: the model config (``cfg.model``).
        micro_batch: sequences per micro-batch.
        seq_len: tokens per sequence.
        tp: tensor-parallel degree.
        sequence_parallel: ``parallel.sequence_parallel``; refused here (transformers' plans shard no norms).
    """
    if sequence_parallel:
        fail(
            "parallel.sequence_parallel has no plan for a Hugging Face model (transformers' plans shard no norms).",
            "pass parallel.sequence_parallel=false",
        )
    return HfActivations(spec, m, micro_batch, seq_len, tp)
