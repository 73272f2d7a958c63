"""What a model family supplies, so that no code outside ``fsdp_exp.models`` knows a parameter's name.

A family is a ``ModelSpec`` subclass with one instance in ``fsdp_exp.models.REGISTRY``, under the
``model.name`` it answers to. ``ModelSpec`` combines six roles, each a small class here (its docstring says
what it owns) that the callers of one concern need: ``SpecChecks`` (config checks, the hub fetch, the fit
check's depth override; every refusal is ``fail(problem, fix)``), ``SpecFacts`` (vocabulary, sequence
length, tokenizer, architecture, FLOPs per token), ``SpecBuild`` (the plain ``nn.Module``, the shared meta
model, initial values drawn from (seed, name) alone, so any world size and sharding agree), ``SpecLayout``
(blocks, the residual stream's two ends, experts, ties, pipeline stages, the tensor-parallel plan as data,
the planner's ``Inventory``), ``SpecContextParallel`` (attention kernels and position buffers for
context parallel) and ``SpecExport`` (Hugging Face's names and config.json). What a block saves
for backward is the planner's own model of the family (``fsdp_exp.plan.activations``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from fsdp_exp.errors import fail

if TYPE_CHECKING:
    import torch
    from torch import nn

COLWISE, ROWWISE = "colwise", "rowwise"


@dataclass(frozen=True)
class TensorParallelPlan:
    """Megatron-style tensor parallelism as data: module name -> ``colwise`` | ``rowwise``.

    ``colwise`` shards a module's output features, ``rowwise`` its input features, as torch's
    ``ColwiseParallel`` / ``RowwiseParallel`` do (an ``nn.Linear`` weight (out, in): colwise dim 0,
    rowwise dim 1; an ``nn.Embedding`` weight (num, dim): colwise dim 1, rowwise dim 0).

    ``root``: modules of the root, the two ends of the residual stream, by their names in the model.
    A rowwise one takes replicated inputs (token ids) and gives the residual stream; a colwise one
    takes the residual stream and gives replicated outputs (the logits).
    ``block``: modules inside every block, by their names in the block. A colwise one takes the
    replicated stream; a rowwise one gives the residual stream back.
    ``sequence_parallel_root`` / ``sequence_parallel_block``: modules (norms) that run on a shard of
    the sequence under ``parallel.sequence_parallel``.
    ``gathered_inputs``: block modules whose input is gathered from the sequence shard before their
    colwise projections, with the number of positional inputs they take (the first is the stream).
    """

    root: dict[str, str]
    block: dict[str, str]
    sequence_parallel_root: tuple[str, ...] = ()
    sequence_parallel_block: tuple[str, ...] = ()
    gathered_inputs: dict[str, int] = field(default_factory=dict)

    def style_of(self, param_name: str, blocks: tuple[str, ...]) -> tuple[Optional[str], str]:
        """(colwise | rowwise | None, module name) of the module holding ``param_name``."""
        module = param_name.rpartition(".")[0]
        block = next((b for b in blocks if module.startswith(b + ".")), None)
        if block is None:
            return self.root.get(module), module
        return self.block.get(module[len(block) + 1 :]), module


def tp_sharded_dim(style: Optional[str], module: "nn.Module", param_attr: str) -> Optional[int]:
    """The dim of ``module.<param_attr>`` that a tensor-parallel ``style`` shards (None: replicated),
    as torch's ColwiseParallel / RowwiseParallel partition an nn.Linear or an nn.Embedding."""
    from torch import nn

    if style is None:
        return None
    if isinstance(module, nn.Embedding):
        return 1 if style == COLWISE else 0
    if style == COLWISE:
        return 0  # weight and bias
    return 1 if param_attr == "weight" else None  # rowwise: the bias stays replicated


@dataclass(frozen=True)
class ParamEntry:
    name: str
    shape: tuple[int, ...]
    block: Optional[int]  # index into Inventory.blocks, None for the root's parameters
    tp_dim: Optional[int]  # the dim tensor parallel shards (from the plan), None: replicated over tp

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Inventory:
    """What the planner needs to know of a model's parameters, read once from the meta model."""

    params: tuple[ParamEntry, ...]  # in named_parameters order, tied duplicates once
    blocks: tuple[str, ...]  # qualified names of the blocks, in forward order
    input_params: frozenset[str]  # root parameters used before the blocks (embeddings): reduced last
    output_params: frozenset[str]  # the output projection's (the logits)
    buffer_bytes: int  # module buffers (e.g. rotary tables), unsharded on every rank


