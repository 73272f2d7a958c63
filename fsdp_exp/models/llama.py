"""A plain Llama decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query SDPA attention).

No parallel code lives here: fsdp_exp.parallel wraps these modules, following the family's spec
(``fsdp_exp.models.llama_spec``: its tensor-parallel plan, export mapping and planner inventory).
The model is built on the meta device and materialized after sharding, so initialization must run
on any device and any sharding: ``fsdp_exp.models.init_weights`` fills each parameter from (seed,
its name) alone, with the std that ``Llama.init_std`` gives it.

    python -m fsdp_exp.plan model=llama7b        # its parameters and per-rank memory, on meta
    python -c "from fsdp_exp.config.schema import ModelConfig; from fsdp_exp.models import count_params; \
print(count_params(ModelConfig(dim=4096, n_layers=32, n_heads=32, vocab_size=32000)))"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_exp.config.schema import ModelConfig
from fsdp_exp.models.attention_mask import Mask, attend, compute_dtype, document_mask
from fsdp_exp.models.loss import chunked_cross_entropy
from fsdp_exp.models.mla import MultiHeadLatentAttention
from fsdp_exp.models.moe import MoE, moe_hidden_dim, number_moe_layers


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    """The SwiGLU width: ``model.dense_hidden_dim``, else the Llama papers' 2/3 of 4*dim, scaled, rounded up to
    ``multiple_of``."""
    if cfg.dense_hidden_dim is not None:
        return cfg.dense_hidden_dim
    hidden = int(2 * (4 * cfg.dim) / 3)
    if cfg.ffn_dim_multiplier is not None:
        hidden = int(cfg.ffn_dim_multiplier * hidden)
    return cfg.multiple_of * ((hidden + cfg.multiple_of - 1) // cfg.multiple_of)


def head_dim(cfg: ModelConfig) -> int:
    """Each head's width: ``model.head_dim``, else dim / n_heads."""
    return cfg.head_dim or cfg.dim // cfg.n_heads


def rotary_dim(cfg: ModelConfig) -> int:
    """The width the rotary tables turn: a head's, or under MLA its rotary part (``model.qk_rope_head_dim``)."""
    return cfg.qk_rope_head_dim if cfg.attention == "mla" else head_dim(cfg)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2), always in fp32. On the meta device (a model
    built for its shapes; ``init_buffers`` fills them later) only the shapes: arithmetic on meta tensors runs
    through torch's reference ops, whose first call imports torch's compiler stack (about a second)."""
    if torch.empty(0, device=device).is_meta:
        return (
            torch.empty(max_seq_len, head_dim // 2, device=device, dtype=torch.float32),
            torch.empty(max_seq_len, head_dim // 2, device=device, dtype=torch.float32),
        )
    angles = torch.outer(
        torch.arange(max_seq_len, device=device, dtype=torch.float32), _inv_freq(head_dim, theta, device)
    )
    return angles.cos(), angles.sin()


def _inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_at(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, seq, head_dim // 2) at each token's own position (``data.positions=document``: counted
    from its document's start). The same fp32 products as ``rope_tables``' rows, so a document alone at
    positions 0.. gets bit-identical angles."""
    angles = positions.to(torch.float32)[..., None] * _inv_freq(head_dim, theta, positions.device)
    return angles.cos(), angles.sin()


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the sequence an attention sees: the tables' first ``seq`` (whole under sequence parallel, where a
    pipeline stage's input is this rank's shard of it; this rank's positions under CP), or per-token angles as
    they are (``rope_at``)."""
    return (cos[:seq], sin[:seq]) if cos.dim() == 2 else (cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim) by the position's angle."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    # (seq, d/2) tables shared by the batch, or (batch, seq, d/2) per-token positions (rope_at)
    cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if cos.dim() == 2 else (cos[:, :, None], sin[:, :, None])
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16/fp16 compute. One fp32 copy, used twice: each call of
        # x.float() makes its own copy and autograd keeps both, 4 bytes a residual element more per norm.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class CausalAttention(nn.Module):
    """The attention kernel alone: (batch, heads, seq, head_dim) queries, keys and values, grouped-query when
    there are fewer key/value heads, under the batch's mask (causal, or block-causal over its documents:
    fsdp_exp.models.attention_mask). Its own module so that context parallel (fsdp_exp.parallel.context) can
    wrap the kernel without knowing the projections around it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        return attend(q, k, v, mask)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = head_dim(cfg)
        # Qwen3's query / key norms: one RMSNorm over each head's width, shared by the heads.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.kernel = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 rather than the configured head count, so a tensor-parallel shard of wq/wk/wv still works.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_rows(cos, sin, seq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        out = self.kernel(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or ffn_hidden_dim(cfg)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_feed_forward(cfg: ModelConfig) -> MoE:
    """A block's mixture of experts (``fsdp_exp.models.moe``), its shared experts one SwiGLU as wide as
    ``n_shared_experts`` routed experts together."""
    width = moe_hidden_dim(cfg, ffn_hidden_dim(cfg))
    shared = FeedForward(cfg, cfg.n_shared_experts * width) if cfg.n_shared_experts else None
    return MoE(cfg, ffn_hidden_dim(cfg), shared)


