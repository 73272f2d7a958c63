"""Any Hugging Face causal LM as the model (``model=hf model.hf_config=<folder|config.json|hub name>``, or
a shipped preset: ``model=hf_mistral_7b``, ``hf_qwen2_7b``, ``hf_gemma_7b``, ``hf_gpt2_xl``).

Everything the run needs is read from the model itself, never written per architecture: it is built by
``AutoModelForCausalLM.from_config`` on the meta device (a forward hook makes it return the logits), its
own ``_init_weights`` is replayed per parameter from (seed, name) (``fsdp_exp.models.hf_init``), its blocks
are the class ``_no_split_modules``, tied weights stay one tensor, tensor parallel translates its
``_tp_plan``, the export is the identity (transformers' names, the config's config.json), pipeline stages
are the model with the other stages' layers deleted (``cut_stage``, ``PIPELINE_MODEL_TYPES``), and the
planner measures it under FakeTensorMode (``fsdp_exp.plan.activations.hf``). The commands and what is
refused: the docs page models.md ("Hugging Face models").
"""

from __future__ import annotations

import copy
import types
from typing import TYPE_CHECKING, Optional

from fsdp_exp.config.topology import largest_divisor_at_most
from fsdp_exp.errors import fail
from fsdp_exp.models import hf_config
from fsdp_exp.models.spec import COLWISE, ROWWISE, ModelSpec, TensorParallelPlan, config_key, no_values_drawn_on_meta

if TYPE_CHECKING:
    import torch
    from torch import nn

# transformers' tensor-parallel styles fsdp_exp translates (torch's ColwiseParallel / RowwiseParallel).
TP_STYLES = {
    "colwise": COLWISE,
    "rowwise": ROWWISE,
    "embedding_rowwise": ROWWISE,
    "colwise_gather_output": COLWISE,
    "colwise_rep": COLWISE,
    "rowwise_rep": ROWWISE,
}


def _logits_only(module, args, output):
    """fsdp_exp's models return the logits; transformers' return a ModelOutput holding them (and the
    chunked loss a plain tensor, passed on)."""
    return getattr(output, "logits", output)


def _forward(model, input_ids, targets=None, loss_chunks: int = 1, **kwargs):
    """transformers' forward, or with ``targets`` the summed cross-entropy of the decoder's last hidden
    states through the model's output embeddings, chunked (``fsdp_exp.models.loss``). What transformers
    does to the logits after the head (a soft cap, a scale) is done per chunk too."""
    if targets is None:
        return type(model).forward(model, input_ids, **kwargs)
    from fsdp_exp.models.loss import chunked_cross_entropy

    if model.base_model is model:
        raise ValueError(
            f"{type(model).__name__} names no decoder (transformers' base_model_prefix) for the chunked "
            "loss to call before its output head: pass trainer.loss_chunks=1"
        )
    hidden = model.base_model(input_ids=input_ids).last_hidden_state
    return chunked_cross_entropy(
        hidden, model.get_output_embeddings(), targets, loss_chunks, _logits_transform(model.config.get_text_config())
    )


def _logits_transform(config):
    """What transformers' causal LMs apply to the head's output before the loss, from their config:
    Gemma 2/3's ``final_logit_softcapping``, Cohere's ``logit_scale``; None when nothing."""
    import torch

    cap, scale = getattr(config, "final_logit_softcapping", None), getattr(config, "logit_scale", None)
    if not cap and scale in (None, 1, 1.0):
        return None

    def transform(logits):
        if scale not in (None, 1, 1.0):
            logits = logits * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