class SpecChecks(ABC):
    """Role: the family's config checks, asked by the launcher and preflight before any rank starts; every
    refusal is ``fail(problem, fix)`` naming the override that fixes it."""

    name: str = ""  # the model.name it answers to

    def check(self, cfg) -> None:
        """Refuse (``fail``) a model config this family cannot build."""

    def check_tensor_parallel(self, cfg, tp: int) -> None:
        """Refuse a ``parallel.tp`` that does not divide what the plan shards."""

    def fetch(self, cfg) -> None:
        """Called by the launcher before preflight: bring what the config names from afar (a hub name)
        into a local cache, so that preflight and the ranks read local files only."""

    def depth_override(self, cfg, n_layers: int) -> Optional[str]:
        """The command-line override that keeps this model's width with ``n_layers`` blocks (what the
        fit check offers for a model too deep for the node), or None where the family has none."""
        return None

    def check_pipeline(self, cfg) -> None:
        """Refuse a model that ``cut_stage`` cannot cut into pipeline stages (``parallel.pp > 1``)."""

    def check_expert_parallel(self, cfg, ep: int) -> None:
        """Refuse ``parallel.ep > 1`` for a model whose routed experts cannot be split over ``ep`` ranks
        (default: the family has no routed experts fsdp_exp can dispatch to)."""
        fail(
            f"parallel.ep={ep}: expert parallel is not built for {self.architecture(cfg)} (model.name={cfg.name}): "
            "fsdp_exp's dispatcher is placed into the llama family's experts only.",
            "pass parallel.ep=1, or a mixture of experts of the llama family (model=moe_tiny, model=mixtral_8x7b)",
        )


