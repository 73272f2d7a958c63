"""Real text -> token blocks on disk, once.

Load with ``datasets`` (local text / json / parquet files, or ``load_dataset`` for the hub or a local
dataset folder; ``data.streaming=true`` never holds the corpus in memory), tokenize with a batched
``map``, then pack: every document's tokens and the end-of-document id, concatenated into one stream
and cut into blocks of ``trainer.seq_len + 1`` tokens. Consecutive blocks overlap by one token, so no
(input, target) pair of the stream is lost; the tail shorter than a block is dropped. The blocks go to
``<data.cache_dir>/<kind>-<key>/blocks.bin`` (a raw ``(n, seq_len + 1)`` array every rank memory-maps),
where each document starts in the stream to ``starts.bin`` (int64 offsets: a block's document numbers,
``Packed.documents``, for ``model.attention_mask=block_causal`` and ``data.positions=document``), with ``meta.json``; the key hashes what defines them. A build holds a file lock and publishes the folder
by an atomic rename, so ranks that find it missing wait and reuse it; the launcher builds before it
spawns any rank. Why: design.md ("Data"); the options: running.md ("Real data").
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

PACK_VERSION = 2  # 2: starts.bin, where each document starts in the stream
PKG_PREFIX = "pkg://fsdp_exp/"
LOCAL_KINDS = ("text", "json", "parquet")
KINDS = ("synthetic", *LOCAL_KINDS, "hf")
MAP_BATCH = 1000


class DataError(ValueError):
    """Data that cannot be used. ``problem`` and ``fix`` become a ConfigError in the launcher."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem, self.fix = problem, fix


def resolve_path(spec: str) -> Path:
    """A path from the config: ``pkg://fsdp_exp/...`` is inside the installed package (the shipped
    corpus); anything else is relative to the current directory, ``~`` expanded."""
    if spec.startswith(PKG_PREFIX):
        return Path(__file__).resolve().parents[1] / spec[len(PKG_PREFIX) :]
    return Path(os.path.expanduser(spec)).resolve()


def resolve_files(entries: list[str], key: str) -> list[Path]:
    """``data.files`` / ``data.val_files`` as existing, non-empty files (glob patterns expanded)."""
    files: list[Path] = []
    for entry in entries:
        path = resolve_path(entry)
        if glob.has_magic(str(path)):
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(
                    f"{key}: the pattern {entry!r} matches no file.", f"pass {key}=[...] with existing files"
                )
            files.extend(matches)
            continue
        if not path.exists():
            where = "" if str(path) == entry else f" ({path})"
            raise DataError(
                f"{key}: {entry!r} does not exist{where}.",
                f"pass {key}=[...] with existing files (pkg://fsdp_exp/data/corpus/train.txt is the shipped corpus)",
            )
        if not path.is_file():
            raise DataError(f"{key}: {entry!r} is not a file.", f"pass the files in it, e.g. {key}=['{entry}/*.txt']")
        files.append(path)
    for path in files:
        if path.stat().st_size == 0:
            raise DataError(f"{key}: {path} is empty (0 bytes).", f"remove it from {key}, or pass a file with text")
    return files


