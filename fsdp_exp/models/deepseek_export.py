"""The llama family's models with multi-head latent attention (``model.attention=mla``) under transformers'
DeepseekV3ForCausalLM: its names, its config.json, and what it cannot hold (``checkpoint.export=hf``; the family's
spec, ``fsdp_exp.models.llama_spec``, asks here).

No rows are permuted: fsdp_exp rotates interleaved pairs of the rotary part, as DeepseekV3 does with
``rope_interleave`` (its default). The routed experts are stacked as transformers keeps them (gate and up fused,
gate first); the loss-free bias is its router's ``e_score_correction_bias``.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_exp.models.llama import ffn_hidden_dim
from fsdp_exp.models.moe import moe_hidden_dim

# fsdp_exp's names in a block -> DeepseekV3's (model.layers.<i>.<name>)
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def why_not_deepseek_v3(cfg) -> Optional[str]:
    """Why DeepseekV3ForCausalLM cannot hold this model, or None."""
    for bad, why in (
        (cfg.n_experts and cfg.router_score != "sigmoid", "a softmax router (its router is sigmoid)"),
        (cfg.n_experts and not cfg.n_shared_experts, "a mixture without a shared expert (model.n_shared_experts=0)"),
        (cfg.n_experts and cfg.aux_loss_coef > 0, "the auxiliary balance loss (model.aux_loss_coef)"),
        (cfg.capacity_factor is not None, "dropped tokens (model.capacity_factor)"),
        (cfg.norm_eps != 1e-6, f"model.norm_eps={cfg.norm_eps} in the latent norms (its are 1e-6)"),
        (cfg.tie_embeddings, "tied embeddings (model.tie_embeddings)"),
    ):
        if bad:
            return f"HF export writes DeepseekV3ForCausalLM, which has no {why}"
    return None


def deepseek_v3_names(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A full state dict (fsdp_exp's names) under DeepseekV3ForCausalLM's."""
    out = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name in ROOT_NAMES:
            out[ROOT_NAMES[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)
        if rest.startswith("feed_forward.experts."):
            experts.setdefault(layer, {})[rest.rpartition(".")[2]] = tensor
        elif rest in BLOCK_NAMES:
            out[f"model.layers.{layer}.{BLOCK_NAMES[rest]}"] = tensor
        else:
            raise ValueError(f"no DeepseekV3 name for parameter {name!r}")
    for layer, t in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.cat([t["w1"], t["w3"]], dim=1)
        out[f"{prefix}.down_proj"] = t["w2"]
    return out


def deepseek_v3_config(base: dict, cfg) -> dict:
    """DeepseekV3's config.json from the family's Llama one (``base``: the shared fields)."""
    for key in ("mlp_bias", "pretraining_tp", "head_dim"):
        base.pop(key)
    routed = cfg.n_experts > 0
    return {
        **base,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": cfg.n_heads,
        "intermediate_size": ffn_hidden_dim(cfg),
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": True,
        "first_k_dense_replace": cfg.first_k_dense if routed else cfg.n_layers,
        "n_routed_experts": cfg.n_experts if routed else 1,
        "num_experts_per_tok": cfg.experts_top_k if routed else 1,
        "moe_intermediate_size": moe_hidden_dim(cfg, ffn_hidden_dim(cfg)),
        "n_shared_experts": cfg.n_shared_experts if routed else 1,
        "n_group": cfg.expert_groups,
        "topk_group": cfg.expert_groups_top_k,
        # The plain router (fsdp_exp.models.moe) always renormalizes sigmoid scores; DeepSeek-V3's asks.
        "norm_topk_prob": bool(cfg.router_renormalize) or (cfg.expert_groups == 1 and cfg.routed_scaling == 1.0),
        "routed_scaling_factor": cfg.routed_scaling,
        "num_nextn_predict_layers": 0,  # no multi-token prediction module: fsdp_exp trains none
    }