class SpecFacts(ABC):
    """Role: what the rest of the run reads of a model config (the data, the record, the FLOPs count)."""

    def vocab_size(self, cfg) -> int:
        """The vocabulary the data's token ids must stay under."""
        return cfg.vocab_size

    def max_seq_len(self, cfg) -> int:
        """The longest sequence the model takes."""
        return cfg.max_seq_len

    def tokenizer_file(self, cfg):
        """The model's own tokenizer (a tokenizer.json path) where this machine has it, else None
        (``data.tokenizer=model``)."""
        return None

    def architecture(self, cfg) -> str:
        """The architecture's name, as the record and the W&B tags show it."""
        return self.name

    @abstractmethod
    def flops_per_token(self, cfg, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token at ``seq_len``."""


class SpecBuild(ABC):
    """Role: the plain ``nn.Module`` and its seeded initial values: ``fsdp_exp.models.init_weights`` draws
    every parameter from (seed, its name) alone, so any world size and any sharding get the same values."""

    model_class: type = object  # the class ``build`` returns (``spec_of(model)`` finds the family by it)

    @abstractmethod
    def build(self, cfg) -> "nn.Module":
        """The plain model of ``cfg`` (no parallel code: ``fsdp_exp.parallel`` wraps it)."""

    def meta_model(self, cfg) -> "nn.Module":
        """A meta-device model of ``cfg``, built once per config and shared: read it, never change it
        (``fsdp_exp.models.build_meta`` builds a fresh one to wrap)."""
        key = config_key(cfg)
        cache = self.__dict__.setdefault("_meta_models", {})
        if key not in cache:
            import torch

            if len(cache) >= CACHE_SIZE:
                cache.clear()
            with torch.device("meta"), no_values_drawn_on_meta():
                cache[key] = self.build(cfg)
        return cache[key]

    def shapes_only(self):
        """A context in which the model runs on meta or fake tensors (FLOP counting, the planner's
        measurements) as it runs on real ones: a family whose forward reads tensor values overrides it."""
        import contextlib

        return contextlib.nullcontext()

    def retie(self, model: "nn.Module") -> None:
        """Make tied parameters one tensor again where ``to_empty`` made them two (it materializes each
        module's parameters on its own); called before the initialization fills them."""

    def init_name(self, model: "nn.Module", name: str) -> str:
        """The name a parameter is drawn under: a tied parameter has one value, under its first name."""
        return name

    def full_param(
        self, model: "nn.Module", name: str, shape: "torch.Size", seed: int, device: "torch.device"
    ) -> "torch.Tensor":
        """The full initial value of parameter ``name`` (canonical), drawn from a generator seeded with
        ``seed`` alone. Default: normal with ``init_std``, or ones where it is None."""
        import torch

        std = self.init_std(model, name)
        full = torch.empty(shape, dtype=torch.float32, device=device)
        if std is None:
            return full.fill_(1.0)
        return full.normal_(0.0, std, generator=torch.Generator(device=device).manual_seed(seed))

    def init_std(self, model: "nn.Module", name: str) -> Optional[float]:
        """Std of the normal init of parameter ``name`` (canonical), or None for ones (norm weights).
        Default: the module's own ``init_std``."""
        return model.init_std(name)

    def init_buffers(self, model: "nn.Module", device: "torch.device") -> None:
        """Fill the (non-persistent, derived) buffers on ``device``."""
        model.init_buffers(device)


class SpecLayout(ABC):
    """Role: where things are in the model, for wrapping, activation checkpointing, compile, tensor parallel
    and the planner: the blocks, the two ends of the residual stream, the experts, the ties, the
    tensor-parallel plan and the planner's inventory (which reads the meta model: ``SpecBuild``)."""

    block_class: type = object  # the unit of wrapping, activation checkpointing, compile and tensor parallel
    input_modules: tuple[str, ...] = ()  # root modules before the blocks (embeddings)
    output_modules: tuple[str, ...] = ()  # root modules that make the logits

    def block_class_of(self, cfg) -> type:
        """The block class of a model of ``cfg`` (a family whose block class depends on the config overrides it)."""
        return self.block_class

    def input_modules_of(self, cfg) -> tuple[str, ...]:
        """``input_modules`` of a model of ``cfg``."""
        return self.input_modules

    def output_modules_of(self, cfg) -> tuple[str, ...]:
        """``output_modules`` of a model of ``cfg``."""
        return self.output_modules

    def expert_modules(self, model: "nn.Module") -> list[str]:
        """Qualified names of a mixture-of-experts model's routed-expert modules (one per layer: its stacked
        expert weights), each its own sharding unit under ``wrap=experts``; none for a dense model (the default)."""
        return []

    def tied_weights(self, cfg) -> dict[str, str]:
        """Parameter name -> the parameter it is tied to (the same tensor)."""
        return {}

    def cut_stage(self, model: "nn.Module", cfg, first: bool, last: bool) -> "nn.Module":
        """One pipeline stage of ``model`` (a meta model whose other stages' blocks are already deleted): what
        runs before the blocks (``input_modules``) becomes ``nn.Identity`` on every stage but the first, the
        root modules after the blocks (final norm, output projection) on every stage but the last. Its forward
        takes the previous stage's activations (the first: token ids) and returns the next stage's (the last:
        the logits). Default: the family's own forward does that once those modules are identities."""
        from torch import nn

        containers = {name.rpartition(".")[0].partition(".")[0] for name in self.inventory(cfg).blocks}
        inputs = self.input_modules_of(cfg)
        after_blocks = [name for name, _ in model.named_children() if name not in inputs and name not in containers]
        for name in () if first else inputs:
            model.set_submodule(name, nn.Identity())
        for name in () if last else after_blocks:
            model.set_submodule(name, nn.Identity())
        return model

    @abstractmethod
    def tensor_parallel_plan(self, cfg) -> TensorParallelPlan:
        """Module -> colwise | rowwise, as data (``TensorParallelPlan``): ``fsdp_exp.parallel.tp`` turns it
        into torch's styles, the planner derives from it which dim of each parameter tensor parallel shards."""

    def inventory(self, cfg) -> Inventory:
        """The planner's view of the parameters (cached per model config)."""
        key = config_key(cfg)
        cache = self.__dict__.setdefault("_inventories", {})
        if key not in cache:
            if len(cache) >= CACHE_SIZE:
                cache.clear()
            cache[key] = self._read_inventory(cfg)
        return cache[key]

    def _read_inventory(self, cfg) -> Inventory:
        model = self.meta_model(cfg)
        block_class = self.block_class_of(cfg)
        blocks = tuple(name for name, m in model.named_modules() if isinstance(m, block_class))
        plan = self.tensor_parallel_plan(cfg)
        params = []
        for name, p in model.named_parameters():  # tied duplicates once
            style, module_name = plan.style_of(name, blocks)
            block = next((j for j, b in enumerate(blocks) if name.startswith(b + ".")), None)
            tp_dim = tp_sharded_dim(style, model.get_submodule(module_name), name.rpartition(".")[2])
            params.append(ParamEntry(name, tuple(p.shape), block, tp_dim))

        def under(modules: tuple[str, ...]) -> frozenset[str]:
            return frozenset(p.name for p in params if p.name.startswith(tuple(m + "." for m in modules)))

        buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        return Inventory(
            tuple(params), blocks, under(self.input_modules_of(cfg)), under(self.output_modules_of(cfg)), buffer_bytes
        )


class SpecContextParallel(ABC):
    """Role: what context parallel (``fsdp_exp.parallel.context``) needs of a family: whether its attention
    can be split over the sequence, where its attention kernels are and which buffers are indexed by position."""

    def check_context_parallel(self, cfg, cp: int, tp: int, method: str) -> None:
        """Refuse ``parallel.cp`` with attention ``method`` (``ring`` or ``all_to_all``, resolved) where this
        family's attention cannot be split that way, by that method's own rules only (the default: every family
        that has not said how, whatever the method)."""
        from fsdp_exp.errors import fail

        fail(
            f"parallel.cp={cp}: the {self.architecture(cfg)} attention of model family {self.name!r} cannot be "
            "split over the sequence yet (context parallel wraps an attention kernel module that takes "
            "(batch, heads, seq, head_dim) queries, keys and values; this family has none).",
            "pass parallel.cp=1, or a Llama model (model=llama_tiny|llama7b|llama3_8b...)",
        )

    def attention_kernels(self, model: "nn.Module") -> list[str]:
        """Qualified names of the modules that compute causal attention from (batch, heads, seq, head_dim)
        queries, keys and values, after the rotary embedding."""
        return []

    def position_buffers(self, model: "nn.Module") -> dict[str, int]:
        """Buffer name -> its sequence dim, for the buffers the model slices by position (rotary tables)."""
        return {}


class SpecExport(ABC):
    """Role: the model under Hugging Face's names and config (``checkpoint.export=hf``)."""

    def why_no_hf_export(self, cfg) -> Optional[str]:
        """Why this model cannot be written as a Hugging Face model, or None when it can."""
        return f"model.name={cfg.name} has no Hugging Face mapping"

    def to_hf(self, state: dict, cfg) -> dict:
        """A full state dict (canonical names) under Hugging Face's names."""
        raise ValueError(self.why_no_hf_export(cfg))

    def hf_config(self, cfg) -> dict:
        """Hugging Face's config.json for this model."""
        raise ValueError(self.why_no_hf_export(cfg))


class ModelSpec(SpecChecks, SpecFacts, SpecBuild, SpecLayout, SpecContextParallel, SpecExport):
    """A model family: every role above (see the module docstring); a subclass implements each role's
    abstract methods. Defaults are generic."""


# The roles in the order a run meets them; test_model_spec keeps each one small.
SPEC_ROLES: tuple[type, ...] = ModelSpec.__bases__


CACHE_SIZE = 16  # model configs whose meta model and inventory are kept


def config_key(cfg) -> str:
    """A hashable key of a model config (a dataclass or a mapping). A search asks it of the same few config objects
    thousands of times (each candidate's plan): a dataclass's key is kept beside a copy of its fields and given again
    while the object is the same one and its fields still equal the copy."""
    if not dataclasses.is_dataclass(cfg):
        return json.dumps(dict(cfg), sort_keys=True, default=str)
    held = _KEYS.get(id(cfg))
    if held is not None and held[0] is cfg and held[1] == vars(cfg):
        return held[2]
    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    if len(_KEYS) >= 256:
        _KEYS.clear()
    _KEYS[id(cfg)] = (cfg, copy.deepcopy(vars(cfg)), key)  # holding the object keeps its id from being reused
    return key


_KEYS: dict[int, tuple] = {}


def no_values_drawn_on_meta():
    """While a model is built, torch's initializers (``nn.Linear``'s ``kaiming_uniform_``, GPT-2's ``Conv1D``
    ``normal_``, ...) called on a meta tensor return it untouched: it has no values to draw, and each call costs
    about a millisecond through torch's reference decompositions (most of the planner's time on the published
    record), the first of them also an import of torch's compiler stack (torch._dynamo, sympy: about a second
    of the launcher's, which needs it for nothing else). A torch function mode, so nothing is patched: shapes,
    dtypes, tying and buffers are built as they are, and a tensor with storage is initialized as before. The
    family draws the values later (``init_std``, ``init_buffers``; transformers' ``_init_weights`` skips meta)."""
    import torch
    from torch.overrides import TorchFunctionMode

    initializers = {
        getattr(torch.nn.init, name) for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")
    }

    class NoValuesOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensor = args[0] if args else kwargs.get("tensor")
            if func in initializers and isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return func(*args, **kwargs)

    return NoValuesOnMeta()