@dataclass(frozen=True)
class Source:
    """Where one split's text comes from."""

    kind: str  # text | json | parquet | hf
    key: str  # the config key that names it (data.files, data.val_files, data.split, data.val_split)
    files: tuple[str, ...] = ()  # local kinds: absolute paths
    dataset: Optional[str] = None  # hf: hub name or local folder
    dataset_config: Optional[str] = None
    split: str = "train"
    revision: Optional[str] = None
    streaming: bool = False
    text_field: str = "text"
    sample_by: str = "paragraph"

    def identity(self) -> dict:
        ident = {"kind": self.kind, "text_field": self.text_field}
        if self.kind == "text":
            ident["sample_by"] = self.sample_by
        if self.kind == "hf":
            ident.update(dataset=self.dataset, config=self.dataset_config, split=self.split, revision=self.revision)
            local = Path(os.path.expanduser(self.dataset))
            if local.is_dir():
                ident["files"] = [
                    _stat(p)
                    for p in sorted(local.rglob("*"))
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(local).parts)
                ]
        else:
            ident["files"] = [_stat(Path(p)) for p in self.files]
        return ident

    def describe(self) -> str:
        if self.kind == "hf":
            return f"{self.dataset} [{self.split}]"
        return ", ".join(self.files) if len(self.files) <= 3 else f"{len(self.files)} {self.kind} files"


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def sources(data_cfg) -> tuple[Optional[Source], Optional[Source]]:
    """(train, val) sources of a DataConfig; val is None without validation data."""
    d = data_cfg
    if d.name not in LOCAL_KINDS + ("hf",):
        return None, None
    common = dict(kind=d.name, streaming=d.streaming, text_field=d.text_field, sample_by=d.sample_by)
    if d.name == "hf":
        train = Source(
            key="data.split",
            dataset=d.dataset,
            dataset_config=d.dataset_config,
            split=d.split,
            revision=d.revision,
            **common,
        )
        val = (
            Source(
                key="data.val_split",
                dataset=d.dataset,
                dataset_config=d.dataset_config,
                split=d.val_split,
                revision=d.revision,
                **common,
            )
            if d.val_split
            else None
        )
        return train, val
    if not d.files:
        raise DataError(
            f"data={d.name} needs files and data.files is empty.",
            "pass data.files=[path/to/file,...] (or data=text for the shipped corpus)",
        )
    train = Source(key="data.files", files=tuple(map(str, resolve_files(list(d.files), "data.files"))), **common)
    val = (
        Source(
            key="data.val_files", files=tuple(map(str, resolve_files(list(d.val_files), "data.val_files"))), **common
        )
        if d.val_files
        else None
    )
    return train, val


# ------------------------------------------------------------------------------------- the cache
@dataclass(frozen=True)
class Packed:
    """A packed split on disk."""

    path: Path  # the folder holding blocks.bin and meta.json
    meta: dict

    @property
    def num_blocks(self) -> int:
        return self.meta["num_blocks"]

    @property
    def fingerprint(self) -> str:
        return self.path.name

    def open_starts(self) -> np.ndarray:
        """Where each document starts, as offsets into the packed stream (block ``i`` is the stream's
        ``[i * seq_len, i * seq_len + seq_len]``)."""
        return np.memmap(self.path / "starts.bin", dtype=np.int64, mode="r", shape=(self.meta["num_docs"],))

    def open_blocks(self) -> np.ndarray:
        return np.memmap(
            self.path / "blocks.bin",
            dtype=self.meta["dtype"],
            mode="r",
            shape=(self.meta["num_blocks"], self.meta["seq_len"] + 1),
        )


def cache_root(data_cfg) -> Path:
    return Path(os.path.expanduser(data_cfg.cache_dir)).resolve()


def pack_key(source: Source, tokenizer_ident: dict, seq_len: int, max_blocks: Optional[int]) -> str:
    blob = json.dumps(
        {
            "version": PACK_VERSION,
            "source": source.identity(),
            "tokenizer": tokenizer_ident,
            "seq_len": seq_len,
            "max_blocks": max_blocks,
        },
        sort_keys=True,
    )
    return f"{source.kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def find_packed(
    source: Source, tokenizer_spec: str, seq_len: int, max_blocks: Optional[int], root: Path
) -> Optional[Packed]:
    """The packed blocks of ``source`` if the cache holds them (nothing is built)."""
    from fsdp_exp.data.tokenizer import tokenizer_identity

    meta_file = root / pack_key(source, tokenizer_identity(tokenizer_spec), seq_len, max_blocks) / "meta.json"
    return Packed(meta_file.parent, json.loads(meta_file.read_text())) if meta_file.exists() else None


def find_or_pack(
    source: Source,
    tokenizer_spec: str,
    eos_token: Optional[str],
    seq_len: int,
    max_blocks: Optional[int],
    root: Path,
    log=None,
) -> tuple[Packed, bool]:
    """The packed blocks of ``source``: from the cache, or built now (under a file lock; see the module).

    Args:
        source: where one split's text comes from (``Source``: files or a dataset, and how to split it).
        tokenizer_spec: ``byte``, a ``tokenizer.json`` (or its folder) or a hub name (``data.tokenizer`` resolved).
        eos_token: the end-of-document token (``data.eos_token``); None: the tokenizer's own.
        seq_len: ``trainer.seq_len``; each block holds ``seq_len + 1`` tokens.
        max_blocks: pack only this many blocks (``data.max_blocks``); None: the whole source.
        root: the cache folder (``data.cache_dir``) the blocks' folder goes under.
        log: called with a line of progress when a build starts and ends; None: silent.

    Returns:
        ``(packed, built_now)``.
    """
    from filelock import FileLock

    from fsdp_exp.data.tokenizer import tokenizer_identity

    folder = root / pack_key(source, tokenizer_identity(tokenizer_spec), seq_len, max_blocks)
    meta_file = folder / "meta.json"
    if meta_file.exists():
        return Packed(folder, json.loads(meta_file.read_text())), False
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if meta_file.exists():  # another process built it while we waited
            return Packed(folder, json.loads(meta_file.read_text())), False
        tmp = root / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            meta = _build(source, tokenizer_spec, eos_token, seq_len, max_blocks, tmp, root, log)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Packed(folder, meta), True


