"""Multi-head latent attention (MLA), the attention of DeepSeek-V2/V3 and Kimi K2, in its cache-free training
form (``model.attention=mla``).

Queries come from the residual stream through a low-rank bottleneck (``model.q_lora_rank``: a down projection,
an RMSNorm, an up projection to every head), or one full projection where the rank is null (DeepSeek-V2-Lite,
torchtitan's 16B). Keys and values share one compressed latent (``model.kv_lora_rank`` wide, normalized) that
an up projection expands into each head's key part without position (``qk_nope_head_dim``) and its value
(``v_head_dim``). Position enters through a separate rotary part of the key (``qk_rope_head_dim`` wide),
projected once from the stream and shared by every head, which each head's rotary query part meets. The
scores are scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), SDPA's own default for that width.

Training computes every head's keys and values in full (no latent cache: that form serves decoding). The
attention itself is the family's kernel module (``fsdp_exp.models.llama.CausalAttention``), handed in by the
block, so whatever wraps or changes that kernel (context parallel, masks) applies here unchanged; the query
and value widths differ, which SDPA takes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def qk_head_dim(cfg) -> int:
    """Each head's query / key width: the part without position and the rotary part."""
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


class MultiHeadLatentAttention(nn.Module):
    """MLA of a block (see the module docstring). ``norm(width, eps)`` builds the family's RMSNorm, ``kernel``
    is its causal attention module (q, k, v of shape (batch, heads, seq, width) -> (batch, heads, seq, v width))
    and ``rope(x, cos, sin)`` its rotary embedding of (batch, seq, heads, width) tensors: the block's own, so
    that MLA differs from the family's attention in its projections alone."""

    def __init__(self, cfg, norm: Callable[[int, float], nn.Module], kernel: nn.Module, rope: Callable):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        q_width = cfg.n_heads * qk_head_dim(cfg)
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = norm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        # One projection gives the latent and the shared rotary key: both read the same stream.
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = norm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)
        self.kernel = kernel
        self.rope = rope

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        """``mask``: the batch's attention mask (fsdp_exp.models.attention_mask; None = causal), handed to the
        kernel as the family's attention hands it."""
        bsz, seq, _ = x.shape
        q = self.queries(x).view(bsz, seq, -1, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[2]
        if cos.dim() == 2:  # the tables: the rows of the sequence attention sees (llama.rope_rows says why)
            cos, sin = cos[:seq], sin[:seq]
        q_rot = self.rope(q_rot, cos, sin)
        k_rot = self.rope(k_rot[:, :, None, :], cos, sin).expand(-1, -1, heads, -1)  # one rotary key for all heads
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, width)
        out = self.kernel(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
