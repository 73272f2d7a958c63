"""What a Llama block (``fsdp_exp.models.llama``) keeps for backward, tensor by tensor: the memory
planner's activation profile of the family (``fsdp_exp.plan.activations.ActivationProfile``).

Sizes are per rank and per micro-batch: tensor parallel divides the heads and the SwiGLU width,
sequence parallel divides the residual stream's sequence. ``e`` is the compute dtype's size in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_exp.models.attention_mask import BLOCK_CAUSAL, mask_bytes
from fsdp_exp.models.llama import ffn_hidden_dim, head_dim
from fsdp_exp.models.mla import qk_head_dim
from fsdp_exp.models.moe import moe_hidden_dim
from fsdp_exp.plan.activations.profile import TokenCounts


@dataclass(frozen=True)
class LlamaActivations(TokenCounts):
    b: int  # micro-batch
    s: int  # sequence length
    d: int  # model width (the residual stream)
    dq: int  # query width on this rank: n_heads * head_dim / tp
    dkv: int  # key / value width on this rank
    heads: int  # query heads on this rank
    ffn: int  # SwiGLU hidden width on this rank (of one routed expert in a mixture of experts)
    vocab: int
    experts: int  # routed experts (0: a dense feed-forward)
    sp: int  # divisor of the residual stream (tp with sequence parallel, else 1)
    tp: int = 1  # tensor-parallel degree: a row-parallel output is reduced by a collective inside the block
    top_k: int = 0  # routed copies of each token
    shared_ffn: int = 0  # the shared experts' SwiGLU width (0: none)
    cp: int = 1  # context-parallel degree: s is already this rank's share of the sequence
    ep: int = 1  # expert-parallel degree: this rank runs experts/ep experts on the copies other ranks send it
    imbalance: float = 1.0  # plan.expert_imbalance: max / mean routed copies per expert (1 = balanced)
    # the experts' SwiGLU intermediates kept per routed copy, in widths: 4, or 2 (w1's and w3's outputs) with
    # model.recompute_expert_activation
    expert_intermediates: int = 4
    attention_mask: str = "causal"  # model.attention_mask: block_causal builds a mask per micro-batch

    # Multi-head latent attention (fsdp_exp.models.mla; model.attention=mla), per head: dq = dkv = heads x qk.
    latent: bool = False
    q_rank: int = 0  # the queries' low rank (0: one full query projection)
    kv_rank: int = 0  # the keys' and values' latent
    qk: int = 0  # a head's query / key width (the part without position and the rotary part)
    rope: int = 0  # the rotary part, one key for every head
    v: int = 0  # a head's value width
    # Dense first blocks of a mixture of experts (model.first_k_dense), of SwiGLU width dense_ffn (on this rank)
    dense_blocks: int = 0
    n_blocks: int = 1
    dense_ffn: int = 0

    def batch_inputs(self, device_kind: str, e: int) -> int:
        """What a micro-batch holds besides its token ids and targets from its forward until its backward ends,
        under block_causal: the document numbers (int32) and the mask built from them, both over the whole
        sequence (under context parallel too): seq^2 elements of the compute dtype a sequence off CUDA (SDPA's
        additive mask; CUDA's FlexAttention BlockMask is counted as nothing: fsdp_exp.models.attention_mask)."""
        if self.attention_mask != BLOCK_CAUSAL:
            return 0
        whole = self.s * self.cp
        return 4 * self.b * whole + mask_bytes(self.attention_mask, self.b, whole, device_kind, e)

    @property
    def cp_repeats_kv(self) -> bool:
        """All-to-all attention repeats the key/value heads up to the query heads when cp does not divide them."""
        return self.cp > 1 and (self.heads * self.dkv // self.dq) % self.cp != 0

    def cp_saved(self, e: int) -> int:
        """What all-to-all attention adds to a block's saved tensors: wo's input is a new tensor after the
        exchange back (without CP it is a view of the kernel's output), and repeated key/value heads are what
        the kernel keeps instead of the grouped ones."""
        if self.cp == 1:
            return 0
        return e * self.tokens * self.dq + (2 * e * self.tokens * (self.dq - self.dkv) if self.cp_repeats_kv else 0)

    @property
    def local_experts(self) -> int:
        """Routed experts this rank runs: all of them, or its share of the EP group's."""
        return max(1, self.experts // self.ep)

    @property
    def peak_weight_grad(self) -> int:
        """w2's weight gradient, made at the block's backward peak: the routed experts' is one stacked tensor
        (of this rank's experts under expert parallel)."""
        return self.d * self.ffn * self.local_experts

    @property
    def block_weight_grads(self) -> int:
        """w2's weight gradients of every expert, held at the backward peak when they stay unsharded."""
        return self.d * self.ffn * self.local_experts

    @property
    def routed(self) -> int:
        """Routed copies of the micro-batch's tokens (dropless, so top_k per token whatever the balance)."""
        return self.tokens * self.top_k

    @property
    def received(self) -> int:
        """Routed copies this rank's experts compute. Without expert parallel its own (every expert is here,
        so the balance changes nothing). With it, what the EP group sends its experts/ep experts: on average
        its own count; at the busiest rank, the busiest expert at ``imbalance`` x the mean per expert and the
        rest sharing what is left evenly (so ep = n_experts receives ``imbalance`` x its own, and an imbalance
        of n_experts, every copy to one expert, sends that rank the whole group's)."""
        if self.ep == 1 or not self.experts:
            return self.routed
        f, per_rank = min(self.imbalance, self.experts), self.local_experts
        others = (self.experts - f) / (self.experts - 1) if self.experts > 1 else 0.0
        return math.ceil(self.routed * (f + (per_rank - 1) * others) / per_rank)

    def residual(self, e: int) -> int:
        return e * self.tokens * self.d // self.sp

    def block_saved(self, e: int, autocast: bool = False, math_attention: bool = False) -> dict[str, int]:
        """Bytes one transformer block keeps for backward, tensor by tensor.

        FSDP computes everything in ``param_dtype`` (its parameters are cast): RMSNorm saves one fp32
        copy of its input when that is not fp32 (``x.float()``, used twice) or the input itself in fp32,
        its rsqrt, the normalized tensor and the weighted one (the input of the next linear); attention
        saves the rotated q and k, v, the softmax log-sum-exp (fp32) and the output; SwiGLU saves w1's
        and w3's outputs, silu's output and the product. Under DDP's autocast (``autocast=True``) the
        residual stream and norms stay fp32 and every linear saves its own low-precision copy of its
        input. The block's input is counted here (the previous block's output). ``math_attention``:
        SDPA's math fallback (CUDA, fp32 with grouped-query attention, which the flash and
        memory-efficient kernels do not take in fp32) also saves the attention probabilities and the
        key / value heads repeated to the query heads.
        """
        bs = self.tokens
        resid = bs * self.d // self.sp  # one residual-stream tensor, in elements
        if autocast:
            norms = 2 * (4 * bs // self.sp + 4 * resid)  # rsqrt and the fp32 normalized tensor, twice
            residual = 2 * 4 * resid  # the block input and h, fp32
            casts = e * bs * self.d * (3 + 2)  # the inputs of wq, wk, wv and w1, w3, each cast
        else:
            copies = 0 if e == 4 else 4 * resid  # x.float() when x is not fp32
            norms = 2 * (copies + 4 * bs // self.sp + e * resid + e * bs * self.d)
            residual = 2 * 4 * resid if e == 4 else 0  # fp32: the norms save the residual tensors themselves
            casts = 0
        if self.latent:
            # wo's input is a copy of the kernel's output with or without context parallel (the values are narrower)
            attention = self._latent_attention_saved(e, math_attention) + (0 if math_attention else self.cp_saved(e))
        else:
            attention = e * bs * self.dq * 2 + 2 * e * bs * self.dkv + 4 * self.b * self.heads * self.s
            attention += self.cp_saved(e)
            if math_attention:
                attention += e * self.b * self.heads * self.s * self.s + 2 * e * bs * (self.dq - self.dkv)
        if self.experts:
            ffn = self._routed_saved(e)
            if self.dense_blocks:
                # The dense first blocks' SwiGLU: every block gets the mean, so the blocks' sum (what is alive at
                # the step's peak, the last block's backward) is exact; alone, a routed block is planned a little
                # under what it keeps (fsdp_exp.plan.step checkpoints and recomputes blocks by one figure).
                routed = self.n_blocks - self.dense_blocks
                ffn = (routed * ffn + self.dense_blocks * 4 * e * bs * self.dense_ffn) // self.n_blocks
        else:
            ffn = 4 * e * bs * self.ffn
        return {
            "residual": residual,
            "norms": norms,
            "casts": casts,
            "attention": attention,
            "ffn": ffn,
            "total": residual + norms + casts + attention + ffn,
        }

    def _latent_attention_saved(self, e: int, math_attention: bool) -> int:
        """What multi-head latent attention keeps: each RMSNorm of a low-rank projection its fp32 input (under fp32
        the projection's output itself, which for the key/value latent is a view keeping the rotary key's columns
        too), its rsqrt, the normalized and the weighted tensors. Then the kernel's: a fused one (CUDA's
        memory-efficient or cuDNN SDPA) the queries and keys after their rotary part is joined on (new tensors,
        heads x qk), the key/value up projection's output (the values are a view of it), its output and
        log-sum-exp (fp32). SDPA's math kernel (the CPU's, whose fused kernel wants the values as wide as the keys)
        keeps the scaled queries and keys, the values and the probabilities, all in fp32 (it computes bf16 in
        fp32), and wo's input is a copy of its output (measured with saved-tensor hooks, fp32 and bf16)."""
        heads, bs = self.heads, self.tokens
        q_path = bs * (4 * self.q_rank + 4 + 2 * e * self.q_rank) if self.q_rank else 0
        kv_norm = bs * (4 * self.kv_rank + 4 + 2 * e * self.kv_rank + (4 * self.rope if e == 4 else 0))
        if math_attention:
            # Under context parallel the kernel sees heads/cp heads over the whole sequence: cp x the probabilities.
            kernel = 4 * bs * heads * (2 * self.qk + self.v) + 4 * self.b * heads * self.s * self.s * self.cp
            return q_path + kv_norm + kernel + e * bs * heads * self.v
        per_token = e * heads * (2 * self.qk + (self.qk - self.rope + self.v) + self.v)
        return q_path + kv_norm + bs * per_token + 4 * self.b * heads * self.s

    def _routed_saved(self, e: int) -> int:
        """What a mixture of experts (``fsdp_exp.models.moe``) keeps: the router's probabilities (fp32), the
        picked weights and their sum; per routed copy, the experts' masked input and their SwiGLU on it (w1's
        and w3's outputs, silu's, the product), and the experts' output (the weighting's other operand) with
        its weight; the int64 orders that sort and scatter the copies, the kept masks, the group offsets; the
        shared experts' SwiGLU. The scatter back to the tokens keeps only its indices. docs/moe.md lists them."""
        n, t = self.routed, self.tokens
        router = 4 * t * self.experts + 4 * n + 4 * t + 4 * self.experts
        act = self.expert_intermediates * self.ffn
        experts = e * n * (2 * self.d + act + 1)
        indices = 3 * 8 * n + 2 * n  # the sort order, each copy's token, the picked experts; two masks
        if self.ep > 1:
            # Expert parallel (fsdp_exp.parallel.expert): the masked input and the SwiGLU are the received
            # copies' (not this rank's own), with the regrouping order, its inverse (int64) and the mask over
            # them; the combined outputs and their weights stay per own copy (torch's tracker on 4 gloo ranks).
            r = self.received
            experts += e * r * (self.d + act) + 17 * r - e * n * (self.d + act) - n
        return router + experts + indices + 4 * e * t * self.shared_ffn

    def _stacked_experts(self, e: int) -> int:
        """The routed copies' outputs alive beside the SwiGLU intermediates (none without experts)."""
        return e * self.routed * self.d if self.experts else 0

    def _ffn_rows(self) -> int:
        """Rows the SwiGLU intermediates span: the routed copies of a mixture of experts, else the tokens."""
        return self.received if self.experts else self.tokens

    def _op_outputs(self, e: int) -> list[tuple[str, int]]:
        """The outputs of a block's ops that op-level checkpointing may save, in forward order, as
        (``matmul`` | ``kept``, bytes): each linear layer's matmul; attention's output and log-sum-exp (fp32);
        under tensor parallel, the collective that reduces each row-parallel output (wo's, w2's)."""
        tokens = self.tokens

        def matmul(width: int) -> tuple[str, int]:
            return "matmul", e * tokens * width

        reduced = [("kept", e * tokens * self.d // self.sp)] if self.tp > 1 else []
        if self.latent:  # wq_a and wq_b (or wq), wkv_a, wkv_b, the kernel's output and log-sum-exp, wo
            queries = [matmul(self.q_rank), matmul(self.dq)] if self.q_rank else [matmul(self.dq)]
            attention = [
                *queries,
                matmul(self.kv_rank + self.rope),
                matmul(self.heads * (self.qk - self.rope + self.v)),
                ("kept", e * tokens * self.heads * self.v + 4 * self.b * self.heads * self.s),
                matmul(self.d),
                *reduced,
            ]
        else:
            attention = self._grouped_query_outputs(e, matmul, reduced)
        swiglu = [matmul(self.ffn), matmul(self.ffn), matmul(self.d)]
        if self.experts:  # the router's matmul, the experts' three grouped matmuls on the routed copies, shared
            routed = [("matmul", e * self.received * w) for w in (self.ffn, self.ffn, self.d)]
            shared = [matmul(self.shared_ffn), matmul(self.shared_ffn), matmul(self.d)] if self.shared_ffn else []
            ffn = [matmul(self.experts), *routed, *shared]
        else:
            ffn = swiglu
        return attention + ffn + reduced

    def _grouped_query_outputs(self, e: int, matmul, reduced: list) -> list[tuple[str, int]]:
        tokens = self.tokens
        return [
            matmul(self.dq),
            matmul(self.dkv),
            matmul(self.dkv),
            ("kept", e * tokens * self.dq + 4 * self.b * self.heads * self.s),
            matmul(self.d),
            *reduced,
        ]

    def op_level_saved(self, e: int, ops: str) -> int:
        """What a block keeps under op-level selective AC beyond its input: the outputs ``ops`` saves
        (fsdp_exp.ops.OpSaver's rule: every matmul's, or the 1st, 3rd, ... matmul's; always
        attention's and the collectives')."""
        saved, matmuls = 0, 0
        for kind, nbytes in self._op_outputs(e):
            if kind == "matmul":
                matmuls += 1
                if ops == "every_matmul" or matmuls % 2 == 1:
                    saved += nbytes
            else:
                saved += nbytes
        return saved

    def checkpointed_forward_peak(self, e: int) -> int:
        """A checkpointed block saves only its input, but then holds h and the norm's output, silu's
        and w3's outputs and their product (and a dense MoE's stacked outputs)."""
        return self.residual(2 * e) + 3 * e * self._ffn_rows() * self.ffn + self._stacked_experts(e)

    def op_level_forward_peak(self, e: int, ops: str) -> int:
        """silu's output and the product, next to the kept matmul outputs (and w3's output, alive until
        the product, when ``ops`` does not keep it)."""
        return (2 if ops == "every_matmul" else 3) * e * self._ffn_rows() * self.ffn

    def backward_peak(self, e: int) -> int:
        """At the SwiGLU's backward: the gradients of silu's output and w3's output next to the
        product's (the product is freed by then); a dense MoE adds the gradient of the stacked outputs. Under
        expert parallel the outputs' gradient comes back through the combine's all-to-all and its regrouping,
        which the grouped matmuls' backward consumes: the tracker sees no stacked gradient beside theirs there
        (calibrated at ep=2 and 4 on 4 gloo ranks, tests/integration/test_expert_parallel.py)."""
        stacked = self._stacked_experts(e) if self.ep == 1 else 0
        return 2 * e * self._ffn_rows() * self.ffn + stacked

    def dispatch_forward_peak(self, e: int) -> int:
        """Expert parallel (``fsdp_exp.parallel.expert``): while the combine's all-to-all runs, the experts'
        output and its copy in arrival order (2 x received) are alive beside the copies this rank sent, next
        to the combined outputs the layer saves."""
        if self.ep == 1 or not self.experts:
            return 0
        return e * self.d * (2 * self.received + self.routed)

    def head_saved(self, e: int, autocast: bool) -> int:
        """The final RMSNorm: under autocast its fp32 input, rsqrt, normalized tensor and the output
        projection's cast input; otherwise the input (and its fp32 copy when it is not fp32), rsqrt,
        the normalized and weighted tensors."""
        bs = self.tokens
        if autocast:
            return 4 * bs * self.d + 4 * bs + 4 * bs * self.d + e * bs * self.d
        return 4 * bs * self.d + 4 * bs + 2 * e * bs * self.d

    def math_attention(self, device_kind: str, e: int) -> bool:
        """SDPA falls back to its math kernel on CUDA in fp32 with grouped-query attention, and on the CPU for
        latent attention whose values are narrower than its queries and keys."""
        if self.latent:
            return device_kind != "cuda" and self.qk != self.v
        return device_kind == "cuda" and e == 4 and self.dkv != self.dq

    def notes(self, device_kind: str, e: int) -> list[str]:
        if device_kind != "cuda":
            return []
        return [
            "CUDA: calibrated on CPU runs; SDPA assumed to save q, k, v, out and the log-sum-exp "
            "(flash / memory-efficient)"
            + (", math fallback here (fp32 with GQA)" if self.math_attention(device_kind, e) else "")
        ]


def profile(
    spec, cfg, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool, cp: int = 1
) -> LlamaActivations:
    """A Llama model's per-rank profile: tensor parallel divides the heads and the SwiGLU width.

    Every family's ``profile`` in ``PROFILES`` has this signature.

    Args:
        spec: the model family's spec (``fsdp_exp.models.spec_for``).
        cfg: the model config (``cfg.model``).
        micro_batch: sequences per micro-batch.
        seq_len: tokens per sequence.
        tp: tensor-parallel degree.
        sequence_parallel: ``parallel.sequence_parallel``: the residual stream around the norms is split
        over the ``tp`` ranks along the sequence.
        cp: context-parallel degree: every rank holds seq_len / cp tokens of each sequence
        (fsdp_exp.parallel.context).
    """
    latent = cfg.attention == "mla"
    head = qk_head_dim(cfg) if latent else head_dim(cfg)
    kv_heads = cfg.n_heads if latent else cfg.n_kv_heads or cfg.n_heads
    expert_width = moe_hidden_dim(cfg, ffn_hidden_dim(cfg)) if cfg.n_experts else ffn_hidden_dim(cfg)
    mla = dict(
        latent=True,
        q_rank=cfg.q_lora_rank or 0,
        kv_rank=cfg.kv_lora_rank,
        qk=qk_head_dim(cfg),
        rope=cfg.qk_rope_head_dim,
        v=cfg.v_head_dim,
    )
    dense_first = cfg.first_k_dense if cfg.n_experts else 0
    return LlamaActivations(
        **(mla if latent else {}),
        dense_blocks=dense_first,
        n_blocks=cfg.n_layers,
        dense_ffn=ffn_hidden_dim(cfg) // tp,
        b=micro_batch,
        s=seq_len // cp,
        d=cfg.dim,
        dq=cfg.n_heads * head // tp,
        dkv=kv_heads * head // tp,
        heads=cfg.n_heads // tp,
        ffn=expert_width // tp,
        vocab=cfg.vocab_size,
        experts=cfg.n_experts,
        top_k=cfg.experts_top_k if cfg.n_experts else 0,
        shared_ffn=cfg.n_shared_experts * expert_width if cfg.n_experts else 0,
        expert_intermediates=2 if cfg.n_experts and getattr(cfg, "recompute_expert_activation", False) else 4,
        sp=tp if sequence_parallel else 1,
        tp=tp,
        cp=cp,
        attention_mask=cfg.attention_mask,
    )
