"""The Llama family's spec (``model.name=llama``, the tiny MoE variant included): its config checks,
FLOPs, tensor-parallel plan and Hugging Face mapping (its activation profile is the planner's:
``fsdp_exp.plan.activations.llama``). The modules themselves are in ``fsdp_exp.models.llama``.

Hugging Face export: fsdp_exp rotates interleaved pairs (x[2i], x[2i+1]) like Meta's original
Llama; HF's LlamaForCausalLM rotates halves (x[i], x[i + d/2]). The rows of wq and wk are permuted
per head on export, which leaves q.k, and so the model, unchanged.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fsdp_exp.config.schema import ModelConfig
from fsdp_exp.config.topology import largest_divisor_at_most
from fsdp_exp.errors import fail
from fsdp_exp.models.deepseek_export import deepseek_v3_config, deepseek_v3_names, why_not_deepseek_v3
from fsdp_exp.models.llama import CausalAttention, Llama, TransformerBlock, ffn_hidden_dim, head_dim
from fsdp_exp.models.mla import qk_head_dim
from fsdp_exp.models.moe import ROUTER_SCORES, MoE, grouped_mm_in_any_dtype, moe_hidden_dim
from fsdp_exp.models.spec import COLWISE, ROWWISE, ModelSpec, TensorParallelPlan

ATTENTIONS = ("gqa", "mla")  # model.attention: grouped-query (fsdp_exp.models.llama), multi-head latent (.mla)

# fsdp_exp's names in a block -> Hugging Face's (model.layers.<i>.<name>), and at the root.
HF_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
HF_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered per head from interleaved pairs to halves."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaSpec(ModelSpec):
    name = "llama"
    model_class = Llama
    block_class = TransformerBlock
    input_modules = ("tok_embeddings",)
    output_modules = ("output",)

    # ----------------------------------------------------------------------------------- SpecChecks
    def check(self, m: ModelConfig) -> None:
        """Every value the model would otherwise meet only in the ranks (a shape that does not build, a
        routing that cannot pick, a NaN from the first norm) is refused here, before any rank starts."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(m, name) < 1:
                fail(f"model.{name}={getattr(m, name)} must be positive.", f"pass a positive model.{name}")
        if m.attention not in ATTENTIONS:
            fail(
                f"model.attention={m.attention!r} is not an attention of the llama family ({', '.join(ATTENTIONS)}).",
                "pass model.attention=gqa (grouped-query) or mla (multi-head latent, model=deepseek_v3)",
            )
        if m.mtp_layers:
            fail(
                f"model.mtp_layers={m.mtp_layers}: multi-token prediction (DeepSeek-V3's extra modules predicting "
                "further tokens) is not built; the presets' counts and the export leave its layer out.",
                "pass model.mtp_layers=0",
            )
        if m.attention == "mla":
            self._check_latent_attention(m)
        else:
            self._check_grouped_query_attention(m)
        self._check_feed_forward(m)
        self._check_numbers(m)
        self._check_experts(m)

    @staticmethod
    def _check_latent_attention(m: ModelConfig) -> None:
        widths = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in widths + (("q_lora_rank",) if m.q_lora_rank is not None else ()):
            if getattr(m, name) < 1:
                fail(
                    f"model.{name}={getattr(m, name)} must be positive (multi-head latent attention).",
                    f"pass a positive model.{name}" + (", or null: a full query projection" if name[0] == "q" else ""),
                )
        if m.qk_rope_head_dim % 2:
            fail(
                f"model.qk_rope_head_dim={m.qk_rope_head_dim} is odd; rotary embeddings turn pairs.",
                f"pass model.qk_rope_head_dim={m.qk_rope_head_dim + 1}",
            )

    @staticmethod
    def _check_grouped_query_attention(m: ModelConfig) -> None:
        if m.n_kv_heads is not None and m.n_kv_heads < 1:
            fail(
                f"model.n_kv_heads={m.n_kv_heads} must be positive.",
                "pass model.n_kv_heads=null (as many as model.n_heads) or a divisor of model.n_heads",
            )
        if m.head_dim is None and m.dim % m.n_heads:
            fail(
                f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}.",
                "pick model.n_heads that divides model.dim, or set model.head_dim",
            )
        kv = m.n_kv_heads or m.n_heads
        if m.n_heads % kv:
            fail(
                f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads} (grouped-query attention).",
                "pick model.n_kv_heads that divides model.n_heads, or null",
            )
        if m.head_dim is not None and m.head_dim < 1:
            fail(
                f"model.head_dim={m.head_dim} must be positive.", "pass model.head_dim=null (model.dim / model.n_heads)"
            )
        if head_dim(m) % 2:
            named = f"model.head_dim={m.head_dim}" if m.head_dim else f"model.dim/model.n_heads={head_dim(m)}"
            fail(
                f"head dimension {named} is odd; rotary embeddings need it even.",
                "change model.dim or model.n_heads, or pass an even model.head_dim",
            )

    @staticmethod
    def _check_feed_forward(m: ModelConfig) -> None:
        # The SwiGLU width (ffn_hidden_dim) divides by multiple_of and scales by ffn_dim_multiplier.
        if m.multiple_of < 1:
            fail(
                f"model.multiple_of={m.multiple_of} must be positive: the SwiGLU width is rounded up to a "
                "multiple of it.",
                "pass model.multiple_of=256 (Llama's), or 1 for no rounding",
            )
        if m.dense_hidden_dim is not None and m.dense_hidden_dim < 1:
            fail(f"model.dense_hidden_dim={m.dense_hidden_dim} must be positive.", "pass model.dense_hidden_dim=null")
        if m.ffn_dim_multiplier is not None and not m.ffn_dim_multiplier > 0:
            fail(
                f"model.ffn_dim_multiplier={m.ffn_dim_multiplier} must be positive: it scales the SwiGLU width.",
                "pass model.ffn_dim_multiplier=null (the Llama papers' 8/3 x model.dim) or a positive factor",
            )

    @staticmethod
    def _check_numbers(m: ModelConfig) -> None:
        # A negative epsilon or std, or a non-positive rotary base, gives NaN or an error at the first step.
        if m.norm_eps < 0:
            fail(
                f"model.norm_eps={m.norm_eps} is negative; RMSNorm adds it under a square root.",
                "pass model.norm_eps=1e-5",
            )
        if not m.rope_theta > 0:
            fail(
                f"model.rope_theta={m.rope_theta} must be positive: it is the base of the rotary frequencies.",
                "pass model.rope_theta=10000 (Llama 2's; Llama 3 uses 500000)",
            )
        if m.init_std < 0:
            fail(
                f"model.init_std={m.init_std} is negative; it is the std of the weights' normal initialization.",
                "pass model.init_std=0.02",
            )

    @staticmethod
    def _check_experts(m: ModelConfig) -> None:
        if m.n_experts < 0:
            fail(
                f"model.n_experts={m.n_experts} is negative.",
                "pass model.n_experts=0 (a dense feed-forward) or the number of experts (model=moe_tiny has 4)",
            )
        if not m.n_experts:
            return
        if not 1 <= m.experts_top_k <= m.n_experts:
            # Too many: torch's topk cannot pick them; none: every token's mixing weights are 0/0.
            good = m.n_experts if m.experts_top_k > m.n_experts else min(2, m.n_experts)
            fail(
                f"model.experts_top_k={m.experts_top_k} routes each token to that many experts, and the model "
                f"has {m.n_experts} (model.n_experts): it must lie between 1 and {m.n_experts}.",
                f"pass model.experts_top_k={good}" + (" (or raise model.n_experts)" if good == m.n_experts else ""),
            )
        LlamaSpec._check_routing(m)
        width = moe_hidden_dim(m, ffn_hidden_dim(m))
        for name, value in (("model.dim", m.dim), ("the experts' width (model.moe_hidden_dim)", width)):
            if value % 8:
                # torch's grouped matmul wants every operand's rows 16-byte aligned: 8 elements at bf16.
                fail(
                    f"{name} is {value}: the experts' grouped matmul needs it a multiple of 8 (16-byte rows in bf16).",
                    f"pass a multiple of 8 (e.g. {8 * max(1, round(value / 8))})",
                )

    @staticmethod
    def _check_routing(m: ModelConfig) -> None:
        # Each value a rank would otherwise meet as a shape error, a NaN or a silently unbalanced router.
        if m.router_score not in ROUTER_SCORES:
            fail(
                f"model.router_score={m.router_score!r} is not a router ({', '.join(ROUTER_SCORES)}).",
                "pass model.router_score=softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)",
            )
        if m.moe_hidden_dim is not None and m.moe_hidden_dim < 1:
            fail(f"model.moe_hidden_dim={m.moe_hidden_dim} must be positive.", "pass model.moe_hidden_dim=null")
        if m.n_shared_experts < 0:
            fail(f"model.n_shared_experts={m.n_shared_experts} is negative.", "pass model.n_shared_experts=0")
        for name in ("aux_loss_coef", "expert_bias_rate"):
            if getattr(m, name) < 0:
                fail(f"model.{name}={getattr(m, name)} is negative.", f"pass model.{name}=0 (off) or a small rate")
        if m.capacity_factor is not None and not m.capacity_factor > 0:
            fail(
                f"model.capacity_factor={m.capacity_factor} must be positive: it caps each expert's tokens.",
                "pass model.capacity_factor=null (dropless) or e.g. 1.25",
            )
        LlamaSpec._check_groups(m)

    @staticmethod
    def _check_groups(m: ModelConfig) -> None:
        # DeepSeek-V3's dense first blocks and group-limited router (fsdp_exp.models.router).
        if not 0 <= m.first_k_dense <= m.n_layers:
            fail(
                f"model.first_k_dense={m.first_k_dense} must lie between 0 and model.n_layers={m.n_layers}.",
                f"pass model.first_k_dense={min(max(m.first_k_dense, 0), m.n_layers)}",
            )
        if not m.routed_scaling > 0:
            fail(f"model.routed_scaling={m.routed_scaling} must be positive.", "pass model.routed_scaling=1.0")
        if m.expert_groups < 1 or m.n_experts % m.expert_groups:
            fail(
                f"model.expert_groups={m.expert_groups} does not divide model.n_experts={m.n_experts} into equal "
                "groups.",
                f"pass model.expert_groups={largest_divisor_at_most(m.n_experts, max(m.expert_groups, 1))}",
            )
        if not 1 <= m.expert_groups_top_k <= m.expert_groups:
            fail(
                f"model.expert_groups_top_k={m.expert_groups_top_k} must lie between 1 and model.expert_groups="
                f"{m.expert_groups}.",
                f"pass model.expert_groups_top_k={min(max(m.expert_groups_top_k, 1), m.expert_groups)}",
            )
        kept = m.expert_groups_top_k * (m.n_experts // m.expert_groups)
        if m.experts_top_k > kept:
            fail(
                f"model.experts_top_k={m.experts_top_k} is more than the {kept} experts of the "
                f"model.expert_groups_top_k={m.expert_groups_top_k} groups a token keeps.",
                f"pass model.experts_top_k={kept}, or raise model.expert_groups_top_k",
            )

    def check_tensor_parallel(self, m: ModelConfig, tp: int) -> None:
        if m.attention == "mla":
            # The rotary key is one projection shared by every head: split over heads, each rank's gradient of it
            # holds its own heads' share only, and the plan (colwise / rowwise modules) has no all-reduce for it.
            fail(
                f"parallel.tp={tp} with multi-head latent attention (model.attention=mla): its rotary key is shared "
                "by every head, and tensor parallel would leave that projection's gradient a partial sum per rank.",
                "pass parallel.tp=1 (shard with FSDP, and the experts with parallel.ep)",
            )
        if m.n_experts:
            # The plan splits the SwiGLU projections of a dense block; routed experts have no such plan here.
            fail(
                f"parallel.tp={tp} with a mixture of experts (model.n_experts={m.n_experts}): tensor parallel "
                "has no plan for the routed experts.",
                "pass parallel.tp=1 and split the experts over ranks with parallel.ep instead",
            )
        # Each rank holds whole heads and an equal slice of the SwiGLU width (the colwise projections).
        for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads or m.n_heads)):
            if value % tp:
                fail(
                    f"parallel.tp={tp} does not divide {name} ({value}): each rank holds whole heads.",
                    f"pass parallel.tp={largest_divisor_at_most(value, tp)}, or a {name} that {tp} divides",
                )
        width = ffn_hidden_dim(m)
        if width % tp:
            fail(
                f"parallel.tp={tp} does not divide the SwiGLU width ({width}, from model.dim, model.multiple_of "
                "and model.ffn_dim_multiplier): each rank holds an equal slice.",
                f"pass model.multiple_of={tp * m.multiple_of // math.gcd(tp, m.multiple_of)} (a multiple of "
                f"parallel.tp), or parallel.tp={largest_divisor_at_most(width, tp)}",
            )

    def check_expert_parallel(self, m: ModelConfig, ep: int) -> None:
        if not m.n_experts:
            fail(
                f"parallel.ep={ep} with a dense model (model.n_experts=0): there are no experts to split.",
                "pass parallel.ep=1, or a mixture of experts (model=moe_tiny, or model.n_experts=8)",
            )
        if m.n_experts % ep:
            fail(
                f"parallel.ep={ep} does not divide model.n_experts={m.n_experts}: each rank holds an equal share.",
                f"pass parallel.ep={largest_divisor_at_most(m.n_experts, ep)}",
            )

    def depth_override(self, cfg: ModelConfig, n_layers: int) -> str:
        return f"model.n_layers={n_layers}"

    # ------------------------------------------------------------------------------------ SpecFacts
    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        """Training FLOPs per token: 6 N + 12 L h S (forward + backward, no recompute).

        N counts the parameters a token computes with (``active_params``) without the input embedding (a
        lookup, no matmul); the output projection is a matmul and counts. 12 L h S is attention's score and
        value products (PaLM appendix B), h the query width (n_heads x head_dim).
        """
        inventory = self.inventory(cfg)
        n = self.active_params(cfg) - sum(p.numel for p in inventory.params if p.name in inventory.input_params)
        if cfg.attention == "mla":  # scores over the query / key width, values over the value width
            return 6 * n + 6 * cfg.n_layers * cfg.n_heads * (qk_head_dim(cfg) + cfg.v_head_dim) * seq_len
        return 6 * n + 12 * cfg.n_layers * cfg.n_heads * head_dim(cfg) * seq_len

    def active_params(self, cfg: ModelConfig) -> int:
        """Parameters one token computes with: all of a dense model's; of a mixture of experts, its top k of
        the routed experts (the convention behind Mixtral's 12.9B of 46.7B and Qwen3's 3.3B of 30.5B)."""
        share = cfg.experts_top_k / cfg.n_experts if cfg.n_experts else 1
        return round(sum(p.numel * (share if ".experts." in p.name else 1) for p in self.inventory(cfg).params))

    # ------------------------------------------------------------------------------------ SpecBuild
    def build(self, cfg: ModelConfig) -> Llama:
        return Llama(cfg)

    def shapes_only(self):
        """The experts' grouped matmul on meta and fake tensors in any dtype (its meta kernel takes bf16 only)."""
        return grouped_mm_in_any_dtype()

    def retie(self, model: Llama) -> None:
        if model.cfg.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
            model.output.weight = model.tok_embeddings.weight

    # ----------------------------------------------------------------------------------- SpecLayout
    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}

    def expert_modules(self, model: Llama) -> list[str]:
        return [f"{name}.experts" for name, m in model.named_modules() if isinstance(m, MoE)]

    def check_context_parallel(self, cfg: ModelConfig, cp: int, tp: int, method: str) -> None:
        """all_to_all (Ulysses) hands each CP rank cp-th of the local query heads; key/value heads cp does not
        divide are repeated up to the query heads (fsdp_exp.parallel.context). Ring keeps every head on every
        rank and splits only the sequence: no rule on the heads."""
        local = cfg.n_heads // tp
        if method == "all_to_all" and local % cp:
            fail(
                f"parallel.cp={cp} does not divide the {local} query heads each rank holds (model.n_heads="
                f"{cfg.n_heads} over parallel.tp={tp}): all-to-all attention (parallel.cp_method=all_to_all) gives each "
                "CP rank whole heads "
                "(key/value heads that cp does not divide are repeated up to the query heads).",
                f"pass parallel.cp={largest_divisor_at_most(local, cp)}, or a model.n_heads that {cp * tp} divides",
            )

    def attention_kernels(self, model: Llama) -> list[str]:
        return [name for name, m in model.named_modules() if isinstance(m, CausalAttention)]

    def position_buffers(self, model: Llama) -> dict[str, int]:
        return {"rope_cos": 0, "rope_sin": 0}

    def tensor_parallel_plan(self, cfg: ModelConfig) -> TensorParallelPlan:
        """Attention: wq/wk/wv colwise (each rank holds n_heads/tp heads), wo rowwise. SwiGLU: w1/w3
        colwise, w2 rowwise. Embedding rowwise, output colwise with replicated logits. Under sequence
        parallel the norms run on a shard of the sequence, which attention and the feed-forward
        gather first."""
        return TensorParallelPlan(
            root={"tok_embeddings": ROWWISE, "output": COLWISE},
            block={
                "attention.wq": COLWISE,
                "attention.wk": COLWISE,
                "attention.wv": COLWISE,
                "attention.wo": ROWWISE,
                "feed_forward.w1": COLWISE,
                "feed_forward.w3": COLWISE,
                "feed_forward.w2": ROWWISE,
            },
            sequence_parallel_root=("norm",),
            sequence_parallel_block=("attention_norm", "ffn_norm"),
            gathered_inputs={"attention": 4, "feed_forward": 1},  # attention also takes cos, sin and the mask
        )

    # ----------------------------------------------------------------------------------- SpecExport
    def why_no_hf_export(self, cfg: ModelConfig) -> Optional[str]:
        if cfg.attention == "mla":
            return why_not_deepseek_v3(cfg)
        if cfg.first_k_dense or cfg.expert_groups > 1 or cfg.routed_scaling != 1.0:
            return (
                "HF export writes DeepseekV3ForCausalLM for dense first blocks, expert groups and a routed scaling, "
                "which has multi-head latent attention (model.attention=mla)"
            )
        if cfg.n_experts > 0:
            # Mixtral's and Qwen3-MoE's routers: softmax over every expert, top k, no bias, no shared experts.
            for bad, why in (
                (cfg.router_score != "softmax", "model.router_score=sigmoid"),
                (cfg.n_shared_experts > 0, "shared experts (model.n_shared_experts)"),
                (cfg.expert_bias_rate > 0, "the loss-free expert bias (model.expert_bias_rate)"),
                (not cfg.qk_norm and not cfg.router_renormalize, "model.router_renormalize=false without Qwen3's"),
            ):
                if bad:
                    return f"HF export writes MixtralForCausalLM or Qwen3MoeForCausalLM, which have no {why}"
            return None
        if cfg.qk_norm:
            return "HF export writes LlamaForCausalLM, which has no query / key norms (model.qk_norm)"
        return None

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        problem = self.why_no_hf_export(cfg)
        if problem:
            raise ValueError(problem)
        if cfg.attention == "mla":
            return deepseek_v3_names(state, cfg)
        n_heads = cfg.n_heads
        n_kv = cfg.n_kv_heads or n_heads
        tied = self.tied_weights(cfg)
        out = {}
        experts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            if name.endswith("router.expert_bias"):
                continue  # zero: the export refuses models that train it (why_no_hf_export)
            if ".feed_forward." in name and cfg.n_experts:
                layer, _, rest = name.removeprefix("layers.").partition(".feed_forward.")
                experts.setdefault(layer, {})[rest] = tensor
                continue
            if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
                # Per-head vectors, rotated like the query / key rows they scale.
                layer = name.split(".")[1]
                out[f"model.layers.{layer}.self_attn.{name.split('.')[-2]}.weight"] = interleaved_to_half(
                    tensor[:, None], 1
                )[:, 0]
                continue
            if name in HF_ROOT_NAMES:
                if name in tied:
                    continue  # HF ties lm_head to embed_tokens itself
                out[HF_ROOT_NAMES[name]] = tensor
                continue
            parts = name.split(".", 2)
            if parts[0] != "layers" or len(parts) < 3 or parts[2] not in HF_BLOCK_NAMES:
                raise ValueError(f"no Hugging Face name for parameter {name!r}")
            if parts[2] == "attention.wq.weight":
                tensor = interleaved_to_half(tensor, n_heads)
            elif parts[2] == "attention.wk.weight":
                tensor = interleaved_to_half(tensor, n_kv)
            out[f"model.layers.{parts[1]}.{HF_BLOCK_NAMES[parts[2]]}"] = tensor
        for layer, t in experts.items():
            # transformers 5 keeps each layer's experts stacked: gate and up fused (gate first), then down.
            prefix = f"model.layers.{layer}.mlp"
            out[f"{prefix}.gate.weight"] = t["router.gate.weight"]
            out[f"{prefix}.experts.gate_up_proj"] = torch.cat([t["experts.w1"], t["experts.w3"]], dim=1)
            out[f"{prefix}.experts.down_proj"] = t["experts.w2"]
        return out

    def hf_config(self, cfg: ModelConfig) -> dict:
        if cfg.attention == "mla":
            return deepseek_v3_config(self._hf_llama_config(cfg), cfg)
        if cfg.n_experts:
            return self._hf_moe_config(cfg)
        return self._hf_llama_config(cfg)

    def _hf_moe_config(self, cfg: ModelConfig) -> dict:
        base = self._hf_llama_config(cfg)
        for key in ("mlp_bias", "pretraining_tp", "intermediate_size"):
            base.pop(key)
        width = moe_hidden_dim(cfg, ffn_hidden_dim(cfg))
        experts = {"num_experts_per_tok": cfg.experts_top_k, "output_router_logits": False}
        if cfg.qk_norm:
            return {
                **base,
                **experts,
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": cfg.n_experts,
                "moe_intermediate_size": width,
                "intermediate_size": width,
                "norm_topk_prob": bool(cfg.router_renormalize),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "router_aux_loss_coef": cfg.aux_loss_coef,
                "use_sliding_window": False,
                "sliding_window": None,
            }
        return {
            **base,
            **experts,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": cfg.n_experts,
            "intermediate_size": width,
            "router_aux_loss_coef": cfg.aux_loss_coef,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }

    def _hf_llama_config(self, cfg: ModelConfig) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.dim,
            "intermediate_size": ffn_hidden_dim(cfg),
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
            "head_dim": head_dim(cfg),
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "rope_scaling": None,
            "tie_word_embeddings": bool(cfg.tie_embeddings),
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": cfg.init_std,
            "pretraining_tp": 1,
            "use_cache": True,
            "bos_token_id": None,
            "eos_token_id": None,
            "torch_dtype": "float32",
            "dtype": "float32",
        }


LLAMA = LlamaSpec()