def _build(
    source: Source,
    tokenizer_spec: str,
    eos_token: Optional[str],
    seq_len: int,
    max_blocks: Optional[int],
    out: Path,
    root: Path,
    log,
) -> dict:
    from fsdp_exp.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_spec, eos_token)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)
    if log:
        log(
            f"packing {source.key}={source.describe()} with tokenizer {tokenizer.name} into blocks of "
            f"{seq_len + 1} tokens (once; cached in {out.parent})"
        )
    docs = _tokenized_docs(source, tokenizer, root)
    stats = _pack(docs, seq_len, tokenizer.eos_id, dtype, out / "blocks.bin", max_blocks, out / "starts.bin")
    meta = {
        "version": PACK_VERSION,
        "source": source.identity(),
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "seq_len": seq_len,
        "dtype": dtype.name,
        "max_blocks": max_blocks,
        **stats,
        "build_s": round(time.perf_counter() - start, 3),
    }
    if log:
        log(
            f"packed {stats['num_docs']} documents, {stats['num_tokens']} tokens -> {stats['num_blocks']} blocks "
            f"in {meta['build_s']:.1f} s"
        )
    return meta


def _load(source: Source, root: Path):
    import datasets

    try:
        if source.kind == "hf":
            return _load_hub_dataset(source)
        kwargs = {"sample_by": source.sample_by} if source.kind == "text" else {}
        # Local files: datasets' Arrow copies live next to our blocks, in data.cache_dir.
        return datasets.load_dataset(
            source.kind,
            data_files=list(source.files),
            split="train",
            streaming=source.streaming,
            cache_dir=str(root / "datasets"),
            **kwargs,
        )
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types: missing repo, bad JSON, offline hub, ...
        what = (
            f"data.dataset={source.dataset!r} split {source.split!r}"
            if source.kind == "hf"
            else f"{source.key} as {source.kind}"
        )
        message = _first_line(exc)
        fix = (
            "check data.dataset / data.dataset_config / the split name, and that the hub is reachable "
            "(or pass a local folder)"
            if source.kind == "hf"
            else "check the files' format, or pick the builder that reads them: data=text|json|parquet"
        )
        raise DataError(f"could not load {what}: {type(exc).__name__}: {message}", fix) from None


def _load_hub_dataset(source: Source):
    """``data.dataset``: a local folder, or a hub name. Where the hub cannot be reached (fsdp_exp.hub: the
    offline variables, or a probe of a few seconds), datasets reads its cache only: a copy there loads at
    once, and a name it lacks is refused now instead of after half a minute of retries."""
    import datasets

    from fsdp_exp import hub

    load = functools.partial(
        datasets.load_dataset,
        source.dataset,
        source.dataset_config,
        split=source.split,
        revision=source.revision,
        streaming=source.streaming,
    )
    why = None if Path(os.path.expanduser(source.dataset)).exists() else hub.unreachable()
    if why is None:
        return load()
    try:
        with hub.offline():
            return load()
    except Exception as exc:  # noqa: BLE001 - whatever datasets raises offline, the cause is the same
        held = " (a data.streaming=true run keeps none)" if source.streaming else ""
        # datasets' own words, unless they only repeat that it is offline (its ConnectionError)
        detail = "" if isinstance(exc, ConnectionError) else f": {type(exc).__name__}: {_first_line(exc)}"
        raise DataError(
            f"data.dataset={source.dataset!r} is a hub name, {why}, and datasets' cache "
            f"({datasets.config.HF_DATASETS_CACHE}) holds no copy of its split {source.split!r}{held}"
            f"{detail}.",
            f"pass data.dataset=<a local folder of its data files (parquet, json, text)>, or "
            f"{hub.how_to_reach()}" + (" with data.streaming=false" if source.streaming else ""),
        ) from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _tokenize(batch: dict, tokenizer, field: str) -> dict:
    texts = [t if isinstance(t, str) and t.strip() else "" for t in batch[field]]
    return {"ids": tokenizer.encode_batch(texts)}


