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
from fsdp_exp.models.llama import CausalAttention, Llama, MoEFeedForward, TransformerBlock, ffn_hidden_dim
from fsdp_exp.models.spec import COLWISE, ROWWISE, ModelSpec, TensorParallelPlan

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
        if m.n_kv_heads is not None and m.n_kv_heads < 1:
            fail(
                f"model.n_kv_heads={m.n_kv_heads} must be positive.",
                "pass model.n_kv_heads=null (as many as model.n_heads) or a divisor of model.n_heads",
            )
        if m.dim % m.n_heads:
            fail(
                f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}.",
                "pick model.n_heads that divides model.dim",
            )
        kv = m.n_kv_heads or m.n_heads
        if m.n_heads % kv:
            fail(
                f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads} (grouped-query attention).",
                "pick model.n_kv_heads that divides model.n_heads, or null",
            )
        if (m.dim // m.n_heads) % 2:
            fail(
                f"head dimension model.dim/model.n_heads={m.dim // m.n_heads} is odd; rotary embeddings need it even.",
                "change model.dim or model.n_heads",
            )
        self._check_feed_forward(m)
        self._check_numbers(m)
        self._check_experts(m)

    @staticmethod
    def _check_feed_forward(m: ModelConfig) -> None:
        # The SwiGLU width (ffn_hidden_dim) divides by multiple_of and scales by ffn_dim_multiplier.
        if m.multiple_of < 1:
            fail(
                f"model.multiple_of={m.multiple_of} must be positive: the SwiGLU width is rounded up to a "
                "multiple of it.",
                "pass model.multiple_of=256 (Llama's), or 1 for no rounding",
            )
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
        if m.n_experts and not 1 <= m.experts_top_k <= m.n_experts:
            # Too many: torch's topk cannot pick them; none: every token's mixing weights are 0/0.
            good = m.n_experts if m.experts_top_k > m.n_experts else min(2, m.n_experts)
            fail(
                f"model.experts_top_k={m.experts_top_k} routes each token to that many experts, and the model "
                f"has {m.n_experts} (model.n_experts): it must lie between 1 and {m.n_experts}.",
                f"pass model.experts_top_k={good}" + (" (or raise model.n_experts)" if good == m.n_experts else ""),
            )

    def check_tensor_parallel(self, m: ModelConfig, tp: int) -> None:
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

    def depth_override(self, cfg: ModelConfig, n_layers: int) -> str:
        return f"model.n_layers={n_layers}"

    # ------------------------------------------------------------------------------------ SpecFacts
    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        """Training FLOPs per token: 6 N + 12 L d S (forward + backward, no recompute).

        N counts parameters without the input embedding (a lookup, no matmul); the output projection
        is a matmul and counts. 12 L d S is attention's score and value products (PaLM appendix B).
        """
        inventory = self.inventory(cfg)
        n = sum(p.numel for p in inventory.params if p.name not in inventory.input_params)
        return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len

    # ------------------------------------------------------------------------------------ SpecBuild
    def build(self, cfg: ModelConfig) -> Llama:
        return Llama(cfg)

    def retie(self, model: Llama) -> None:
        if model.cfg.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
            model.output.weight = model.tok_embeddings.weight

    # ----------------------------------------------------------------------------------- SpecLayout
    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}

    def expert_modules(self, model: Llama) -> list[str]:
        return [
            f"{name}.experts.{i}"
            for name, m in model.named_modules()
            if isinstance(m, MoEFeedForward)
            for i in range(len(m.experts))
        ]

    def check_context_parallel(self, cfg: ModelConfig, cp: int, tp: int) -> None:
        """Ulysses hands each CP rank cp-th of the local query heads; key/value heads cp does not divide are
        repeated up to the query heads (fsdp_exp.parallel.context)."""
        local = cfg.n_heads // tp
        if local % cp:
            fail(
                f"parallel.cp={cp} does not divide the {local} query heads each rank holds (model.n_heads="
                f"{cfg.n_heads} over parallel.tp={tp}): all-to-all attention gives each CP rank whole heads "
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
            gathered_inputs={"attention": 3, "feed_forward": 1},  # attention also takes cos and sin
        )

    # ----------------------------------------------------------------------------------- SpecExport
    def why_no_hf_export(self, cfg: ModelConfig) -> Optional[str]:
        if cfg.n_experts > 0:
            return "HF export writes LlamaForCausalLM; a mixture-of-experts model has no such layout"
        return None

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        problem = self.why_no_hf_export(cfg)
        if problem:
            raise ValueError(problem)
        n_heads = cfg.n_heads
        n_kv = cfg.n_kv_heads or n_heads
        tied = self.tied_weights(cfg)
        out = {}
        for name, tensor in state.items():
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
        return out

    def hf_config(self, cfg: ModelConfig) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.dim,
            "intermediate_size": ffn_hidden_dim(cfg),
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
            "head_dim": cfg.dim // cfg.n_heads,
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