class TransformerBlock(nn.Module):
    """``layer``: the block's index, which the first ``model.first_k_dense`` blocks of a mixture of experts keep a
    dense SwiGLU by (None: a block past them)."""

    def __init__(self, cfg: ModelConfig, layer: int | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.attention == "mla":
            self.attention = MultiHeadLatentAttention(cfg, RMSNorm, CausalAttention(), apply_rope)
        else:
            self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        routed = cfg.n_experts > 0 and (layer is None or layer >= cfg.first_k_dense)
        self.feed_forward = moe_feed_forward(cfg) if routed else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0", "1", ... keeps parameter names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        number_moe_layers(self)  # kept by a pipeline stage: its routing counts line up with the other stages'
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived, not learned: non-persistent, rebuilt by init_buffers().
        cos, sin = rope_tables(rotary_dim(cfg), cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_chunks: int = 1,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits; with ``targets``, the summed cross-entropy instead, the output projection taken
        ``loss_chunks`` slices of the sequence at a time (``fsdp_exp.models.loss``). ``documents``: each
        position's document number in its block, over the whole sequence (under context parallel too), which
        ``model.attention_mask=block_causal`` keeps apart; ``positions``: each token's rotary position
        (``data.positions=document``), else the tables' rows in order."""
        if positions is not None:
            cos, sin = rope_at(positions, rotary_dim(self.cfg), self.cfg.rope_theta)
        else:
            cos, sin = self.rope_cos, self.rope_sin  # each attention takes the rows of the sequence it sees
        h = self.tok_embeddings(tokens)
        # once a batch, for every block (none without documents: the causal kernel's own mask)
        mask = None if documents is None else document_mask(documents, self.cfg.attention_mask, compute_dtype(h))
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        if targets is not None:
            return chunked_cross_entropy(self.norm(h), self.output, targets, loss_chunks)
        return self.output(self.norm(h))

    def init_buffers(self, device: torch.device) -> None:
        cos, sin = rope_tables(rotary_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin
        for moe in self.modules():
            if isinstance(moe, MoE):  # loss-free balancing starts unbiased; a resume loads the biases after
                moe.router.expert_bias = torch.zeros_like(moe.router.expert_bias, device=device)
                for name in ("tokens_per_expert", "dropped", "aux_loss"):
                    setattr(moe, name, torch.zeros_like(getattr(moe, name), device=device))

    def init_std(self, param_name: str) -> float | None:
        """Std of the normal init of a parameter (by its canonical name), or None for norm weights (ones)."""
        if param_name.endswith("norm.weight"):
            return None
        if param_name.endswith(("attention.wo.weight", ".w2.weight", ".experts.w2")):
            # Residual-branch outputs are scaled down with depth (GPT-2 / Llama practice).
            return self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5
        return self.cfg.init_std