def _tokenized_docs(source: Source, tokenizer, root: Path) -> Iterator[list[np.ndarray]]:
    """Batches of documents as token-id arrays, tokenized with a batched ``datasets.map``
    (cached by datasets for in-memory-mapped datasets, lazy for streaming ones)."""
    ds = _load(source, root)
    columns = ds.column_names
    if columns is not None and source.text_field not in columns:
        raise DataError(
            f"{source.key}: the data has no {source.text_field!r} column (it has {', '.join(columns)}).",
            f"pass data.text_field=<one of {', '.join(columns)}>",
        )
    ds = ds.map(
        _tokenize,
        batched=True,
        batch_size=MAP_BATCH,
        fn_kwargs={"tokenizer": tokenizer, "field": source.text_field},
        remove_columns=columns,
    )
    ds = ds.with_format("numpy")
    try:
        for batch in ds.iter(batch_size=MAP_BATCH):
            yield [np.asarray(ids) for ids in batch["ids"]]
    except KeyError:
        raise DataError(
            f"{source.key}: the data has no {source.text_field!r} field.",
            "pass data.text_field=<the field that holds the text>",
        ) from None


def _pack(
    docs: Iterator[list[np.ndarray]],
    seq_len: int,
    eos_id: int,
    dtype: np.dtype,
    out_file: Path,
    max_blocks: Optional[int],
    starts_file: Path,
) -> dict:
    """Stream documents into ``(n, seq_len + 1)`` blocks appended to ``out_file``, and each document's start
    (its offset in the stream, its end-of-document id its last token) to ``starts_file``; return counts."""
    width = seq_len + 1
    eos = np.array([eos_id], dtype=dtype)
    carry = np.empty(0, dtype=dtype)
    n_blocks = n_docs = n_tokens = max_id = 0
    with open(out_file, "wb") as f, open(starts_file, "wb") as starts_out:
        for batch in docs:
            parts = [carry]
            starts = []
            for ids in batch:
                if ids.size == 0:
                    continue
                max_id = max(max_id, int(ids.max()))
                starts.append(n_tokens)  # the stream so far: every earlier document and its end-of-document id
                parts += [ids.astype(dtype, copy=False), eos]
                n_docs += 1
                n_tokens += ids.size + 1
            np.asarray(starts, dtype=np.int64).tofile(starts_out)
            stream = np.concatenate(parts)
            n = (stream.size - 1) // seq_len if stream.size >= width else 0
            if max_blocks is not None:
                n = min(n, max_blocks - n_blocks)
            if n > 0:
                rows = np.lib.stride_tricks.sliding_window_view(stream, width)[::seq_len][:n]
                np.ascontiguousarray(rows).tofile(f)
                n_blocks += n
            carry = stream[n * seq_len :]
            if max_blocks is not None and n_blocks >= max_blocks:
                break
    return {
        "num_blocks": n_blocks,
        "num_docs": n_docs,
        "attention_span": _attention_span(starts_file, n_blocks, seq_len),
        "num_tokens": n_tokens,
        "max_id": max(max_id, eos_id) if n_docs else 0,
    }


def block_attention_span(starts: np.ndarray, n_blocks: int, seq_len: int) -> float:
    """The mean over the blocks of (sum of the squared lengths of the document pieces in a block) / seq_len: the
    sequence length at which a causal attention costs, per token, what block-causal attention over these
    blocks costs (``seq_len`` itself for one document a block; the mean document length for many short ones)."""
    if n_blocks == 0:
        return float(seq_len)
    end = n_blocks * seq_len  # the inputs of the blocks: each block's first seq_len tokens of the stream
    cuts = np.union1d(starts[starts < end], np.arange(0, end + 1, seq_len))
    pieces = np.diff(cuts).astype(np.float64)
    return float((pieces**2).sum() / end)


def _attention_span(starts_file: Path, n_blocks: int, seq_len: int) -> float:
    return round(block_attention_span(np.fromfile(starts_file, dtype=np.int64), n_blocks, seq_len), 3)


def stderr_log(message: str) -> None:
    print(f"fsdp_exp: {message}", file=sys.stderr, flush=True)
