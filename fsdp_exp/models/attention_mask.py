"""Which keys a query may see: the attention mask of every family's attention, in one place.

``model.attention_mask``:

- ``causal`` (the default): every token sees every earlier token of its sequence, whatever document it
  belongs to (packed blocks attend across their documents' boundaries).
- ``block_causal``: a token sees the earlier tokens of its own document only. The documents of a batch come
  from the data (``Batch.documents``: each input position's document number within its block, fsdp_exp.data).

``document_mask(documents)`` builds the mask once per batch (the model's forward calls it, before its blocks),
and every attention kernel calls ``attend(q, k, v, mask)``:

- no mask (``causal``): SDPA with ``is_causal=True``, as before.
- an additive float tensor (batch, 1, seq, seq) in the attention's dtype (0 where a key is seen, -inf
  elsewhere), on every device but CUDA: SDPA with that explicit mask. Exact and differentiable everywhere;
  it costs seq^2 elements per sequence, built once per batch and held until the backward (the planner
  counts it: fsdp_exp.plan.activations.llama). Not a boolean mask: SDPA turns a boolean one into a float
  copy inside every call, and each layer's copy is kept for its backward (measured with torch's tracker on
  CPU: 2 layers at seq 1024 held 16 MiB more than the causal run, the planner's -34% error).
- a FlexAttention ``BlockMask`` on CUDA: ``flex_attention`` compiled, skipping the blocks of the score matrix
  that the mask empties (work that grows with the documents' own lengths, not the block's); the BlockMask's
  index tables are O(seq^2 / 128^2).

Grouped-query attention alike (SDPA's ``enable_gqa``, FlexAttention's ``enable_gqa``). Under context parallel
(all_to_all) the kernel sees whole sequences, in their natural order, after the exchange: the mask built over
the whole sequence applies unchanged. Why and the figures: docs/data.md ("Packed documents and the mask").
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F

from fsdp_exp.errors import fail

CAUSAL, BLOCK_CAUSAL = "causal", "block_causal"
MASKS = (CAUSAL, BLOCK_CAUSAL)
POSITIONS = ("block", "document")  # data.positions: rotary positions count from the block's / each document's start


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own document (``documents``: (batch, seq) document numbers, non-decreasing
    along the sequence): 0 at every document's first token."""
    seq = documents.shape[-1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    # the index of the latest document start at or before each token
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def block_causal_bool(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) booleans: query i may see key j when j <= i and both lie in the same document."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _block_mask(documents: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    batch, seq = documents.shape
    return create_block_mask(mask_mod, batch, None, seq, seq, device=documents.device, _compile=True)


Mask = Union[None, torch.Tensor, object]  # None (causal), an additive float tensor, or a FlexAttention BlockMask


def document_mask(documents: Optional[torch.Tensor], kind: str, dtype: torch.dtype = torch.float32) -> Mask:
    """The batch's mask, built once before the blocks: None for ``causal`` (or no documents), else the
    block-causal mask in the form this device's kernel takes (module docstring); ``dtype``: the queries'
    (``compute_dtype``)."""
    if kind == CAUSAL or documents is None:
        return None
    if kind != BLOCK_CAUSAL:
        raise ValueError(f"model.attention_mask={kind!r} is not one of {', '.join(MASKS)}")
    if documents.device.type == "cuda":
        return _block_mask(documents)
    seen = block_causal_bool(documents)
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype attention's queries will have: autocast's where it is on, else the hidden states'."""
    device = hidden.device.type
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    except RuntimeError:  # a device autocast does not know (meta: the planner's and the FLOP counter's models)
        return hidden.dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask = None) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) queries over keys and values (fewer key/value heads:
    grouped-query), under ``mask`` (``document_mask``'s)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa)
    return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)


RING_BLOCK_CAUSAL_REFUSAL = (
    "torch's ring attention (parallel.cp_method=ring) dispatches SDPA's causal kernels, which take no per-batch "
    "mask: each rank's queries would see the keys of every document passed round the ring; all_to_all "
    "hands each rank whole sequences, where the block-causal mask applies as built"
)


def check(cfg, device_type: str) -> None:
    """preflight's checks of ``model.attention_mask`` and ``data.positions`` (before any rank starts): the
    names, the families that take packed documents, and the context-parallel method that cannot mask them."""
    kind = getattr(cfg.model, "attention_mask", CAUSAL)
    if kind not in MASKS:
        fail(f"model.attention_mask={kind!r} is not one of {', '.join(MASKS)}.", "pass model.attention_mask=causal")
    if cfg.data.positions not in POSITIONS:
        fail(
            f"data.positions={cfg.data.positions!r} is not one of {', '.join(POSITIONS)}.", "pass data.positions=block"
        )
    if cfg.data.synthetic_doc_len is not None and cfg.data.synthetic_doc_len < 1:
        fail(
            f"data.synthetic_doc_len={cfg.data.synthetic_doc_len} must be at least 1.",
            "pass data.synthetic_doc_len=null (trainer.seq_len // 4)",
        )
    packed = kind == BLOCK_CAUSAL or cfg.data.positions == "document"
    if packed and cfg.model.name != "llama":
        fail(
            f"model={cfg.model.name} takes no packed-document inputs yet (model.attention_mask={kind}, "
            f"data.positions={cfg.data.positions}): fsdp_exp passes transformers models token ids only.",
            "pass model.attention_mask=causal data.positions=block, or a Llama-family model",
        )
    p = cfg.parallel
    ring = p.cp_method == "ring" or (p.cp_method == "auto" and device_type == "cuda")  # auto: ring on CUDA
    if kind == BLOCK_CAUSAL and p.cp > 1 and ring:
        fail(
            f"parallel.cp_method={p.cp_method} (ring) with model.attention_mask=block_causal: {RING_BLOCK_CAUSAL_REFUSAL}.",
            "pass parallel.cp_method=all_to_all",
        )


def packed_inputs(documents: Optional[torch.Tensor], mask_kind: str, positions_kind: str) -> dict:
    """What the model's forward takes besides the tokens for a batch of packed documents: ``documents`` under
    ``block_causal``, per-token ``positions`` under ``data.positions=document``; nothing (today's call) for
    ``causal`` with block positions."""
    out = {}
    if documents is not None and mask_kind == BLOCK_CAUSAL:
        out["documents"] = documents
    if documents is not None and positions_kind == "document":
        out["positions"] = document_positions(documents)
    return out


def mask_bytes(kind: str, batch: int, seq: int, device_type: str, e: int = 4) -> int:
    """What ``document_mask`` holds for a batch from its build until the backward: the planner's figure.
    CUDA's BlockMask keeps per-(128 x 128)-block index tables, a few int32 per block: counted as 0. ``e``: the
    compute dtype's bytes (the additive mask's element)."""
    if kind == CAUSAL or device_type == "cuda":
        return 0
    return e * batch * seq * seq