# transformers' names for the number of experts of a mixture-of-experts config (Mixtral's, Qwen-MoE's, DeepSeek's);
# each routes ``num_experts_per_tok`` of them.
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _check_heads(text_config) -> None:
    """Grouped-query attention: a config whose key/value heads do not divide its query heads builds (the
    projections are plain linears) and fails only in a rank's first forward."""
    heads, kv = getattr(text_config, "num_attention_heads", None), getattr(text_config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        fail(
            f"num_key_value_heads={kv} of the model does not divide num_attention_heads={heads}: each key/value "
            "head serves a whole group of query heads.",
            f"pass model.hf_overrides.num_key_value_heads={largest_divisor_at_most(heads, kv)} (a divisor of {heads})",
        )


def _check_experts(text_config) -> None:
    """An MoE config routing more experts per token than it has (or none) builds, and fails (or mixes 0/0)
    only in a rank's first forward."""
    top_k = getattr(text_config, "num_experts_per_tok", None)
    field = next((f for f in EXPERT_COUNTS if getattr(text_config, f, None)), None)
    if top_k is None or field is None:
        return
    n = getattr(text_config, field)
    if not 1 <= top_k <= n:
        good = n if top_k > n else min(2, n)
        fail(
            f"num_experts_per_tok={top_k} of the model routes each token to that many experts, and it has {n} "
            f"({field}): it must lie between 1 and {n}.",
            f"pass model.hf_overrides.num_experts_per_tok={good}",
        )


def _routed_share(text_config) -> float:
    """The share of a routed expert's parameters one token computes with: top-k of the experts (1 for a
    dense model)."""
    top_k = getattr(text_config, "num_experts_per_tok", None)
    field = next((f for f in EXPERT_COUNTS if getattr(text_config, f, None)), None)
    return top_k / getattr(text_config, field) if top_k and field else 1.0


def _is_routed_expert(name: str) -> bool:
    """transformers keeps routed experts under a module named ``experts`` (one stacked tensor per projection,
    or one module per expert); DeepSeek's always-on ``shared_experts`` are dense."""
    return "experts" in name.split(".")


# transformers architectures (model_type) that run as pipeline stages: each stage calls the base model on the
# previous stage's hidden states (``inputs_embeds``), which is the whole model's computation only where nothing
# but the token lookup comes before the layers and nothing but the final norm and the head (with the transform
# ``_logits_transform`` replays) comes after. Each was checked here, cut in two, against the whole model's logits
# (test_pipeline_hf keeps checking them); GPT-2 and GPT-NeoX-style models (position
# embeddings added in the forward, other names), Granite (multipliers applied in the forward) are not among them.
PIPELINE_MODEL_TYPES = (
    "llama",
    "mistral",
    "ministral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3_text",
    "olmo",
    "olmo2",
    "starcoder2",
    "stablelm",
    "helium",
    "cohere",
    "mixtral",
    "qwen3_moe",
)


def _stage_forward(model, hidden, first: bool, last: bool):
    """A pipeline stage's forward: the base model (its remaining layers, with its own rotary embedding and
    causal mask) on token ids (the first stage) or on the previous stage's hidden states, then on the last
    stage the output head (and what transformers applies to its logits)."""
    hidden = model.base_model(**({"input_ids": hidden} if first else {"inputs_embeds": hidden})).last_hidden_state
    if not last:
        return hidden
    logits = model.get_output_embeddings()(hidden)
    transform = _logits_transform(model.config.get_text_config())
    return transform(logits) if transform else logits


class _NoTransformers:
    """Stands for transformers' model class where transformers is not installed (nothing is one)."""


class HfSpec(ModelSpec):
    name = "hf"

    # ----------------------------------------------------------------------------- the family's own
    def config(self, m):
        """The transformers config of ``m`` (cached per model config; treat it as read-only)."""
        cache = self.__dict__.setdefault("_configs", {})
        key = config_key(m)
        if key not in cache:
            cache[key] = hf_config.load(m)
        return cache[key]

    # ----------------------------------------------------------------------------------- SpecChecks
    def fetch(self, m) -> None:
        hf_config.fetch(m)

    def check(self, m) -> None:
        if m.attn_implementation not in ("sdpa", "eager"):
            fail(
                f"model.attn_implementation={m.attn_implementation!r} is not one of sdpa, eager.",
                "pass model.attn_implementation=sdpa",
            )
        config = self.config(m)
        self._check_attention_kernel(m)
        _check_heads(config.get_text_config())
        _check_experts(config.get_text_config())
        try:
            model = self.meta_model(m)
        except Exception as exc:  # noqa: BLE001 - transformers' own refusal of the config's values
            message = " ".join(str(exc).split())
            fail(
                f"transformers cannot build {self.architecture(m)} from this config: {type(exc).__name__}: {message}",
                "pass model.attn_implementation=eager"
                if "attn_implementation" in message
                else "fix the field it names (model.hf_overrides.<field>=...)",
            )
        self.block_class_of(m)
        recipes, unknown = self._init_recipes(model.config)
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        missing = [n for n in names if n not in recipes or n in unknown]
        if missing:
            fail(
                f"{type(model).__name__}'s own initialization (_init_weights) leaves {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                + " without a value fsdp_exp "
                "can replay on a sharded model.",
                f"pick another architecture than {config.model_type}",
            )

    def _check_attention_kernel(self, m) -> None:
        """transformers refuses SDPA for a model class that has no such path (Gemma-2's soft-capped scores,
        MPT's ALiBi): what fixes it is the eager kernel, not a field of the config."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config(m))]
        if m.attn_implementation == "sdpa" and getattr(model_class, "_supports_sdpa", True) is False:
            fail(
                f"model.attn_implementation=sdpa (the default): {model_class.__name__} has no SDPA attention in "
                f"transformers {hf_config.transformers().__version__}.",
                "pass model.attn_implementation=eager (transformers' own attention: it keeps the whole score "
                "matrix, which the planner counts)",
            )

    def check_tensor_parallel(self, m, tp: int) -> None:
        plan, problem = self._translated_plan(m)
        if problem:
            fail(f"parallel.tp={tp}: {problem}.", "pass parallel.tp=1")
        config = self.config(m)
        model = self.meta_model(m)
        for field in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, field, None)
            if value is not None and value % tp:
                fail(
                    f"parallel.tp={tp} does not divide {field}={value} of the model: each rank holds whole heads.",
                    "pick parallel.tp that divides it",
                )
        from torch import nn

        blocks = self._blocks(model)
        for name, style in [*plan.root.items(), *((f"{blocks[0]}.{k}", v) for k, v in plan.block.items())]:
            module = model.get_submodule(name)
            if isinstance(module, nn.Linear):
                width = module.out_features if style == COLWISE else module.in_features
                if width % tp:
                    fail(
                        f"parallel.tp={tp} does not divide the {style} width {width} of {name}.",
                        "pick parallel.tp that divides it",
                    )

    def depth_override(self, m, n_layers: int) -> str:
        # transformers' common name for the block count (an alias where a config names it otherwise: GPT-2's
        # n_layer); ++ sets it whether or not the command line already did.
        return f"++model.hf_overrides.num_hidden_layers={n_layers}"

    def check_pipeline(self, m) -> None:
        config = self.config(m)
        if config.model_type not in PIPELINE_MODEL_TYPES:
            fail(
                f"parallel.pp>1 with {self.architecture(m)} ({config.model_type}): its pipeline stages would call "
                "the base model on the previous stage's hidden states, which fsdp_exp checked gives the whole "
                f"model's logits only for {', '.join(PIPELINE_MODEL_TYPES)} (their decoder is a list of layers "
                "between the token embedding and the final norm; others add position embeddings or multipliers "
                "in the forward).",
                "pass parallel.pp=1, or a model of those architectures",
            )
        tied = self.tied_weights(m)
        if tied:
            name, to = next(iter(tied.items()))
            fail(
                f"parallel.pp>1: the model ties {name} to {to} (tie_word_embeddings), the last stage's output "
                "projection to the first stage's embedding; stages on different ranks cannot share a tensor.",
                "pass ++model.hf_overrides.tie_word_embeddings=false, or parallel.pp=1",
            )

    # ------------------------------------------------------------------------------------ SpecFacts
    def vocab_size(self, m) -> int:
        return self.config(m).get_text_config().vocab_size

    def max_seq_len(self, m) -> int:
        config = self.config(m).get_text_config()
        return getattr(config, "max_position_embeddings", None) or 2**31

    def tokenizer_file(self, m):
        """The tokenizer.json beside the config.json (a local folder, or the hub cache's copy)."""
        if not m.hf_config:
            return None
        if hf_config.is_local(m.hf_config):
            found = hf_config.config_file(m).with_name("tokenizer.json")
            return found if found.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(m.hf_config, "tokenizer.json", revision=m.revision)
        return found if isinstance(found, str) else None

    def architecture(self, m) -> str:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config(m))].__name__

    def flops_per_token(self, m, seq_len: int) -> int:
        """Training FLOPs per token: 6 N + 12 L w S (forward + backward, no recompute).

        N counts the parameters a token computes with (of a mixture of experts, top-k of the routed
        experts), less the embedding lookups before the blocks (token and position
        embeddings), with the output projection counted as the matmul it is even when it is tied to
        the input embedding; w is attention's width (heads x head dim), L the blocks, S the sequence.
        Attention is counted over the whole sequence (as PaLM's appendix B does), sliding windows too.
        """
        inventory = self.inventory(m)
        model = self.meta_model(m)
        # A mixture of experts computes each token with its top-k routed experts only (6 N counts active
        # parameters, as the model FLOPs of MoE training are usually quoted).
        share = _routed_share(self.config(m).get_text_config())
        n = sum(
            p.numel * (share if _is_routed_expert(p.name) else 1)
            for p in inventory.params
            if p.name not in inventory.input_params
        )
        tied = self.tied_weights(m)
        n += sum(
            model.get_parameter(name).numel()
            for name in tied
            if name.startswith(tuple(o + "." for o in self.output_modules_of(m)))
        )
        return round(6 * n) + 12 * len(inventory.blocks) * self._attention_width(m) * seq_len

    def _attention_width(self, m) -> int:
        config = self.config(m).get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads * head_dim

    # ------------------------------------------------------------------------------------ SpecBuild
    @property
    def model_class(self) -> type:  # noqa: D401 - what spec_of matches a built model against
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return _NoTransformers
        return PreTrainedModel

    def build(self, m) -> "nn.Module":
        import torch
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.config(m))
        config.use_cache = False  # training: no key/value cache
        with no_values_drawn_on_meta():
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=m.attn_implementation
            )
        model.forward = types.MethodType(_forward, model)  # the chunked loss when targets are passed
        model.register_forward_hook(_logits_only)
        return model

    def shapes_only(self):
        """transformers reads the position ids to find sequences packed into one row, which meta and fake
        tensors cannot give, and would then build an explicit attention mask (repeating the key / value
        heads) that a real run does not: fsdp_exp passes no position ids, so each row is one sequence."""
        from unittest import mock

        from transformers import masking_utils

        return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)

    def retie(self, model: "nn.Module") -> None:
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if (
            getattr(model.config.get_text_config(), "tie_word_embeddings", False)
            and head is not None
            and head.weight is not embedding.weight
        ):
            model.tie_weights()

    def _init_recipes(self, config) -> tuple[dict, set]:
        """The architecture's initialization, recorded once per transformers config (hf_init.record)."""
        import torch
        from transformers import AutoModelForCausalLM

        from fsdp_exp.models import hf_init

        cache = self.__dict__.setdefault("_recipes", {})
        key = config.to_json_string(use_diff=False)
        if key not in cache:
            with torch.device("meta"), no_values_drawn_on_meta():
                fresh = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
            first: dict[int, str] = {}
            aliases = {
                name: first.setdefault(id(p), name) for name, p in fresh.named_parameters(remove_duplicate=False)
            }
            self.__dict__.setdefault("_aliases", {})[key] = aliases
            cache[key] = hf_init.record(fresh)
        return cache[key]

    def full_param(self, model: "nn.Module", name: str, shape, seed: int, device: "torch.device") -> "torch.Tensor":
        from fsdp_exp.models import hf_init

        recipes, _ = self._init_recipes(model.config)
        return hf_init.full_value(recipes[name], shape, seed, device)

    def init_name(self, model: "nn.Module", name: str) -> str:
        """A tied parameter under its second name (FSDP1 names it so) is drawn under its first."""
        self._init_recipes(model.config)
        return self._aliases[model.config.to_json_string(use_diff=False)].get(name, name)

    def init_buffers(self, model: "nn.Module", device: "torch.device") -> None:
        import torch

        from fsdp_exp.models import canonical_name, hf_init

        recipes, _ = self._init_recipes(model.config)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                value = hf_init.full_value(recipes[canonical_name(name)], buffer.shape, 0, device)
                buffer.copy_(value.to(buffer.dtype))

    # ----------------------------------------------------------------------------------- SpecLayout
    def _blocks(self, model: "nn.Module") -> list[str]:
        block_class = self._block_class(model)
        return [name for name, module in model.named_modules() if isinstance(module, block_class)]

    def _block_class(self, model: "nn.Module") -> type:
        named = set(getattr(model, "_no_split_modules", None) or ())
        counts: dict[type, int] = {}
        for module in model.modules():
            if type(module).__name__ in named:
                counts[type(module)] = counts.get(type(module), 0) + 1
        if not counts:
            fail(
                f"{type(model).__name__} names no decoder layer class (transformers' _no_split_modules), so "
                "fsdp_exp cannot tell its blocks.",
                "pick an architecture whose model class names one",
            )
        return max(counts, key=counts.get)

    def block_class_of(self, m) -> type:
        return self._block_class(self.meta_model(m))

    def input_modules_of(self, m) -> tuple[str, ...]:
        """The embeddings used before the first block: lookups, not matmuls (token and position)."""
        from torch import nn

        model = self.meta_model(m)
        blocks = tuple(b + "." for b in self._blocks(model))
        output = self.output_modules_of(m)
        return tuple(
            name
            for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and not name.startswith(blocks) and name not in output
        )

    def output_modules_of(self, m) -> tuple[str, ...]:
        model = self.meta_model(m)
        head = model.get_output_embeddings()
        return tuple(name for name, module in model.named_modules() if module is head)

    def tied_weights(self, m) -> dict[str, str]:
        first: dict[int, str] = {}
        tied = {}
        for name, param in self.meta_model(m).named_parameters(remove_duplicate=False):
            if id(param) in first:
                tied[name] = first[id(param)]
            else:
                first[id(param)] = name
        return tied

    def cut_stage(self, model: "nn.Module", m, first: bool, last: bool) -> "nn.Module":
        """The embeddings, on every stage but the first, and the final norm and head, on every stage but the
        last, become ``nn.Identity``; the forward becomes ``_stage_forward`` (hidden states in, hidden states
        or logits out)."""
        import functools

        from torch import nn

        for name in () if first else self.input_modules_of(m):
            model.set_submodule(name, nn.Identity())
        for name in () if last else (*self.output_modules_of(m), self._final_norm(model)):
            model.set_submodule(name, nn.Identity())
        model.forward = types.MethodType(functools.partial(_stage_forward, first=first, last=last), model)
        return model

    def _final_norm(self, model: "nn.Module") -> str:
        """The base model's norm after its layers (``norm`` in every architecture of PIPELINE_MODEL_TYPES)."""
        prefix = model.base_model_prefix
        return f"{prefix}.norm" if model.base_model is not model else "norm"

    def tensor_parallel_plan(self, m) -> TensorParallelPlan:
        """The model's ``_tp_plan`` (module pattern -> style), block entries by their names in a block;
        empty for a model without one (``check_tensor_parallel`` refuses ``parallel.tp > 1`` then)."""
        return self._translated_plan(m)[0]

    def _translated_plan(self, m) -> tuple[TensorParallelPlan, Optional[str]]:
        """(the plan, why fsdp_exp cannot use it or None)."""
        model = self.meta_model(m)
        raw = dict(getattr(model, "_tp_plan", None) or {})
        if not raw:
            return TensorParallelPlan(
                root={}, block={}
            ), f"{type(model).__name__} carries no tensor-parallel plan (transformers' base_model_tp_plan)"
        blocks = self._blocks(model)
        pattern = blocks[0].rpartition(".")[0] + ".*."  # model.layers.*.
        root, block, problem = {}, {}, None
        for key, style in raw.items():
            if style not in TP_STYLES:
                problem = (
                    f"{type(model).__name__}'s tensor-parallel plan gives {key} the style {style!r}, which "
                    f"fsdp_exp does not translate (it knows {', '.join(sorted(TP_STYLES))})"
                )
            elif key.startswith(pattern):
                block[key[len(pattern) :]] = TP_STYLES[style]
            elif "*" in key:
                problem = f"{type(model).__name__}'s tensor-parallel plan names {key}, outside its blocks ({pattern})"
            else:
                root[key] = TP_STYLES[style]
        return TensorParallelPlan(root=root, block=block), problem

    # ----------------------------------------------------------------------------------- SpecExport
    def why_no_hf_export(self, m) -> Optional[str]:
        return None

    def to_hf(self, state: dict, m) -> dict:
        """Already transformers' names; a tied duplicate is left to from_pretrained to tie again."""
        tied = self.tied_weights(m)
        return {name: tensor for name, tensor in state.items() if name not in tied}

    def hf_config(self, m) -> dict:
        config = copy.deepcopy(self.config(m))
        config.architectures = [self.architecture(m)]
        config.dtype = "float32"
        return config.to_dict()


HF = HfSpec()
