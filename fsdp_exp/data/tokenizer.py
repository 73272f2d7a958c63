"""Tokenizers: a byte-level one that needs nothing, and any Hugging Face ``tokenizers`` tokenizer.

``data.tokenizer=byte`` (the default): a token is a UTF-8 byte, so the vocabulary is 256 and fits
``model=llama_tiny``. Byte 0 (NUL, which no text needs) is reserved as the end-of-document id: NUL
bytes are dropped from the text, and id 0 separates documents once they are packed.

``data.tokenizer=<path to tokenizer.json, or a folder holding one>`` or ``=<hub name>``: a
``tokenizers.Tokenizer`` (what ``transformers``' fast tokenizers are built on), loaded with
``Tokenizer.from_file`` / ``Tokenizer.from_pretrained``. Its end-of-document token is
``data.eos_token``, or the first of the usual names it knows.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

BYTE = "byte"
# Tried in order when data.eos_token is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message says what to pass instead."""


class ByteTokenizer:
    vocab_size = 256
    eos_id = 0
    name = BYTE

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            out.append(ids[ids != 0])
        return out

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, tokenizer, name: str, eos_token: Optional[str]):
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        for token in candidates:
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                self.eos_id = token_id
                break
        else:
            if eos_token:
                raise TokenizerError(
                    f"data.eos_token={eos_token!r} is not in the vocabulary of data.tokenizer={name!r}."
                )
            raise TokenizerError(
                f"data.tokenizer={name!r} has none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)})."
            )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _local_tokenizer_file(spec: str) -> Optional[Path]:
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"data.tokenizer={spec!r} is a folder without a tokenizer.json.")
        return path.resolve()
    if path.is_file():
        return path.resolve()
    if spec.startswith(("/", ".", "~")) or spec.endswith(".json"):
        raise TokenizerError(f"data.tokenizer={spec!r} looks like a local path and does not exist.")
    return None


def tokenizer_identity(spec: str) -> dict:
    """What identifies a tokenizer for the packed-data cache, without loading it."""
    if spec == BYTE:
        return {"kind": BYTE}
    local = _local_tokenizer_file(spec)
    if local is not None:
        st = local.stat()
        return {"kind": "file", "path": str(local), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"kind": "hub", "name": spec}


def load_tokenizer(spec: str, eos_token: Optional[str] = None):
    """``byte``, a tokenizer.json (or a folder with one), or a hub name. Raises TokenizerError."""
    if spec == BYTE:
        if eos_token:
            raise TokenizerError("data.eos_token does not apply to data.tokenizer=byte (its end-of-document id is 0).")
        return ByteTokenizer()
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a declared dependency
        raise TokenizerError(
            f"data.tokenizer={spec!r} needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    local = _local_tokenizer_file(spec)
    if local is None:
        return HFTokenizer(_from_hub(spec), spec, eos_token)
    try:
        tok = Tokenizer.from_file(str(local))
    except Exception as exc:  # tokenizers raises plain Exceptions for bad files
        raise TokenizerError(
            f"data.tokenizer={spec!r} could not be loaded from the file {local}: {_first_line(exc)}"
        ) from None
    return HFTokenizer(tok, spec, eos_token)


def _from_hub(spec: str):
    """A hub name's tokenizer.json, through the hub cache. Where the hub cannot be reached (fsdp_exp.hub), from
    the cache only: a name it lacks is refused in seconds, not after the hub client's half minute of retries."""
    from tokenizers import Tokenizer

    from fsdp_exp import hub

    why = hub.unreachable()
    try:
        with hub.offline() if why else contextlib.nullcontext():
            return Tokenizer.from_pretrained(spec)
    except Exception as exc:  # tokenizers raises plain Exceptions for missing repos
        if why:
            raise TokenizerError(
                f"data.tokenizer={spec!r} is not a local path; as a hub name: {why}, and the hub "
                f"cache holds no copy of its tokenizer.json ({hub.how_to_reach()})."
            ) from None
        raise TokenizerError(
            f"data.tokenizer={spec!r} could not be loaded from the Hugging Face hub (no such local "
            f"path either): {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
