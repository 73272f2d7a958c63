"""Training data, one rank's share at a time.

- ``data=synthetic``: seeded uniform random tokens (``synthetic.py``).
- ``data=text|json|parquet`` (local ``data.files``) and ``data=hf`` (``data.dataset`` on the hub or
  a local folder): real text, tokenized (``tokenizer.py``) and packed into fixed-length blocks once,
  cached on disk (``packing.py``), read in a per-epoch permutation (``blocks.py``).

Either way the trainer calls ``micro_batches(step)`` (``loader.py``): the global batch of step ``s``
is the next ``trainer.global_batch_size`` samples of the order, and each data-parallel rank takes its
contiguous slice. The launcher calls :func:`check_config` (inside ``config.validate``) and
:func:`prepare_data` before any rank exists, so bad data is a ConfigError, and ranks only map the
cached blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from fsdp_exp.config import ConfigError, RunConfig, Topology, fail
from fsdp_exp.data.blocks import PackedBlocks
from fsdp_exp.data.loader import Batch, StepData
from fsdp_exp.data.packing import (
    KINDS,
    DataError,
    Packed,
    block_attention_span,
    cache_root,
    find_or_pack,
    find_packed,
    sources,
    stderr_log,
)
from fsdp_exp.data.synthetic import SyntheticSource, SyntheticTokens
from fsdp_exp.data.tokenizer import TokenizerError, load_tokenizer

__all__ = [
    "Batch",
    "StepData",
    "SyntheticTokens",
    "PackedBlocks",
    "build_data",
    "check_config",
    "prepare_data",
    "packed_splits",
    "attention_span",
]

SAMPLE_BY = ("line", "paragraph", "document")


def check_config(cfg: RunConfig) -> None:
    """What can be checked without reading the data: the source, its files, the tokenizer's
    vocabulary against the model. Raises ConfigError naming the override that fixes it."""
    d, t = cfg.data, cfg.trainer
    if d.name not in KINDS:
        fail(f"data={d.name!r} is not one of {', '.join(KINDS)}.", "pass data=synthetic|text|json|parquet|hf")
    if t.eval_every < 0:
        fail(f"trainer.eval_every={t.eval_every} is negative.", "pass trainer.eval_every=0 (never) or a step interval")
    for key, value, least in (
        ("data.num_workers", d.num_workers, 0),
        ("data.prefetch_factor", d.prefetch_factor, 1),
        ("data.val_batches", d.val_batches, 1),
    ):
        if value < least:
            fail(f"{key}={value} must be at least {least}.", f"pass {key}={max(least, 1) if least else 0} or more")
    if d.max_blocks is not None and d.max_blocks < 1:
        fail(f"data.max_blocks={d.max_blocks} must be positive.", "pass data.max_blocks=null (all the data)")

    if d.name == "synthetic":
        if d.files or d.val_files:
            fail(
                "data.files / data.val_files are set, but data=synthetic ignores them.",
                "pass data=text (or json, parquet) to train on the files, or drop them",
            )
        if t.eval_every:
            fail(
                f"trainer.eval_every={t.eval_every} needs validation data, and data=synthetic has none.",
                "pass trainer.eval_every=0, or data=text with data.val_files=[...]",
            )
        return

    if d.sample_by not in SAMPLE_BY:
        fail(
            f"data.sample_by={d.sample_by!r} is not one of {', '.join(SAMPLE_BY)}.",
            "pass data.sample_by=paragraph (a blank line ends a document)",
        )
    if d.name == "hf":
        if not d.dataset:
            fail(
                "data=hf needs a dataset.",
                "pass data.dataset=<hub name, e.g. roneneldan/TinyStories, or a local folder>",
            )
        if d.dataset.startswith(("/", ".", "~")) and not Path(d.dataset).expanduser().exists():
            fail(
                f"data.dataset={d.dataset!r} looks like a local folder and does not exist.",
                "pass data.dataset=<an existing folder or a hub name>",
            )
        if d.files or d.val_files:
            fail(
                "data.files / data.val_files do not apply to data=hf.",
                "pass data=json|parquet|text for local files, or data.split / data.val_split for data=hf",
            )
    try:
        _, val = sources(d)  # missing and empty files
    except DataError as err:
        raise ConfigError(str(err)) from None
    if t.eval_every and val is None:
        key = "data.val_split=<split>" if d.name == "hf" else "data.val_files=[...]"
        fail(
            f"trainer.eval_every={t.eval_every} needs validation data, and there is none.",
            f"pass {key} or trainer.eval_every=0",
        )

    try:
        tokenizer = load_tokenizer(tokenizer_name(cfg), d.eos_token)
    except TokenizerError as err:
        fail(
            str(err),
            "pass data.tokenizer=byte, a tokenizer.json (or its folder), or a hub name "
            "(and data.eos_token=<its end-of-document token>)",
        )
    if tokenizer.vocab_size > model_vocab_size(cfg):
        fail(
            f"data.tokenizer={d.tokenizer!r} has a vocabulary of {tokenizer.vocab_size} tokens, more than the "
            f"model's embedding (model.vocab_size={model_vocab_size(cfg)}).",
            f"pass model.vocab_size={tokenizer.vocab_size}"
            + (
                f" (or a multiple of 64 above it, e.g. model.vocab_size={-(-tokenizer.vocab_size // 64) * 64})"
                if tokenizer.vocab_size % 64
                else ""
            ),
        )


MODEL_TOKENIZER = "model"


def tokenizer_name(cfg: RunConfig) -> str:
    """``data.tokenizer``, with ``model`` resolved: the model's own tokenizer where its family finds one on
    this machine (a tokenizer.json beside a Hugging Face model's config.json), else the byte tokenizer when
    the model's vocabulary holds its 256 ids."""
    from fsdp_exp.data.tokenizer import BYTE, ByteTokenizer
    from fsdp_exp.models import spec_for

    if cfg.data.tokenizer != MODEL_TOKENIZER:
        return cfg.data.tokenizer
    spec = spec_for(cfg.model)
    own = spec.tokenizer_file(cfg.model)
    if own is not None:
        return str(own)
    if spec.vocab_size(cfg.model) < ByteTokenizer.vocab_size:
        fail(
            f"data.tokenizer=model: the model names no tokenizer found on this machine, and its vocabulary of "
            f"{spec.vocab_size(cfg.model)} cannot hold the byte tokenizer's 256 ids.",
            "pass data.tokenizer=<a tokenizer.json, its folder, or a hub name>",
        )
    return BYTE


def model_vocab_size(cfg: RunConfig) -> int:
    """The model's vocabulary, as its family reads it from the model config."""
    from fsdp_exp.models import spec_for

    return spec_for(cfg.model).vocab_size(cfg.model)


def packed_splits(cfg: RunConfig, log: Optional[Callable[[str], None]] = None) -> tuple[Packed, Optional[Packed], dict]:
    """(train, val, info) of a real-data config: from the cache, or packed now (under a lock).
    Raises ConfigError when the data cannot fill a global batch."""
    d, t = cfg.data, cfg.trainer
    G = t.global_batch_size
    try:
        train_src, val_src = sources(d)
        root = cache_root(d)
        train, built = find_or_pack(train_src, tokenizer_name(cfg), d.eos_token, t.seq_len, d.max_blocks, root, log)
        _check_packed(cfg, "training", train, train_src.key)
        val = val_built = None
        if val_src is not None:
            val, val_built = find_or_pack(
                val_src, tokenizer_name(cfg), d.eos_token, t.seq_len, d.val_batches * G, root, log
            )
            _check_packed(cfg, "validation", val, val_src.key)
    except (DataError, TokenizerError) as err:
        raise ConfigError(str(err)) from None
    info = {"train": {"path": str(train.path), "built_now": built, **_counts(train.meta)}}
    if val is not None:
        info["val"] = {
            "path": str(val.path),
            "built_now": val_built,
            **_counts(val.meta),
            "val_batches": min(d.val_batches, val.num_blocks // G),
        }
    return train, val, info


def _check_packed(cfg: RunConfig, split: str, packed: Packed, key: str) -> None:
    m, t = packed.meta, cfg.trainer
    if m["num_blocks"] < t.global_batch_size:
        fail(
            f"the {split} data ({key}) yields {m['num_tokens']} tokens in {m['num_docs']} documents: "
            f"{m['num_blocks']} blocks of trainer.seq_len + 1 = {t.seq_len + 1} tokens, fewer than one global "
            f"batch (trainer.global_batch_size={t.global_batch_size}).",
            f"pass more text in {key}, a smaller trainer.seq_len or a smaller trainer.global_batch_size",
        )
    if m["max_id"] >= model_vocab_size(cfg):
        fail(
            f"the {split} data holds token id {m['max_id']}, outside the model's embedding "
            f"(model.vocab_size={model_vocab_size(cfg)}).",
            f"pass model.vocab_size={m['vocab_size']}",
        )


def _counts(meta: dict) -> dict:
    keys = ("num_docs", "num_tokens", "num_blocks", "seq_len", "tokenizer", "vocab_size", "eos_id", "build_s")
    return {k: meta[k] for k in keys}


def prepare_data(cfg: RunConfig, log: Optional[Callable[[str], None]] = stderr_log) -> Optional[dict]:
    """Before any rank is spawned: pack real data into the cache (once). Returns what was prepared
    (for the run record), or None for synthetic data."""
    if cfg.data.name == "synthetic":
        return None
    return packed_splits(cfg, log)[2]


SYNTHETIC_SPAN_SAMPLES = 256  # rows of synthetic documents the span is read from (deterministic)


def attention_span(cfg: RunConfig) -> tuple[float, str]:
    """(span, where it comes from): the sequence length at which a causal attention costs, per token, what this
    run's attention costs; the step-time model and MFU price attention at it. ``causal``: trainer.seq_len.
    ``block_causal``: each document's own causal work, sum of the squared document pieces of a block over its
    length, mean over blocks: from data.doc_len_mean / data.doc_len_std when set (mean + std^2 / mean, at most
    seq_len: documents cut by the block's edges are not modelled), else from the data: the packed cache's
    blocks (recorded at packing), synthetic data's first rows; seq_len where the data is not packed yet."""
    d, seq = cfg.data, cfg.trainer.seq_len
    if getattr(cfg.model, "attention_mask", "causal") != "block_causal":
        return float(seq), "causal: the whole sequence"
    if d.doc_len_mean is not None:
        span = min(float(seq), d.doc_len_mean + d.doc_len_std**2 / d.doc_len_mean)
        return span, f"data.doc_len_mean={d.doc_len_mean}, data.doc_len_std={d.doc_len_std}"
    if d.name == "synthetic":
        source = SyntheticSource(cfg.trainer.seed, 1, seq, d.synthetic_doc_len or 0)
        starts, offset = [], 0
        for i in range(SYNTHETIC_SPAN_SAMPLES):
            documents = source.sample_documents(i)[:-1].numpy()  # the inputs' document numbers
            starts.append(offset + np.flatnonzero(np.diff(documents, prepend=-1)))
            offset += seq
        span = block_attention_span(np.concatenate(starts), SYNTHETIC_SPAN_SAMPLES, seq)
        return span, f"synthetic documents (data.synthetic_doc_len={source.doc_len}), {SYNTHETIC_SPAN_SAMPLES} rows"
    try:
        train, _ = sources(d)
        packed = find_packed(train, tokenizer_name(cfg), seq, d.max_blocks, cache_root(d))
    except (DataError, TokenizerError, ConfigError):
        packed = None
    if packed is None or "attention_span" not in packed.meta:
        return float(seq), "the data is not packed yet: trainer.seq_len (pass data.doc_len_mean to set it)"
    return float(packed.meta["attention_span"]), f"the packed blocks ({packed.path.name})"


def build_data(cfg: RunConfig, topology: Topology, dp_rank: int, device: torch.device) -> StepData:
    if cfg.data.name == "synthetic":
        return SyntheticTokens(cfg, topology, dp_rank, device)
    train, val, info = packed_splits(cfg)
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
    return StepData(
        PackedBlocks(train, seed, cfg.data.shuffle),
        cfg,
        topology,
        dp_rank,
        device,
        val_source=PackedBlocks(val, seed, shuffle=False) if val is not None else None,
        val_batches=info["val"]["val_batches"] if val is not None else 0,
    )
