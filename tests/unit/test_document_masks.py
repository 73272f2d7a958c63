"""Packed documents kept apart, in one process: where packing says each document starts, synthetic data's
documents, the block-causal mask and document positions of fsdp_exp/models/attention_mask.py against the
documents run one by one, what preflight refuses, and the step-time model's attention FLOPs under the mask.
The layouts (FSDP2, TP, CP, PP on gloo ranks): tests/integration/test_packed_documents.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_exp.config import ConfigError
from fsdp_exp.data import attention_span
from fsdp_exp.data.blocks import PackedBlocks
from fsdp_exp.data.packing import Packed, _pack
from fsdp_exp.data.synthetic import SyntheticSource
from fsdp_exp.models import attention_mask, build_meta, init_weights

from conftest import TINY_MODEL, run_config

EOS = 255


def test_packing_records_where_each_document_starts_and_a_block_numbers_its_documents_from_them(tmp_path):
    seq_len = 8
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=n).astype(np.uint16) for n in (3, 1, 11, 5, 2, 7, 4)]
    stats = _pack(
        iter([docs[:4], docs[4:]]),
        seq_len,
        EOS,
        np.dtype(np.uint16),
        tmp_path / "blocks.bin",
        None,
        tmp_path / "starts.bin",
    )
    meta = {**stats, "seq_len": seq_len, "dtype": "uint16"}
    blocks = PackedBlocks(Packed(tmp_path, meta), seed=0, shuffle=False)
    tokens, documents = blocks.rows(0, meta["num_blocks"]).numpy(), blocks.documents(0, meta["num_blocks"]).numpy()
    assert meta["num_docs"] == len(docs) and meta["num_blocks"] == 4  # (40 tokens - 1) // 8
    for row, numbers in zip(tokens, documents):
        # a document begins right after every end-of-document id, and nowhere else
        after_eos = np.concatenate(([0], np.cumsum(row[:-1] == EOS)))
        np.testing.assert_array_equal(numbers, after_eos)
    # the span the step-time model prices attention at: the blocks' document pieces (pieces of 4, 2, 2 | 8 | ...)
    assert 1 < meta["attention_span"] < seq_len


def test_synthetic_documents_are_a_function_of_the_sample_and_keep_its_tokens():
    source = SyntheticSource(seed=3, vocab_size=256, seq_len=64, doc_len=8)
    first = source.documents(10, 4)
    assert torch.equal(first, source.documents(10, 4))
    assert first.shape == (4, 65) and (first[:, 0] == 0).all()
    steps = first.diff(dim=1)
    assert set(steps.unique().tolist()) <= {0, 1} and steps.sum() > 4 * 3  # several documents a row
    assert torch.equal(source.rows(10, 4), SyntheticSource(seed=3, vocab_size=256, seq_len=64).rows(10, 4))


def test_document_positions_restart_at_each_document_and_the_mask_keeps_documents_apart():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert attention_mask.document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = attention_mask.block_causal_bool(documents)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask.sum().item() == 6 + 3 + 1


# grouped-query attention (the tiny Llama: 4 heads, 2 key/value heads) and multi-head latent attention (a tiny
# DeepSeek-V3: its shared rotary key, a dense first block, group-routed experts)
ATTENTIONS = {"gqa": list(TINY_MODEL), "mla": ["model=deepseek_v3_tiny"]}


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
@pytest.mark.parametrize("kind", ["block_causal", "causal"])
def test_a_packed_block_gives_its_documents_losses_one_by_one_only_under_block_causal(kind, attention):
    cfg = run_config([*ATTENTIONS[attention], f"model.attention_mask={kind}"])
    model = build_meta(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, 0, torch.device("cpu"))
    lengths = (7, 12, 5)
    tokens = torch.randint(0, 256, (1, sum(lengths) + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = attention_mask.packed_inputs(documents, kind, "document")
    losses = F.cross_entropy(model(x, **packed)[0], y[0], reduction="none")
    # and through the chunked loss (the model's own forward takes the documents there too)
    chunked = model(x, targets=y, loss_chunks=3, **packed)
    alone, start = [], 0
    for n in lengths:
        alone.append(F.cross_entropy(model(x[:, start : start + n])[0], y[0, start : start + n], reduction="none"))
        start += n
    alone = torch.cat(alone)
    if kind == "block_causal":
        torch.testing.assert_close(losses, alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(chunked, alone.sum(), rtol=1e-5, atol=1e-5)
    else:
        assert (losses[lengths[0] :] - alone[lengths[0] :]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["model.attention_mask=full"], "model.attention_mask='full'"),
        (["data.positions=token"], "data.positions='token'"),
        (["parallel.cp=2", "parallel.cp_method=ring", "trainer.nproc_per_node=2"], "parallel.cp_method=ring"),
    ],
)
def test_preflight_refuses_by_name(overrides, refused):
    cfg = run_config([*TINY_MODEL, "model.attention_mask=block_causal", *overrides])
    for device in ("cpu", "cuda"):  # ring with block_causal: refused on every device, before any rank starts
        with pytest.raises(ConfigError, match=refused.replace("(", r"\(")):
            attention_mask.check(cfg, device)


def test_cp_auto_picks_ring_on_cuda_and_is_refused_with_block_causal_there_only():
    cfg = run_config([*TINY_MODEL, "model.attention_mask=block_causal", "parallel.cp=2", "trainer.nproc_per_node=2"])
    attention_mask.check(cfg, "cpu")  # auto: all_to_all on the CPU
    with pytest.raises(ConfigError, match="ring"):
        attention_mask.check(cfg, "cuda")


def test_the_step_time_model_prices_n_documents_of_length_l_as_n_causal_attentions_of_length_l():
    from fsdp_exp.tune.work import work

    n, length = 4, 16
    block = run_config(
        [
            *TINY_MODEL,
            f"trainer.seq_len={n * length}",
            "model.attention_mask=block_causal",
            f"data.doc_len_mean={length}",
        ]
    )
    one = run_config([*TINY_MODEL, f"trainer.seq_len={length}"])
    whole = run_config([*TINY_MODEL, f"trainer.seq_len={n * length}"])
    assert attention_span(block) == (length, f"data.doc_len_mean={float(length)}, data.doc_len_std=0.0")
    attention = work(block).attention_flops_per_token * n * length  # a block's, forward
    assert attention == pytest.approx(n * work(one).attention_flops_per_token * length, rel=1e-9)
    assert attention == pytest.approx(work(whole).attention_flops_per_token * n * length / n, rel=1e-9)
    # MFU's numerator alike: the matmuls of the block's tokens, the attention of its documents
    from fsdp_exp.metrics.flops import convention_flops_per_token

    matmuls = convention_flops_per_token("fsdp_exp", block.model, 0)
    per_block = convention_flops_per_token("fsdp_exp", block.model, attention_span(block)[0]) * n * length
    per_document = convention_flops_per_token("fsdp_exp", one.model, length) * length
    assert per_block - matmuls * n * length == pytest.approx(n * (per_document - matmuls * length), rel=1e-9)


def test_synthetic_data_says_its_span():
    cfg = run_config(
        [*TINY_MODEL, "trainer.seq_len=256", "model.attention_mask=block_causal", "data.synthetic_doc_len=16"]
    )
    span, source = attention_span(cfg)
    # lengths uniform in [1, 31]: E[L^2] / E[L] = 16 + var / 16 = 16 + 80 / 16 = 21, less the pieces the rows cut
    assert 17 < span < 21 and "synthetic" in source
    assert attention_span(run_config([*TINY_MODEL, "trainer.seq_len=256"]))[0] == 256


@pytest.mark.parametrize("packed", ["model.attention_mask=block_causal", "data.positions=document"])
def test_a_transformers_model_is_refused_packed_documents_by_name(packed):
    cfg = run_config(["model=hf_gpt2_xl", packed])
    with pytest.raises(ConfigError, match="model=hf takes no packed-document inputs"):
        attention_mask.check(cfg, "cpu")
